"""`ellm bench`: prefill and decode speed and peak memory of a loaded model."""
from __future__ import annotations

import resource
import statistics
import time
from typing import Any

from .sampling_params import SamplingParams

_TEXT = ("The history of science is the study of the development of science and scientific knowledge, "
         "including both the natural and social sciences. Science is a body of empirical, theoretical, "
         "and practical knowledge about the natural world, produced by scientists who emphasize the "
         "observation, explanation, and prediction of real-world phenomena. ")


def bench_prompt(llm: Any, n_tokens: int) -> list[int]:
    """A deterministic prompt of exactly n_tokens tokens of ordinary English."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += llm.tokenizer.encode(_TEXT, add_special_tokens=False)
    return ids[:n_tokens]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_prefill(llm: Any, n_tokens: int) -> float:
    """Seconds to prefill n_tokens and produce the first token (prefix cache bypassed)."""
    ids = bench_prompt(llm, n_tokens)
    llm.engine.blocks.clear_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0


def time_decode(llm: Any, context: int, new_tokens: int) -> float:
    """Seconds per decoded token after a prompt of `context` tokens (prefill excluded)."""
    ids = bench_prompt(llm, context)
    llm.engine.blocks.clear_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    stamps = []
    for _ in llm.stream(ids, params):
        stamps.append(time.perf_counter())
    if len(stamps) < 2:
        # pieces can merge (incomplete UTF-8); fall back to whole-run timing
        t0 = time.perf_counter()
        llm.generate(ids, params)
        return (time.perf_counter() - t0) / new_tokens
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run_bench(llm: Any, prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              contexts: tuple[int, ...] = ()) -> dict[str, float]:
    time_prefill(llm, 16)  # warm up: page in the weights, start the threads
    prefill = [prompt_tokens / time_prefill(llm, prompt_tokens) for _ in range(repeats)]
    decode = [1.0 / time_decode(llm, 16, new_tokens) for _ in range(repeats)]
    result = {
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "peak_rss_mb": peak_rss_mb(),
    }
    print(f"model: {llm.source}")
    print(f"prefill @{prompt_tokens}: {result['prefill_tok_s']:.1f} tok/s (median of {repeats})")
    print(f"decode {new_tokens} tokens: {result['decode_tok_s']:.1f} tok/s (median of {repeats})")
    for ctx in contexts:
        ms = 1000.0 * time_decode(llm, ctx, 32)
        result[f"decode_ms_at_{ctx}"] = ms
        print(f"decode at context {ctx}: {ms:.2f} ms/token")
    print(f"peak RSS: {result['peak_rss_mb']:.0f} MB")
    return result
