"""Quantized and float weight kernels (ellm._native._quant) against independent numpy code.

- dequantize: every GGML type vs the `gguf` package's numpy dequantizers, on random but
  valid blocks and on real tensors sliced from the two model files;
- linear: Y = X . W^T vs float64 numpy on the dequantized weights, at every SIMD level
  this CPU runs, by NMSE (quantized) or elementwise bounds (float weights); plus a tight
  check against numpy doing the same 8-bit activation rounding as the kernels;
- batch invariance: a row's outputs are bit-identical whatever else is in the call (T,
  position, order, thread count), for every type and level; linear_multi equals
  separate linear calls bit for bit;
- quantize: Q8_0 / Q4_0 bytes vs gguf.quants.quantize (bit-exact);
- bad shapes, dtypes and indices raise ValueError / IndexError, never crash.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ellm._native import _core, _quant  # noqa: E402
from ellm.formats.ggml_types import BLOCK_LAYOUT, GGMLType  # noqa: E402

Q32 = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]
QK = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
QUANT = Q32 + QK
FLOATS = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
LEVELS = _core.supported_simd_levels()

# byte offsets of the f16 scale fields in each block: random bytes there could be
# inf / nan, which no real file holds
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}


def use_level(level: str) -> None:
    """Runs the kernels at `level`. _quant links its own copy of the native dispatch
    state, so set it there too, and check it took."""
    _core.set_simd_level(level)
    _quant.set_simd_level(level)
    assert _quant.simd_level() == level


# the CPUs whose decode kernels matmul.c's decode_kernel chooses apart: another vendor's,
# AMD before Zen 5 (family 25), Zen 5 (26)
CPU_FAMILIES = {"other": 0, "zen4": 25, "zen5": 26}


@pytest.fixture
def cpu_family():
    """Sets which CPU's decode kernels matmul.c takes (a CPU_FAMILIES value); asks the CPU
    again after."""
    yield _quant.set_cpu_amd_family
    _quant.set_cpu_amd_family(None)


@pytest.fixture(autouse=True)
def _restore_simd_level():
    before = _quant.simd_level()
    yield
    use_level(before)


def random_rows(qtype: GGMLType, n_rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_rows, row_bytes) uint8: random blocks with finite, model-sized f16 scales."""
    blk, size = BLOCK_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(n_rows * (k // blk), size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-1.0, 1.0, size=blocks.shape[0]).astype(np.float16) * np.float16(0.02)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, -1)


def gguf_dequant(raw: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """(n_rows, row_bytes) uint8 -> (n_rows, k) float32 through the gguf package."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))).astype(np.float32)


def c_dequant(raw: np.ndarray, qtype: GGMLType, k: int) -> np.ndarray:
    out = np.empty(raw.shape[0] * k, np.float32)
    _quant.dequantize(np.ascontiguousarray(raw).reshape(-1), int(qtype), out)
    return out.reshape(raw.shape[0], k)


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.sum((y - ref) ** 2) / max(np.sum(ref**2), 1e-30))


def q8_act_reference(x: np.ndarray, block: int) -> np.ndarray:
    """x after the kernels' activation rounding: per `block` values, d = amax / 127,
    q = round-to-nearest-even(x * 127 / amax), all in float32 as the C code does."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    q = np.rint(xb * inv)
    return (q * (amax / np.float32(127))).reshape(x.shape)


# ------------------------------------------------------------------------------------
# dequantize
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_dequantize_random_blocks(qtype: GGMLType) -> None:
    rng = np.random.default_rng(int(qtype))
    k = 4 * BLOCK_LAYOUT[qtype][0]
    raw = random_rows(qtype, 8, k, rng)
    np.testing.assert_array_equal(c_dequant(raw, qtype, k), gguf_dequant(raw, qtype))


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_dequantize_float_types(qtype: GGMLType) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    if qtype == GGMLType.F32:
        raw, ref = x.view(np.uint8), x
    elif qtype == GGMLType.F16:
        h = x.astype(np.float16)
        raw, ref = h.view(np.uint8), h.astype(np.float32)
    else:
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        raw, ref = bits.view(np.uint8), (bits.astype(np.uint32) << 16).view(np.float32)
    out = np.empty(1000, np.float32)
    _quant.dequantize(raw, int(qtype), out)
    np.testing.assert_array_equal(out, ref)


@pytest.fixture(scope="module")
def model_tensors(smollm2_gguf: Path, gemma3_gguf: Path) -> dict[GGMLType, list[tuple[str, np.ndarray]]]:
    """Per quantized type: (name, the first rows of a real tensor) from both models
    (the paths come from tests/conftest.py, which pulls the models through ellm.hub)."""
    from ellm.formats.gguf import GGUFFile

    found: dict[GGMLType, list[tuple[str, np.ndarray]]] = {}
    for path in (smollm2_gguf, gemma3_gguf):
        f = GGUFFile(path)
        for name, info in f.tensors.items():
            if info.qtype in QUANT and len(info.shape) == 2 and len(found.get(info.qtype, [])) < 2:
                # copy a slice: the map stays with f, which is dropped at the end
                found.setdefault(info.qtype, []).append((name, np.array(f.raw(name)[:48])))
    return found


def test_real_tensors_cover_the_model_types(model_tensors) -> None:
    want = {GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K}
    assert want <= set(model_tensors)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K,
                                   GGMLType.Q6_K], ids=lambda t: t.name)
def test_dequantize_real_tensors(model_tensors, qtype: GGMLType) -> None:
    for name, raw in model_tensors[qtype]:
        blk, size = BLOCK_LAYOUT[qtype]
        k = raw.shape[1] // size * blk
        np.testing.assert_array_equal(c_dequant(raw, qtype, k), gguf_dequant(raw, qtype),
                                      err_msg=name)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K,
                                   GGMLType.Q6_K], ids=lambda t: t.name)
def test_linear_real_tensors(model_tensors, qtype: GGMLType, level: str) -> None:
    use_level(level)
    rng = np.random.default_rng(7)
    for name, raw in model_tensors[qtype]:
        w = gguf_dequant(raw, qtype).astype(np.float64)
        for t in (1, 5):
            x = rng.standard_normal((t, w.shape[1])).astype(np.float32)
            out = np.empty((t, w.shape[0]), np.float32)
            _quant.linear(x, raw, int(qtype), out)
            err = nmse(out, x @ w.T)
            assert err < 2e-4, f"{name} T={t}: nmse {err:.2e}"


# ------------------------------------------------------------------------------------
# linear on quantized weights
# ------------------------------------------------------------------------------------

# (T, N, K-blocks): odd T and N, T beyond one token tile, K of one and of many blocks
SHAPES = [(1, 1, 1), (1, 37, 3), (2, 5, 2), (3, 19, 6), (7, 33, 1), (33, 20, 4), (40, 17, 3),
          (16, 64, 8)]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_linear_quantized(qtype: GGMLType, level: str) -> None:
    use_level(level)
    rng = np.random.default_rng(100 + int(qtype))
    blk = BLOCK_LAYOUT[qtype][0]
    outs, refs = [], []
    for t, n, kb in SHAPES:
        k = kb * blk
        raw = random_rows(qtype, n, k, rng)
        w = gguf_dequant(raw, qtype).astype(np.float64)
        x = rng.standard_normal((t, k)).astype(np.float32)
        out = np.full((t, n), np.nan, np.float32)
        _quant.linear(x, raw, int(qtype), out)
        # numpy with the same 8-bit rounding of x: what is left is summation order
        xr = q8_act_reference(x, blk).astype(np.float64)
        tight = nmse(out, xr @ w.T)
        assert tight < 1e-10, f"T={t} N={n} K={k}: nmse vs rounded-x reference {tight:.2e}"
        outs.append(out.reshape(-1))
        refs.append((x.astype(np.float64) @ w.T).reshape(-1))
    # against exact f64 math, over all ~2700 outputs (one output alone is too noisy a
    # statistic): measured ~3e-5 with a scale per 32 and ~5e-5 with one per 256
    err = nmse(np.concatenate(outs), np.concatenate(refs))
    assert err < (1e-4 if blk == 32 else 2e-4), f"nmse {err:.2e}"


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q4_K], ids=lambda t: t.name)
def test_linear_levels_agree(qtype: GGMLType) -> None:
    rng = np.random.default_rng(3)
    k = 2 * 256
    raw = random_rows(qtype, 50, k, rng)
    x = rng.standard_normal((9, k)).astype(np.float32)
    outs = {}
    for level in LEVELS:
        use_level(level)
        outs[level] = np.empty((9, 50), np.float32)
        _quant.linear(x, raw, int(qtype), outs[level])
    for level in LEVELS:
        assert nmse(outs[level], outs["scalar"]) < 1e-10, level


@pytest.mark.parametrize("qtype", QK, ids=lambda t: t.name)
def test_kquant_simd_levels_give_the_same_bits(qtype: GGMLType) -> None:
    """The K-quants sum each block exactly in integers and take the same float steps at
    every SIMD level (the AVX2 and VNNI row and token-group kernels, the AMX
    tiles; NEON is held to AVX2's bits by wheels/cross.sh): T = 1, 3 and 40 give the
    same bits at each."""
    simd = [level for level in LEVELS if level != "scalar"]
    if len(simd) < 2:
        pytest.skip(f"one SIMD level here ({LEVELS})")
    rng = np.random.default_rng(31 + int(qtype))
    k = 3 * 256
    w = extreme_kquant_rows(qtype, 70, k, rng)
    x = rng.standard_normal((40, k)).astype(np.float32)
    outs = {}
    for level in simd:
        use_level(level)
        outs[level] = [linear_rows(x[:t], w, qtype) for t in (1, 3, 40)]
    for level in simd[1:]:
        for got, want in zip(outs[level], outs[simd[0]]):
            np.testing.assert_array_equal(got, want, err_msg=f"{level} vs {simd[0]}, T={len(got)}")


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.BF16],
                         ids=lambda t: t.name)
def test_linear_threads_agree(qtype: GGMLType) -> None:
    """Each output is computed by one task in a fixed order: any thread count gives the
    same bits."""
    rng = np.random.default_rng(8)
    k, n = 512, 300
    if qtype in QUANT:
        w = random_rows(qtype, n, k, rng)
    else:
        w = float_weights(qtype, n, k, rng)[0]
    before = _quant.num_threads()
    try:
        for t in (1, 37):
            x = rng.standard_normal((t, k)).astype(np.float32)
            outs = []
            for threads in (1, 2, 3):
                _quant.set_num_threads(threads)
                outs.append(np.empty((t, n), np.float32))
                _quant.linear(x, w, int(qtype), outs[-1])
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
    finally:
        _quant.set_num_threads(before)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_linear_large_matrix_decode(qtype: GGMLType) -> None:
    """Decode weights past 64 MiB (an output head, read from DRAM in long runs of rows
    with software prefetch): same results as the batched path, bit for bit, and right."""
    rng = np.random.default_rng(7)
    k = 256
    n = (65 << 20) // _quant.row_bytes(int(qtype), k) + 3
    w = random_rows(qtype, n, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    for level in [lv for lv in LEVELS if lv != "scalar"]:
        use_level(level)
        alone = linear_rows(x[1:2], w, qtype)
        batch = linear_rows(x, w, qtype)
        assert np.array_equal(alone[0], batch[1]), level
        rows = np.r_[0:64, n - 64:n]  # both ends of the matrix against numpy
        ref = q8_act_reference(x[1:2], 32) @ c_dequant(w[rows], qtype, k).astype(np.float64).T
        assert nmse(alone[0, rows], ref[0]) < 1e-10, level


def test_linear_accepts_unaligned_rows() -> None:
    """Rows of a map view start at any byte; the kernels must not assume alignment."""
    rng = np.random.default_rng(11)
    raw = random_rows(GGMLType.Q4_1, 6, 64, rng)
    buf = np.zeros(raw.size + 1, np.uint8)
    buf[1:] = raw.reshape(-1)
    shifted = buf[1:].reshape(raw.shape)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    a, b = np.empty((2, 6), np.float32), np.empty((2, 6), np.float32)
    _quant.linear(x, raw, int(GGMLType.Q4_1), a)
    _quant.linear(x, shifted, int(GGMLType.Q4_1), b)
    np.testing.assert_array_equal(a, b)


def test_linear_zero_activations() -> None:
    raw = random_rows(GGMLType.Q4_K, 4, 256, np.random.default_rng(0))
    out = np.full((3, 4), np.nan, np.float32)
    _quant.linear(np.zeros((3, 256), np.float32), raw, int(GGMLType.Q4_K), out)
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K,
                                   GGMLType.F32, GGMLType.BF16], ids=lambda t: t.name)
def test_linear_propagates_nan_and_inf(qtype: GGMLType, level: str) -> None:
    """A NaN or inf in a token's activations makes that token's outputs NaN (or inf),
    as float math would; other tokens are untouched."""
    use_level(level)
    rng = np.random.default_rng(9)
    k, n = 512, 7
    w = random_rows(qtype, n, k, rng) if qtype in QUANT else float_weights(qtype, n, k, rng)[0]
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 5] = np.nan
    x[2, 300] = np.inf
    out = np.empty((3, n), np.float32)
    _quant.linear(x, w, int(qtype), out)
    assert np.isnan(out[0]).all()
    assert np.isfinite(out[1]).all()
    assert not np.isfinite(out[2]).any()


def test_scratch_grows_only_when_needed() -> None:
    rng = np.random.default_rng(1)
    raw = random_rows(GGMLType.Q8_0, 4, 64, rng)
    out = np.empty((8, 4), np.float32)
    _quant.linear(rng.standard_normal((8, 64)).astype(np.float32), raw, int(GGMLType.Q8_0), out)
    cap = _quant.scratch_bytes()
    assert cap >= 8 * 2 * 40
    _quant.linear(rng.standard_normal((2, 64)).astype(np.float32), raw, int(GGMLType.Q8_0),
                  out[:2])
    assert _quant.scratch_bytes() == cap


# ------------------------------------------------------------------------------------
# linear on float weights
# ------------------------------------------------------------------------------------

def float_weights(qtype: GGMLType, n: int, k: int, rng: np.random.Generator):
    """(stored array, its exact float64 values)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == GGMLType.F32:
        return w, w.astype(np.float64)
    if qtype == GGMLType.F16:
        h = w.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_linear_float(qtype: GGMLType, level: str) -> None:
    use_level(level)
    rng = np.random.default_rng(int(qtype))
    for t, n, k in [(1, 1, 1), (1, 13, 37), (1, 40, 256), (3, 9, 100), (9, 17, 65),
                    (37, 33, 200)]:
        w, wf = float_weights(qtype, n, k, rng)
        x = rng.standard_normal((t, k)).astype(np.float32)
        out = np.empty((t, n), np.float32)
        _quant.linear(x, w, int(qtype), out)
        ref = x.astype(np.float64) @ wf.T
        # f32 accumulation: error grows with sum |x w|; 1e-5 of it is an honest bound
        scale = np.abs(x).astype(np.float64) @ np.abs(wf).T
        assert np.all(np.abs(out - ref) <= 1e-5 * scale + 1e-30), f"T={t} N={n} K={k}"


def test_linear_f16_accepts_float16_dtype() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 48)).astype(np.float16)
    x = rng.standard_normal((2, 48)).astype(np.float32)
    a, b = np.empty((2, 5), np.float32), np.empty((2, 5), np.float32)
    _quant.linear(x, w, int(GGMLType.F16), a)
    _quant.linear(x, w.view(np.uint16), int(GGMLType.F16), b)
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------
# batch invariance: the engine needs a sequence's logits not to depend on what else is in
# the batch (batched greedy decode = decoding alone; prefix-cache hit = miss; KV-cached
# decode = full recompute), so row t of linear(x) must equal linear(x[t:t+1]) bit for bit
# ------------------------------------------------------------------------------------

# both sides of FEW_TOKENS, FEW_TOKENS_VNNI512 and FEW_TOKENS_VNNI512_K (matmul.c: rows up
# to 8 / 11, groups from 9 / 12); 9, 17, 24 and 31 end in a part-filled second group of the
# two-group tiles (quant_x86.h's QX_GROUPS); 9 and 11 take the K-quant rows in two passes
BATCH_SIZES = (1, 2, 3, 5, 7, 8, 9, 11, 12, 15, 16, 17, 24, 31, 64, 129, 512)


def invariance_case(qtype: GGMLType, rng: np.random.Generator):
    """(weights, K, x of 512 rows). K leaves a remainder everywhere a kernel could treat
    one: an odd number of 32-blocks, 256-blocks and SIMD steps, and a k % 16 tail."""
    n = 37  # odd, and not a multiple of any row tile
    if qtype in QK:
        k = 3 * 256
    elif qtype in Q32:
        k = 15 * 32
    else:
        k = 203
    w = random_rows(qtype, n, k, rng) if qtype in QUANT else float_weights(qtype, n, k, rng)[0]
    # rows of very different magnitudes, as hidden states are
    x = rng.standard_normal((512, k)).astype(np.float32)
    x *= np.exp(rng.uniform(-4.0, 4.0, size=(512, 1))).astype(np.float32)
    return w, k, x


def linear_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLType) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _quant.linear(np.ascontiguousarray(x), w, int(qtype), out)
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QUANT + FLOATS, ids=lambda t: t.name)
def test_linear_batch_invariant(qtype: GGMLType, level: str) -> None:
    """Row i of linear(x) is bit-identical to linear(x[i:i+1]) whatever the batch size,
    the row's position and the order of the rows around it, and the thread count."""
    use_level(level)
    rng = np.random.default_rng(300 + int(qtype))
    w, k, x = invariance_case(qtype, rng)
    alone = np.concatenate([linear_rows(x[i:i + 1], w, qtype) for i in range(len(x))])
    assert np.isfinite(alone).all()
    for t in BATCH_SIZES:
        for start in sorted({0, (len(x) - t) // 2, len(x) - t}):
            got = linear_rows(x[start:start + t], w, qtype)
            assert np.array_equal(got, alone[start:start + t]), f"T={t} rows {start}.."
    perm = rng.permutation(len(x))
    assert np.array_equal(linear_rows(x[perm], w, qtype), alone[perm]), "rows reordered"
    before = _quant.num_threads()
    try:
        for threads in (1, 2, 3):
            _quant.set_num_threads(threads)
            for t in (1, 24, 129):   # 24: a batched decode step, split in regions per thread
                got = linear_rows(x[100:100 + t], w, qtype)
                assert np.array_equal(got, alone[100:100 + t]), f"T={t}, {threads} threads"
    finally:
        _quant.set_num_threads(before)



def assert_prefixes_match_rows_alone(qtype: GGMLType, rows: int, k: int, ts: tuple[int, ...],
                                     rng: np.random.Generator) -> None:
    """linear of the first t of 160 random rows, for each t in ts, equals each row's T=1
    result bit for bit (random (rows, k) weights of qtype)."""
    w = random_rows(qtype, rows, k, rng)
    x = rng.standard_normal((160, k)).astype(np.float32)
    alone = np.concatenate([linear_rows(x[i:i + 1], w, qtype) for i in range(len(x))])
    for t in ts:
        assert np.array_equal(linear_rows(x[:t], w, qtype), alone[:t]), f"T={t}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [64, 65])
@pytest.mark.parametrize("rows", [1024, 1536])
def test_linear_batch_invariant_at_the_unpack_limit(qtype: GGMLType, level: str, blocks: int, rows: int) -> None:
    """Rows of 64 blocks are unpacked in one chunk for all the token pairs of a call, rows
    of 65 in two, the sums kept between them (quant_x86.h, QX_REUSE_BLOCKS); both give each
    row's T=1 bits. 1024 output
    rows: a stride of a multiple of 1024 floats, which the staged outputs (matmul.c) are for;
    1536: stored straight, one token pair at a time (qgemm32z_rows_pairs' two_pairs).
    T = 129 and 160: a whole 128-token item (matmul.c's TOK_TILE, staged whole) and a part one."""
    use_level(level)
    assert_prefixes_match_rows_alone(qtype, rows, 32 * blocks, (16, 25, 41, 129, 160),
                                     np.random.default_rng(500 + blocks + rows + int(qtype)))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QK, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [8, 9, 17])
@pytest.mark.parametrize("rows", [37, 512])
def test_kquant_batch_invariant_across_block_chunks(qtype: GGMLType, level: str, blocks: int, rows: int) -> None:
    """At the AVX-512 level Q4_K and Q6_K rows are unpacked 8 blocks at a time for up to 8
    token pairs (quant_x86.h, QXK_REUSE_BLOCKS and QXK_BATCH_PAIRS), their sums kept between
    chunks; rows of 8, 9 and 17 blocks, T past one batch, give each row's T=1 bits. 512 rows:
    one pair at a time (two_pairs). At the AVX2 level panels of 16 rows are unpacked 2 blocks
    at a time for up to 16 token groups, taken 4 at a time (QXA_*): 37 rows end in a short
    panel, odd block counts in a short chunk, T = 16 and 40 in groups left over from the 4s.
    Q5_K takes Q4_K's kernels at both levels, its values 0..31 (at AVX2 4 products of a
    pair summed in int16 before the madd, not 8); Q2_K and Q3_K take Q6_K's runs of 16,
    Q2_K with Q4_K's mins. At the AMX level all five take the tiles from 8 tokens on
    (matmul_amx.c, chunks of 2 blocks)."""
    use_level(level)
    assert_prefixes_match_rows_alone(qtype, rows, 256 * blocks, (9, 16, 40, 129, 160),
                                     np.random.default_rng(700 + blocks + rows + int(qtype)))


def extreme_kquant_rows(qtype: GGMLType, n_rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """K-quant rows whose blocks take the largest values and scales the types hold (Q4_K:
    q = 15, Q5_K: q = 31, with scales and mins 63; Q6_K: q = 0 or 63, i.e. -32 or 31, with
    scales -128 or 127; Q2_K: q = 3 with scales and mins 15; Q3_K: -4 or 3 with scales
    -32 or 31) in every mix, among random blocks: the products the AMX kernels split a
    scale for (matmul_amx.c), and the int16 sums of the AVX2 kernels, at their ends."""
    raw = random_rows(qtype, n_rows, k, rng)
    blocks = raw.reshape(-1, BLOCK_LAYOUT[qtype][1])
    pick = rng.integers(0, 4, size=len(blocks))
    for i in np.nonzero(pick > 0)[0]:
        b = blocks[i]
        if qtype == GGMLType.Q2_K:                           # scales[16] | qs[64] | d | dmin
            b[0:16] = 0xFF                                   # every scale and min 15
            b[16:80] = 0xFF if pick[i] != 2 else rng.integers(0, 256, 64, dtype=np.uint8)
        elif qtype == GGMLType.Q3_K:                         # hmask[32] | qs[64] | scales[12] | d
            fill = {1: 0x00, 2: 0xFF, 3: None}[int(pick[i])]  # v = -4 with scale -32, 3 with 31
            if fill is not None:
                b[0:96] = fill
                b[96:108] = fill
            else:
                b[96:108] = rng.choice(np.array([0x00, 0xFF], np.uint8), 12)
        elif qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
            b[4:16] = 0xFF                                   # every scale and min 63
            b[16:] = 0xFF if pick[i] != 2 else rng.integers(0, 256, len(b) - 16, dtype=np.uint8)
        else:
            q = {1: 0x00, 2: 0xFF, 3: None}[int(pick[i])]    # q = 0 (v = -32), 63 (v = 31), random
            if q is not None:
                b[0:192] = q
            b[192:208] = rng.choice(np.array([-128, 127, -125, 124], np.int8), 16).view(np.uint8)
    return raw


@pytest.mark.parametrize("cpu", ["other", "zen5"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QK, ids=lambda t: t.name)
def test_kquant_extremes_batch_invariant(qtype: GGMLType, level: str, cpu: str, cpu_family) -> None:
    """Blocks at the ends of the types' ranges against activations at +-127 after
    quantization: each row of a 16-, 40- and 129-token call (the AMX tiles at that level)
    equals its T=1 result bit for bit, and those equal the scalar level's, with the
    one-token kernels of either vendor's CPUs."""
    use_level(level)
    cpu_family(CPU_FAMILIES[cpu])
    rng = np.random.default_rng(1100 + int(qtype))
    k = 4 * 256
    w = extreme_kquant_rows(qtype, 48, k, rng)
    x = np.where(rng.random((129, k)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0
    x[::3] = rng.standard_normal((43, k)).astype(np.float32)
    alone = np.concatenate([linear_rows(x[i:i + 1], w, qtype) for i in range(len(x))])
    assert np.isfinite(alone).all()
    for t in (16, 40, 129):
        assert np.array_equal(linear_rows(x[:t], w, qtype), alone[:t]), f"T={t}"
    use_level("scalar")
    scalar = np.concatenate([linear_rows(x[i:i + 1], w, qtype) for i in range(0, len(x), 8)])
    assert nmse(alone[::8], scalar) < 1e-10


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_linear_into_rows_off_a_cache_line(qtype: GGMLType, level: str) -> None:
    """y's rows starting 0-15 floats past a 64-byte line: the first item of a several-token
    call (the AMX tiles, and the token-group kernels of the VNNI and AVX2 levels) is then
    shorter, so that the others store whole lines (matmul.c, lead_rows). Every offset, at
    1 and 2 threads, gives each row its T=1 bits and writes nothing outside y."""
    use_level(level)
    rng = np.random.default_rng(900 + int(qtype))
    n, k = 272, 512  # 17 tiles of 16 rows; n % 16 == 0, as the shorter first item needs
    w = random_rows(qtype, n, k, rng)
    x = rng.standard_normal((40, k)).astype(np.float32)
    alone = np.concatenate([linear_rows(x[i:i + 1], w, qtype) for i in range(len(x))])
    before = _quant.num_threads()
    try:
        for threads in (1, 2):
            _quant.set_num_threads(threads)
            for t in (16, 40):
                buf = np.full(t * n + 64, np.nan, np.float32)
                line = (-buf.ctypes.data // 4) % 16  # first float of buf on a 64-byte line
                for off in (0, 1, 7, 15):
                    buf[:] = np.nan
                    y = buf[line + off:line + off + t * n].reshape(t, n)
                    _quant.linear(np.ascontiguousarray(x[:t]), w, int(qtype), y)
                    assert np.array_equal(y, alone[:t]), f"threads={threads} T={t} offset={off}"
                    assert np.isnan(buf[:line + off]).all() and np.isnan(buf[line + off + t * n:]).all()
    finally:
        _quant.set_num_threads(before)


# Decode-sized calls: parts large enough that one token's call is split into several
# long row runs (matmul.c's decode items, 16 KiB to 1 MiB each, and the exact path's),
# of different sizes, so the runs fall differently for each thread count
DECODE_PARTS = [(GGMLType.Q5_0, 1200), (GGMLType.Q8_0, 257), (GGMLType.Q4_K, 611),
                (GGMLType.Q6_K, 390), (GGMLType.Q4_1, 1501)]


@pytest.mark.parametrize("exact", [False, True], ids=["act8", "exact"])
@pytest.mark.parametrize("level", LEVELS)
def test_decode_split_is_bit_identical(level: str, exact: bool) -> None:
    """A token's outputs from a decode-sized linear_multi (several parts, each split into
    runs of rows over the pool) are bit-identical at 1, 2 and 3 threads, alone (T=1) and
    as a row of T=8 (the few-token path), and equal to linear on each part alone."""
    use_level(level)
    rng = np.random.default_rng(1700)
    k = 512
    ws = [(random_rows(q, n, k, rng), q) for q, n in DECODE_PARTS]
    x = rng.standard_normal((8, k)).astype(np.float32)
    run = _quant.linear_multi_exact if exact else _quant.linear_multi

    def call(xt: np.ndarray) -> list[np.ndarray]:
        outs = [np.full((len(xt), w.shape[0]), np.nan, np.float32) for w, _ in ws]
        run(np.ascontiguousarray(xt), [(w, int(q), o) for (w, q), o in zip(ws, outs)])
        return outs

    before = _quant.num_threads()
    try:
        _quant.set_num_threads(1)
        ref = [np.concatenate(parts) for parts in zip(*(call(x[t:t + 1]) for t in range(len(x))))]
        assert all(np.isfinite(r).all() for r in ref)
        for threads in (1, 2, 3):
            _quant.set_num_threads(threads)
            for t in (0, 5):
                got = call(x[t:t + 1])
                for i, (g, r) in enumerate(zip(got, ref)):
                    assert np.array_equal(g[0], r[t]), f"T=1 row {t}, {threads} threads, part {i}"
            got = call(x)
            for i, (g, r) in enumerate(zip(got, ref)):
                assert np.array_equal(g, r), f"T=8, {threads} threads, part {i}"
        if not exact:
            for (w, q), r in zip(ws, ref):
                assert np.array_equal(linear_rows(x[:1], w, q)[0], r[0]), q.name
    finally:
        _quant.set_num_threads(before)


@pytest.mark.parametrize("cpu", CPU_FAMILIES)
@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_1, *QK], ids=lambda t: t.name)
def test_decode_of_a_matrix_past_the_caches_is_bit_identical(qtype: GGMLType, cpu: str, cpu_family) -> None:
    """One token against a matrix of more than 16 MiB (a model's head) gives the bits of the
    same rows at two tokens (the row tiles) and of a small slice of them, at 1 and 2
    threads, with the kernels each kind of CPU takes (matmul.c decode_kernel: one row at a
    time for the 32-element types' large matrices on AMD CPUs before Zen 5, for the
    K-quants' on other vendors' at the 512-bit levels)."""
    cpu_family(CPU_FAMILIES[cpu])
    rng = np.random.default_rng(1701 + int(qtype))
    k = 256
    n = (16 << 20) // (k // BLOCK_LAYOUT[qtype][0] * BLOCK_LAYOUT[qtype][1]) + 3
    w = random_rows(qtype, n, k, rng)
    assert w.nbytes > 16 << 20
    x = rng.standard_normal((2, k)).astype(np.float32)
    before = _quant.num_threads()
    try:
        for threads in (1, 2):
            _quant.set_num_threads(threads)
            one = linear_rows(x[:1], w, qtype)
            two = linear_rows(x, w, qtype)
            assert np.array_equal(one[0], two[0]), f"{threads} threads"
            for lo in (0, n // 2, n - 8):
                assert np.array_equal(one[0, lo:lo + 8], linear_rows(x[:1], w[lo:lo + 8], qtype)[0]), lo
    finally:
        _quant.set_num_threads(before)


# ------------------------------------------------------------------------------------
# linear_multi: several matrices against one x in one call
# ------------------------------------------------------------------------------------

MULTI_PARTS = [(GGMLType.Q4_1, 40), (GGMLType.Q8_0, 19), (GGMLType.Q4_K, 33), (GGMLType.Q2_K, 0),
               (GGMLType.Q6_K, 5), (GGMLType.F32, 7), (GGMLType.BF16, 9), (GGMLType.Q5_0, 1)]


@pytest.mark.parametrize("level", LEVELS)
def test_linear_multi_equals_linear(level: str) -> None:
    """Each part's output is bit-identical to linear on that matrix alone, whether the
    outs are separate arrays or column slices of one wide array (mixed activation
    formats in one call), and stays batch invariant."""
    use_level(level)
    rng = np.random.default_rng(12)
    k = 512
    ws = [(np.zeros((0, _quant.row_bytes(int(q), k)), np.uint8) if n == 0  # an empty matrix
           else random_rows(q, n, k, rng) if q in QUANT else float_weights(q, n, k, rng)[0], q)
          for q, n in MULTI_PARTS]
    x = rng.standard_normal((40, k)).astype(np.float32)
    wide_n = sum(n for _, n in MULTI_PARTS)
    rows = {}
    for t in (1, 5, 40):
        xt = x[:t]
        ref = [linear_rows(xt, w, q) for w, q in ws]
        sep = [np.full((t, w.shape[0]), np.nan, np.float32) for w, _ in ws]
        _quant.linear_multi(xt, [(w, int(q), o) for (w, q), o in zip(ws, sep)])
        wide = np.full((t, wide_n + 3), np.nan, np.float32)
        cols, at = [], 0
        for w, _ in ws:
            cols.append(wide[:, at:at + w.shape[0]])
            at += w.shape[0]
        _quant.linear_multi(xt, [(w, int(q), o) for (w, q), o in zip(ws, cols)])
        for i, (w, q) in enumerate(ws):
            assert np.array_equal(sep[i], ref[i]), f"T={t} part {i} ({q.name})"
            assert np.array_equal(cols[i], ref[i]), f"T={t} part {i} ({q.name}) in a wide out"
        assert np.isnan(wide[:, wide_n:]).all()  # columns past the parts stay untouched
        rows[t] = wide[:, :wide_n]
    assert np.array_equal(rows[1], rows[40][:1]) and np.array_equal(rows[5], rows[40][:5])


@pytest.mark.parametrize("level", LEVELS)
def test_linear_multi_mixed_kquant_layouts(level: str) -> None:
    """Every K-quant in one call shares the activations in one layout (token groups on
    x86, rows on NEON and the scalar level): each part bit-identical to decoding each row
    alone."""
    use_level(level)
    rng = np.random.default_rng(13)
    k = 768
    ws = [(random_rows(q, n, k, rng), q) for q, n in
          [(GGMLType.Q4_K, 21), (GGMLType.Q6_K, 13), (GGMLType.Q3_K, 9), (GGMLType.Q2_K, 7),
           (GGMLType.Q5_K, 5)]]
    x = rng.standard_normal((40, k)).astype(np.float32)
    outs = [np.full((40, w.shape[0]), np.nan, np.float32) for w, _ in ws]
    _quant.linear_multi(x, [(w, int(q), o) for (w, q), o in zip(ws, outs)])
    for (w, q), o in zip(ws, outs):
        alone = np.concatenate([linear_rows(x[i:i + 1], w, q) for i in range(len(x))])
        assert np.array_equal(o, alone), q.name


def test_linear_multi_empty_part() -> None:
    """A part with no rows is skipped (and the activation format only it needs is not
    computed); the other parts are unaffected."""
    rng = np.random.default_rng(14)
    k = 256
    empty = np.zeros((0, _quant.row_bytes(int(GGMLType.Q4_K), k)), np.uint8)
    w = random_rows(GGMLType.Q8_0, 6, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    out = np.empty((3, 6), np.float32)
    _quant.linear_multi(x, [(empty, int(GGMLType.Q4_K), np.empty((3, 0), np.float32)),
                            (w, int(GGMLType.Q8_0), out)])
    assert np.array_equal(out, linear_rows(x, w, GGMLType.Q8_0))


def test_linear_multi_bad_arguments_raise() -> None:
    rng = np.random.default_rng(13)
    q = int(GGMLType.Q4_0)
    raw = random_rows(GGMLType.Q4_0, 4, 64, rng)
    x = np.zeros((2, 64), np.float32)
    out = np.empty((2, 4), np.float32)
    ro = np.empty((2, 4), np.float32)
    ro.flags.writeable = False
    bad_calls = [
        lambda: _quant.linear_multi(x, []),                                         # no parts
        lambda: _quant.linear_multi(x, [(raw, q, out)] * (_quant.MAX_PARTS + 1)),   # too many
        lambda: _quant.linear_multi(x, [(raw, q)]),                                 # not a triple
        lambda: _quant.linear_multi(x, [[raw, q, out]]),                            # not a tuple
        lambda: _quant.linear_multi(x, [(raw, q, out), (raw, 99, out)]),            # bad type
        lambda: _quant.linear_multi(x, [(raw, q, np.empty((2, 5), np.float32))]),   # out N
        lambda: _quant.linear_multi(x, [(raw, q, np.empty((3, 4), np.float32))]),   # out T
        lambda: _quant.linear_multi(x, [(raw, q, np.empty((4, 2), np.float32).T)]),  # col stride
        lambda: _quant.linear_multi(x, [(raw, q, np.empty((2, 4), np.float64))]),   # out dtype
        lambda: _quant.linear_multi(x, [(raw, q, ro)]),                             # read-only
        lambda: _quant.linear_multi(x, [(raw, q, np.empty((2, 4), np.float32)[::-1])]),  # rows
        lambda: _quant.linear_multi(np.zeros((2, 48), np.float32), [(raw, q, out)]),  # K
        lambda: _quant.linear_multi(x, [(raw[:, :18], q, out)]),                    # w strides
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")


# ------------------------------------------------------------------------------------
# the bias epilogue (Qwen2's q/k/v): y = x . w^T + b, the add made after the sum
# ------------------------------------------------------------------------------------

def bias_case(qtype: GGMLType, rng: np.random.Generator):
    w, k, x = invariance_case(qtype, rng)
    # biases as large as the outputs, of both signs, so a missed or doubled add shows
    bias = (rng.standard_normal(w.shape[0]) * 30).astype(np.float32)
    return w, k, x, bias


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QUANT + FLOATS, ids=lambda t: t.name)
def test_linear_bias_is_an_epilogue(qtype: GGMLType, level: str) -> None:
    """linear(x, w, bias) is bit for bit linear(x, w) + bias (a float32 numpy add: one
    rounding after the fixed-order sum), for every weight type, at every level, on both
    sides of the few-token threshold; and batch invariant like linear itself."""
    use_level(level)
    rng = np.random.default_rng(400 + int(qtype))
    w, k, x, bias = bias_case(qtype, rng)
    alone = None
    for t in (1, 3, 16, 129):
        plain = linear_rows(x[:t], w, qtype)
        out = np.full_like(plain, np.nan)
        _quant.linear(np.ascontiguousarray(x[:t]), w, int(qtype), out, bias)
        assert np.array_equal(out, plain + bias), f"T={t}"
        if alone is None:
            alone = np.concatenate([
                _run_bias(x[i:i + 1], w, qtype, bias) for i in range(129)])
        assert np.array_equal(out, alone[:t]), f"T={t}: not batch invariant"


def _run_bias(x: np.ndarray, w: np.ndarray, qtype: GGMLType, bias: np.ndarray) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _quant.linear(np.ascontiguousarray(x), w, int(qtype), out, bias)
    return out


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.BF16, GGMLType.F32],
                         ids=lambda t: t.name)
def test_ops_linear_bias_matches_reference(qtype: GGMLType) -> None:
    """ops.cpu and ops.reference on a Linear that carries a bias (the reference adds it to
    an f32 matmul of the dequantized weights); linear_multi takes each part's own bias."""
    from ellm.ops.cpu import CpuOps
    from ellm.ops.reference import ReferenceOps
    from ellm.weights import Linear
    rng = np.random.default_rng(410 + int(qtype))
    w, k, x, bias = bias_case(qtype, rng)
    lin = Linear(w, qtype, w.shape[0], k, "test", bias=bias)
    for t in (1, 20):
        got = CpuOps().linear(x[:t], lin)
        want = ReferenceOps().linear(x[:t], lin)
        no_bias = ReferenceOps().linear(x[:t], Linear(w, qtype, w.shape[0], k, "test"))
        assert not np.allclose(want, no_bias)  # the bias is large enough to matter
        scale = np.abs(want).max()
        tol = 1e-5 if qtype in FLOATS else 2e-2  # int8 activations on quantized weights
        assert np.abs(got - want).max() <= tol * scale, f"T={t}"
        outs = CpuOps().linear_multi(x[:t], [(lin, np.empty((t, w.shape[0]), np.float32)),
                                             (Linear(w, qtype, w.shape[0], k, "nb"),
                                              np.empty((t, w.shape[0]), np.float32))])
        assert np.array_equal(outs[0], got)
        assert np.array_equal(outs[1] + bias, got)  # the part without a bias has none


@pytest.mark.parametrize("level", LEVELS)
def test_linear_multi_bias_per_part(level: str) -> None:
    """Each part takes its own bias (or none), in separate outs or column slices of one
    wide out: bit-identical to linear with that bias alone."""
    use_level(level)
    rng = np.random.default_rng(15)
    k = 512
    ws = [(random_rows(q, n, k, rng) if q in QUANT else float_weights(q, n, k, rng)[0], q)
          for q, n in MULTI_PARTS if n > 0]
    biases = [(rng.standard_normal(w.shape[0]) * 10).astype(np.float32) if i % 2 == 0 else None
              for i, (w, _) in enumerate(ws)]
    x = rng.standard_normal((20, k)).astype(np.float32)
    for t in (1, 20):
        wide = np.full((t, sum(w.shape[0] for w, _ in ws) + 2), np.nan, np.float32)
        cols, at = [], 0
        for w, _ in ws:
            cols.append(wide[:, at:at + w.shape[0]])
            at += w.shape[0]
        _quant.linear_multi(x[:t], [(w, int(q), o, b) for (w, q), o, b in zip(ws, cols, biases)])
        for (w, q), o, b in zip(ws, cols, biases):
            want = np.empty_like(o)
            _quant.linear(x[:t], w, int(q), want, b)
            assert np.array_equal(o, want), f"T={t} {q.name} bias={b is not None}"
        assert np.isnan(wide[:, at:]).all()


def test_linear_bias_with_empty_k() -> None:
    """K = 0: every sum is empty, so the output is the bias itself."""
    bias = np.arange(5, dtype=np.float32)
    out = np.full((3, 5), np.nan, np.float32)
    _quant.linear(np.zeros((3, 0), np.float32), np.zeros((5, 0), np.float32), int(GGMLType.F32),
                  out, bias)
    assert np.array_equal(out, np.broadcast_to(bias, (3, 5)))


def test_linear_bad_bias_raises() -> None:
    rng = np.random.default_rng(16)
    q = int(GGMLType.Q8_0)
    raw = random_rows(GGMLType.Q8_0, 4, 64, rng)
    x = np.zeros((2, 64), np.float32)
    out = np.empty((2, 4), np.float32)
    bad = [np.zeros(5, np.float32), np.zeros(4, np.float64), np.zeros((4, 1), np.float32),
           np.zeros(8, np.float32)[::2], [0.0] * 4, out[0]]
    for b in bad:
        with pytest.raises(ValueError, match="bias"):
            _quant.linear(x, raw, q, out, b)
        with pytest.raises(ValueError, match="bias"):
            _quant.linear_multi(x, [(raw, q, out, b)])
    with pytest.raises(ValueError, match="bias"):
        _quant.linear(np.zeros((0, 64), np.float32), raw, q, np.empty((0, 4), np.float32),
                      np.zeros(3, np.float32))


# ------------------------------------------------------------------------------------
# get_rows, quantize, row_bytes
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.F32, GGMLType.BF16],
                         ids=lambda t: t.name)
def test_get_rows(qtype: GGMLType) -> None:
    rng = np.random.default_rng(4)
    k = 256
    if qtype in QUANT:
        w = random_rows(qtype, 10, k, rng)
        full = gguf_dequant(w, qtype)
    else:
        w, wf = float_weights(qtype, 10, k, rng)
        full = wf.astype(np.float32)
    ids = np.array([3, 0, 9, 3], np.int32)
    out = np.empty((4, k), np.float32)
    _quant.get_rows(w, int(qtype), ids, out)
    np.testing.assert_array_equal(out, full[ids])


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_quantize_matches_gguf(qtype: GGMLType) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((700, 96)).astype(np.float32)  # rows enough for several chunks
    x[0, :32] = 0.0  # an all-zero block
    x[1, 40] = 1e-3 * x[1, 41]  # a tie-free tiny value next to a large one
    ours = _quant.quantize(x, int(qtype))
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    np.testing.assert_array_equal(ours, ref)
    assert ours.shape == (700, _quant.row_bytes(int(qtype), 96))


def test_row_bytes() -> None:
    assert _quant.row_bytes(int(GGMLType.Q4_1), 576) == 18 * 20
    assert _quant.row_bytes(int(GGMLType.Q6_K), 512) == 2 * 210
    assert _quant.row_bytes(int(GGMLType.BF16), 7) == 14
    with pytest.raises(ValueError):
        _quant.row_bytes(int(GGMLType.Q4_K), 576)
    with pytest.raises(ValueError):
        _quant.row_bytes(99, 32)


# ------------------------------------------------------------------------------------
# bad input is an exception
# ------------------------------------------------------------------------------------

def test_bad_shapes_raise() -> None:
    q = int(GGMLType.Q4_0)
    raw = random_rows(GGMLType.Q4_0, 4, 64, np.random.default_rng(0))  # (4, 36)
    x = np.zeros((2, 64), np.float32)
    out = np.empty((2, 4), np.float32)
    bad_calls = [
        lambda: _quant.linear(np.zeros((2, 48), np.float32), raw, q, out),      # K != w's K
        lambda: _quant.linear(np.zeros((2, 40), np.float32), raw, q, out),      # K not blocks
        lambda: _quant.linear(x, raw, q, np.empty((2, 5), np.float32)),         # out N
        lambda: _quant.linear(x, raw, q, np.empty((3, 4), np.float32)),         # out T
        lambda: _quant.linear(x.astype(np.float64), raw, q, out),               # x dtype
        lambda: _quant.linear(np.zeros((64, 2), np.float32).T, raw, q, out),    # x strides
        lambda: _quant.linear(x, raw.reshape(-1), q, out),                      # w 1-D
        lambda: _quant.linear(x, raw[:, :18], q, out),                          # w not contig.
        lambda: _quant.linear(x, raw.view(np.int16), q, out),                   # w dtype
        lambda: _quant.linear(x, raw, 99, out),                                 # unknown type
        lambda: _quant.linear(x, np.zeros((4, 64), np.float64), int(GGMLType.F32), out),
        lambda: _quant.linear(x, np.zeros((4, 63), np.float32), int(GGMLType.F32), out),
        lambda: _quant.dequantize(raw.reshape(-1)[:-1], q, np.empty(128, np.float32)),
        lambda: _quant.dequantize(raw.reshape(-1), q, np.empty(100, np.float32)),
        lambda: _quant.get_rows(raw, q, np.zeros(2, np.int32), np.empty((3, 64), np.float32)),
        lambda: _quant.quantize(np.zeros((2, 40), np.float32), int(GGMLType.Q8_0)),
        lambda: _quant.quantize(np.zeros((2, 64), np.float32), int(GGMLType.Q4_K)),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")
    with pytest.raises(TypeError):
        _quant.linear(None, raw, q, out)


def test_get_rows_bad_index_raises() -> None:
    raw = random_rows(GGMLType.Q8_0, 4, 32, np.random.default_rng(0))
    out = np.empty((2, 32), np.float32)
    for ids in ([0, 4], [-1, 0]):
        with pytest.raises(IndexError):
            _quant.get_rows(raw, int(GGMLType.Q8_0), np.array(ids, np.int32), out)


# ------------------------------------------------------------------------------------
# AMX tiles (many tokens) against the AVX-512 VNNI level, bit for bit
# ------------------------------------------------------------------------------------

# the types with AMX kernels (csrc/matmul_amx.c); every other type runs the AVX-512 path
# at the AMX level, which the level-parametrized tests above cover
AMX_TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, *QK]
# (T, N, K-blocks): T from 8 (tiles take calls from 8 tokens on, padded to 16), below, at
# and past 16-token groups and 64-token items, N below and past a 16-row tile, K past one
# unpacking chunk (32 blocks of 32, 4 blocks of 256)
AMX_SHAPES = {32: [(8, 16, 2), (13, 21, 3), (16, 16, 1), (17, 5, 3), (31, 33, 2), (64, 16, 33),
                   (100, 37, 7), (257, 48, 18),
                   # [amx] one whole-K unpacking for every token (up to 48 blocks), past it
                   # (49, 50: sums kept between chunks), 512-token items and the call past one
                   (16, 33, 48), (16, 33, 49), (512, 19, 18), (600, 21, 50)],
              256: [(8, 16, 1), (13, 21, 2), (16, 16, 1), (17, 5, 2), (31, 33, 1), (64, 16, 5),
                    (100, 37, 3), (257, 48, 3), (512, 19, 3), (600, 21, 2),
                    # [amx] K-quant calls take up to 512-token items, halved past 1 MiB of
                    # activations (K = 2048: 256-token items)
                    (600, 9, 8)]}


def needs_amx() -> None:
    if "amx" not in LEVELS:
        pytest.skip("this CPU (or its OS) offers no AMX tiles: "
                    f"levels {LEVELS}; see dispatch.c (CPUID, XCR0, ARCH_REQ_XCOMP_PERM)")


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_amx_equals_vnni_bit_for_bit(qtype: GGMLType) -> None:
    """The tile unit forms each block's exact integer dot; the float steps after it are
    the VNNI kernels', in their order: every output is the same float."""
    needs_amx()
    rng = np.random.default_rng(500 + int(qtype))
    blk = BLOCK_LAYOUT[qtype][0]
    for t, n, kb in AMX_SHAPES[blk]:
        k = kb * blk
        raw = random_rows(qtype, n, k, rng)
        x = rng.standard_normal((t, k)).astype(np.float32)
        x *= np.exp(rng.uniform(-3.0, 3.0, size=(t, 1))).astype(np.float32)
        use_level("avx512")
        vnni = linear_rows(x, raw, qtype)
        use_level("amx")
        amx = linear_rows(x, raw, qtype)
        assert np.isfinite(amx).all()
        np.testing.assert_array_equal(amx, vnni, err_msg=f"T={t} N={n} K={k}")
        w = gguf_dequant(raw, qtype).astype(np.float64)
        ref = q8_act_reference(x, blk).astype(np.float64) @ w.T
        assert nmse(amx, ref) < 1e-10, f"T={t} N={n} K={k}"


@pytest.mark.parametrize("with_q3_k", [False, True])
def test_amx_linear_multi_mixes_tiles_and_vnni(with_q3_k: bool) -> None:
    """A call with both activation formats on the tiles (with Q3_K too, which took the
    tiles last, in Q6_K's three rows): each part as at the VNNI level, bit for bit."""
    needs_amx()
    rng = np.random.default_rng(14)
    k = 512
    parts = [(GGMLType.Q4_1, 40), (GGMLType.Q8_0, 19), (GGMLType.Q5_0, 3), (GGMLType.Q4_K, 21),
             (GGMLType.Q6_K, 17), (GGMLType.F32, 4)] + ([(GGMLType.Q3_K, 9)] if with_q3_k else [])
    ws = [(random_rows(q, n, k, rng) if q in QUANT else float_weights(q, n, k, rng)[0], q)
          for q, n in parts]
    x = rng.standard_normal((70, k)).astype(np.float32)
    use_level("avx512")
    vnni = [linear_rows(x, w, q) for w, q in ws]
    use_level("amx")
    outs = [np.full((70, w.shape[0]), np.nan, np.float32) for w, _ in ws]
    _quant.linear_multi(x, [(w, int(q), o) for (w, q), o in zip(ws, outs)])
    for (w, q), o, v in zip(ws, outs, vnni):
        np.testing.assert_array_equal(o, v, err_msg=q.name)


# ------------------------------------------------------------------------------------
# linear_multi_exact: f32 activations (ellm.load(..., activations="f32"))
# ------------------------------------------------------------------------------------

def exact_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLType) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _quant.linear_multi_exact(np.ascontiguousarray(x), [(w, int(qtype), out)])
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_linear_exact_is_the_dequantized_matmul(qtype: GGMLType, level: str) -> None:
    """No 8-bit rounding of x: what is left against float64 numpy on the gguf package's
    dequantized weights is f32 summation order (~1e-7 relative), far below the ~1e-2
    that rounding x to 8 bits costs."""
    use_level(level)
    rng = np.random.default_rng(700 + int(qtype))
    blk = BLOCK_LAYOUT[qtype][0]
    for t, n, kb in [(1, 37, 3), (3, 19, 6), (70, 9, 2)]:
        k = kb * (blk if blk == 256 else 256)
        raw = random_rows(qtype, n, k, rng)
        w = gguf_dequant(raw, qtype).astype(np.float64)
        x = rng.standard_normal((t, k)).astype(np.float32)
        got = exact_rows(x, raw, qtype)
        ref = x.astype(np.float64) @ w.T
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 2e-6, f"T={t} N={n} K={k}: max error {rel:.2e} of the largest output"
    # the 8-bit path on the same case is far off in comparison (what this mode is for)
    int8 = linear_rows(x, raw, qtype)
    assert np.abs(int8 - ref).max() / np.abs(ref).max() > 20 * rel


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K,
                                   GGMLType.Q6_K, GGMLType.Q3_K, GGMLType.BF16],
                         ids=lambda t: t.name)
def test_linear_exact_batch_invariant(qtype: GGMLType, level: str) -> None:
    """Row i of the exact linear is bit-identical whatever T, position and thread count."""
    use_level(level)
    rng = np.random.default_rng(800 + int(qtype))
    w, k, x = invariance_case(qtype, rng)
    x = x[:150]
    alone = np.concatenate([exact_rows(x[i:i + 1], w, qtype) for i in range(len(x))])
    assert np.isfinite(alone).all()
    for t in (2, 5, 16, 64, 65, 150):
        for start in sorted({0, len(x) - t}):
            got = exact_rows(x[start:start + t], w, qtype)
            assert np.array_equal(got, alone[start:start + t]), f"T={t} rows {start}.."
    before = _quant.num_threads()
    try:
        for threads in (1, 3):
            _quant.set_num_threads(threads)
            assert np.array_equal(exact_rows(x, w, qtype), alone), f"{threads} threads"
    finally:
        _quant.set_num_threads(before)


def test_linear_exact_fast_dequant_is_bit_identical() -> None:
    """The AVX-512 row dequantizers feed the same float values as quant.c's: at one
    token the exact linear of a matrix equals dot products of ellm's own dequantized rows
    computed by the float kernel (an F32 linear on those rows), bit for bit."""
    rng = np.random.default_rng(15)
    for level in [lv for lv in LEVELS if lv != "scalar"]:
        use_level(level)
        for qtype in QUANT:
            blk = BLOCK_LAYOUT[qtype][0]
            k = 2 * max(blk, 256)
            raw = random_rows(qtype, 13, k, rng)
            x = rng.standard_normal((3, k)).astype(np.float32)
            w32 = np.ascontiguousarray(c_dequant(raw, qtype, k))
            want = exact_rows(x, w32, GGMLType.F32)
            np.testing.assert_array_equal(exact_rows(x, raw, qtype), want,
                                          err_msg=f"{qtype.name} at {level}")


def test_linear_exact_bad_arguments_raise() -> None:
    rng = np.random.default_rng(16)
    raw = random_rows(GGMLType.Q4_1, 4, 64, rng)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="part 0"):
        _quant.linear_multi_exact(x, [(raw, int(GGMLType.Q4_1), np.zeros((2, 5), np.float32))])
    with pytest.raises(ValueError, match="unsupported GGML type"):
        _quant.linear_multi_exact(x, [(raw, 99, np.zeros((2, 4), np.float32))])
    with pytest.raises(ValueError, match="1 to"):
        _quant.linear_multi_exact(x, [])
    with pytest.raises(ValueError):
        _quant.linear_multi_exact(np.zeros((2, 32), np.float32),
                                  [(raw, int(GGMLType.Q4_1), np.zeros((2, 4), np.float32))])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.F16], ids=lambda t: t.name)
def test_linear_exact_bias(qtype: GGMLType) -> None:
    """A bias is one plain add after each output's sum, as on the 8-bit path."""
    rng = np.random.default_rng(17)
    k, n = 512, 21
    w = random_rows(qtype, n, k, rng) if qtype in QUANT else float_weights(qtype, n, k, rng)[0]
    bias = rng.standard_normal(n).astype(np.float32)
    for t in (1, 20):
        x = rng.standard_normal((t, k)).astype(np.float32)
        plain = exact_rows(x, w, qtype)
        out = np.full((t, n), np.nan, np.float32)
        _quant.linear_multi_exact(x, [(w, int(qtype), out, bias)])
        np.testing.assert_array_equal(out, plain + bias)
