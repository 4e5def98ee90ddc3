"""The cost of ellm.integrations: one chat reply of --tokens tokens through each framework
against the same reply from `llm.chat` on the same loaded model.

    python benchmarks/bench_integrations.py [--model M] [--tokens 64] [--rounds 15]

Every call is greedy on the same prompt (long enough that the reply runs to --tokens
tokens), so every variant decodes the same tokens; the token counts are checked. The
variants run in a fresh random order in each round (in-process A/B alternation) and the
medians are printed with each one's ratio to llm.chat and the load average. Frameworks
that are not installed are left out.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import ellm

PROMPT = "Write a long story about a dragon who learns to bake bread. Take your time."


def variants(llm: ellm.LLM, tokens: int) -> dict[str, Callable[[], int]]:
    """name -> a call returning how many tokens it generated."""
    messages = [{"role": "user", "content": PROMPT}]
    out: dict[str, Callable[[], int]] = {
        "llm.chat": lambda: len(llm.chat(messages, max_tokens=tokens, temperature=0).token_ids)}
    try:
        from ellm.integrations.langchain import ChatEllm
        chat = ChatEllm(llm=llm, max_tokens=tokens, temperature=0)
        out["langchain invoke"] = lambda: chat.invoke(PROMPT).usage_metadata["output_tokens"]
    except ImportError:
        pass
    try:
        from ellm.integrations.llama_index import EllmLLM
        li = EllmLLM(llm=llm, max_tokens=tokens, temperature=0)
        out["llama_index complete"] = lambda: li.complete(PROMPT).additional_kwargs["completion_tokens"]
    except ImportError:
        pass
    try:
        import litellm

        from ellm.integrations import litellm as provider
        provider.register(llm, "bench")
        out["litellm completion"] = lambda: litellm.completion(model="ellm/bench", messages=messages, max_tokens=tokens,
                                                               temperature=0).usage.completion_tokens
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0, help="of the order shuffles")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with ellm.load(args.model, max_model_len=1024, progress=False) as llm:
        calls = variants(llm, args.tokens)
        counts = {name: fn() for name, fn in calls.items()}   # warm-up (and llguidance-free: no constraint)
        if len(set(counts.values())) != 1 or args.tokens not in counts.values():
            raise SystemExit(f"the variants generated different token counts: {counts}")
        times: dict[str, list[float]] = {name: [] for name in calls}
        load_before = os.getloadavg()
        for _ in range(args.rounds):
            order = list(calls)
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        load_after = os.getloadavg()
    base = statistics.median(times["llm.chat"])
    print(f"{llm.source}: {args.tokens} tokens a call, {args.rounds} rounds, medians "
          f"(load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {med * 1e3:8.1f} ms  ({args.tokens / med:6.1f} tok/s)  x{med / base:.3f}  "
              f"[min {min(ts) * 1e3:.1f} ms]")


if __name__ == "__main__":
    main()
