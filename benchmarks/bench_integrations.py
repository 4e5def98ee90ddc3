"""The cost of ellm.integrations: one chat reply of --tokens tokens through each framework
against the same reply from `llm.chat` on the same loaded model.

    python benchmarks/bench_integrations.py [--model M] [--tokens 64] [--rounds 15] [--only langchain]

Every call is greedy on the same prompt (long enough that the reply runs to --tokens
tokens), so every variant decodes the same tokens; the token counts are checked. The
variants run in a fresh random order in each round (in-process A/B alternation); printed
per variant: the median time, its ratio to llm.chat's median, the median of the per-round
ratios (paired), the median extra time per call, the fastest call, and the load average.
--tokens 1 shows the fixed cost a call adds. Frameworks that are not installed are left out.
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
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network fetch on import
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
    ap.add_argument("--only", action="append", default=[],
                    help="keep only variants whose name holds this (repeatable; llm.chat always runs)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with ellm.load(args.model, max_model_len=1024, progress=False) as llm:
        calls = {name: fn for name, fn in variants(llm, args.tokens).items()
                 if name == "llm.chat" or not args.only or any(o in name for o in args.only)}
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
    base = times["llm.chat"]
    print(f"{llm.source}: {args.tokens} tokens a call, {args.rounds} rounds "
          f"(load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    print(f"  {'':22s} {'median':>9s} {'tok/s':>7s} {'ratio':>7s} {'paired':>7s} {'extra':>9s} {'min':>9s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        # paired: the median of this variant's time over llm.chat's in the same round, which
        # cancels most of what other processes do to both; extra: the median difference
        paired = statistics.median(t / b for t, b in zip(ts, base))
        extra = statistics.median(t - b for t, b in zip(ts, base))
        print(f"  {name:22s} {med * 1e3:7.1f}ms {args.tokens / med:7.1f} {med / statistics.median(base):7.3f} "
              f"{paired:7.3f} {extra * 1e3:+7.1f}ms {min(ts) * 1e3:7.1f}ms")


if __name__ == "__main__":
    main()
