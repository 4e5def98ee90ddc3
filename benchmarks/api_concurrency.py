"""Callers sharing one LLM: the same requests one after another, from threads, from asyncio.

    python benchmarks/api_concurrency.py [--model M] [--requests 16] [--tokens 32] [--rounds 3]

Each request decodes exactly --tokens tokens (greedy, EOS ignored), so every mode does the
same work; the modes alternate within each round and the medians are printed. Threads and
asyncio tasks land in one engine loop, so their requests batch together; the sequential
mode shows one request at a time. The engine's forward count per mode is printed too.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import ellm
from ellm import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.requests)]
    with ellm.load(args.model, max_model_len=1024, progress=False) as llm:
        llm.generate(prompts[0], max_tokens=2)   # warm up

        def sequential() -> None:
            for p in prompts:
                llm.generate(p, params)

        def threads() -> None:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda p: llm.generate(p, params), prompts))

        def tasks() -> None:
            async def go() -> None:
                await asyncio.gather(*(llm.agenerate(p, params) for p in prompts))
            asyncio.run(go())

        modes: dict[str, Callable[[], None]] = {"sequential": sequential, "8 threads": threads,
                                                "asyncio.gather": tasks}
        times: dict[str, list[float]] = {m: [] for m in modes}
        steps: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, fn in modes.items():
                before = llm.engine.stats["steps"]
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                steps[name] = llm.engine.stats["steps"] - before
        total = args.requests * args.tokens
        print(f"{args.requests} requests x {args.tokens} tokens, {args.model}, median of {args.rounds}")
        for name in modes:
            t = statistics.median(times[name])
            print(f"  {name:15s} {t:6.2f} s  {total / t:7.1f} tok/s  {steps[name]:5d} forwards")


if __name__ == "__main__":
    main()
