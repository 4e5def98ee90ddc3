"""Decode speed with a JSON-schema constraint against none, at 1 and 16 sequences.

Each round runs `concurrency` sequences of the same chat prompt to max_tokens, once
constrained by a JSON schema that cannot close before max_tokens (so both runs generate
the same number of tokens) and once free (ignore_eos); the two alternate, round after
round, and the table gives median decode tok/s (steps with no prefill in them: tokens
made / wall time) and their ratio. The constrained run's time includes the matcher
advancing and any wait for the masks that the forward pass did not hide; the last two
columns say how long the batch's mask fill took (it runs beside the forward pass) and how
long step() then still waited for it (medians over the constrained steps).

    nice python benchmarks/bench_structured.py [--model PATH] [--rounds 3] [--tokens 48]
        [--concurrency 1 16]

Shared machines are noisy (check /proc/loadavg): read the ratio, not the absolute figure.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ellm
from ellm.engine import structured
from ellm.sampling_params import SamplingParams

# Notes that must number at least 40: never complete within the benchmark's max_tokens.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 40,
                                                     "items": {"type": "string", "maxLength": 24}}},
          "required": ["notes"], "additionalProperties": False}


class MaskTimer:
    """Wraps MaskFiller.start to time each batch's fill and the wait that follows the forward."""

    def __init__(self) -> None:
        self.fills: list[float] = []
        self.waits: list[float] = []
        start = structured.MaskFiller.start
        timer = self

        def timed(filler: structured.MaskFiller, states: list) -> structured.PendingMasks | None:
            pending = start(filler, states)
            if pending is None:
                return None
            t0 = time.perf_counter()
            pending._future.add_done_callback(lambda _: timer.fills.append(time.perf_counter() - t0))
            wait = pending.wait

            def timed_wait() -> list:
                t = time.perf_counter()
                rows = wait()
                timer.waits.append(time.perf_counter() - t)
                return rows
            pending.wait = timed_wait  # type: ignore[method-assign]
            return pending

        structured.MaskFiller.start = timed  # type: ignore[method-assign]


def decode_rate(llm: Any, ids: list[int], params: SamplingParams, concurrency: int) -> tuple[float, int]:
    """(decode tok/s, tokens generated) for `concurrency` copies of one request."""
    engine = llm.engine
    llm.engine.blocks.clear_prefix_cache()
    for _ in range(concurrency):
        engine.add_request(ids, params)
    tokens, seconds = 0, 0.0
    while engine.has_unfinished():
        prefill = any(s.in_prefill or s.num_computed == 0 for s in engine.scheduler.running) or engine.num_waiting
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not prefill:
            tokens += sum(len(o.new_token_ids) for o in outs)
            seconds += dt
    return (tokens / seconds if seconds else 0.0), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 2 or any(c < 1 for c in args.concurrency):
        ap.error("--rounds >= 1, --tokens >= 2 and every --concurrency >= 1")

    llm = ellm.load(args.model, max_num_seqs=max(args.concurrency), progress=False)
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Write notes about the sea as JSON."}])
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, json_schema=SCHEMA)
    decode_rate(llm, ids, constrained, 1)  # builds llguidance's tokenizer once, outside the timing
    timer = MaskTimer()

    print(f"model {llm.source}, {args.tokens} tokens per sequence, {args.rounds} rounds (medians)")
    print("| sequences | free tok/s | JSON schema tok/s | constrained / free | mask fill ms | wait after forward ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        rates: dict[str, list[float]] = {"free": [], "json": []}
        timer.fills.clear()
        timer.waits.clear()
        for _ in range(args.rounds):
            for name, params in (("free", free), ("json", constrained)):
                rate, made = decode_rate(llm, ids, params, c)
                if made < c * (args.tokens - 2):
                    raise SystemExit(f"{name} run made only {made} tokens: the comparison would be unfair")
                rates[name].append(rate)
        f, j = statistics.median(rates["free"]), statistics.median(rates["json"])
        fill, wait = statistics.median(timer.fills) * 1e3, statistics.median(timer.waits) * 1e3
        print(f"| {c} | {f:.1f} | {j:.1f} | {j / f:.3f} | {fill:.2f} | {wait:.3f} |", flush=True)


if __name__ == "__main__":
    main()
