"""Prefill and decode speed on the bf16 Hugging Face folders, engines side by side.

Each round runs every interpreter of --pythons (each an environment with its own ellm:
e.g. main's against a branch's) in a subprocess of its own, in alternating order, on the
same token ids and thread count; then transformers on the same folder in bf16 when
--hf-python names a Python with torch and transformers. Reported: the median over
rounds of prefill tok/s at 512 tokens (each round's figure a median of 3 calls) and of
decode tok/s (128 greedy tokens after 16), with the ratio last / first interpreter.

    python benchmarks/bench_bf16.py --pythons /work/main/.venv/bin/python,.venv/bin/python \
        --models smollm2-135m-instruct-bf16 --rounds 3               # ~1 min a model
    python benchmarks/bench_bf16.py --level avx512                   # the FMA kernels
    python benchmarks/bench_bf16.py --cpu-time --pythons A,B        # shared machine

With --kernels it instead times _quant.linear on BF16 weights of the two models' shapes
(SmolLM2 576x576, 1536x576, 576x1536, head 49152x576; Gemma 3 1024x640, 2048x640,
640x2048, head 262144x640) at T = 1, 16 and 512 (the heads at 1, SmolLM2's also at 16), one
thread, by thread CPU time, the levels of --levels alternated in one process (avx512: the
FMA kernels main runs; amx: the tiles), each figure the best of 5 rounds' medians:

    python benchmarks/bench_bf16.py --kernels --levels avx512,amx

With --cpu-time the ellm workers run one pool thread and time by their process's CPU
time, so neighbours on a shared machine slow the wall clock but not the figures (decode:
64 greedy tokens after 16, the prefill's CPU time subtracted); transformers keeps --threads
and the wall clock.

Folders are looked up under ~/.cache/ellm/hf (tests/goldens/make.py --folders makes
them). The CPU model, its SIMD flags and /proc/loadavg are printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_stream import cpu_line  # noqa: E402
from vs_llamacpp import _prefill_rate, worker_ellm  # noqa: E402

HF_ROOT = Path.home() / ".cache" / "ellm" / "hf"
IDS = list(range(1000, 1512))  # 512 ordinary token ids of both vocabularies


def worker_transformers_bf16(folder: str, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.eval()
    out = {}
    with torch.no_grad():
        model(torch.tensor([IDS[:16]]))
        out["prefill512"] = _prefill_rate(lambda k: model(torch.tensor([IDS[:k]])), 512)
        res = model(torch.tensor([IDS[:16]]), use_cache=True)
        past, tok = res.past_key_values, res.logits[0, -1].argmax()
        steps = 32  # a few tens of tok/s: fewer steps keep a round short
        t0 = time.perf_counter()
        for _ in range(steps):
            res = model(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = res.past_key_values, res.logits[0, -1].argmax()
        out["decode128"] = steps / (time.perf_counter() - t0)
    return out


def worker_ellm_cpu(folder: str) -> dict:
    """One pool thread, rates by this process's CPU time."""
    import ellm
    from ellm._native import _kernels
    from ellm.sampling_params import SamplingParams
    _kernels.set_num_threads(1)
    llm = ellm.load(folder, progress=False, max_model_len=1024)
    llm.engine.blocks.enable_prefix_caching = False

    def cpu_seconds(ids: list[int], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        t0 = time.process_time()
        llm.generate(ids, params)
        return time.process_time() - t0

    cpu_seconds(IDS[:16], 2)  # warm-up: pages in the weights
    prefill = statistics.median(cpu_seconds(IDS, 1) for _ in range(3))
    new = 64
    decode = cpu_seconds(IDS[:16], new + 1) - cpu_seconds(IDS[:16], 1)
    return {"prefill512": len(IDS) / prefill, "decode128": new / max(decode, 1e-9)}


KERNEL_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (1024, 640), (2048, 640),
                 (640, 2048), (262144, 640)]


def bench_kernels(levels: list[str], rounds: int = 5) -> None:
    import numpy as np
    from ellm._native import _core, _quant
    _quant.set_num_threads(1)

    def median_call(fn) -> float:
        fn()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < 0.05:
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        return float(np.median(times))

    rng = np.random.default_rng(0)
    print(f"{'N x K':>11} {'T':>4}" + "".join(f" {lv + ' us':>11} {'GFLOP/s':>8}" for lv in levels)
          + f" {'last/first':>10}")
    for n, k in KERNEL_SHAPES:
        w = rng.integers(0x3000, 0x3C00, size=(n, k), dtype=np.uint16)  # finite bf16 bits
        for T in (1, 16, 512):
            if n > 10_000 and (T > 16 or n > 100_000):
                continue  # the heads: decode (and SmolLM2's at 16 sequences) only
            x = rng.standard_normal((T, k), dtype=np.float32)
            y = np.empty((T, n), np.float32)
            best = {lv: float("inf") for lv in levels}
            for _ in range(rounds):
                for lv in levels:
                    _core.set_simd_level(lv)
                    _quant.set_simd_level(lv)
                    best[lv] = min(best[lv], median_call(lambda: _quant.linear(x, w, 30, y)))
            cells = "".join(f" {1e6 * best[lv]:11.1f} {2 * T * n * k / best[lv] / 1e9:8.1f}" for lv in levels)
            print(f"{f'{n}x{k}':>11} {T:4}{cells} {best[levels[0]] / best[levels[-1]]:10.2f}", flush=True)


def worker(engine: str, folder: str, threads: int, level: str | None, cpu_time: bool) -> dict:
    if engine == "transformers":
        return worker_transformers_bf16(folder, threads)
    if level:
        from ellm._native import _core
        _core.set_simd_level(level)
    return worker_ellm_cpu(folder) if cpu_time else worker_ellm(folder, threads, IDS, [])


def run(python: str, engine: str, folder: str, threads: int, level: str | None, cpu_time: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--folder", folder,
           "--threads", str(threads)] + (["--level", level] if level else [])
    cmd += ["--cpu-time"] if cpu_time else []
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{python} ({engine}) failed on {folder}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct-bf16,gemma-3-270m-bf16")
    ap.add_argument("--pythons", default=sys.executable, help="comma-separated interpreters with ellm")
    ap.add_argument("--hf-python", default=None, help="a Python with torch + transformers (bf16 beside)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--level", default=None, help="force a SIMD level in the ellm workers")
    ap.add_argument("--cpu-time", action="store_true",
                    help="ellm: one pool thread, rates by process CPU time (steady on a shared machine)")
    ap.add_argument("--kernels", action="store_true", help="time the BF16 linear kernels instead")
    ap.add_argument("--levels", default="avx512,amx", help="with --kernels: SIMD levels to alternate")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.folder, args.threads, args.level, args.cpu_time)))
        return
    print(f"# {cpu_line()}")
    if args.kernels:
        print(f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}; BF16 linear, 1 thread, thread CPU time")
        bench_kernels(args.levels.split(","))
        return
    clock = "ellm: 1 thread, process CPU time" if args.cpu_time else f"{args.threads} threads, wall clock"
    print(f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}; {clock}; "
          f"level {args.level or 'best'}, {args.rounds} rounds")
    engines = [(p, "ellm") for p in args.pythons.split(",")]
    engines += [(args.hf_python, "transformers")] if args.hf_python else []
    names = [Path(os.path.abspath(p)).parents[2].name if e == "ellm" else "transformers-bf16"
             for p, e in engines]
    for model in args.models.split(","):
        folder = str(HF_ROOT / model)
        if not Path(folder).is_dir():
            sys.exit(f"no folder {folder} (tests/goldens/make.py --folders makes it)")
        got: list[dict[str, list[float]]] = [{"prefill512": [], "decode128": []} for _ in engines]
        for r in range(args.rounds):
            order = list(range(len(engines)))
            order = order if r % 2 == 0 else order[::-1]
            for i in order:
                res = run(engines[i][0], engines[i][1], folder, args.threads, args.level, args.cpu_time)
                for key in got[i]:
                    got[i][key].append(res[key])
        print(f"\n{model}")
        print(f"{'':>14}" + "".join(f" {n:>18}" for n in names)
              + (f" {'last/first ellm':>16}" if len(args.pythons.split(",")) > 1 else ""))
        n_ellm = len(args.pythons.split(","))
        for key, label in (("prefill512", "prefill@512"), ("decode128", "decode tok/s")):
            meds = [statistics.median(g[key]) for g in got]
            ratio = f" {meds[n_ellm - 1] / meds[0]:16.2f}" if n_ellm > 1 else ""
            print(f"{label:>14}" + "".join(f" {m:18.1f}" for m in meds) + ratio)


if __name__ == "__main__":
    main()
