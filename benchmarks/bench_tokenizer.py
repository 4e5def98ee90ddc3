"""How long a tokenizer takes to build from a GGUF's vocabulary, in CPU time.

Gemma 3's 262k-token vocabulary ships without merges; ellm recovers them from the token
list. That recovery once took seconds; this times the whole `Tokenizer.from_gguf` (and the
merge recovery alone) so a regression shows up as a number, not as a flaky test:

    python benchmarks/bench_tokenizer.py                              # Gemma 3 270M from the cache
    python benchmarks/bench_tokenizer.py --gguf path/to/model.gguf --rounds 9

CPU time (time.process_time), so other processes on a shared machine count less; medians
and the best of --rounds, with /proc/loadavg printed first.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ellm.formats.gguf import GGUFFile
from ellm.tokenization.gguf_vocab import derive_merges
from ellm.tokenizer import Tokenizer

DEFAULT = Path.home() / ".cache/ellm/models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"


def cpu_seconds(fn: Callable[[], object]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT, help="a GGUF file (default: Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"no GGUF at {args.gguf}: pass --gguf, or `ellm pull gemma-3-270m` first")
    print("loadavg:", Path("/proc/loadavg").read_text().strip())
    gguf = GGUFFile(args.gguf)
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    print(f"{args.gguf.name}: {len(tokens):,} tokens")
    for name, fn in (("Tokenizer.from_gguf", lambda: Tokenizer.from_gguf(gguf)),
                     ("derive_merges", lambda: derive_merges(tokens))):
        times = [cpu_seconds(fn) for _ in range(args.rounds)]
        print(f"{name:20s} median {statistics.median(times):.3f} s  best {min(times):.3f} s  "
              f"(CPU time, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
