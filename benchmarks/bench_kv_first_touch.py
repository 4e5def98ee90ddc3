"""What writing a fresh KV block costs a prefill: the first write to each page of the
cache is a page fault that the kernel answers with a zeroed page.

The paged KV cache (engine/kv_cache.py) is committed page by page as blocks are written.
With prefix caching on, each new prompt takes blocks no earlier prompt wrote (the cached
ones are kept for reuse), so until the cache has been filled once every prefill pays a
fault per 4 KiB of K and V it writes: ~46 KB a token for SmolLM2, ~1.2 MB a 512-token
prompt per layer. This times 512-token prefills of distinct prompts in fresh engines,
alternating, with the cache mapped as ellm maps it (private, 4 KiB pages) and as a plain
`mmap.mmap(-1, n)` would (shared, shmem-backed), and prints each round's ratio:

    python benchmarks/bench_kv_first_touch.py --model smollm2-135m-instruct --rounds 6

`--warm` also times the same prompts with prefix caching off, where freed blocks are
taken again at once (pages already committed): the floor the first touch is measured from.
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import time
from typing import Any, Callable

import numpy as np

import ellm
import ellm.engine.kv_cache as kv_cache
from ellm.ops import memory


def shared_zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """The cache as a default mmap.mmap(-1, n) maps it (MAP_SHARED: shmem pages)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(count * dtype.itemsize, 1)), dtype=dtype,
                         count=count).reshape(shape)


def prefill_rate(model: str, zeros: Callable[..., np.ndarray], prompts: list[list[int]],
                 prefix_caching: bool) -> float:
    """Median tok/s of prefilling each prompt once (1 output token) in a fresh engine."""
    memory.host_kv_zeros = kv_cache.host_kv_zeros = zeros
    llm = ellm.load(model, threads=2)
    llm.engine.blocks.enable_prefix_caching = prefix_caching
    greedy1 = ellm.SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompts[0][:64]], greedy1)      # the first call's one-time costs
    times = []
    for ids in prompts:
        t0 = time.perf_counter()
        llm.generate([ids], greedy1)
        times.append(time.perf_counter() - t0)
    return len(prompts[0]) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=6, help="distinct prompts per engine")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--warm", action="store_true", help="also time reused (committed) blocks")
    args = ap.parse_args()

    private_zeros = memory.host_kv_zeros
    configs = {"private (ellm)": (private_zeros, True), "shared": (shared_zeros, True)}
    if args.warm:
        configs["reused blocks"] = (private_zeros, False)
    rng = np.random.default_rng(0)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            prompts = [[int(t) for t in rng.integers(100, 20000, args.tokens)] for _ in range(args.prompts)]
            zeros, caching = configs[name]
            rates[name].append(prefill_rate(args.model, zeros, prompts, caching))
    print(f"{args.model}: prefill@{args.tokens} tok/s of fresh prompts, {args.rounds} alternated rounds")
    for name, values in rates.items():
        print(f"  {name:15s} median {statistics.median(values):7.0f}   rounds: "
              + " ".join(f"{v:.0f}" for v in values))
    ratios = [p / s for p, s in zip(rates["private (ellm)"], rates["shared"])]
    print(f"  private / shared per round: median {statistics.median(ratios):.3f} ("
          + " ".join(f"{x:.3f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
