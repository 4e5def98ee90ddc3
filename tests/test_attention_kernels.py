"""Batched decode through the fused attention kernel: many sequences, one token each.

A decode step of 16 sequences is one rope_attention call of 16 tokens, each over its own
context. The kernel runs a small call (one short sequence alone) on the calling thread and
a larger one over the pool, groups keys 16 at a time where a tile has them and 4 or 1 at a
time at its end: none of that may change a bit of any token's output, and the batch must
match the NumPy reference (ops/reference.py, the specification).
"""
from __future__ import annotations

import numpy as np
import pytest

from ellm._native import _kernels as K
from ellm.ops import reference as ref

from test_kernels import assert_bits, assert_close, make_batch
from test_kernels import simd  # noqa: F401  (the fixture: every SIMD level, both modules)


# 16 sequences: contexts from 0 to past two chunks, every tile remainder class (0, 1, 15,
# 16, 17, 63 keys past a multiple of 64) and lengths on both sides of a chunk (256)
CONTEXTS = [0, 1, 14, 15, 16, 31, 47, 63, 64, 65, 127, 200, 255, 256, 300, 530]


@pytest.fixture
def threads_restored():
    before = K.num_threads()
    yield
    K.set_num_threads(before)


def decode(batch, idx, cache, window=0, cap=0.0):
    """The kernel on tokens `idx` of batch over cache = [k, v] (written in place)."""
    idx = np.asarray(idx, np.int64)
    hd = batch["q"].shape[2]
    return K.rope_attention(batch["q"][idx], batch["k"][idx], batch["v"][idx], batch["positions"][idx],
                            batch["seq_ids"][idx], batch["block_tables"], cache[0], cache[1], batch["inv_freq"],
                            True, hd**-0.5, window, cap)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)], ids=["smollm2", "gemma3"])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (100, 30.0)], ids=["causal", "window-cap"])
def test_batched_decode_of_16_equals_each_alone(simd, threads_restored, heads, window, cap) -> None:
    """16 sequences decoding one token each in one call == each sequence alone (a small
    call, run on one thread), on 1 and 2 threads, and both match the reference."""
    nh, nkv, hd = heads
    batch = make_batch(nh, nkv, hd, new=[1] * 16, before=CONTEXTS, seed=hd + window)
    results = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        together = decode(batch, range(16), [batch["k_cache"].copy(), batch["v_cache"].copy()], window, cap)
        alone = np.concatenate([decode(batch, [t], [batch["k_cache"].copy(), batch["v_cache"].copy()], window, cap)
                                for t in range(16)])
        assert_bits(alone, together, f"each sequence alone vs all 16 together, {threads} threads")
        results.append(together)
    assert_bits(results[1], results[0], "2 threads vs 1")
    rb = {n: a.copy() for n, a in batch.items()}
    want = ref.rope_attention(rb["q"], rb["k"], rb["v"], rb["positions"], rb["seq_ids"], rb["block_tables"],
                              rb["k_cache"], rb["v_cache"], rb["inv_freq"], True, hd**-0.5, window, cap)
    assert_close(results[0], want, 2e-5)


@pytest.mark.parametrize("hd", [16, 40, 64, 130])
def test_decode_over_every_tile_remainder_equals_prefill(simd, hd) -> None:
    """One sequence prefilled over 80 positions in one call == the same tokens decoded one
    by one: every token's last tile holds 1..64 keys, so its scores come from 16-key
    groups, 4-key groups and single keys in every mix, in both schedules."""
    batch = make_batch(4, 2, hd, new=[80], before=[0], seed=hd)
    full = decode(batch, range(80), [batch["k_cache"].copy(), batch["v_cache"].copy()])
    cache = [batch["k_cache"].copy(), batch["v_cache"].copy()]
    steps = np.concatenate([decode(batch, [t], cache) for t in range(80)])
    assert_bits(steps, full, "decode one by one vs one prefill")


# ================================ f16 caches ================================


def _half(batch):
    """The batch with float16 caches (the same positions, their values rounded)."""
    return dict(batch, k_cache=batch["k_cache"].astype(np.float16), v_cache=batch["v_cache"].astype(np.float16))


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)], ids=["smollm2", "gemma3"])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (100, 30.0)], ids=["causal", "window-cap"])
def test_f16_cache_batched_decode_is_invariant_and_matches_the_reference(simd, threads_restored, heads,
                                                                        window, cap) -> None:
    """With float16 caches: 16 sequences together == each alone, 1 thread == 2, and the
    NumPy reference on the same float16 caches (its stores round as the kernel's do)
    agrees."""
    nh, nkv, hd = heads
    batch = _half(make_batch(nh, nkv, hd, new=[1] * 16, before=CONTEXTS, seed=hd + window + 1))
    results = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        cache = [batch["k_cache"].copy(), batch["v_cache"].copy()]
        together = decode(batch, range(16), cache, window, cap)
        alone = np.concatenate([decode(batch, [t], [batch["k_cache"].copy(), batch["v_cache"].copy()], window, cap)
                                for t in range(16)])
        assert_bits(alone, together, f"f16 cache: each alone vs all 16 together, {threads} threads")
        results.append((together, cache))
    assert_bits(results[1][0], results[0][0], "f16 cache: 2 threads vs 1")
    rb = {n: a.copy() for n, a in batch.items()}
    want = ref.rope_attention(rb["q"], rb["k"], rb["v"], rb["positions"], rb["seq_ids"], rb["block_tables"],
                              rb["k_cache"], rb["v_cache"], rb["inv_freq"], True, hd**-0.5, window, cap)
    assert_close(results[0][0], want.astype(np.float32), 2e-5)
    # V is stored as given: the same bits; K after RoPE, whose f32 value may be an ulp from
    # the reference's (as in the f32 test): then at most one f16 step apart
    assert np.array_equal(results[0][1][1].view(np.uint16), rb["v_cache"].view(np.uint16))
    np.testing.assert_allclose(results[0][1][0].astype(np.float32), rb["k_cache"].astype(np.float32),
                               rtol=2.0**-10, atol=1e-6)


@pytest.mark.parametrize("hd", [16, 40, 64, 130])
def test_f16_cache_holding_exact_values_gives_the_f32_bits(simd, hd) -> None:
    """No rotation (inv_freq empty) and k, v, caches that float16 holds exactly: the f16
    cache path is the f32 path on the same numbers, bit for bit, in both schedules
    (a prefill of 80 and one-token decodes) and every tile remainder."""
    batch = make_batch(4, 2, hd, new=[80], before=[0], seed=hd)
    for name in ("k", "v", "k_cache", "v_cache"):
        batch[name] = batch[name].astype(np.float16).astype(np.float32)
    batch["inv_freq"] = np.zeros(0, np.float32)
    f32 = decode(batch, range(80), [batch["k_cache"].copy(), batch["v_cache"].copy()])
    half = _half(batch)
    f16 = decode(half, range(80), [half["k_cache"].copy(), half["v_cache"].copy()])
    assert_bits(f16, f32, "f16 cache vs f32 cache on f16-exact values")
    cache = [half["k_cache"].copy(), half["v_cache"].copy()]
    steps = np.concatenate([decode(half, [t], cache) for t in range(80)])
    assert_bits(steps, f32, "f16 cache, decode one by one vs the f32 prefill")


def test_f16_cache_arguments_are_checked() -> None:
    batch = make_batch(4, 2, 64, new=[3], before=[5], seed=2)
    with pytest.raises(ValueError, match="float16"):   # one f16, one f32
        decode(batch, range(3), [batch["k_cache"].astype(np.float16), batch["v_cache"].copy()])
    big = _half(make_batch(2, 1, 258, new=[1], before=[2], seed=3))
    with pytest.raises(ValueError, match="f16 cache takes head_dim <= 256"):
        decode(big, [0], [big["k_cache"], big["v_cache"]])
    half = _half(batch)
    with pytest.raises(ValueError, match="float16|writable|contiguous"):
        decode(half, range(3), [half["k_cache"][:, :, ::-1], half["v_cache"]])
