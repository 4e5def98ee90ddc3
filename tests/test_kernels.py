"""The native elementwise and RoPE + paged attention kernels against ops/reference.py.

Every test runs at every SIMD level this CPU supports. Inputs are random but seeded;
outputs are compared by max-abs error and NMSE with the NumPy reference, which is the
specification. Run as a script for a short benchmark (see benchmarks/bench_attention.py).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ellm._native import _core
from ellm._native import _kernels as K
from ellm.ops import reference as ref

LEVELS = _core.supported_simd_levels()


@pytest.fixture(params=LEVELS)
def simd(request):
    """Sets the SIMD level in both modules (each links its own copy of csrc/)."""
    before = K.simd_level()
    _core.set_simd_level(request.param)
    K.set_simd_level(request.param)
    yield request.param
    _core.set_simd_level(before)
    K.set_simd_level(before)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want64 = want.astype(np.float64)
    return float(((got.astype(np.float64) - want64) ** 2).sum() / max((want64**2).sum(), 1e-30))


def assert_close(got: np.ndarray, want: np.ndarray, atol: float, max_nmse: float = 1e-11) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    err = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0
    assert err <= atol, f"max abs error {err} > {atol}"
    # NMSE says nothing when the reference is (near) zero everywhere: max-abs covers that
    if float((want.astype(np.float64) ** 2).sum()) > 1e-6 * want.size:
        assert nmse(got, want) <= max_nmse


def assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}: "
                           f"{got[tuple(bad[0])]!r} vs {want[tuple(bad[0])]!r}")


# ================================ fast exp / tanh ================================

def test_exp_accuracy(simd) -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-87, 88.7, 300_001), rng.uniform(-1, 1, 10_000),
                        np.linspace(-1e-6, 1e-6, 101)]).astype(np.float32)
    got = K.fast_exp(x).astype(np.float64)
    truth = np.exp(x.astype(np.float64))
    normal = truth > 1.1754944e-38
    rel = np.abs(got[normal] - truth[normal]) / truth[normal]
    assert rel.max() < 1e-6, f"exp max relative error {rel.max()}"
    # within a few f32 ulp -- numpy's own f32 exp is about 2e-7
    assert rel.max() < 3e-7


def test_exp_special_values(simd) -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.7, 89.0, 100.0, -87.0, -95.0, -103.0, -150.0],
                 np.float32)
    got = K.fast_exp(x)
    with np.errstate(over="ignore", under="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    assert got[0] == 1 and got[1] == 1 and got[2] == np.inf and got[3] == 0 and np.isnan(got[4])
    assert np.isfinite(got[5]) and got[6] == np.inf and got[7] == np.inf
    # subnormal results: right to within a relative 1e-6 or one subnormal step
    np.testing.assert_allclose(got[8:], want[8:], rtol=1e-6, atol=2e-45)


def test_tanh_accuracy(simd) -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-10, 10, 300_001), rng.uniform(-0.7, 0.7, 100_000),
                        rng.uniform(-1e-5, 1e-5, 1001), [0.625, -0.625, 0.62500006, 9.5, 20.0, 1e-30]]
                       ).astype(np.float32)
    got = K.fast_tanh(x).astype(np.float64)
    truth = np.tanh(x.astype(np.float64))
    nz = truth != 0
    rel = np.abs(got[nz] - truth[nz]) / np.abs(truth[nz])
    assert rel.max() < 1e-6, f"tanh max relative error {rel.max()}"
    sp = K.fast_tanh(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32))
    assert sp[0] == 0 and np.signbit(sp[1]) and sp[2] == 1 and sp[3] == -1 and np.isnan(sp[4])


# ================================== elementwise ==================================

ROW_SHAPES = [(1, 576), (1, 640), (7, 33), (3, 1), (2, 1000), (300, 640), (64, 2048)]


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_rmsnorm(simd, shape) -> None:
    rng = np.random.default_rng(hash(shape) % 2**32)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    want = ref.rmsnorm(x, w, 1e-5)
    assert_close(K.rmsnorm(x, w, 1e-5), want, 2e-5)
    out = np.full_like(x, np.nan)
    assert K.rmsnorm(x, w, 1e-5, out) is out
    assert_close(out, want, 2e-5)
    y = x.copy()
    K.rmsnorm(y, w, 1e-5, y)  # in place
    assert_close(y, want, 2e-5)


def test_rmsnorm_strided_and_nd(simd) -> None:
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((9, 100)).astype(np.float32)
    x = wide[:, 10:70]  # row stride 100, 60 columns
    w = rng.standard_normal(60).astype(np.float32)
    assert_close(K.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), 2e-5)
    x3 = rng.standard_normal((2, 5, 60)).astype(np.float32)
    got = K.rmsnorm(x3, w, 1e-6)
    assert got.shape == (2, 5, 60)
    assert_close(got, ref.rmsnorm(x3, w, 1e-6), 2e-5)


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_add_rmsnorm(simd, shape) -> None:
    rng = np.random.default_rng(4 + shape[1])
    res = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    total = res + x
    want = ref.rmsnorm(total, w, 1e-6)
    r = res.copy()
    out = K.add_rmsnorm(r, x, w, 1e-6)
    np.testing.assert_array_equal(r, total)  # one f32 add, exactly numpy's
    assert_close(out, want, 2e-5)
    r = res.copy()
    x2 = x.copy()
    K.add_rmsnorm(r, x2, w, 1e-6, x2)  # out may be x
    assert_close(x2, want, 2e-5)
    with pytest.raises(ValueError, match="residual"):
        K.add_rmsnorm(r, x, w, 1e-6, r)


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_gated_activations(simd, shape, kind) -> None:
    rng = np.random.default_rng(5 + shape[0])
    R, F = shape
    fused = (rng.standard_normal((R, 2 * F)) * 4).astype(np.float32)
    fused[:, :3] = [-30.0, 30.0, -9.0][: min(3, F)] if F >= 3 else fused[:, :3]
    gate, up = fused[:, :F], fused[:, F:]  # views into a fused projection, row stride 2F
    fn, want_fn = (K.swiglu, ref.swiglu) if kind == "swiglu" else (K.geglu, ref.geglu)
    want = want_fn(gate, up)
    scale = float(np.abs(want).max()) + 1.0
    got = fn(gate, up)
    assert_close(got, want, 2e-6 * scale)
    g2 = np.ascontiguousarray(gate)
    fn(g2, up, g2)  # out may be gate
    assert_close(g2, want, 2e-6 * scale)


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_add_scale_softcap(simd, shape) -> None:
    rng = np.random.default_rng(6 + shape[1])
    a = (rng.standard_normal(shape) * 40).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    want = a + b
    got = a.copy()
    assert K.add(got, b) is got
    np.testing.assert_array_equal(got, want)
    s = a.copy()
    K.scale_(s, 0.125)
    np.testing.assert_array_equal(s, a * np.float32(0.125))
    for cap in (50.0, 30.0, 0.0, -1.0):
        c = a.copy()
        assert K.softcap_(c, cap) is c
        assert_close(c, ref.softcap(a, cap), 2e-6 * max(cap, 1.0))


def _row_ops():
    """name -> fn(x (R, n), y (R, n), w (n,)) returning a fresh result, one per row op."""
    def add_rmsnorm(x, y, w):
        r = x.copy()
        out = K.add_rmsnorm(r, y, w, 1e-6)
        return np.concatenate([r, out], axis=1)
    return {
        "rmsnorm": lambda x, y, w: K.rmsnorm(x, w, 1e-5),
        "add_rmsnorm": add_rmsnorm,
        "swiglu": lambda x, y, w: K.swiglu(x, y),
        "geglu": lambda x, y, w: K.geglu(x, y),
        "softcap": lambda x, y, w: K.softcap_(x.copy(), 30.0),
        "scale": lambda x, y, w: K.scale_(x.copy(), 0.37),
        "add": lambda x, y, w: K.add(x.copy(), y),
    }


@pytest.mark.parametrize("op", list(_row_ops()))
@pytest.mark.parametrize("n", [576, 640, 1536, 77])
def test_elementwise_row_invariant(simd, op, n) -> None:
    """A row's result does not depend on how many rows are in the call (so whether the
    call is split over threads), on the thread count, or on where the row sits in
    memory (alignment, stride)."""
    fn = _row_ops()[op]
    rng = np.random.default_rng(n)
    R = 300  # 300 * n elements: large enough for the thread pool to split the rows
    x = (rng.standard_normal((R, n)) * 5).astype(np.float32)
    y = (rng.standard_normal((R, n)) * 5).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    threads0 = K.num_threads()
    try:
        K.set_num_threads(2)
        whole = fn(x, y, w)
        K.set_num_threads(1)
        assert_bits(fn(x, y, w), whole, f"{op}: 1 thread vs 2")
        K.set_num_threads(2)
        assert_bits(fn(x[7:11], y[7:11], w), whole[7:11], f"{op}: 4 rows vs {R}")
        for r in (0, 123, R - 1):
            assert_bits(fn(x[r:r + 1], y[r:r + 1], w), whole[r:r + 1], f"{op}: row {r} alone")
            # the same row at an odd offset inside a wider buffer (misaligned, strided)
            wide = np.zeros((2, 2 * n + 3), np.float32)
            wide[1, 3: 3 + n] = x[r]
            wide[1, 3 + n: 3 + 2 * n] = y[r]
            got = fn(wide[1:, 3: 3 + n], wide[1:, 3 + n: 3 + 2 * n], w)
            assert_bits(got, whole[r:r + 1], f"{op}: row {r} misaligned")
    finally:
        K.set_num_threads(threads0)


def test_elementwise_rejects_bad_input() -> None:
    x = np.ones((3, 8), np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="x must be float32"):
        K.rmsnorm(x.astype(np.float64), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm(x, np.ones(7, np.float32), 1e-5)
    with pytest.raises(ValueError, match="out"):
        K.rmsnorm(x, w, 1e-5, np.empty((3, 7), np.float32))
    with pytest.raises(ValueError, match="contiguous rows"):
        K.rmsnorm(np.ones((8, 3), np.float32).T, w, 1e-5)
    ro = np.ones((3, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        K.rmsnorm(x, w, 1e-5, ro)
    with pytest.raises(ValueError, match="differ in shape"):
        K.swiglu(x, np.ones((3, 9), np.float32))
    with pytest.raises(ValueError, match="differ in shape"):
        K.add(x, np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="numpy"):
        K.add([1.0], x)


# ============================ RoPE + paged attention ============================

BLOCK = 16


def make_batch(nh, nkv, hd, new, before, *, block=BLOCK, seed=0, free_before=None):
    """A paged cache holding `before[b]` earlier tokens of each sequence b, which now adds
    `new[b]` tokens; block tables are a shuffled permutation of the physical blocks.
    free_before[b]: blocks wholly below this position are released (-1), as a sliding-
    window cache may do."""
    rng = np.random.default_rng(seed)
    B = len(new)
    need = [(before[b] + new[b] + block - 1) // block for b in range(B)]
    max_blocks = max(need) + 2
    num_blocks = sum(need) + 5
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((B, max_blocks), -1, np.int32)
    used = 0
    for b in range(B):
        table[b, : need[b]] = perm[used: used + need[b]]
        used += need[b]
        if free_before and free_before[b]:
            table[b, : free_before[b] // block] = -1
    k_cache = rng.standard_normal((num_blocks, block, nkv, hd)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block, nkv, hd)).astype(np.float32)
    positions = np.concatenate([np.arange(before[b], before[b] + new[b]) for b in range(B)]).astype(np.int32)
    seq_ids = np.concatenate([np.full(new[b], b) for b in range(B)]).astype(np.int32)
    T = len(positions)
    q = (rng.standard_normal((T, nh, hd)) * 2).astype(np.float32)
    k = (rng.standard_normal((T, nkv, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(np.float32)
    return dict(q=q, k=k, v=v, positions=positions, seq_ids=seq_ids, block_tables=table,
                k_cache=k_cache, v_cache=v_cache, inv_freq=inv_freq)


def run_both(batch, interleaved, scale, window, cap, mscale=1.0):
    """(kernel out, reference out, kernel caches, reference caches)."""
    kb = {n: a.copy() for n, a in batch.items()}
    rb = {n: a.copy() for n, a in batch.items()}
    got = K.rope_attention(kb["q"], kb["k"], kb["v"], kb["positions"], kb["seq_ids"], kb["block_tables"],
                           kb["k_cache"], kb["v_cache"], kb["inv_freq"], interleaved, scale, window, cap,
                           rope_mscale=mscale)
    want = ref.rope_attention(rb["q"], rb["k"], rb["v"], rb["positions"], rb["seq_ids"], rb["block_tables"],
                              rb["k_cache"], rb["v_cache"], rb["inv_freq"], interleaved, scale, window, cap,
                              mscale)
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(kb[name], batch[name], err_msg=f"{name} was modified")
    return got, want, (kb["k_cache"], kb["v_cache"]), (rb["k_cache"], rb["v_cache"])


def check_attention(batch, interleaved=False, window=0, cap=0.0, scale=None, mscale=1.0):
    hd = batch["q"].shape[2]
    scale = hd**-0.5 if scale is None else scale
    got, want, (kc, vc), (rkc, rvc) = run_both(batch, interleaved, scale, window, cap, mscale)
    assert_close(got, want, 2e-5, 1e-11)
    # the caches hold the rotated k and the raw v of every new token, nothing else changed
    np.testing.assert_allclose(kc, rkc, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(vc, rvc)


# the batch from the brief: one sequence prefilling 17 tokens, two decoding one token
# each at long positions
MIXED = dict(new=[17, 1, 1], before=[0, 700, 1234])


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)], ids=["smollm2", "gemma3"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("cap", [0.0, 50.0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_attention_mixed_batch(simd, heads, window, cap, interleaved) -> None:
    nh, nkv, hd = heads
    batch = make_batch(nh, nkv, hd, **MIXED, seed=nh + window)
    check_attention(batch, interleaved, window, cap)


@pytest.mark.parametrize("hd", [2, 6, 10, 18, 40, 130])
def test_attention_odd_head_dims(simd, hd) -> None:
    """Every even head_dim: vector bodies plus masked tails at both widths."""
    batch = make_batch(4, 2, hd, new=[5, 1, 3], before=[0, 77, 20], seed=hd)
    check_attention(batch, interleaved=hd % 4 == 2, window=7 if hd > 10 else 0, cap=20.0 if hd == 40 else 0.0)


def test_attention_large_group(simd) -> None:
    """17 query heads per kv head: more than one pass over the keys per group."""
    batch = make_batch(34, 2, 16, new=[3, 1], before=[0, 200], seed=7)
    check_attention(batch)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("window", [0, 300])
def test_attention_long_decode_splits(simd, threads, window) -> None:
    """Single-token decode at long contexts, where the keys are split across threads
    (the split count follows the thread count)."""
    before = K.num_threads()
    K.set_num_threads(threads)
    try:
        batch = make_batch(4, 1, 256, new=[1], before=[1500], seed=threads)
        check_attention(batch, window=window, cap=50.0)
        batch = make_batch(9, 3, 64, new=[1, 1], before=[900, 130], seed=threads + 1)
        check_attention(batch, interleaved=True, window=window)
    finally:
        K.set_num_threads(before)


def test_attention_long_prefill(simd) -> None:
    batch = make_batch(9, 3, 64, new=[150, 40], before=[0, 60], seed=11)
    check_attention(batch, interleaved=True)


def test_attention_freed_blocks_outside_window(simd) -> None:
    """Blocks wholly before a token's window may be released (-1): they are never read."""
    # windows: [69, 100] for sequence 0; [39, 70] and [40, 71] for sequence 1
    batch = make_batch(4, 1, 32, new=[1, 2], before=[100, 70], free_before=[64, 32], seed=3)
    check_attention(batch, window=32)
    # freeing the block of positions 32..47 as well is caught before anything runs
    batch = make_batch(4, 1, 32, new=[1, 2], before=[100, 70], free_before=[64, 48], seed=3)
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = -1"):
        check_attention(batch, window=32)


# ------------------------- partial rotary and rope_mscale -------------------------
# Phi-3 / Phi-4-mini rotate only the first partial_rotary_factor * head_dim dims of each
# head (inv_freq shorter than hd/2) and scale cos and sin by longrope's attention factor.

def partial(batch, n_rot):
    """The batch with only its first n_rot frequencies (dims >= 2 n_rot pass through)."""
    return dict(batch, inv_freq=np.ascontiguousarray(batch["inv_freq"][:n_rot]))


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 96)], ids=["hd64", "hd96"])
@pytest.mark.parametrize("frac", [0.0, 0.25, 0.75, 1.0])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 1.1902380714238083])
def test_attention_partial_rotary(simd, heads, frac, interleaved, mscale) -> None:
    """Prefill and long decodes in one mixed batch (decode at 700 / 1234 takes the split
    schedule on 2+ threads), against the reference: rotated dims, the dims passed
    through (in q and in the cached k) and the scaled cos / sin."""
    nh, nkv, hd = heads
    n_rot = int(frac * hd) // 2
    batch = partial(make_batch(nh, nkv, hd, **MIXED, seed=nh + n_rot), n_rot)
    check_attention(batch, interleaved, window=0, cap=0.0, mscale=mscale)


def test_attention_partial_rotary_leaves_the_rest(simd) -> None:
    """The cached k of a token: dims past 2 n_rot are the raw k bits; with mscale 1 and
    n_rot = hd/2 the result is the full-rotary call's, bit for bit."""
    batch = make_batch(4, 2, 32, new=[3], before=[5], seed=5)
    for interleaved in (False, True):
        part = partial(batch, 6)
        cache = fresh_cache(part)
        run_tokens(part, cache, range(3), interleaved, 0, 0.0)
        slots = [(batch["block_tables"][0, p // BLOCK], p % BLOCK) for p in batch["positions"]]
        for t, (blk, off) in enumerate(slots):
            np.testing.assert_array_equal(cache[0][blk, off][:, 12:], batch["k"][t][:, 12:])
            assert not np.array_equal(cache[0][blk, off][:, :12], batch["k"][t][:, :12])
        full = run_tokens(batch, fresh_cache(batch), range(3), interleaved, 0, 0.0)
        same = run_tokens(batch, fresh_cache(batch), range(3), interleaved, 0, 0.0, mscale=1.0)
        assert_bits(same, full, "mscale 1.0 is the identity")


@pytest.mark.parametrize("interleaved", [False, True])
def test_attention_partial_rotary_batch_invariant(simd, interleaved) -> None:
    """Partial rotary with mscale: 40 tokens at once == 30 then 10 one by one, and a
    sequence alone == batched with others, at every thread count."""
    batch = partial(make_batch(8, 2, 64, new=[40], before=[236], seed=21), 12)
    ms = 1.19
    full = run_tokens(batch, fresh_cache(batch), range(40), interleaved, 0, 0.0, mscale=ms)
    cache = fresh_cache(batch)
    first = run_tokens(batch, cache, range(30), interleaved, 0, 0.0, mscale=ms)
    steps = np.concatenate([run_tokens(batch, cache, [t], interleaved, 0, 0.0, mscale=ms)
                            for t in range(30, 40)])
    assert_bits(first, full[:30], "30-token prefill vs 40-token prefill")
    assert_bits(steps, full[30:], "one-by-one decode vs prefill")
    mixed = partial(make_batch(8, 2, 64, new=[23, 1, 6], before=[290, 1000, 40], seed=22), 12)
    seq = mixed["seq_ids"]
    threads0 = K.num_threads()
    try:
        for threads in (1, 2, 3):
            K.set_num_threads(threads)
            together = run_tokens(mixed, fresh_cache(mixed), range(len(seq)), interleaved, 0, 0.0,
                                  mscale=ms)
            for b in range(3):
                mine = np.flatnonzero(seq == b)
                alone = run_tokens(mixed, fresh_cache(mixed), mine, interleaved, 0, 0.0, mscale=ms)
                assert_bits(alone, together[mine], f"sequence {b} alone vs batched, {threads} threads")
    finally:
        K.set_num_threads(threads0)


def test_attention_rejects_bad_rotary(small_batch) -> None:
    b = small_batch
    with pytest.raises(ValueError, match="head_dim/2"):
        call(b, inv_freq=np.ones(b["q"].shape[2] // 2 + 1, np.float32))
    with pytest.raises(ValueError, match="rope_mscale"):
        call(b, rope_mscale=float("nan"))


# ------------------------------ batch invariance ------------------------------
# A token's output must be bit-identical whatever else is in the call: the engine relies
# on it (batched greedy decode == each sequence alone, prefix-cache hit == miss, decode
# over the cache == full recompute), because 1e-6 differences are amplified by the 8-bit
# activation quantization of the matmuls into different greedy text.

def run_tokens(batch, cache, idx, interleaved, window, cap, scratch=None, mscale=1.0):
    """The kernel on the tokens `idx` of batch (in that order), over cache = [k, v] (updated
    in place). Returns their output rows."""
    idx = np.asarray(idx, np.int64)
    hd = batch["q"].shape[2]
    return K.rope_attention(batch["q"][idx], batch["k"][idx], batch["v"][idx], batch["positions"][idx],
                            batch["seq_ids"][idx], batch["block_tables"], cache[0], cache[1],
                            batch["inv_freq"], interleaved, hd**-0.5, window, cap, None, scratch,
                            rope_mscale=mscale)


def fresh_cache(batch):
    return [batch["k_cache"].copy(), batch["v_cache"].copy()]


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)], ids=["smollm2", "gemma3"])
@pytest.mark.parametrize("window", [0, 5, 512])
@pytest.mark.parametrize("cap", [0.0, 50.0])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("before", [0, 236, 600], ids=["from0", "across256", "long"])
def test_attention_prefill_equals_incremental(simd, heads, window, cap, interleaved, before) -> None:
    """40 tokens in one call == 30 in one call, then 10 one at a time (decode over the
    cache). `before` cached tokens first: the new ones then cross chunk and tile
    boundaries, and a 512 window starts mid-chunk."""
    nh, nkv, hd = heads
    batch = make_batch(nh, nkv, hd, new=[40], before=[before], seed=before + window + nh)
    full = run_tokens(batch, fresh_cache(batch), range(40), interleaved, window, cap)
    cache = fresh_cache(batch)
    first = run_tokens(batch, cache, range(30), interleaved, window, cap)
    steps = np.concatenate([run_tokens(batch, cache, [t], interleaved, window, cap) for t in range(30, 40)])
    assert_bits(first, full[:30], "30-token prefill vs 40-token prefill")
    assert_bits(steps, full[30:], "one-by-one decode vs prefill")
    if before == 0 and window == 0:  # and both agree with the specification
        assert_close(full, run_both(batch, interleaved, hd**-0.5, window, cap)[1], 2e-5)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (34, 1, 16)], ids=["smollm2", "gemma3", "g34"])
@pytest.mark.parametrize("window", [0, 300])
def test_attention_sequence_alone_equals_batched(simd, heads, window) -> None:
    """Each sequence alone == the same sequence batched with two others (different
    lengths, prefill and decode mixed), in two orders."""
    nh, nkv, hd = heads
    batch = make_batch(nh, nkv, hd, new=[23, 1, 6], before=[290, 1000, 40], seed=nh + window)
    seq = batch["seq_ids"]
    together = run_tokens(batch, fresh_cache(batch), range(len(seq)), True, window, 30.0)
    order = np.concatenate([np.flatnonzero(seq == 2), np.flatnonzero(seq == 0), np.flatnonzero(seq == 1)])
    shuffled = np.empty_like(together)
    shuffled[order] = run_tokens(batch, fresh_cache(batch), order, True, window, 30.0)
    assert_bits(shuffled, together, "batch in another order")
    for b in range(3):
        mine = np.flatnonzero(seq == b)
        alone = run_tokens(batch, fresh_cache(batch), mine, True, window, 30.0)
        assert_bits(alone, together[mine], f"sequence {b} alone vs batched")


@pytest.mark.parametrize("case", ["decode1", "decode2", "decode8", "prefill"])
def test_attention_thread_count_invariant(simd, case) -> None:
    """1, 2, 3 or 4 threads (small batches split their keys over threads, larger ones
    do not; a minimal scratch forbids splitting): the same bits."""
    shapes = {"decode1": ((4, 1, 256), [1], [1800]), "decode2": ((9, 3, 64), [1, 1], [700, 1300]),
              "decode8": ((9, 3, 64), [1] * 8, [100 * i + 37 for i in range(8)]),
              "prefill": ((9, 3, 64), [70, 1], [200, 530])}
    (nh, nkv, hd), new, before = shapes[case]
    batch = make_batch(nh, nkv, hd, new=new, before=before, seed=len(new))
    T = len(batch["positions"])
    threads0 = K.num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 4):
            K.set_num_threads(threads)
            results.append(run_tokens(batch, fresh_cache(batch), range(T), False, 0, 0.0))
        least = np.empty(K.attention_scratch_bytes(T, nh, nkv, hd, 1) // 4, np.float32)
        results.append(run_tokens(batch, fresh_cache(batch), range(T), False, 0, 0.0, scratch=least))
    finally:
        K.set_num_threads(threads0)
    for i, r in enumerate(results[1:]):
        assert_bits(r, results[0], f"run {i + 1} vs 1 thread")


def test_attention_far_apart_tokens_of_one_sequence(simd) -> None:
    """Tokens of one sequence far apart in one call, with a window and the blocks between
    their windows released (-1): the kernel reads only what each token sees, and each
    token's row equals that token alone."""
    nh, nkv, hd, bs = 4, 1, 32, BLOCK
    rng = np.random.default_rng(12)
    positions = np.array([20, 2000, 21, 700], np.int32)
    window = 5
    table = np.full((1, 2001 // bs + 1), -1, np.int32)
    needed = sorted({b for p in positions for b in range((p - window + 1) // bs, p // bs + 1)})
    table[0, needed] = np.arange(len(needed), dtype=np.int32)
    batch = dict(q=rng.standard_normal((4, nh, hd)).astype(np.float32),
                 k=rng.standard_normal((4, nkv, hd)).astype(np.float32),
                 v=rng.standard_normal((4, nkv, hd)).astype(np.float32),
                 positions=positions, seq_ids=np.zeros(4, np.int32), block_tables=table,
                 k_cache=rng.standard_normal((len(needed), bs, nkv, hd)).astype(np.float32),
                 v_cache=rng.standard_normal((len(needed), bs, nkv, hd)).astype(np.float32),
                 inv_freq=(1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32))
    check_attention(batch, window=window)
    together = run_tokens(batch, fresh_cache(batch), range(4), False, window, 0.0)
    cache = fresh_cache(batch)
    run_tokens(batch, cache, range(4), False, window, 0.0)  # every token's k/v in place
    for t in range(4):
        assert_bits(run_tokens(batch, [cache[0].copy(), cache[1].copy()], [t], False, window, 0.0),
                    together[t:t + 1], f"token {t} alone")


def test_attention_qkv_views_and_scale(simd) -> None:
    """q, k, v as views into one fused projection output (token stride > heads * hd)."""
    nh, nkv, hd = 9, 3, 64
    batch = make_batch(nh, nkv, hd, new=[6, 1], before=[0, 40], seed=5)
    T = batch["q"].shape[0]
    fused = np.concatenate([batch["q"].reshape(T, -1), batch["k"].reshape(T, -1),
                            batch["v"].reshape(T, -1), np.zeros((T, 3), np.float32)], axis=1)
    q = fused[:, : nh * hd].reshape(T, nh, hd)
    k = fused[:, nh * hd: (nh + nkv) * hd].reshape(T, nkv, hd)
    v = fused[:, (nh + nkv) * hd: (nh + 2 * nkv) * hd].reshape(T, nkv, hd)
    assert not q.flags.c_contiguous
    kc, vc = batch["k_cache"].copy(), batch["v_cache"].copy()
    out = np.empty((T, nh, hd), np.float32)
    got = K.rope_attention(q, k, v, batch["positions"], batch["seq_ids"], batch["block_tables"], kc, vc,
                           batch["inv_freq"], False, 0.1, 0, 0.0, out)
    assert got is out
    want = ref.rope_attention(batch["q"], batch["k"], batch["v"], batch["positions"], batch["seq_ids"],
                              batch["block_tables"], batch["k_cache"].copy(), batch["v_cache"].copy(),
                              batch["inv_freq"], False, 0.1, 0, 0.0)
    assert_close(got, want, 2e-5)


def test_attention_empty_batch() -> None:
    batch = make_batch(4, 2, 8, new=[1], before=[3])
    for name in ("q", "k", "v"):
        batch[name] = batch[name][:0]
    batch["positions"] = batch["positions"][:0]
    batch["seq_ids"] = batch["seq_ids"][:0]
    out = K.rope_attention(*batch.values(), False, 1.0)
    assert out.shape == (0, 4, 8)


def test_attention_concurrent_callers() -> None:
    """Two Python threads at once (the shared scratch is taken by one, the other allocates)."""
    batches = [make_batch(9, 3, 64, new=[8, 1], before=[0, 300 + 50 * i], seed=20 + i) for i in range(4)]
    expected = [run_both(b, False, 0.125, 0, 0.0)[1] for b in batches]
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(10):
            b = {n: a.copy() for n, a in batches[i].items()}
            got = K.rope_attention(*b.values(), False, 0.125)
            err = float(np.abs(got - expected[i]).max())
            if err > 2e-5:
                errors.append(f"batch {i}: error {err}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ------------------------------- validation -------------------------------

def call(batch, **over):
    b = {**batch, **over}
    return K.rope_attention(b["q"], b["k"], b["v"], b["positions"], b["seq_ids"], b["block_tables"],
                            b["k_cache"], b["v_cache"], b["inv_freq"], False, 0.125,
                            over.get("window", 0), 0.0, over.get("out"),
                            rope_mscale=over.get("rope_mscale", 1.0))


@pytest.fixture
def small_batch():
    return make_batch(4, 2, 8, new=[3, 1], before=[0, 20], seed=9)


def test_attention_rejects_bad_block_table(small_batch) -> None:
    kc0 = small_batch["k_cache"].copy()
    for bad in (-1, small_batch["k_cache"].shape[0], 10**6):
        table = small_batch["block_tables"].copy()
        table[1, 0] = bad  # a block the decoding token at position 20 reads
        with pytest.raises(ValueError, match=r"block_tables\[1, 0\]"):
            call(small_batch, block_tables=table)
    np.testing.assert_array_equal(small_batch["k_cache"], kc0)  # nothing written


def test_attention_rejects_bad_positions_and_ids(small_batch) -> None:
    max_pos = small_batch["block_tables"].shape[1] * BLOCK
    for bad in (max_pos, -1, 2**31 - 1):
        pos = small_batch["positions"].copy()
        pos[-1] = bad
        with pytest.raises(ValueError, match="positions"):
            call(small_batch, positions=pos)
    sid = small_batch["seq_ids"].copy()
    sid[0] = 2
    with pytest.raises(ValueError, match="seq_ids"):
        call(small_batch, seq_ids=sid)
    sid[0] = -1
    with pytest.raises(ValueError, match="seq_ids"):
        call(small_batch, seq_ids=sid)
    # position inside the table but in a block that is not allocated (-1)
    pos = small_batch["positions"].copy()
    pos[-1] = (small_batch["block_tables"].shape[1] - 1) * BLOCK
    with pytest.raises(ValueError, match="block_tables"):
        call(small_batch, positions=pos)


def test_attention_rejects_bad_shapes_and_dtypes(small_batch) -> None:
    b = small_batch
    with pytest.raises(ValueError, match="int32"):
        call(b, positions=b["positions"].astype(np.int64))
    with pytest.raises(ValueError, match="float32"):
        call(b, q=b["q"].astype(np.float64))
    with pytest.raises(ValueError, match="heads"):
        call(b, q=np.zeros((4, 3, 8), np.float32))  # 3 heads, 2 kv heads
    with pytest.raises(ValueError, match="tokens"):
        call(b, k=b["k"][:2])
    with pytest.raises(ValueError, match="inv_freq"):
        call(b, inv_freq=b["inv_freq"][::2])  # not contiguous
    with pytest.raises(ValueError, match="inv_freq"):
        call(b, inv_freq=b["inv_freq"].astype(np.float64))
    with pytest.raises(ValueError, match="k_cache"):
        call(b, v_cache=b["v_cache"][:, :, :1].copy())
    with pytest.raises(ValueError, match="out"):
        call(b, out=np.empty((4, 4, 9), np.float32))
    with pytest.raises(ValueError, match="overlaps"):
        call(b, out=b["k_cache"].reshape(-1)[: 4 * 4 * 8].reshape(4, 4, 8))
    with pytest.raises(ValueError, match="window"):
        call(b, window=-3)
    with pytest.raises(ValueError, match="even"):
        odd = make_batch(2, 1, 8, new=[1], before=[0])
        call(odd, q=odd["q"][:, :, :7], k=odd["k"][:, :, :7], v=odd["v"][:, :, :7])


def test_attention_scratch_bytes(small_batch) -> None:
    one = K.attention_scratch_bytes(5, 9, 3, 64, threads=1)
    assert one > 4 * 5 * 9 * 64  # the rotated q plus a per-thread chunk accumulator
    assert K.attention_scratch_bytes(5, 9, 3, 64, threads=2) > one
    b = small_batch
    T, nh, _ = b["q"].shape
    with pytest.raises(ValueError, match="scratch"):
        K.rope_attention(*b.values(), False, 0.125, 0, 0.0, None, np.empty(T * nh * 8, np.float32))



# ============================ mixture of experts ============================
# Qwen3-MoE: softmax top-k routing, then each chosen expert's SwiGLU MLP on the tokens
# routed to it (grouped per expert in C), weighted and summed per token.

from ellm._native import _moe  # noqa: E402
from ellm.formats.ggml_types import BLOCK_LAYOUT, GGMLType  # noqa: E402
from ellm.ops.cpu import CpuOps  # noqa: E402
from ellm.ops.reference import Experts, ReferenceOps  # noqa: E402
from ellm.weights import Linear  # noqa: E402

# f16 scale fields of the K-quant blocks, and the factor on std that gives their random
# blocks weights of about that std
_KQ_F16 = {GGMLType.Q4_K: ((0, 2), 1 / 300), GGMLType.Q6_K: ((208,), 1 / 1200)}


def random_matrix(qtype: GGMLType, n: int, k: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """(n, k) weights of qtype as stored: floats drawn with `std`, 32-blocks quantized by
    the kernels' own quantizer, K-quant blocks random bytes with sane scales."""
    w = (rng.standard_normal((n, k)) * std).astype(np.float32)
    if qtype == GGMLType.F32:
        return w
    if qtype == GGMLType.F16:
        return w.astype(np.float16).view(np.uint16)
    if qtype == GGMLType.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    if qtype in (GGMLType.Q8_0, GGMLType.Q4_0):
        from ellm._native import _quant
        return _quant.quantize(w, int(qtype))
    blk, size = BLOCK_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(n * (k // blk), size), dtype=np.uint8)
    fields, factor = _KQ_F16[qtype]
    for off in fields:
        scale = rng.uniform(-1.0, 1.0, size=blocks.shape[0]).astype(np.float16) * np.float16(std * factor)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def make_experts(qtype: GGMLType, E: int, H: int, F: int, seed: int, layout: str = "stacked") -> Experts:
    """E experts as the files hold them: views of stacked (E, N, row) tensors (GGUF),
    separate arrays (per-expert safetensors), or row slices of a fused (E, 2F, row) gate_up."""
    rng = np.random.default_rng(seed)
    if layout == "fused":
        gu = np.stack([random_matrix(qtype, 2 * F, H, rng, 0.3) for _ in range(E)])
        gate = [Linear(gu[e, :F], qtype, F, H) for e in range(E)]
        up = [Linear(gu[e, F:], qtype, F, H) for e in range(E)]
    else:
        g = [random_matrix(qtype, F, H, rng, 0.3) for _ in range(E)]
        u = [random_matrix(qtype, F, H, rng, 0.3) for _ in range(E)]
        if layout == "stacked":
            g, u = np.stack(g), np.stack(u)
        gate = [Linear(g[e], qtype, F, H) for e in range(E)]
        up = [Linear(u[e], qtype, F, H) for e in range(E)]
    d = np.stack([random_matrix(qtype, H, F, rng, 0.3) for _ in range(E)])
    return Experts(gate, up, [Linear(d[e], qtype, H, F) for e in range(E)])


def make_router(E: int, H: int, seed: int) -> Linear:
    rng = np.random.default_rng(seed)
    return Linear((rng.standard_normal((E, H)) * 0.5).astype(np.float32), GGMLType.F32, E, H)


def moe_tokens(T: int, H: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    return x * np.exp(rng.uniform(-1.0, 1.0, size=(T, 1))).astype(np.float32)


@pytest.mark.parametrize("norm", [False, True])
def test_moe_route_matches_reference(norm) -> None:
    rng = np.random.default_rng(30)
    logits = (rng.standard_normal((67, 24)) * 3).astype(np.float32)
    logits[5, [3, 9]] = logits[5].max() + 1.0  # a tie: the lower id comes first
    ids = np.empty((67, 6), np.int32)
    w = np.empty((67, 6), np.float32)
    _moe.route(logits, 6, norm, ids, w)
    want_ids, want_w = ref.moe_route(logits, 6, norm)
    np.testing.assert_array_equal(ids, want_ids)
    assert list(ids[5, :2]) == [3, 9]
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=0)
    if norm:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


MOE_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
             GGMLType.Q4_K, GGMLType.Q6_K]


@pytest.mark.parametrize("qtype", MOE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("layout", ["stacked", "separate", "fused"])
def test_moe_matches_reference(simd, qtype, layout) -> None:
    """ops.cpu.moe against ops.reference.moe (float math on the dequantized experts):
    8 experts, top 3, H = F = 256, 21 tokens."""
    E, H, F, T = 8, 256, 256, 21
    experts = make_experts(qtype, E, H, F, seed=int(qtype), layout=layout)
    router = make_router(E, H, seed=31)
    x = moe_tokens(T, H, seed=32)
    got = CpuOps().moe(x, router, experts, 3, True)
    want = ReferenceOps().moe(x, router, experts, 3, True)
    scale = float(np.abs(want).max())
    # float weights: f32 sums in another order; quantized: the kernels' 8-bit activations
    tol = 2e-5 if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) else 3e-2
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"max abs error {err:.3g} vs max |out| {scale:.3g}"
    if qtype == GGMLType.F32:
        assert nmse(got, want) < 1e-10


@pytest.mark.parametrize("qtype", [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_moe_batch_invariant(simd, qtype) -> None:
    """A token's output is bit-identical alone, in a batch of 300, in passes of 97 tokens
    (the kernel's passes are as long as its scratch bound allows: all 300 here), at
    another position, in another order, and on 1 / 2 / 3 threads: whichever tokens share
    its experts' groups (16 experts, top 4)."""
    E, H, F, T, k = 16, 256, 256, 300, 4
    experts = make_experts(qtype, E, H, F, seed=40 + int(qtype))
    router = make_router(E, H, seed=41)
    x = moe_tokens(T, H, seed=42)
    ops = CpuOps()
    alone = np.concatenate([ops.moe(x[t:t + 1], router, experts, k, True) for t in range(0, T, 7)])
    together = ops.moe(x, router, experts, k, True)
    assert_bits(together[::7], alone, "batched vs alone")
    ids, w = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    _moe.route(np.ascontiguousarray(ops.linear(x, router)), k, True, ids, w)
    passes = np.empty_like(together)
    _moe.experts(x, ids, w, *ops._stacks(experts), passes, max_pass_tokens=97)
    assert_bits(passes, together, "in passes of 97 tokens")
    perm = np.random.default_rng(43).permutation(T)
    assert_bits(ops.moe(x[perm], router, experts, k, True), together[perm], "rows reordered")
    assert_bits(ops.moe(x[100:117], router, experts, k, True), together[100:117], "a slice")
    threads0 = K.num_threads()
    try:
        for threads in (1, 2, 3):
            K.set_num_threads(threads)
            assert_bits(ops.moe(x[:40], router, experts, k, True), together[:40], f"{threads} threads")
            # decode-sized: the groups' items cut into one region of weights a thread
            assert_bits(ops.moe(x[:3], router, experts, k, True), together[:3], f"3 tokens, {threads} threads")
    finally:
        K.set_num_threads(threads0)


def test_moe_without_renormalisation(simd) -> None:
    experts = make_experts(GGMLType.F32, 6, 64, 96, seed=50)
    router = make_router(6, 64, seed=51)
    x = moe_tokens(9, 64, seed=52)
    got = CpuOps().moe(x, router, experts, 2, False)
    want = ReferenceOps().moe(x, router, experts, 2, False)
    assert_close(got, want, 2e-5 * float(np.abs(want).max()), 1e-10)
    assert not np.allclose(got, CpuOps().moe(x, router, experts, 2, True))


def test_moe_rejects_bad_input() -> None:
    experts = make_experts(GGMLType.Q8_0, 4, 64, 32, seed=60)
    ops = CpuOps()
    gate, up, down = ops._stacks(experts)
    x = moe_tokens(3, 64, seed=61)
    w = np.full((3, 2), 0.5, np.float32)
    out = np.empty((3, 64), np.float32)
    with pytest.raises(IndexError):
        _moe.experts(x, np.array([[0, 4]] * 3, np.int32), w, gate, up, down, out)  # id >= E
    with pytest.raises(IndexError):
        _moe.experts(x, np.array([[1, 1]] * 3, np.int32), w, gate, up, down, out)  # twice
    with pytest.raises(ValueError, match="down"):
        _moe.experts(x, np.zeros((3, 2), np.int32), w, gate, up, gate, out)
    with pytest.raises(ValueError, match="out"):
        _moe.experts(x, np.array([[0, 1]] * 3, np.int32), w, gate, up, down, np.empty((3, 63), np.float32))
    with pytest.raises(ValueError, match="max_pass_tokens"):
        _moe.experts(x, np.array([[0, 1]] * 3, np.int32), w, gate, up, down, out, max_pass_tokens=-1)
    with pytest.raises(ValueError, match="top_k"):
        _moe.route(np.zeros((3, 4), np.float32), 5, True, np.empty((3, 5), np.int32),
                   np.empty((3, 5), np.float32))
    with pytest.raises(ValueError, match="columns"):
        _moe.ExpertStack([np.zeros((4, 10), np.uint8)], int(GGMLType.Q8_0), 64)
    with pytest.raises(ValueError, match="contiguous"):
        _moe.ExpertStack([np.zeros((4, 136), np.uint8)[:, ::2]], int(GGMLType.Q8_0), 128)
    with pytest.raises(ValueError, match="Experts"):
        Experts(experts.gate, experts.up[:3], experts.down)
    with pytest.raises(ValueError, match="Experts"):
        Experts(experts.gate, experts.down, experts.down)  # up has the wrong shape


if __name__ == "__main__":
    import runpy
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    sys.argv = [str(bench)]
    runpy.run_path(str(bench), run_name="__main__")


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_moe_f32_activations_match_reference(qtype) -> None:
    """CpuOps(activations="f32") runs the experts on unrounded activations: within f32
    summation order of the reference (float math on the dequantized experts), where the
    8-bit path is allowed 3e-2; and a token's output does not depend on its batch."""
    E, H, F, T = 8, 256, 256, 37
    experts = make_experts(qtype, E, H, F, seed=60 + int(qtype))
    router = make_router(E, H, seed=61)
    x = moe_tokens(T, H, seed=62)
    ops = CpuOps(activations="f32")
    got = ops.moe(x, router, experts, 3, True)
    want = ReferenceOps().moe(x, router, experts, 3, True)
    err = float(np.abs(got - want).max())
    assert err <= 2e-5 * float(np.abs(want).max()), f"max abs error {err:.3g}"
    alone = np.concatenate([ops.moe(x[t:t + 1], router, experts, 3, True) for t in range(0, T, 5)])
    assert_bits(got[::5], alone, "batched vs alone")


# ------------------- key_limit: tokens that see later ones (an image) -------------------

def image_limits(batch, runs):
    """key_limit for batch: causal, except runs (seq, first, end) of new positions whose
    tokens see up to end - 1 (Gemma 3's image tokens seeing their whole image)."""
    limit = batch["positions"].copy()
    for seq, first, end in runs:
        rows = (batch["seq_ids"] == seq) & (batch["positions"] >= first) & (batch["positions"] < end)
        limit[rows] = end - 1
    return limit


def run_limited(batch, limit, window=0, cap=0.0, interleaved=False):
    """(kernel out, reference out) with key_limit, on copies of the batch."""
    kb = {n: a.copy() for n, a in batch.items()}
    rb = {n: a.copy() for n, a in batch.items()}
    scale = batch["q"].shape[2] ** -0.5
    got = K.rope_attention(*kb.values(), interleaved, scale, window, cap, key_limit=limit)
    want = ref.rope_attention(*rb.values(), interleaved, scale, window, cap, key_limit=limit)
    np.testing.assert_allclose(kb["k_cache"], rb["k_cache"], rtol=0, atol=2e-6)
    return got, want


def run_limited_caches(batch, limit):
    """The kernel's caches after a call on a copy of batch with key_limit."""
    kb = {n: a.copy() for n, a in batch.items()}
    n = len(limit)
    K.rope_attention(kb["q"][:n], kb["k"][:n], kb["v"][:n], kb["positions"][:n], kb["seq_ids"][:n],
                     kb["block_tables"], kb["k_cache"], kb["v_cache"], kb["inv_freq"], False,
                     batch["q"].shape[2] ** -0.5, key_limit=limit)
    return kb["k_cache"], kb["v_cache"]


# (new, before, image runs): an image inside a prefill chunk, one that starts the chunk,
# one across a 64-key tile and a 256-key chunk boundary, and decoding neighbours
LIMITED = [
    (dict(new=[17, 1, 1], before=[0, 700, 1234]), [(0, 3, 11)]),
    (dict(new=[12, 30], before=[5, 240]), [(0, 5, 9), (0, 12, 17), (1, 250, 262)]),
    (dict(new=[70], before=[0]), [(0, 1, 67)]),
]


@pytest.mark.parametrize("case", range(len(LIMITED)))
@pytest.mark.parametrize("window", [0, 6, 300])
@pytest.mark.parametrize("heads", [(4, 2, 16), (34, 2, 8)], ids=["gqa", "large-group"])
def test_attention_key_limit_matches_reference(simd, case, window, heads) -> None:
    shape, runs = LIMITED[case]
    nh, nkv, hd = heads
    batch = make_batch(nh, nkv, hd, **shape, seed=case + window)
    limit = image_limits(batch, runs)
    got, want = run_limited(batch, limit, window, cap=30.0 if window == 6 else 0.0, interleaved=case == 1)
    assert_close(got, want, 2e-5, 1e-11)
    # the limit changes what the image's tokens see, and nothing else
    causal = run_both(batch, case == 1, hd ** -0.5, window, 30.0 if window == 6 else 0.0)[0]
    sees_more = limit > batch["positions"]
    np.testing.assert_array_equal(got[~sees_more], causal[~sees_more])
    assert np.abs(got[sees_more] - causal[sees_more]).max() > 1e-3


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_attention_key_limit_is_batch_invariant(simd, threads) -> None:
    """An image's rows are bit-identical alone, beside other sequences, on any thread count
    (small batches split keys over threads), and key_limit = positions is causal."""
    before = K.num_threads()
    K.set_num_threads(threads)
    try:
        batch = make_batch(4, 2, 16, new=[6, 1, 1], before=[300, 500, 40], seed=3)
        limit = image_limits(batch, [(0, 301, 305)])
        got, want = run_limited(batch, limit)
        assert_close(got, want, 2e-5, 1e-11)
        alone = {n: (a[:6] if n in ("q", "k", "v", "positions", "seq_ids") else a) for n, a in batch.items()}
        np.testing.assert_array_equal(run_limited(alone, limit[:6])[0], got[:6])
        others = {n: (a[6:] if n in ("q", "k", "v", "positions", "seq_ids") else a) for n, a in batch.items()}
        np.testing.assert_array_equal(run_limited(others, limit[6:])[0], got[6:])
        # the token after the image, alone, the image's k/v cached by an earlier call
        last = {n: (a[5:6] if n in ("q", "k", "v", "positions", "seq_ids") else a) for n, a in batch.items()}
        last["k_cache"], last["v_cache"] = run_limited_caches(alone, limit[:5])
        np.testing.assert_array_equal(run_limited(last, limit[5:6])[0], got[5:6])
        plain = run_both(batch, False, 16 ** -0.5, 0, 0.0)[0]
        np.testing.assert_array_equal(run_limited(batch, batch["positions"].copy())[0], plain)
    finally:
        K.set_num_threads(before)


def test_attention_key_limit_refused_when_bad(small_batch) -> None:
    pos = small_batch["positions"]
    scale = 0.125
    with pytest.raises(ValueError, match=r"key_limit\[0\] = -1 must be in \[positions\[0\]"):
        K.rope_attention(*small_batch.values(), False, scale, key_limit=pos - 1)
    far = pos.copy()
    far[3] = 10_000
    with pytest.raises(ValueError, match=r"key_limit\[3\] = 10000"):
        K.rope_attention(*small_batch.values(), False, scale, key_limit=far)
    with pytest.raises(ValueError, match="key_limit has 2 elements"):
        K.rope_attention(*small_batch.values(), False, scale, key_limit=pos[:2].copy())
    with pytest.raises(ValueError, match="key_limit must be a contiguous 1-D int32"):
        K.rope_attention(*small_batch.values(), False, scale, key_limit=pos.astype(np.int64))
    # a limit into a block the table does not hold
    unmapped = pos.copy()
    unmapped[0] = small_batch["block_tables"].shape[1] * BLOCK - 1
    with pytest.raises(ValueError, match="block_tables"):
        K.rope_attention(*small_batch.values(), False, scale, key_limit=unmapped)
    with pytest.raises(ValueError, match="key_limit"):
        ref.rope_attention(*small_batch.values(), False, scale, key_limit=pos - 1)
