"""AMX tiles and exact activations, end to end on a GGUF: prefill@512 at the avx512 and
amx levels, and greedy decode with activations="int8" (default) and "f32".

One pool thread, timed by this process's CPU time, so that neighbours on a shared
machine slow the wall clock but not the figures (a quiet machine gives the same ratios;
absolute tok/s of one thread, not two). Engines alternate within each round; medians.

    python benchmarks/bench_amx_exact.py MODEL.gguf [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import ellm
from ellm._native import _core, _kernels
from ellm.sampling_params import SamplingParams


def cpu_rate(fn, n: int) -> float:
    t0 = time.process_time()
    fn()
    return n / (time.process_time() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=48)
    args = ap.parse_args()
    _kernels.set_num_threads(1)
    levels = [lv for lv in ("avx512", "amx") if lv in _core.supported_simd_levels()]
    llms = {a: ellm.load(args.model, max_model_len=1024, progress=False, activations=a)
            for a in ("int8", "f32")}
    rng = np.random.default_rng(0)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    dec = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    prefill: dict[str, list[float]] = {lv: [] for lv in levels}
    decode: dict[str, list[float]] = {a: [] for a in llms}
    best = _core.simd_level()
    for _ in range(args.rounds):
        for lv in levels:
            _core.set_simd_level(lv)
            ids = [int(t) for t in rng.integers(100, 20000, 512)]  # fresh: no prefix-cache hit
            prefill[lv].append(cpu_rate(lambda: llms["int8"].generate(ids, one), 512))
        _core.set_simd_level(best)
        for a, llm in llms.items():
            ids = [int(t) for t in rng.integers(100, 20000, 16)]
            t_pre = time.process_time()
            llm.generate(ids, one)
            pre = time.process_time() - t_pre
            ids2 = [int(t) for t in rng.integers(100, 20000, 16)]
            t0 = time.process_time()
            llm.generate(ids2, dec)
            # one prefill of 16 and the first token come with it: take a prefill's cost off
            decode[a].append(args.decode_tokens / max(time.process_time() - t0 - pre, 1e-9))
    print(f"model {Path(args.model).name}; 1 thread, CPU-time rates; load average "
          f"{open('/proc/loadavg').read().split()[0]}; best level {best}")
    for lv, v in prefill.items():
        print(f"prefill@512 {lv:>7}: {statistics.median(v):8.1f} tok/s  rounds {[round(x) for x in v]}")
    if len(levels) == 2:
        print(f"prefill amx / avx512: {statistics.median(prefill['amx']) / statistics.median(prefill['avx512']):.2f}")
    for a, v in decode.items():
        print(f"decode activations={a:>4}: {statistics.median(v):8.1f} tok/s  rounds {[round(x) for x in v]}")
    print(f"decode f32 / int8: {statistics.median(decode['f32']) / statistics.median(decode['int8']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
