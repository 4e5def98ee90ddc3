"""kv_cache_dtype="float16" on the real GGUFs: half the cache, batch invariance kept,
logits near the float32 cache's, the layer stack and the ops agreeing on it, and the
option's bad values named. (The kernel against the NumPy reference on float16 caches:
tests/test_attention_kernels.py.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm.models.batch import Batch
from ellm.ops.reference import KV_BF16
from ellm.sampling_params import SamplingParams


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[300 + i] + rng.integers(300, 9000, 20 + 9 * i).tolist() for i in range(n)]


def _prompt_logits(llm, ids: list[int]) -> np.ndarray:
    e = llm.engine
    assert e.blocks.allocate("p", len(ids))
    try:
        tables = {w: np.asarray([e.blocks.table("p", w)], np.int32) for w in e.kv.windows}
        return e.runner.forward(Batch.single(np.array(ids, np.int32), 0, tables, all_logits=True)).copy()
    finally:
        e.blocks.free("p")


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_float16_cache_is_half_the_bytes_and_batch_invariant(request, fixture: str) -> None:
    path = request.getfixturevalue(fixture)
    llm = ellm.load(path, kv_cache_dtype="float16", max_num_seqs=8, progress=False)
    f32 = ellm.load(path, max_num_seqs=8, progress=False)
    assert llm.engine.kv.k[0].dtype == np.float16 and f32.engine.kv.k[0].dtype == np.float32
    assert 2 * llm.engine.kv.bytes_per_token == f32.engine.kv.bytes_per_token
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4)
    together = llm.generate(_prompts(5), sp)
    for p, t in zip(_prompts(5), together):
        alone = llm.generate([p], sp)[0]
        assert alone.token_ids == t.token_ids and alone.logprobs == t.logprobs
    # the stack and the ops one by one, on the float16 cache
    llm.model.ops.layer_stack = None
    one_by_one = llm.generate(_prompts(5), sp)
    assert [r.logprobs for r in one_by_one] == [r.logprobs for r in together]


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_float16_cache_logits_stay_near_the_float32_cache(request, fixture: str) -> None:
    """A bound against gross errors (a wrong row read moves logits by tens): over a
    200-token prompt of random ids, each position's largest logit difference from the
    float32 cache, across the whole vocabulary. Measured on this machine: median 0.58 /
    largest 1.23 (SmolLM2, logits to ~38) and 1.6 / 11.4 (Gemma 3, logits to ~146); the
    greedy choice the same at 90% and 78% of these near-tie-ridden positions."""
    path = request.getfixturevalue(fixture)
    ids = _prompts(1)[0][:1] + np.random.default_rng(9).integers(300, 9000, 199).tolist()
    half = _prompt_logits(ellm.load(path, kv_cache_dtype="float16", progress=False), ids)
    full = _prompt_logits(ellm.load(path, progress=False), ids)
    per_position = np.abs(half - full).max(axis=1)
    assert 0 < np.median(per_position) < 2.5 and per_position.max() < 20, per_position
    assert np.mean(half.argmax(1) == full.argmax(1)) >= 0.7


@pytest.mark.parametrize("fixture, median, largest", [("smollm2_gguf", 0.15, 0.5), ("gemma3_gguf", 0.5, 3.0)])
def test_bfloat16_cache_logits_stay_near_the_float32_cache(request, fixture: str, median: float,
                                                            largest: float) -> None:
    """The cuda backend's default cache (kv_cache_dtype="auto" there) in its meaning, run by
    the reference backend (ops/reference.py KV_BF16, f32 activations): over the 200-token
    prompt of random ids above, each position's largest logit difference from the float32
    cache. Measured here: median 0.049 / largest 0.14 (SmolLM2, logits to ~38) and 0.15 /
    1.0 (Gemma 3, logits to ~156), the greedy choice the same at 99.5% of positions in both;
    the bounds are about three times those."""
    path = request.getfixturevalue(fixture)
    ids = _prompts(1)[0][:1] + np.random.default_rng(9).integers(300, 9000, 199).tolist()
    bf16 = ellm.load(path, device="reference", kv_cache_dtype="bfloat16", max_model_len=512, progress=False)
    f32 = ellm.load(path, device="reference", max_model_len=512, progress=False)
    assert bf16.engine.kv.k[0].dtype == KV_BF16 and f32.engine.kv.k[0].dtype == np.float32
    half, full = _prompt_logits(bf16, ids), _prompt_logits(f32, ids)
    per_position = np.abs(half - full).max(axis=1)
    assert 0 < np.median(per_position) < median and per_position.max() < largest, per_position
    assert np.mean(half.argmax(1) == full.argmax(1)) >= 0.95


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_cuda(smollm2_gguf: Path) -> None:
    from ellm.llm import kv_cache_element_type
    assert [kv_cache_element_type("auto", d) for d in ("cpu", "reference", "cuda")] == \
        ["float32", "float32", "bfloat16"]
    assert kv_cache_element_type("float32", "cuda") == "float32"
    llm = ellm.load(smollm2_gguf, device="reference", max_model_len=64, progress=False)
    assert llm.engine.cfg.kv_cache_dtype == "float32" and llm.engine.kv.k[0].dtype == np.float32


def test_bad_kv_cache_dtype_is_named(smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'float32', 'float16'"):
        ellm.load(smollm2_gguf, kv_cache_dtype="bf16", progress=False)
    with pytest.raises(ValueError, match="cpu backend"):
        ellm.load(smollm2_gguf, kv_cache_dtype="float16", device="reference", progress=False)
    with pytest.raises(ValueError, match="cuda backend"):   # the C kernels read f32 / f16 caches only
        ellm.load(smollm2_gguf, kv_cache_dtype="bfloat16", device="cpu", progress=False)
