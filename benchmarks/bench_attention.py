"""Micro-benchmark of the fused RoPE + paged attention kernel, the thread pool's dispatch
overhead, and the per-call cost of the elementwise shims, at the real models' decode shapes.

Prints only; run on a quiet machine (check /proc/loadavg first):
    nice /work/venv/bin/python benchmarks/bench_attention.py [--threads N] [--iters N]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from ellm._native import _kernels as K

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


def time_us(fn, iters: int) -> float:
    """Median microseconds per call over `iters` calls (after a warm-up)."""
    for _ in range(min(20, iters)):
        fn()
    ts = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts[i] = time.perf_counter_ns() - t0
    return float(np.median(ts)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="pool threads (0: all CPUs)")
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    K.set_num_threads(args.threads)
    print(f"threads {K.num_threads()}, SIMD {K.simd_level()}, loadavg {open('/proc/loadavg').read().split()[:3]}")
    rng = np.random.default_rng(0)

    print("\ndecode attention, one sequence (median µs per call; GB/s = K+V bytes read / time)")
    for name, (nh, nkv, hd) in {"SmolLM2 9/3x64": (9, 3, 64), "Gemma3 4/1x256": (4, 1, 256)}.items():
        for ctx in (100, 500, 2000):
            a = decode_case(nh, nkv, hd, ctx, rng)
            us = time_us(lambda: K.rope_attention(*a), args.iters)
            kv_bytes = 2 * (ctx + 1) * nkv * hd * 4
            print(f"  {name:16s} ctx {ctx:5d}: {us:8.1f} µs  {kv_bytes / us / 1e3:6.2f} GB/s")

    print("\npool dispatch (parallel_for over one chunk per thread; µs beyond the chunks' own work)")
    for work_ns in (0, 5000):
        hot = K.pool_dispatch_ns(2000, work_ns=work_ns)
        cold = K.pool_dispatch_ns(200, work_ns=work_ns, sleep_us=2000)
        print(f"  chunks of {work_ns / 1e3:3.0f} µs: workers spinning {np.median(hot) / 1e3 - work_ns / 1e3:6.2f} µs "
              f"(p90 {np.percentile(hot, 90) / 1e3 - work_ns / 1e3:6.2f}), "
              f"workers asleep {np.median(cold) / 1e3 - work_ns / 1e3:6.2f} µs "
              f"(p90 {np.percentile(cold, 90) / 1e3 - work_ns / 1e3:6.2f})")

    print("\nelementwise shims at decode shapes (median µs per call, shim included)")
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
