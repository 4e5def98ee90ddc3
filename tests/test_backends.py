"""Every op and memory method on every backend present, against ops/reference.py.

The backends: `reference` (NumPy, the specification), `cpu` (C kernels; int8 and f32
activations) and `cuda` when ellm.ops.cuda, CuPy and a GPU are all there (skipped, with
the reason, otherwise). Inputs are seeded random arrays and slices of the real models'
GGUF tensors; each backend gets them through its own upload methods and hands results
back through to_host, and they are compared with ReferenceOps on the host by NMSE
(<= 1e-6 in f32; 2e-4 where int8 activations meet quantized weights, as in test_quant).

Then the memory interface itself (empty, kv_zeros, upload*, gather_rows, to_host, the
Workspace), the model runner on each backend against the reference backend, and
tests/opaque_ops.py: a backend whose arrays NumPy cannot read, through which whole models
and the engine must give the cpu backend's numbers bit for bit, proving that models and
engine use only the op set.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ellm
from ellm.engine.engine import Engine, EngineConfig
from ellm.engine.kv_cache import BlockManager
from ellm.formats.dequant import dequantize
from ellm.formats.ggml_types import GGMLType
from ellm.formats.gguf import GGUFFile
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.ops.cpu import CpuOps
from ellm.ops.memory import host_kv_zeros
from ellm.ops import reference
from ellm.ops.reference import KV_BF16, Experts, ReferenceOps, from_bf16_bits, kv_storage_dtype, to_bf16_bits
from ellm.ops.workspace import Workspace
from ellm.sampling_params import SamplingParams
from ellm.weights import Linear
from conftest import ops_or_skip
from opaque_ops import Opaque, OpaqueOps

BACKENDS = ["reference", "cpu", "cpu-f32", "cuda"]
REF = ReferenceOps()
QUANTIZED = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K]
FLOATS = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]


def backend(name: str) -> Any:
    """The op set called `name` ("cpu-f32": f32 activations); cuda skips when absent."""
    device, _, acts = name.partition("-")
    return ops_or_skip(device, acts or ("f32" if device == "cuda" else "int8"))


@pytest.fixture(params=BACKENDS, scope="module")
def ops(request) -> Any:
    return backend(request.param)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    w = want.astype(np.float64)
    return float(((got.astype(np.float64) - w) ** 2).sum() / max((w ** 2).sum(), 1e-30))


def host(ops: Any, x: Any) -> np.ndarray:
    got = ops.to_host(x)
    assert isinstance(got, np.ndarray)
    return got


def assert_near(got: np.ndarray, want: np.ndarray, bound: float = 1e-6, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: not finite"
    err = nmse(got, want)
    assert err <= bound, f"{what}: nmse {err:.2e} > {bound:.0e}"


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def real_weights(smollm2_gguf: Path, gemma3_gguf: Path) -> dict[GGMLType, tuple[str, np.ndarray, int]]:
    """Per quantized type, (name, its first 40 rows, in_features) of a real tensor."""
    from ellm.formats.ggml_types import BLOCK_LAYOUT
    found: dict[GGMLType, tuple[str, np.ndarray, int]] = {}
    for path in (smollm2_gguf, gemma3_gguf):
        f = GGUFFile(path)
        for name, info in f.tensors.items():
            if info.qtype in QUANTIZED and len(info.shape) == 2 and info.qtype not in found:
                raw = np.array(f.raw(name)[:40])
                blk, size = BLOCK_LAYOUT[info.qtype]
                found[info.qtype] = (name, raw, raw.shape[1] // size * blk)
    assert set(QUANTIZED) <= set(found)
    return found


def weight(qtype: GGMLType, real_weights: dict, rng: np.random.Generator, bias: bool = False) -> Linear:
    if qtype in FLOATS:
        w = rand(rng, 40, 96, scale=0.1)
        data = {GGMLType.F32: w, GGMLType.F16: w.astype(np.float16).view(np.uint16),
                GGMLType.BF16: (w.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
        n, k = w.shape
    else:
        _, data, k = real_weights[qtype]
        n = data.shape[0]
    b = rand(rng, n) if bias else None
    return Linear(data, qtype, n, k, f"test-{qtype.name}", bias=b)


def matmul_bound(ops: Any, qtype: GGMLType) -> float:
    int8 = ops.name == "cpu" and not ops.exact_activations
    return 2e-4 if int8 and qtype not in FLOATS else 1e-6


# ====================================== compute ops ======================================

@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_linear(ops, qtype, real_weights) -> None:
    rng = np.random.default_rng(int(qtype))
    w = weight(qtype, real_weights, rng, bias=qtype in (GGMLType.Q8_0, GGMLType.F32))
    dw = ops.upload_linear(w)
    for t in (1, 5, 33):
        x = rand(rng, t, w.in_features)
        want = REF.linear(x, w)
        assert_near(host(ops, ops.linear(ops.upload(x), dw)), want, matmul_bound(ops, qtype), f"T={t}")
        out = ops.empty((t, w.out_features))
        got = ops.linear(ops.upload(x), dw, out=out)
        assert_near(host(ops, got), want, matmul_bound(ops, qtype), f"T={t} into out")
        assert np.array_equal(host(ops, out), host(ops, got))


def test_linear_multi_equals_linear(ops, real_weights) -> None:
    rng = np.random.default_rng(3)
    from ellm._native import _quant
    k = 128
    parts = [Linear(_quant.quantize(rand(rng, n, k, scale=0.1), int(q)), q, n, k, q.name, bias=b)
             for q, n, b in ((GGMLType.Q8_0, 40, None), (GGMLType.Q4_0, 33, rand(rng, 33)))]
    parts.append(Linear(rand(rng, 24, k, scale=0.1), GGMLType.F32, 24, k, "f32"))
    x = ops.upload(rand(rng, 7, k))
    dparts = [ops.upload_linear(w) for w in parts]
    outs = ops.linear_multi(x, [(w, ops.empty((7, w.out_features))) for w in dparts])
    for w, o in zip(dparts, outs):
        assert np.array_equal(host(ops, o), host(ops, ops.linear(x, w))), w.name


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.BF16, GGMLType.F32],
                         ids=lambda t: t.name)
def test_embed(ops, qtype, real_weights) -> None:
    rng = np.random.default_rng(5)
    w = weight(qtype, real_weights, rng)
    ids = np.array([3, 0, 39, 3, 17], np.int32)
    got = host(ops, ops.embed(ops.upload_linear(w), ops.upload(ids), out=ops.empty((5, w.in_features))))
    want = dequantize(np.ascontiguousarray(w.data), qtype, (w.out_features, w.in_features))[ids]
    assert np.array_equal(got, want)   # a row lookup is exact on every backend


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 4, 16)])
def test_norms_and_activations(ops, shape) -> None:
    rng = np.random.default_rng(11)
    x, y, wt = rand(rng, *shape, scale=3.0), rand(rng, *shape, scale=3.0), rand(rng, shape[-1])
    def up(a: np.ndarray) -> Any:   # a copy: on the host, upload is x itself and some ops work in place
        return ops.upload(a.copy())
    assert_near(host(ops, ops.rmsnorm(up(x), up(wt), 1e-6, out=ops.empty(shape))), REF.rmsnorm(x, wt, 1e-6),
                what="rmsnorm")
    if len(shape) == 2:
        res = up(x)
        normed = ops.add_rmsnorm(res, up(y), up(wt), 1e-5, out=ops.empty(shape))
        want_res = x + y
        assert_near(host(ops, res), want_res, what="add_rmsnorm residual")
        assert_near(host(ops, normed), REF.rmsnorm(want_res, wt, 1e-5), what="add_rmsnorm")
        for name in ("swiglu", "geglu"):
            got = getattr(ops, name)(up(x), up(y), out=ops.empty(shape))
            assert_near(host(ops, got), getattr(REF, name)(x, y), what=name)
        a = up(x)
        assert_near(host(ops, ops.add(a, up(y))), x + y, what="add")
        assert_near(host(ops, ops.scale(up(x), 0.37)), x * np.float32(0.37), what="scale")
        assert_near(host(ops, ops.softcap(up(x), 2.5)), REF.softcap(x.copy(), 2.5), what="softcap")
        assert np.array_equal(host(ops, ops.softcap(up(x), 0.0)), x)   # cap 0: untouched


@pytest.mark.parametrize("window, cap, interleaved, image", [(0, 0.0, False, False), (5, 0.0, True, False),
                                                             (0, 30.0, False, False), (0, 0.0, False, True),
                                                             (3, 0.0, True, True)])
def test_rope_attention_paged(ops, window, cap, interleaved, image) -> None:
    """Two sequences in one batch: one prefilling 6 tokens from position 3 (3 cached),
    one decoding at position 9; caches from ops.kv_zeros, blocks out of order. image:
    positions 4..7 see each other both ways (key_limit, Gemma 3's image tokens)."""
    rng = np.random.default_rng(17 + window)
    nh, nkv, hd, bs, nb = 6, 2, 16, 4, 12
    positions = np.array([3, 4, 5, 6, 7, 8, 9], np.int32)
    seq_ids = np.array([0, 0, 0, 0, 0, 0, 1], np.int32)
    tables = np.array([[7, 2, 10, -1], [1, 5, 0, -1]], np.int32)
    kc, vc = rand(rng, nb, bs, nkv, hd), rand(rng, nb, bs, nkv, hd)   # earlier positions' k/v
    q, k, v = rand(rng, 7, nh, hd), rand(rng, 7, nkv, hd), rand(rng, 7, nkv, hd)
    inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    want_k, want_v = kc.copy(), vc.copy()
    limit = None
    if image:
        limit = positions.copy()
        limit[1:5] = 7
    want = REF.rope_attention(q, k, v, positions, seq_ids, tables, want_k, want_v, inv_freq, interleaved,
                              hd ** -0.5, window, cap, key_limit=limit)
    dk, dv = ops.kv_zeros(kc.shape), ops.kv_zeros(vc.shape)   # (the reference's inputs stay untouched)
    assert not host(ops, dk).any()
    for dst, src in ((dk, kc), (dv, vc)):   # the cached positions, through a device copy
        ops.add(dst, ops.upload(src))
    up = ops.upload
    got = ops.rope_attention(up(q), up(k), up(v), up(positions), up(seq_ids), up(tables), dk, dv, up(inv_freq),
                             interleaved, hd ** -0.5, window, cap, out=ops.empty(q.shape),
                             key_limit=None if limit is None else up(limit))
    assert_near(host(ops, got), want, what="attention")
    assert_near(host(ops, dk), want_k, what="k cache")
    assert_near(host(ops, dv), want_v, what="v cache")


# ---- the fused ops (reference.FusedByComposition: each against the plain ops it means) ----

FUSED_TOKENS = (1, 5, 33, 70)   # 70: above the cuda backend's decode kernels (its composed path)
FUSED_TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.BF16, GGMLType.F16, GGMLType.F32]


def fused_bound(ops: Any, qtype: GGMLType, t: int) -> float:
    """matmul_bound, and above 64 tokens on cuda the tensor cores' bf16-rounded inputs."""
    if ops.name == "cuda" and t > 64 and qtype != GGMLType.F32:
        return 1e-4
    return matmul_bound(ops, qtype)


def synthetic(qtype: GGMLType, n: int, k: int, rng: np.random.Generator, bias: bool = False) -> Linear:
    """A random (n, k) matrix in qtype (quantized here: no model file needed, so these run
    on a GPU machine that carried SmolLM2 alone)."""
    from ellm._native import _quant
    w = rand(rng, n, k, scale=0.1)
    data = {GGMLType.F32: w, GGMLType.F16: w.astype(np.float16).view(np.uint16),
            GGMLType.BF16: (w.view(np.uint32) >> 16).astype(np.uint16)}.get(qtype)
    if data is None:
        data = _quant.quantize(w, int(qtype))
    return Linear(data, qtype, n, k, f"synthetic-{qtype.name}", bias=rand(rng, n) if bias else None)


@pytest.mark.parametrize("qtype", FUSED_TYPES, ids=lambda t: t.name)
def test_norm_linear_multi(ops, qtype) -> None:
    rng = np.random.default_rng(41 + int(qtype))
    ws = [synthetic(qtype, n, 128, rng, bias=i == 1) for i, n in enumerate((40, 24, 17))]
    dws = [ops.upload_linear(w) for w in ws]
    K = ws[0].in_features
    g = rand(rng, K)
    for t in FUSED_TOKENS:
        x = rand(rng, t, K, scale=2.0)
        h = REF.rmsnorm(x, g, 1e-5)
        for n_parts in (3, 2):
            outs = ops.norm_linear_multi(ops.upload(x), ops.upload(g), 1e-5,
                                         [(w, ops.empty((t, w.out_features))) for w in dws[:n_parts]])
            assert len(outs) == n_parts
            for w, o in zip(ws, outs):
                assert_near(host(ops, o), REF.linear(h, w), fused_bound(ops, qtype, t), f"T={t} {n_parts} parts")
        plain = ops.norm_linear_multi(ops.upload(x), None, 1e-5, [(dws[0], ops.empty((t, ws[0].out_features)))])
        assert_near(host(ops, plain[0]), REF.linear(x, ws[0]), fused_bound(ops, qtype, t), f"T={t} no norm")


def test_norm_linear_multi_of_mixed_types(ops) -> None:
    """q/k and v of different types (a Q4_K_M file's v in Q6_K; cuda: one launch a type,
    each with the norm folded in): every output as the composition says, in its place,
    and on cuda the bits of each matrix's own norm_linear_multi."""
    rng = np.random.default_rng(44)
    ws = [synthetic(t, n, 128, rng, bias=i == 2) for i, (t, n) in
          enumerate(((GGMLType.Q8_0, 40), (GGMLType.Q4_0, 24), (GGMLType.Q8_0, 17)))]
    dws = [ops.upload_linear(w) for w in ws]
    g = rand(rng, 128)
    for t in FUSED_TOKENS:
        x = rand(rng, t, 128, scale=2.0)
        h = REF.rmsnorm(x, g, 1e-5)
        outs = ops.norm_linear_multi(ops.upload(x), ops.upload(g), 1e-5,
                                     [(w, ops.empty((t, w.out_features))) for w in dws])
        for w, dw, o in zip(ws, dws, outs):
            assert_near(host(ops, o), REF.linear(h, w), fused_bound(ops, w.qtype, t), f"T={t} {w.qtype.name}")
            if ops.name == "cuda":
                alone = ops.norm_linear_multi(ops.upload(x), ops.upload(g), 1e-5,
                                              [(dw, ops.empty((t, w.out_features)))])
                assert np.array_equal(host(ops, o), host(ops, alone[0])), f"T={t} {w.qtype.name}"


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.BF16, GGMLType.F32], ids=lambda t: t.name)
def test_norm_linear_greedy(ops, qtype) -> None:
    """A decode step's head with each row's greedy token (cuda: in the product's own
    launch where mmv.cu takes the type): the logits as the composition gives them, the
    ids their argmax_rows answer, into the array given."""
    rng = np.random.default_rng(45)
    w = synthetic(qtype, 40, 128, rng, bias=True)
    dw = ops.upload_linear(w)
    g = rand(rng, 128)
    for t in FUSED_TOKENS:
        x = rand(rng, t, 128, scale=2.0)
        for norm in (g, None):
            h = x if norm is None else REF.rmsnorm(x, norm, 1e-5)
            logits, ids = ops.empty((t, 40)), ops.upload(np.full(t, -1, np.int32))
            got = ops.norm_linear_greedy(ops.upload(x), None if norm is None else ops.upload(norm), 1e-5, dw,
                                         logits, ids)
            assert got is ids
            assert_near(host(ops, logits), REF.linear(h, w), fused_bound(ops, qtype, t), f"T={t}")
            assert host(ops, ids).tolist() == reference.argmax_ids(host(ops, logits)).tolist(), f"T={t}"


def test_argmax_rows(ops) -> None:
    """Each row's greedy token: the first of equal maxima; NaN and -inf never chosen, a
    row of nothing else 0; +inf is a value like any other."""
    inf, nan = np.inf, np.nan
    rows = np.array([[1, 3, 3, 2], [nan, -1, 5, nan], [-inf, -inf, -inf, -inf], [nan, nan, -inf, nan],
                     [-2, inf, -inf, inf], [-5, -4, -4, -9]], np.float32)
    want = [1, 2, 0, 0, 1, 1]
    assert reference.argmax_ids(rows).tolist() == want
    assert host(ops, ops.argmax_rows(ops.upload(rows))).tolist() == want
    out = ops.upload(np.full(len(rows), -1, np.int32))
    assert ops.argmax_rows(ops.upload(rows), out=out) is out and host(ops, out).tolist() == want


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.BF16], ids=lambda t: t.name)
def test_norm_linear_glu(ops, act, qtype) -> None:
    rng = np.random.default_rng(43)
    gate, up = synthetic(qtype, 40, 96, rng), synthetic(qtype, 40, 96, rng, bias=True)
    dg, du = ops.upload_linear(gate), ops.upload_linear(up)
    K = gate.in_features
    g = rand(rng, K)
    glu = REF.swiglu if act == "silu" else REF.geglu
    for t in FUSED_TOKENS:
        x = rand(rng, t, K)
        for norm in (g, None):
            h = x if norm is None else REF.rmsnorm(x, norm, 1e-6)
            want = glu(REF.linear(h, gate), REF.linear(h, up))
            got = ops.norm_linear_glu(ops.upload(x), None if norm is None else ops.upload(norm), 1e-6, dg, du, act,
                                      out=ops.empty((t, gate.out_features)))
            assert_near(host(ops, got), want, fused_bound(ops, qtype, t), f"T={t} norm={norm is not None}")
    with pytest.raises(ValueError, match="act"):
        ops.norm_linear_glu(ops.upload(rand(rng, 1, K)), None, 1e-6, dg, du, "relu")


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.BF16], ids=lambda t: t.name)
def test_linear_add(ops, qtype) -> None:
    rng = np.random.default_rng(47)
    w = synthetic(qtype, 40, 160, rng, bias=qtype == GGMLType.BF16)
    dw = ops.upload_linear(w)
    for t in FUSED_TOKENS:
        x, r = rand(rng, t, w.in_features), rand(rng, t, w.out_features, scale=3.0)
        res = ops.upload(r.copy())
        got = ops.linear_add(ops.upload(x), dw, res)
        assert_near(host(ops, got), r + REF.linear(x, w), fused_bound(ops, qtype, t), f"T={t}")
        assert_near(host(ops, res), r + REF.linear(x, w), fused_bound(ops, qtype, t), f"T={t} in place")


def test_norm_add(ops) -> None:
    """residual += scale * rmsnorm(x) (or scale * x): a block's post norm and residual
    multiplier with its add (Gemma's, OLMo 2's, Granite's, in ops/fused_stack.py); x is
    left as it was."""
    rng = np.random.default_rng(48)
    wt = rand(rng, 96) + 1.0
    for t in FUSED_TOKENS:
        for norm, scale in ((wt, 1.0), (wt, 0.25), (None, 0.22)):
            x, r = rand(rng, t, 96, scale=2.0), rand(rng, t, 96, scale=3.0)
            res, dx = ops.upload(r.copy()), ops.upload(x)
            got = ops.norm_add(res, dx, None if norm is None else ops.upload(norm), 1e-6, scale)
            want = r + scale * (x if norm is None else REF.rmsnorm(x, norm, 1e-6))
            what = f"T={t} norm={norm is not None} scale={scale}"
            assert_near(host(ops, got), want, what=what)
            assert_near(host(ops, res), want, what=what + " in place")
            assert np.array_equal(host(ops, dx), x), what


def _kv_dtypes(ops: Any) -> list[Any]:
    """The KV cache element types a backend keeps: float32 everywhere, bfloat16 bits on
    cuda and the host backends' composed fused ops (numpy stores)."""
    return [np.float32, KV_BF16]


@pytest.mark.parametrize("window, interleaved, n_rot, bias", [(0, False, 8, False), (3, True, 8, True),
                                                               (0, False, 5, False), (0, True, 0, False)])
@pytest.mark.parametrize("t_new", [7, 70])
@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.Q8_0], ids=lambda t: t.name)
def test_norm_qkv_rope_write_then_paged_attention_is_rope_attention(ops, window, interleaved, n_rot, bias,
                                                                    t_new, qtype) -> None:
    """norm + q/k/v + RoPE + KV write, then attention over the cache, against rope_attention
    of the reference's own projections: the outputs and both caches, f32 and bf16 caches.
    Sequence 0 prefills t_new - 1 tokens from position 3, sequence 1 decodes one; n_rot 5:
    partial rotary (dims 10..15 pass through); n_rot 0: NoPE. F32 weights take cuda's f32
    kernels for the 7-token step, Q8_0 ones mmv.cu's."""
    rng = np.random.default_rng(53 + n_rot + t_new)
    nh, nkv, hd, bs, nb, H = 6, 2, 16, 4, 40, 64
    positions = np.concatenate([np.arange(3, 3 + t_new - 1), [9]]).astype(np.int32)
    seq_ids = np.array([0] * (t_new - 1) + [1], np.int32)
    tables = np.full((2, 20), -1, np.int32)
    tables[0, :19] = np.arange(39, 20, -1)   # blocks out of order
    tables[1, :3] = [1, 5, 0]
    mats = [synthetic(qtype, n * hd, H, rng, bias=bias) for n in (nh, nkv, nkv)]
    g = rand(rng, H)
    x = rand(rng, t_new, H)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 2 * n_rot, 2) / hd)).astype(np.float32)[:n_rot]
    h = REF.rmsnorm(x, g, 1e-6)
    q, k, v = (REF.linear(h, m).reshape(t_new, -1, hd) for m in mats)
    earlier_k, earlier_v = rand(rng, nb, bs, nkv, hd), rand(rng, nb, bs, nkv, hd)
    up = ops.upload
    for dtype in _kv_dtypes(ops):
        store = (lambda a: to_bf16_bits(a)) if np.dtype(dtype) == KV_BF16 else (lambda a: a.copy())
        want_k, want_v = store(earlier_k), store(earlier_v)
        want = REF.rope_attention(q, k, v, positions, seq_ids, tables, want_k, want_v, inv_freq, interleaved,
                                  hd ** -0.5, window)
        dk, dv = ops.kv_zeros(earlier_k.shape, dtype), ops.kv_zeros(earlier_v.shape, dtype)
        _fill(ops, dk, store(earlier_k))
        _fill(ops, dv, store(earlier_v))
        q_rot = ops.norm_qkv_rope_write(up(x), up(g), 1e-6, *(ops.upload_linear(m) for m in mats), hd, up(positions),
                                        up(seq_ids), up(tables), dk, dv, up(inv_freq), interleaved,
                                        q_out=ops.empty((t_new, nh, hd)))
        got = ops.paged_attention(q_rot, up(positions), up(seq_ids), up(tables), dk, dv, hd ** -0.5, window,
                                  out=ops.empty((t_new, nh, hd)))
        what = f"{np.dtype(dtype).name} cache"
        bound = fused_bound(ops, qtype, t_new)
        assert_near(host(ops, got), want, bound, what=f"attention, {what}")
        for got_c, want_c, name in ((dk, want_k, "k"), (dv, want_v, "v")):
            c = host(ops, got_c)
            if np.dtype(dtype) == KV_BF16:
                c, want_c = from_bf16_bits(c), from_bf16_bits(want_c)
            assert_near(c, want_c, bound, what=f"{name} cache, {what}")


@pytest.mark.parametrize("whole", [False, True], ids=["per_head", "whole"])
@pytest.mark.parametrize("t_new", [7, 70])
def test_qk_norm_rope_write_then_paged_attention(ops, whole, t_new) -> None:
    """q/k norms (each head's, Qwen3 / Gemma 3; the whole projection's, OLMo 2) + RoPE +
    KV write, then attention over the cache, against rope_attention of the reference's
    normed q and k: the outputs and both caches, f32 and bf16 caches; q and k are left as
    they were. Sequence 0 prefills t_new - 1 tokens, sequence 1 decodes one; partial
    rotary (5 of 8 pairs)."""
    rng = np.random.default_rng(61 + t_new + whole)
    nh, nkv, hd, bs, nb, n_rot = 6, 2, 16, 4, 40, 5
    positions = np.concatenate([np.arange(3, 3 + t_new - 1), [9]]).astype(np.int32)
    seq_ids = np.array([0] * (t_new - 1) + [1], np.int32)
    tables = np.full((2, 20), -1, np.int32)
    tables[0, :19] = np.arange(39, 20, -1)
    tables[1, :3] = [1, 5, 0]
    q, k, v = rand(rng, t_new, nh, hd, scale=3.0), rand(rng, t_new, nkv, hd, scale=3.0), rand(rng, t_new, nkv, hd)
    qg, kg = (rand(rng, n * hd if whole else hd) + 1.0 for n in (nh, nkv))
    inv_freq = (1.0 / 10000 ** (np.arange(0, 2 * n_rot, 2) / hd)).astype(np.float32)
    if whole:
        qn = REF.rmsnorm(q.reshape(t_new, -1), qg, 1e-6).reshape(q.shape)
        kn = REF.rmsnorm(k.reshape(t_new, -1), kg, 1e-6).reshape(k.shape)
    else:
        qn, kn = REF.rmsnorm(q, qg, 1e-6), REF.rmsnorm(k, kg, 1e-6)
    earlier_k, earlier_v = rand(rng, nb, bs, nkv, hd), rand(rng, nb, bs, nkv, hd)
    up = ops.upload
    for dtype in _kv_dtypes(ops):
        store = (lambda a: to_bf16_bits(a)) if np.dtype(dtype) == KV_BF16 else (lambda a: a.copy())
        want_k, want_v = store(earlier_k), store(earlier_v)
        want = REF.rope_attention(qn, kn, v, positions, seq_ids, tables, want_k, want_v, inv_freq, True, hd ** -0.5)
        dk, dv = ops.kv_zeros(earlier_k.shape, dtype), ops.kv_zeros(earlier_v.shape, dtype)
        _fill(ops, dk, store(earlier_k))
        _fill(ops, dv, store(earlier_v))
        dq, dkk = up(q), up(k)
        q_rot = ops.qk_norm_rope_write(dq, dkk, up(v), up(qg), up(kg), 1e-6, whole, up(positions), up(seq_ids),
                                       up(tables), dk, dv, up(inv_freq), True, q_out=ops.empty((t_new, nh, hd)))
        got = ops.paged_attention(q_rot, up(positions), up(seq_ids), up(tables), dk, dv, hd ** -0.5,
                                  out=ops.empty((t_new, nh, hd)))
        what = f"{np.dtype(dtype).name} cache"
        assert_near(host(ops, got), want, what=f"attention, {what}")
        assert np.array_equal(host(ops, dq), q) and np.array_equal(host(ops, dkk), k), what
        if ops.name == "cuda":   # one kernel, the bits of the plain path's two norms and rope_kv_write
            pk, pv = ops.kv_zeros(earlier_k.shape, dtype), ops.kv_zeros(earlier_v.shape, dtype)
            _fill(ops, pk, store(earlier_k))
            _fill(ops, pv, store(earlier_v))
            shape = (t_new, -1) if whole else (t_new, -1, hd)
            pq, pkn = (ops.rmsnorm(up(a.reshape(shape)), up(g), 1e-6).reshape(a.shape) for a, g in ((q, qg), (k, kg)))
            plain = ops.rope_attention(pq, pkn, up(v), up(positions), up(seq_ids), up(tables), pk, pv, up(inv_freq),
                                       True, hd ** -0.5, out=ops.empty((t_new, nh, hd)))
            assert np.array_equal(host(ops, got), host(ops, plain)), what
            assert np.array_equal(host(ops, dk), host(ops, pk)) and np.array_equal(host(ops, dv), host(ops, pv)), what
        for got_c, want_c, name in ((dk, want_k, "k"), (dv, want_v, "v")):
            c = host(ops, got_c)
            if np.dtype(dtype) == KV_BF16:
                c, want_c = from_bf16_bits(c), from_bf16_bits(want_c)
            assert_near(c, want_c, what=f"{name} cache, {what}")
    with pytest.raises(ValueError, match="norm weights"):
        ops.qk_norm_rope_write(up(q), up(k), up(v), up(qg[:3]), up(kg), 1e-6, whole, up(positions), up(seq_ids),
                               up(tables), ops.kv_zeros(earlier_k.shape, np.float32),
                               ops.kv_zeros(earlier_v.shape, np.float32), up(inv_freq), True)


def _fill(ops: Any, cache: Any, values: np.ndarray) -> None:
    """A backend's KV cache set to host values of its element type (a device copy)."""
    if isinstance(cache, np.ndarray):
        cache[...] = values
    else:
        cache.set(values)


def test_bf16_cache_rounds_keys_and_values_on_write() -> None:
    """reference rope_attention with a bfloat16 cache: every stored key and value is the
    f32 cache's rounded to nearest even, and the output is attention over those values."""
    rng = np.random.default_rng(59)
    nh, nkv, hd, bs = 4, 2, 8, 4
    positions, seq_ids = np.arange(6, dtype=np.int32), np.zeros(6, np.int32)
    tables = np.array([[2, 0]], np.int32)
    q, k, v = rand(rng, 6, nh, hd), rand(rng, 6, nkv, hd), rand(rng, 6, nkv, hd)
    inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    kf, vf = np.zeros((3, bs, nkv, hd), np.float32), np.zeros((3, bs, nkv, hd), np.float32)
    kb, vb = np.zeros(kf.shape, KV_BF16), np.zeros(vf.shape, KV_BF16)
    REF.rope_attention(q, k, v, positions, seq_ids, tables, kf, vf, inv_freq, False, hd ** -0.5)
    got = REF.rope_attention(q, k, v, positions, seq_ids, tables, kb, vb, inv_freq, False, hd ** -0.5)
    assert np.array_equal(kb, to_bf16_bits(kf)) and np.array_equal(vb, to_bf16_bits(vf))
    assert not np.array_equal(from_bf16_bits(kb), kf)   # the rounding did something
    q_rot = reference.rope(q, positions, inv_freq, False)
    want = reference.paged_attention(q_rot, positions, seq_ids, tables, from_bf16_bits(kb), from_bf16_bits(vb),
                               hd ** -0.5)
    assert np.array_equal(got, want)
    # round to nearest even, ties included; NaN stays NaN
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.nan], np.float32)   # 1 + 2^-8: a tie, to even
    assert from_bf16_bits(to_bf16_bits(x))[:4].tolist() == [1.0, 1.0, 1.015625, -2.5]
    assert np.isnan(from_bf16_bits(to_bf16_bits(x))[4])


def test_moe(ops) -> None:
    rng = np.random.default_rng(23)
    E, H, F = 4, 32, 48

    def lin(n: int, k: int, name: str) -> Linear:
        return Linear(rand(rng, n, k, scale=0.2), GGMLType.F32, n, k, name)
    experts = Experts([lin(F, H, "g") for _ in range(E)], [lin(F, H, "u") for _ in range(E)],
                      [lin(H, F, "d") for _ in range(E)])
    router = lin(E, H, "router")
    x = rand(rng, 5, H)
    want = REF.moe(x, router, experts, 2, True)
    dexperts = Experts(*([ops.upload_linear(m) for m in mats] for mats in (experts.gate, experts.up, experts.down)))
    got = ops.moe(ops.upload(x), ops.upload_linear(router), dexperts, 2, True, out=ops.empty(x.shape))
    assert_near(host(ops, got), want, 1e-6, "moe")


def test_norm_moe_add(ops) -> None:
    """residual += moe(rmsnorm(residual)), in place: every backend against the reference's
    composition, with BF16 experts 64 and 96 wide (cuda: on the device, the norm folded
    into the router's and gate/up's products, the add into the sum) and F32 ones (cuda:
    routed on the host), for 1, 5 and 70 tokens (cuda: 64 at a time)."""
    rng = np.random.default_rng(29)
    E, H, F = 5, 64, 96

    def lin(n: int, k: int, qtype: GGMLType) -> Linear:
        w = rand(rng, n, k, scale=0.2)
        return Linear(w if qtype == GGMLType.F32 else (w.view(np.uint32) >> 16).astype(np.uint16), qtype, n, k, "e")
    for qtype in (GGMLType.BF16, GGMLType.F32):
        experts = Experts([lin(F, H, qtype) for _ in range(E)], [lin(F, H, qtype) for _ in range(E)],
                          [lin(H, F, qtype) for _ in range(E)])
        router, norm = lin(E, H, GGMLType.F32), (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
        dexperts = Experts(*([ops.upload_linear(m) for m in ms] for ms in (experts.gate, experts.up, experts.down)))
        for T in (1, 5, 70):
            res = rand(rng, T, H)
            want = REF.norm_moe_add(res.copy(), norm, 1e-6, router, experts, 2, True)
            d = ops.upload(res)
            got = ops.norm_moe_add(d, ops.upload(norm), 1e-6, ops.upload_linear(router), dexperts, 2, True)
            assert_near(host(ops, got), want, 1e-6, f"norm_moe_add {qtype.name} T={T}")
            assert_near(host(ops, d), want, 1e-6, "in place")


# ===================================== memory methods =====================================

def _mapping_of(addr: int) -> tuple[str, int]:
    """(permissions, Rss in kB) of the mapping of this process that holds addr."""
    perms, rss, inside = "", 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            inside = lo <= addr < hi
            if inside:
                perms = head[1]
        elif inside and line.startswith("Rss:"):
            rss = int(head[1])
    return perms, rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_host_kv_cache_is_private_and_committed_page_by_page() -> None:
    """The host KV cache is a private mapping (a shared one is shmem, whose first writes
    cost about twice as much), zero, and a written block commits its own pages only."""
    kv = host_kv_zeros((1024, 16, 4, 64))            # 16 MiB, 16 KiB a block
    perms, rss0 = _mapping_of(kv.ctypes.data)
    assert perms.endswith("p"), f"mapping {perms!r} is not private"
    kv[700] = 1.0
    _, rss1 = _mapping_of(kv.ctypes.data)
    assert 16 <= rss1 - rss0 <= 64, f"one 16 KiB block committed {rss1 - rss0} kB"
    assert float(kv.sum()) == 16 * 4 * 64 and not kv[699].any() and not kv[701].any()


def test_memory_round_trips(ops) -> None:
    rng = np.random.default_rng(29)
    x = rand(rng, 5, 8)
    assert np.array_equal(host(ops, ops.upload(x)), x)
    buf = ops.empty((4, 3, 2))
    assert tuple(buf.shape) == (4, 3, 2) and buf.dtype == np.float32
    assert ops.empty((6,), np.int32).dtype == np.int32
    kv = ops.kv_zeros((3, 4, 2, 8))
    assert tuple(kv.shape) == (3, 4, 2, 8) and not host(ops, kv).any()
    rows = np.array([4, 0, 4], np.int32)
    got = ops.gather_rows(ops.upload(x), ops.upload(rows), out=ops.empty((3, 8)))
    assert np.array_equal(host(ops, got), x[rows])
    dst = ops.upload(x.copy())
    vals = rand(rng, 2, 8)
    got = ops.scatter_rows(dst, ops.upload(np.array([3, 1], np.int32)), ops.upload(vals))
    want = x.copy()
    want[[3, 1]] = vals
    assert np.array_equal(host(ops, got), want) and np.array_equal(host(ops, dst), want)
    w = Linear(x, GGMLType.F32, 5, 8, "w", bias=rand(rng, 5))
    dw = ops.upload_linear(w)
    assert (dw.qtype, dw.out_features, dw.in_features) == (w.qtype, 5, 8)
    assert np.array_equal(host(ops, dw.data), x) and np.array_equal(host(ops, dw.bias), w.bias)
    batch = Batch.single(np.array([5, 6, 7], np.int32), 4, {0: np.array([[2, 0]], np.int32)})
    db = ops.upload_batch(batch)
    for name in ("token_ids", "positions", "seq_ids", "logits_rows"):
        assert np.array_equal(host(ops, getattr(db, name)), getattr(batch, name)), name
    assert np.array_equal(host(ops, db.block_tables[0]), batch.block_tables[0])


def test_workspace_grows_and_reuses(ops) -> None:
    ws = Workspace(ops)
    a = ws.get("x", 4, 8)
    assert tuple(a.shape) == (4, 8)
    before, gen = ws.nbytes, ws.generation
    ws.get("x", 3, 8)                      # fewer rows: the same buffer
    assert (ws.nbytes, ws.generation) == (before, gen)
    assert tuple(ws.get("x", 9, 8).shape) == (9, 8) and ws.nbytes >= 9 * 8 * 4
    assert ws.generation == gen + 1        # grown: views taken before are stale
    assert tuple(ws.get("x", 2, 5).shape) == (2, 5)   # another row shape: a buffer of its own
    assert ws.generation == gen + 2


def test_sample_hook_is_none_or_greedy(ops, smollm2_gguf) -> None:
    """ops.sample answers None (host sampling) or, for plain-greedy rows, the argmax."""
    from ellm.engine.sampler import SequenceSampler
    rng = np.random.default_rng(31)
    logits = rand(rng, 3, 50)
    samplers = [SequenceSampler(SamplingParams(temperature=0.0), [1, 2], 50) for _ in range(3)]
    got = ops.sample(ops.upload(logits), samplers)
    if got is not None:
        assert [r.token_id for r in got] == np.argmax(logits, axis=1).tolist()


# ====================================== the runner ======================================

def _runner_logits(path: Path, device: str) -> tuple[np.ndarray, np.ndarray]:
    """Through the model runner of `ellm.load(path, device)`: the logits of a 5-token
    prompt at every position, then of one decode step that reads its cache."""
    device, _, acts = device.partition("-")
    runner = ellm.load(path, device=device, progress=False, max_num_seqs=2, max_model_len=64,
                       activations=acts or "int8", kv_cache_dtype="float32").engine.runner
    blocks = BlockManager(runner.kv)   # the runner's own cache, from ops.kv_zeros
    assert blocks.allocate("s", 6)
    tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in runner.kv.windows}
    pre = runner.forward(Batch.single(np.array([1, 504, 3458, 314, 253], np.int32), 0, tables, all_logits=True))
    pre = pre.copy()   # the next pass reuses the workspace
    return pre, runner.forward(Batch.single(np.array([42], np.int32), 5, tables)).copy()


@pytest.fixture(scope="module")
def reference_logits(smollm2_gguf) -> tuple[np.ndarray, np.ndarray]:
    return _runner_logits(smollm2_gguf, "reference")


@pytest.mark.parametrize("name", ["cpu", "cpu-f32", "cuda"])
def test_runner_logits_match_reference(name, smollm2_gguf, reference_logits) -> None:
    """The model runner on each backend (SmolLM2's Q4_1 GGUF) against the reference
    backend: prefill and a decode step sharing its cache."""
    if name == "cuda":
        backend(name)   # skips without one
    bound = 2e-3 if name == "cpu" else 1e-6   # int8 activations round every matmul's input
    for got, want, what in zip(_runner_logits(smollm2_gguf, name), reference_logits, ("prefill", "decode")):
        assert got.dtype == np.float32
        assert_near(got, want, bound, what)


class _FusedCpu(CpuOps):
    """The cpu backend (f32 activations) running every layer through ops/fused_stack.py:
    the fused ops as their compositions, so the stack's plan is checked on its own."""

    def layer_stack(self, specs, t, hidden, residual, proj, h_buf, eps):   # noqa: ANN001, ANN201
        from ellm.ops.fused_stack import fused_layer_stack
        return fused_layer_stack(self, specs, t, hidden, residual, proj, h_buf, eps)


def _logits_on(path: Path, ops: Any, kv_cache_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """_runner_logits through a ModelRunner over the model of `path` built on `ops`."""
    from ellm.engine.runner import ModelRunner
    from ellm.models import build_model, config_from_gguf, gguf_weights
    f = GGUFFile(path)
    runner = ModelRunner(build_model(config_from_gguf(f), gguf_weights(f), ops),
                         EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_tokens=256,
                                      kv_cache_dtype=kv_cache_dtype))
    assert runner.kv.k[0].dtype == kv_storage_dtype(kv_cache_dtype)
    blocks = BlockManager(runner.kv)
    assert blocks.allocate("s", 6)
    tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in runner.kv.windows}
    pre = runner.forward(Batch.single(np.array([1, 504, 3458, 314, 253], np.int32), 0, tables,
                                      all_logits=True)).copy()
    return pre, runner.forward(Batch.single(np.array([42], np.int32), 5, tables)).copy()


@pytest.fixture(scope="module")
def fused_smollm2_logits(smollm2_gguf) -> tuple[np.ndarray, np.ndarray]:
    return _logits_on(smollm2_gguf, _FusedCpu(activations="f32"))


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fused_layer_stack_matches_the_layer_loop(model, smollm2_gguf, gemma3_gguf, request) -> None:
    """ops/fused_stack.py (norms folded into the next product, residual adds into the
    products, q/k/v + RoPE + KV write, attention from the cache) gives the layer loop's
    logits: SmolLM2 (Llama layers) and Gemma 3 (GeGLU, post-block norms, q/k norms,
    sliding windows: the stack's fallbacks)."""
    from ellm.ops.fused_stack import FusedLayerStack
    plain = CpuOps(activations="f32")
    assert plain.layer_stack([], 1, 1, None, None, None, 1e-6) is None   # f32 activations: the layer loop
    if model == "smollm2":
        got, want = request.getfixturevalue("fused_smollm2_logits"), _logits_on(smollm2_gguf, plain)
    else:
        got, want = _logits_on(gemma3_gguf, _FusedCpu(activations="f32")), _logits_on(gemma3_gguf, plain)
    for g, w, what in zip(got, want, ("prefill", "decode")):
        assert_near(g, w, 1e-6, f"{model} {what}")
    stack = _FusedCpu(activations="f32").layer_stack([{"act": "silu", "next_norm": None, "moe": None}], 1, 1, None,
                                                     None, None, 1e-6)
    assert isinstance(stack, FusedLayerStack)
    # [lora] a batch naming adapters runs layer by layer (the decoder asks takes_adapters)
    assert stack.takes_adapters is False
    with pytest.raises(ValueError, match="LoRA"):
        stack.run(None, None, {}, None, np.zeros(1, np.int32))


def test_bf16_kv_cache_through_the_runner(smollm2_gguf, fused_smollm2_logits) -> None:
    """kv_cache_dtype="bfloat16" through the model runner (its cache made of KV_BF16, the
    fused stack's composed ops storing rounded keys and values): the f32 cache's logits
    moved only by that rounding. (The ops against the reference on bf16 caches:
    test_norm_qkv_rope_write_then_paged_attention_is_rope_attention.)"""
    got = _logits_on(smollm2_gguf, _FusedCpu(activations="f32"), "bfloat16")
    for g, f, what in zip(got, fused_smollm2_logits, ("prefill", "decode")):
        assert not np.array_equal(g, f), what   # the cache's rounding shows
        assert_near(g, f, 1e-3, f"bf16 against f32 cache {what}")


# ============================ models and engine use only ops ============================

def _engine(path: Path, ops: Any, **cfg: Any) -> Engine:
    """An engine over the model of `path` built on `ops` (the opaque backend or cpu)."""
    from ellm.models import build_model, config_from_gguf, gguf_weights
    from ellm.tokenizer import Tokenizer
    f = GGUFFile(path)
    model = build_model(config_from_gguf(f), gguf_weights(f), ops)
    return Engine(model, Tokenizer.from_gguf(f), EngineConfig(max_model_len=256, **cfg))


def _run_engine(eng: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    # the seeded request ends first, so the last steps are all greedy (device-sampled)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=3, ignore_eos=True, logprobs=2)]
    for i, p in enumerate(prompts):
        eng.add_request(p, params[i % 2], request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    return {"ids": done, "logits": eng.logits(prompts[0]),
            "embed": eng.embed(prompts, pooling="mean")}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_engine_on_a_backend_numpy_cannot_read(model, smollm2_gguf, gemma3_gguf) -> None:
    """Engine steps (batched prefill + decode, greedy and seeded sampling), logits() and
    embed() through OpaqueOps(cpu) equal plain cpu bit for bit: no model or engine code
    read a backend array with NumPy; the device-sampling hook chose the greedy rows and
    decode steps ran from the executor's static buffers."""
    path = smollm2_gguf if model == "smollm2" else gemma3_gguf
    prompts = [[2, 818, 5279, 529, 3034, 563], [2, 1437, 1110], [2, 9, 10, 11, 12, 13, 14, 15]]
    opaque = OpaqueOps(get_ops("cpu"))
    got = _run_engine(_engine(path, opaque, max_num_seqs=3), prompts)
    want = _run_engine(_engine(path, get_ops("cpu"), max_num_seqs=3), prompts)
    assert got["ids"] == want["ids"] and [len(got["ids"][f"r{i}"]) for i in range(3)] == [6, 3, 6]
    for key in ("logits", "embed"):
        assert got[key].tobytes() == want[key].tobytes(), key
    assert opaque.counts["sample"] > 0 and opaque.counts["replayed"] > 0 and opaque.counts["eager"] > 0


def test_speculative_steps_on_a_backend_numpy_cannot_read(smollm2_gguf) -> None:
    """Steps that check n-gram guesses through OpaqueOps(cpu): a step of greedy rows has
    them all chosen by the device-sampling hook (rows named, none copied back), a step
    with a seeded request's rows has them copied back for the host's sampler; the same
    ids as plain cpu with the same guesses, and as without guesses."""
    from ellm.engine.speculative import SpeculativeConfig
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                    "prompt_lookup_min": 1, "adaptive": False})
    prompts = [[455, 2654, 4461, 2382, 2654, 4461, 2382, 2654, 4461, 2382, 2654],   # "red green blue ..."
               [2, 818, 5279, 529, 3034, 563, 818, 5279]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=4, ignore_eos=True)]

    def run(eng: Engine) -> dict[str, list[int]]:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            eng.add_request(ids, p, request_id=f"r{i}")
        done: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        return done

    opaque = OpaqueOps(get_ops("cpu"))
    asked: list[tuple[int, int]] = []   # (rows, sequences) per call of the device-sampling hook
    hook = opaque.sample
    opaque.sample = lambda logits, samplers, masks=None, rows=None: (  # type: ignore[method-assign]
        asked.append((len(samplers), len(set(map(id, samplers))))) or hook(logits, samplers, masks, rows))
    eng = _engine(smollm2_gguf, opaque, max_num_seqs=2, speculative=spec)
    got = run(eng)
    assert got == run(_engine(smollm2_gguf, get_ops("cpu"), max_num_seqs=2, speculative=spec))
    assert got == run(_engine(smollm2_gguf, get_ops("cpu"), max_num_seqs=2))
    assert eng.stats["spec_checks"] > 0 and eng.stats["spec_accepted_tokens"] > 0, eng.stats
    assert opaque.counts["to_host"] > 0
    assert any(n_rows > n_seqs for n_rows, n_seqs in asked)   # a sequence's guesses' rows on the device


def test_opaque_arrays_refuse_numpy() -> None:
    """The check above can fail: NumPy on an Opaque array raises."""
    a = Opaque(np.zeros((3, 2), np.float32))
    for bad in (lambda: np.take(a, [0], axis=0), lambda: np.asarray(a), lambda: a + 1.0,
                lambda: a[Opaque(np.zeros(1))]):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError, match="never uploaded"):
        OpaqueOps(get_ops("cpu")).rmsnorm(np.zeros((1, 4), np.float32), Opaque(np.ones(4, np.float32)), 1e-6)


def test_get_ops_names_the_devices() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu'.*cpu, reference, cuda"):
        get_ops("tpu")
