"""Aggregate decode speed of many sequences at once: `LLM.generate` of S prompts.

Each of the S prompts is its own (distinct token ids, no shared prefix) and generates
exactly --new-tokens tokens (greedy, EOS ignored), all in one batch; the time of the
same call with one new token (the prefill) is subtracted, so the figure is decode only:

    aggregate tok/s = S * (new_tokens - 1) / (t(new_tokens) - t(1))

Printed per S (default 1, 4 and 16): the median over --rounds of that rate. With
--pythons A,B each round runs every interpreter in its own subprocess in turn (e.g.
today's main against a branch, each an environment with ellm installed), so all see the
same neighbours; the table then has one column per interpreter and their ratio:

    python benchmarks/bench_batched_decode.py                         # ~1 min
    python benchmarks/bench_batched_decode.py --pythons /work/main/.venv/bin/python,.venv/bin/python

The CPU model, its SIMD flags and /proc/loadavg are printed first.
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
from bench_stream import cpu_line  # noqa: E402  (one reading of /proc/cpuinfo)


def prompts(n: int, length: int, vocab_low: int = 200, vocab_high: int = 20000) -> list[list[int]]:
    """n token-id prompts of `length`, distinct from their first token on."""
    import numpy as np
    rng = np.random.default_rng(17)
    out = []
    for i in range(n):
        ids = rng.integers(vocab_low, vocab_high, length).tolist()
        ids[0] = vocab_low + i  # no two share a first block
        out.append([int(t) for t in ids])
    return out


def worker(model: str, threads: int, seqs: list[int], new_tokens: int, prompt_len: int,
           level: str | None, kv_cache_dtype: str = "auto") -> dict[str, float]:
    """One round: {S: aggregate decode tok/s} in this process."""
    import ellm
    from ellm._native import _core, _kernels
    from ellm.sampling_params import SamplingParams
    if level:
        _core.set_simd_level(level)
    _kernels.set_num_threads(threads)
    llm = ellm.load(model, progress=False, **({} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}))
    llm.engine.blocks.enable_prefix_caching = False
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts(2, 16), first)  # warm-up: pages in the weights
    out = {}
    for s in seqs:
        ps = prompts(s, prompt_len)
        t0 = time.perf_counter()
        llm.generate(ps, first)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = llm.generate(ps, full)
        t_all = time.perf_counter() - t0
        assert all(len(r.token_ids) == new_tokens for r in res), "a sequence stopped early"
        out[str(s)] = s * (new_tokens - 1) / max(t_all - t_prefill, 1e-9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seqs", default="1,4,16", help="batch sizes (sequences at once)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--level", default=None, help="force a SIMD level (default: the best)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (float32) or float16 (ellm.load's option)")
    ap.add_argument("--pythons", default=sys.executable,
                    help="comma-separated interpreters, each with an ellm to measure")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (one is the prefill's)")
    if args.worker:
        print(json.dumps(worker(args.model, args.threads, seqs, args.new_tokens, args.prompt_len, args.level,
                                args.kv_cache_dtype)))
        return
    print(f"# {cpu_line()}")
    print(f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}; model {args.model}, "
          f"{args.threads} threads, prompts of {args.prompt_len}, {args.new_tokens} new tokens each, "
          f"kv cache {args.kv_cache_dtype}")
    pythons = args.pythons.split(",")
    rates: dict[str, dict[str, list[float]]] = {p: {str(s): [] for s in seqs} for p in pythons}
    cmd = [__file__, "--worker", "--model", args.model, "--seqs", args.seqs, "--threads", str(args.threads),
           "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len)]
    cmd += ["--level", args.level] if args.level else []
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else []
    for r in range(args.rounds):
        order = pythons if r % 2 == 0 else pythons[::-1]  # alternate who goes first
        for py in order:
            res = subprocess.run([py, *cmd], capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{py} failed:\n{res.stderr[-2000:]}")
            for s, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                rates[py][s].append(v)
    # an interpreter's column is named by its checkout: <checkout>/.venv/bin/python
    head = "".join(f" {Path(os.path.abspath(p)).parents[2].name:>22}" for p in pythons)
    ratio = f" {'last / first':>12}" if len(pythons) > 1 else ""
    print(f"{'sequences':>9}{head}{ratio}   (aggregate decode tok/s, median of {args.rounds})")
    for s in map(str, seqs):
        meds = [statistics.median(rates[p][s]) for p in pythons]
        cells = "".join(f" {m:22.1f}" for m in meds)
        print(f"{s:>9}{cells}" + (f" {meds[-1] / meds[0]:12.2f}" if len(pythons) > 1 else ""))


if __name__ == "__main__":
    main()
