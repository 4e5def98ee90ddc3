"""Micro-benchmark of the fused RoPE + paged attention kernel, the thread pool's dispatch
overhead, and the per-call cost of the elementwise shims, at the real models' decode shapes.

Prints only; run on a quiet machine (check /proc/loadavg first):
    nice /work/venv/bin/python benchmarks/bench_attention.py [--threads N] [--iters N]
        [--only attention] [--module path/to/_kernels.so] [--simd avx2]

--module loads another build of ellm._native._kernels (e.g. a copy of the installed one
kept from before a change) so two builds can be timed alternately on the same machine.
Each line gives the median wall time per call and the median CPU time per call (all
threads of the process), which is less disturbed when other processes share the cores.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import numpy as np

BLOCK = 16


def decode_case(nh: int, nkv: int, hd: int, ctx: int, rng: np.random.Generator) -> tuple:
    """One sequence decoding its token at position `ctx` over a shuffled paged cache."""
    n_blocks = ctx // BLOCK + 1
    table = rng.permutation(n_blocks + 8)[:n_blocks].astype(np.int32)[None, :]
    kc = rng.standard_normal((n_blocks + 8, BLOCK, nkv, hd)).astype(np.float32)
    vc = rng.standard_normal((n_blocks + 8, BLOCK, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((1, nh, hd)).astype(np.float32)
    k = rng.standard_normal((1, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((1, nkv, hd)).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    pos = np.array([ctx], np.int32)
    sid = np.zeros(1, np.int32)
    out = np.empty_like(q)
    return (q, k, v, pos, sid, table, kc, vc, inv, True, hd ** -0.5, 0, 0.0, out)


def batched_decode_case(nh: int, nkv: int, hd: int, ctx: int, n_seq: int, rng: np.random.Generator) -> tuple:
    """n_seq sequences decoding one token each at position `ctx`, each over its own
    shuffled blocks: one decode step of a batch."""
    per = ctx // BLOCK + 1
    table = rng.permutation(n_seq * per + 8)[: n_seq * per].astype(np.int32).reshape(n_seq, per)
    kc = rng.standard_normal((n_seq * per + 8, BLOCK, nkv, hd)).astype(np.float32)
    vc = rng.standard_normal((n_seq * per + 8, BLOCK, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((n_seq, nh, hd)).astype(np.float32)
    k = rng.standard_normal((n_seq, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n_seq, nkv, hd)).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    pos = np.full(n_seq, ctx, np.int32)
    sid = np.arange(n_seq, dtype=np.int32)
    return (q, k, v, pos, sid, table, kc, vc, inv, True, hd ** -0.5, 0, 0.0, np.empty_like(q))


def prefill_case(nh: int, nkv: int, hd: int, n: int, window: int, rng: np.random.Generator) -> tuple:
    """One sequence prefilling its first n tokens in one call (a shuffled paged cache)."""
    n_blocks = (n + BLOCK - 1) // BLOCK
    table = rng.permutation(n_blocks + 8)[:n_blocks].astype(np.int32)[None, :]
    kc = np.zeros((n_blocks + 8, BLOCK, nkv, hd), np.float32)
    vc = np.zeros((n_blocks + 8, BLOCK, nkv, hd), np.float32)
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    sid = np.zeros(n, np.int32)
    out = np.empty_like(q)
    return (q, k, v, pos, sid, table, kc, vc, inv, True, hd ** -0.5, window, 0.0, out)


def time_us(fn, iters: int) -> float:
    """Median microseconds per call over `iters` calls (after a warm-up)."""
    return time_wall_cpu_us(fn, iters)[0]


def time_wall_cpu_us(fn, iters: int) -> tuple[float, float]:
    """(median wall µs, median process CPU µs) per call over `iters` calls, after a warm-up."""
    for _ in range(min(20, iters)):
        fn()
    wall = np.empty(iters)
    cpu = np.empty(iters)
    for i in range(iters):
        c0 = time.process_time_ns()
        t0 = time.perf_counter_ns()
        fn()
        wall[i] = time.perf_counter_ns() - t0
        cpu[i] = time.process_time_ns() - c0
    return float(np.median(wall)) / 1e3, float(np.median(cpu)) / 1e3


def load_kernels(path: str | None):
    """ellm._native._kernels, or the build at `path` with the libellm_kernels.so beside it.
    Loaded before anything of ellm: the library's soname is the same in every build, and
    the dynamic loader would reuse one already loaded."""
    if not path:
        from ellm._native import _kernels
        return _kernels
    spec = importlib.util.spec_from_file_location("ellm._native._kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="pool threads (0: all CPUs)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--only", choices=["attention", "all"], default="all")
    ap.add_argument("--module", default=None, help="path of another _kernels build to time")
    ap.add_argument("--simd", default=None, help="force a SIMD level (scalar, avx2, avx512)")
    args = ap.parse_args()
    kern = load_kernels(args.module)
    kern.set_num_threads(args.threads)
    if args.simd:
        kern.set_simd_level(args.simd)
    print(f"{kern.__file__}\nthreads {kern.num_threads()}, SIMD {kern.simd_level()}, "
          f"loadavg {open('/proc/loadavg').read().split()[:3]}")
    rng = np.random.default_rng(0)
    shapes = {"SmolLM2 9/3x64": (9, 3, 64), "Gemma3 4/1x256": (4, 1, 256)}

    print("\ndecode attention, one sequence (median µs per call, wall and CPU; GB/s = K+V bytes / wall)")
    for name, (nh, nkv, hd) in shapes.items():
        for ctx in (16, 100, 500, 2000):
            a = decode_case(nh, nkv, hd, ctx, rng)
            us, cpu = time_wall_cpu_us(lambda: kern.rope_attention(*a), args.iters)
            kv_bytes = 2 * (ctx + 1) * nkv * hd * 4
            print(f"  {name:16s} ctx {ctx:5d}: {us:8.1f} µs  cpu {cpu:8.1f} µs  {kv_bytes / us / 1e3:6.2f} GB/s")

    print("\nbatched decode attention, 16 sequences at one position each (median µs per call)")
    for name, (nh, nkv, hd) in shapes.items():
        for ctx in (16, 500):
            a = batched_decode_case(nh, nkv, hd, ctx, 16, rng)
            us, cpu = time_wall_cpu_us(lambda: kern.rope_attention(*a), max(args.iters // 4, 20))
            print(f"  {name:16s} ctx {ctx:5d}: {us:8.1f} µs  cpu {cpu:8.1f} µs")

    print("\nprefill attention, one sequence of 512 tokens in one call (median µs per call)")
    for name, (nh, nkv, hd) in shapes.items():
        for window in (0, 512) if hd == 256 else (0,):
            a = prefill_case(nh, nkv, hd, 512, window, rng)
            us, cpu = time_wall_cpu_us(lambda: kern.rope_attention(*a), max(args.iters // 20, 5))
            print(f"  {name:16s} window {window:3d}: {us:9.0f} µs  cpu {cpu:9.0f} µs")
    if args.only == "attention":
        return

    print("\npool dispatch (parallel_for over one chunk per thread; µs beyond the chunks' own work)")
    for work_ns in (0, 5000):
        hot = kern.pool_dispatch_ns(2000, work_ns=work_ns)
        cold = kern.pool_dispatch_ns(200, work_ns=work_ns, sleep_us=2000)
        print(f"  chunks of {work_ns / 1e3:3.0f} µs: workers spinning {np.median(hot) / 1e3 - work_ns / 1e3:6.2f} µs "
              f"(p90 {np.percentile(hot, 90) / 1e3 - work_ns / 1e3:6.2f}), "
              f"workers asleep {np.median(cold) / 1e3 - work_ns / 1e3:6.2f} µs "
              f"(p90 {np.percentile(cold, 90) / 1e3 - work_ns / 1e3:6.2f})")

    print("\nelementwise shims at decode shapes (median µs per call, shim included)")
    K = kern  # noqa: N806 (the short name the lines below read best with)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    res = x.copy()
    out = np.empty_like(x)
    gu = rng.standard_normal((1, 2 * 1536)).astype(np.float32)
    act = np.empty((1, 1536), np.float32)
    print(f"  rmsnorm 1x576      {time_us(lambda: K.rmsnorm(x, w, 1e-5, out), args.iters * 10):6.2f}")
    print(f"  add_rmsnorm 1x576  {time_us(lambda: K.add_rmsnorm(res, x, w, 1e-5, out), args.iters * 10):6.2f}")
    print(f"  swiglu 1x1536      {time_us(lambda: K.swiglu(gu[:, :1536], gu[:, 1536:], act), args.iters * 10):6.2f}")
    big = rng.standard_normal((512, 576)).astype(np.float32)
    bout = np.empty_like(big)
    print(f"  rmsnorm 512x576    {time_us(lambda: K.rmsnorm(big, w, 1e-5, bout), args.iters):6.2f}")
    print(f"  (numpy reference rmsnorm 512x576: "
          f"{time_us(lambda: big / np.sqrt(np.mean(big * big, -1, keepdims=True) + 1e-5) * w, args.iters):6.1f})")


if __name__ == "__main__":
    os.nice(5)
    main()
