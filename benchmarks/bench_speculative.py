"""Decode speed with and without speculative decoding (n-gram prompt lookup by default).

    nice -n 10 .venv/bin/python benchmarks/bench_speculative.py [--model NAME_OR_PATH] [--rounds 3]
    nice -n 10 .venv/bin/python benchmarks/bench_speculative.py --cost   # forward time vs tokens

Two LLMs on the same file, one with speculative_config, run the same greedy chat
requests, alternating on/off within each round (the machine is shared: medians over
rounds, ratios). Input-grounded prompts (rewrite, extract, code edit) carry ~512 tokens of
this repository's own text and code; open-ended ones carry none. Decode tok/s is measured
from a request's first output to its last (prefill excluded). Greedy ids are compared
too: speculation must not change them.

--cost prints the time of one forward of T tokens of one decoding sequence relative to
T = 1, the figure behind speculative.ROW_COST.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import ellm
from ellm import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def _clip(tokenizer, text: str, n: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def prompts(tokenizer, n_input: int) -> dict[str, list[dict]]:
    readme = _clip(tokenizer, (ROOT / "README.md").read_text(), n_input)
    docs = _clip(tokenizer, (ROOT / "docs" / "ARCHITECTURE.md").read_text(), n_input)
    code = _clip(tokenizer, (ROOT / "src" / "ellm" / "engine" / "stop.py").read_text(), n_input)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return {
        "rewrite": user("Rewrite the following text, keeping every sentence but fixing typos:\n\n" + readme),
        "extract": user("Quote the paragraphs of this document that talk about the engine, verbatim:\n\n" + docs),
        "code-edit": user("In this Python module, rename the class StopStringMatcher to StopMatcher and "
                          "print the whole module:\n\n" + code),
        "open-story": user("Write a long story about a lighthouse keeper and a storm."),
        "open-explain": user("Explain in detail how airplanes fly."),
    }


CLOCK = time.perf_counter


def timed(llm, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """-> (decode tok/s after the first output, generated ids)."""
    stream = llm._loop().submit_blocking(ids, params)
    first = None
    n_first = 0
    out = None
    try:
        for out in stream:
            if first is None and out.new_token_ids:
                first, n_first = CLOCK(), len(out.new_token_ids)
            if out.finished:
                break
        end = CLOCK()
    finally:
        stream.close()
    n = len(out.token_ids)
    return (n - n_first) / max(end - first, 1e-9), out.token_ids


def bench(args: argparse.Namespace) -> int:
    spec_cfg = json.loads(args.speculative_config) if args.speculative_config else NGRAM
    off = ellm.load(args.model, threads=args.threads, progress=False)
    on = ellm.load(args.model, threads=args.threads, progress=False, speculative_config=spec_cfg)
    chats = prompts(off.tokenizer, args.input_tokens)
    ids = {name: off.encode_chat(m) for name, m in chats.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=not args.eos)
    for llm in (off, on):   # warm up: page the weights in, fill the prefix cache
        for v in ids.values():
            timed(llm, v, SamplingParams(temperature=0, max_tokens=4))
    rates: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in ids}
    same = True
    for r in range(args.rounds):
        for name, v in ids.items():
            order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
            got = {}
            for label, llm in order:
                rate, toks = timed(llm, v, params)
                rates[name][label].append(rate)
                got[label] = toks
            same &= got["on"] == got["off"]
    if args.batch > 1:   # open-ended requests together: aggregate tok/s (guesses should back off)
        together = [ids["open-story"], ids["open-explain"]] * (args.batch // 2)
        agg: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for label, llm in ((("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))):
                t0 = CLOCK()
                outs = llm.generate(together, params)
                agg[label].append(sum(len(o.token_ids) for o in outs) / (CLOCK() - t0))
    st = on.engine.stats
    print(f"model {args.model or 'default'}, {args.threads} threads, speculative_config {json.dumps(spec_cfg)}")
    eos = 'honoured' if args.eos else 'ignored'
    clock = 'CPU' if args.cpu_time else 'wall'
    print(f"{args.max_tokens} new tokens, greedy, {args.rounds} rounds, medians, EOS {eos}, {clock} time; loadavg "
          f"{open('/proc/loadavg').read().split()[0]}")
    print(f"{'prompt':14} {'prompt tok':>10} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7}")
    ratios: dict[str, list[float]] = {"grounded": [], "open": []}
    for name, v in ids.items():
        a, b = statistics.median(rates[name]["off"]), statistics.median(rates[name]["on"])
        ratios["open" if name.startswith("open") else "grounded"].append(b / a)
        print(f"{name:14} {len(v):10d} {a:10.1f} {b:10.1f} {b / a:7.2f}")
    for group, rs in ratios.items():
        print(f"{group}: geometric mean ratio {float(np.exp(np.mean(np.log(rs)))):.2f}")
    if args.batch > 1:
        a, b = statistics.median(agg["off"]), statistics.median(agg["on"])
        print(f"{len(together)} open-ended requests at once: off {a:.1f}, on {b:.1f} tok/s (with prefill), "
              f"ratio {b / a:.2f}")
    acc = st["spec_accepted_tokens"] / max(1, st["spec_proposed_tokens"])
    print(f"guesses checked {st['spec_proposed_tokens']}, kept {st['spec_accepted_tokens']} ({acc:.0%}); "
          f"greedy ids identical: {same}")
    on.close()
    off.close()
    return 0 if same else 1


def cost(args: argparse.Namespace) -> int:
    """One sequence's forward of T tokens (its last token + T-1 guesses) vs T = 1."""
    from ellm.models.batch import Batch

    llm = ellm.load(args.model, threads=args.threads, progress=False)
    eng = llm.engine
    ctx = 512
    key = ("cost", 0)
    eng.blocks.allocate(key, ctx + 16)
    tables = {w: np.asarray([eng.blocks.table(key, w)], np.int32) for w in eng.kv.windows}
    ids = np.arange(100, 100 + ctx + 16, dtype=np.int32) % llm.config.vocab_size
    eng.runner.forward(Batch.single(ids[:ctx], 0, tables))
    base = None
    for T in (1, 2, 3, 5, 9, 17):
        times = []
        for _ in range(args.rounds * 10):
            batch = Batch.single(ids[ctx:ctx + T], ctx, tables, all_logits=True)
            t0 = CLOCK()
            eng.runner.forward(batch)
            times.append(CLOCK() - t0)
        t = statistics.median(times)
        base = base or t
        print(f"T={T:2d}  {t * 1e3:7.2f} ms  x{t / base:5.2f}  per extra row {(t / base - 1) / max(1, T - 1):.3f}")
    eng.blocks.free(key)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="name or path (default: smollm2-135m-instruct)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--input-tokens", type=int, default=512)
    p.add_argument("--speculative-config", default=None, metavar="JSON")
    p.add_argument("--batch", type=int, default=16, help="open-ended requests run together (0: skip)")
    p.add_argument("--eos", action="store_true", help="stop at EOS (default: always max-tokens)")
    p.add_argument("--cost", action="store_true", help="forward time vs tokens, then exit")
    p.add_argument("--cpu-time", action="store_true",
                   help="rates by this process's CPU time (all threads), less hurt by a shared host")
    args = p.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    return cost(args) if args.cost else bench(args)


if __name__ == "__main__":
    sys.exit(main())
