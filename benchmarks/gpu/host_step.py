"""The host's share of a CUDA decode step, measured on a machine without a GPU.

    PYTHONPATH=tests/cuda_host python benchmarks/gpu/host_step.py MODEL [--batch 1 --batch 64]
        [--lengths 32,160] [--logprobs N]

Runs ellm's CUDA path on the host stand-in for CuPy (tests/cuda_host) with every kernel
and cuBLAS call skipped, so what a `generate` step costs is the engine's and the
backend's Python: scheduling, the batch, the graph's inputs, sampling's bookkeeping,
detokenizing, the outputs. On a GPU, with the engine's overlap off, this time adds to
each step's replay (the engine reads a step's ids before it plans the next); with it on
(the default there, for rows sampled on the device: all but grammars) the host does it
while the next step runs, and only the launch's share stays on the critical path. benchmarks/gpu/step_profile.py
measures both there. A graph replay costs nothing here (on a GPU: one driver call of a
few microseconds); the stand-in's copies and events cost about what CuPy's Python
does. Greedy ids are all 0 (no logits are computed); with --logprobs every request asks
for N top logprobs, and each row's record says tokens 0..N-1 with logprob 0.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def skip_kernels() -> None:
    """Kernels, graph replays, cuBLAS and the greedy argmax become no-ops on the stand-in."""
    import cupy
    import numpy as np
    if not hasattr(cupy, "_run"):
        raise SystemExit("host_step.py needs the host stand-in for CuPy: PYTHONPATH=tests/cuda_host")
    cupy._run = lambda *a, **k: None
    cupy.cuda.Graph.launch = lambda self, stream=None: None   # a replay is one driver call on a GPU
    import cupy_backends.cuda.libs.cublas as cublas
    cublas.gemmEx = lambda *a, **k: None
    from ellm.ops.cuda import CudaOps
    from ellm.ops.cuda_sampling import LOGPROB_HEAD

    def argmax_rows(self: Any, logits: Any, out: Any = None) -> Any:
        out = self.cp.empty(int(logits.shape[0]), np.int32) if out is None else out
        out.view(np.ndarray)[...] = 0   # the stand-in's memory, written as a kernel would (captures too)
        return out
    CudaOps.argmax_rows = argmax_rows
    cupy.empty = cupy.zeros   # what the skipped kernels would write (sampled ids) is 0, not garbage
    logprob_records = CudaOps.logprob_records

    def records(self: Any, plan: Any, ids: Any) -> Any:
        out = logprob_records(self, plan, ids)   # (its kernel skipped: written here instead)
        rec, n = out.view(np.ndarray), (int(out.shape[1]) - LOGPROB_HEAD) // 2
        rec[...] = 0   # log-sum-exp 0, maximum 0, the chosen token's logit 0
        rec[:, 4] = n
        rec[:, LOGPROB_HEAD:LOGPROB_HEAD + n] = np.arange(n, dtype=np.int32)
        return out
    CudaOps.logprob_records = records


def step_us(llm: Any, ids: list[int], batch: int, short: int = 32, long: int = 160, repeats: int = 3,
            logprobs: int | None = None) -> float:
    """A decode step from the difference of two generate lengths (best of `repeats`)."""
    from ellm.sampling_params import SamplingParams
    best: dict[int, float] = {}
    for _ in range(repeats):
        for n in (short, long):
            p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
            t = time.perf_counter()
            llm.generate([ids] * batch, p)
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
    return (best[long] - best[short]) / (long - short) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a GGUF file or Hugging Face folder")
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--lengths", default="32,160",
                    help="SHORT,LONG: the two generate lengths whose difference gives a step (tokens)")
    ap.add_argument("--logprobs", type=int, default=None, help="every request asks for N top logprobs")
    args = ap.parse_args(argv)
    short, long = (int(n) for n in args.lengths.split(","))
    batches = args.batch or [1, 16, 64]
    skip_kernels()
    import ellm
    from ellm.sampling_params import SamplingParams
    llm = ellm.load(args.model, device="cuda", kv_cache_dtype="bfloat16", max_model_len=max(1024, long + 64),
                    kv_cache_tokens=max(batches) * (long + 64), progress=False)
    try:
        ids = llm.encode_prompt("The history of the printing press begins")
        print("| batch | host µs a decode step | µs a sequence | overlapped: host µs a step |\n"
              "|---:|---:|---:|---:|")
        for b in batches:
            llm.generate([ids] * b, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))   # capture
            llm.engine.overlap = False
            us = step_us(llm, ids, b, short, long, logprobs=args.logprobs)
            llm.engine.overlap = True
            ahead = step_us(llm, ids, b, short, long, logprobs=args.logprobs)
            print(f"| {b} | {us:.0f} | {us / b:.1f} | {ahead:.0f} |", flush=True)
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
