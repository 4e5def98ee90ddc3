"""The CUDA backend against the CPU: every op against ops/reference.py by NMSE (<= 1e-6
on the f32 paths, <= 1e-3 where the tensor cores round to bf16), the two real models'
logits against the CPU f32 path, greedy ids equal up to the first small-margin step,
batched == single and graphs == eager bit for bit, and the device sampler against the
host sampler's semantics.

Needs CuPy and an NVIDIA GPU (compute capability >= 8.0); skipped, saying which is
missing, without them. benchmarks/gpu/check.sh runs this file on a lent GPU machine.
Without a GPU, `test_cuda_unavailable_*` check the error a user gets instead.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ellm
from ellm.engine.sampler import SequenceSampler
from ellm.formats.ggml_types import BLOCK_LAYOUT, GGMLType, row_bytes
from ellm.models.batch import Batch
from ellm.ops import reference as R
from ellm.ops.reference import ReferenceOps
from ellm.sampling_params import SamplingParams
from ellm.weights import Linear


def _gpu_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'ellm-engine[gpu]' or 'ellm-engine[gpu-cuda13]')"
    try:
        from ellm.ops.cuda import import_cupy
        import_cupy()
    except Exception as e:   # CudaUnavailableError: says what is missing
        return str(e)
    return None


GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"no GPU: {GPU_REASON}")


# -- without a GPU: the error a user meets -------------------------------------------------

@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present")
def test_cuda_unavailable_error_says_what_is_missing() -> None:
    from ellm.ops import get_ops
    with pytest.raises(Exception) as info:
        get_ops("cuda")
    msg = str(info.value)
    if importlib.util.find_spec("cupy") is None:
        assert "CuPy" in msg and "ellm-engine[gpu]" in msg and "ellm-engine[gpu-cuda13]" in msg
    else:
        assert "GPU" in msg
    assert "device='cpu'" in msg


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present")
def test_cuda_unavailable_load_fails_before_reading_weights(smollm2_gguf: Path) -> None:
    with pytest.raises(Exception, match="CuPy|GPU"):
        ellm.load(smollm2_gguf, device="cuda")


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present")
def test_cuda_unavailable_cli_says_so_without_a_traceback(smollm2_gguf: Path) -> None:
    import subprocess
    import sys
    for cmd in (["run", "--device", "cuda", str(smollm2_gguf), "hi"], ["bench", "--device", "cuda", str(smollm2_gguf)]):
        proc = subprocess.run([sys.executable, "-m", "ellm", *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0, cmd
        assert "Traceback" not in proc.stderr and ("CuPy" in proc.stderr or "GPU" in proc.stderr), proc.stderr


def test_a_gpu_ordinal_says_how_to_pick_that_gpu() -> None:
    """ellm runs on the first visible GPU: "cuda:0" and "gpu" mean "cuda"; another ordinal
    is refused before anything is read, naming CUDA_VISIBLE_DEVICES, in the API and the CLI."""
    import subprocess
    import sys

    from ellm.ops import normalize_device
    assert [normalize_device(d) for d in ("cuda", "gpu", "cuda:0", "gpu:0", "cpu")] == ["cuda"] * 4 + ["cpu"]
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=2 and pass device='cuda'"):
        ellm.load("/no/such/model.gguf", device="cuda:2")
    with pytest.raises(ValueError, match="unknown device 'cuda:x'"):
        ellm.load("/no/such/model.gguf", device="cuda:x")
    for cmd in (["run", "--device", "gpu:1", "m", "hi"], ["serve", "--device", "cuda:3", "m"]):
        proc = subprocess.run([sys.executable, "-m", "ellm", *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"CUDA_VISIBLE_DEVICES={cmd[2][-1]}" in proc.stderr, proc.stderr


# -- helpers ---------------------------------------------------------------------------------

def nmse(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-30))


@pytest.fixture(scope="module")
def ops():
    from ellm.ops.cuda import CudaOps
    return CudaOps()


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("k", [576, 4096])
def test_rows_are_kept_split_on_the_device(qtype: GGMLType, k: int) -> None:
    """Q8_0 / Q4_0 / Q4_1 on the GPU (ops/cuda_kernels.py rows_split; common.cuh deq8_*): each
    row's values of every block, then the blocks' scales (f16 d; Q4_1: d, m), rows padded
    to 16 bytes; the values GGML's dequantization gives."""
    from ellm.formats.dequant import dequantize
    from ellm.ops.cuda import rows_split
    w = random_linear(np.random.default_rng(5), qtype, 7, k)
    split = rows_split(w.data, qtype)
    row = w.data.shape[1]
    assert split.shape[0] == 7 and split.shape[1] % 16 == 0 and split.shape[1] - row < 16
    assert not split[:, row:].any()
    nb = k // 32
    if qtype == GGMLType.Q8_0:
        q = split[:, :k].view(np.int8).astype(np.float32)
        d, m = split[:, k:row].copy().view(np.float16).astype(np.float32), 0.0
    else:
        nib = split[:, :k // 2].reshape(7, nb, 16)
        q = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(7, k).astype(np.float32)
        sc = split[:, k // 2:row].copy().view(np.float16).astype(np.float32)
        if qtype == GGMLType.Q4_0:
            d, m, q = sc, 0.0, q - 8
        else:
            d, m = sc[:, 0::2], np.repeat(sc[:, 1::2], 32, axis=1)
    assert np.array_equal(np.repeat(d, 32, axis=1) * q + m, dequantize(w.data, qtype, (7, k)))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("k", [1536, 4096])
def test_k_quant_rows_are_kept_split_on_the_device(qtype: GGMLType, k: int) -> None:
    """The K-quants on the GPU (csrc/quant.c ellm_split_rows; common.cuh deq8_q4_k,
    deq8_q5_k, deq8_q6_k): each step of 32 weights a record starting with 16 bytes of
    nibbles (weight j < 16 the low nibble of byte j, j >= 16 the high one of byte j - 16,
    as Q4_0's); Q5_K's adds 4 bytes of fifth bits (byte w: weights 4w + i at bit i,
    16 + 4w + i at bit 4 + i), Q6_K's 4 u16 words of high bit pairs (word w: weights
    4w + i at bits 2i, 16 + 4w + i at bits 8 + 2i). Then Q4_K's and Q5_K's block heads
    (f16 d, f16 dmin, a word of each sub-block's top 2 bits of scale and min at bits 4s
    and 4s + 2, a byte a sub-block of their low 4 bits); Q6_K's int8 scales, then its f16
    d. Rows padded to 16 bytes; the values GGML's dequantization gives."""
    from ellm.formats.dequant import dequantize
    from ellm.ops.cuda import rows_split
    n, nb, steps = 5, k // 256, k // 32
    w = random_linear(np.random.default_rng(6), qtype, n, k)
    split = rows_split(w.data, qtype)
    row = w.data.shape[1]
    assert split.shape[0] == n and split.shape[1] % 16 == 0 and split.shape[1] - row < 16
    assert not split[:, row:].any()
    rec_bytes = {GGMLType.Q4_K: 16, GGMLType.Q5_K: 20, GGMLType.Q6_K: 24}[qtype]
    rec = split[:, :steps * rec_bytes].reshape(n, steps, rec_bytes)
    q = np.concatenate([rec[..., :16] & 15, rec[..., :16] >> 4], axis=2).astype(np.int32)
    j = np.arange(32)
    if qtype == GGMLType.Q6_K:
        words = rec[..., 16:].copy().view("<u2").astype(np.int32)          # (n, steps, 4)
        high = (words[..., (j & 15) >> 2] >> (2 * ((j & 3) + 4 * (j >> 4)))) & 3
        q = (q | (high << 4)) - 32
        scales = split[:, steps * 24:nb * 208].view(np.int8).astype(np.float32)
        d = split[:, nb * 208:row].copy().view(np.float16).astype(np.float32)
        got = np.repeat(d, 256, axis=1) * np.repeat(scales, 16, axis=1) * q.reshape(n, k)
    else:
        if qtype == GGMLType.Q5_K:
            fifth = rec[..., 16:20].astype(np.int32)
            q = q | (((fifth[..., (j & 15) >> 2] >> ((j & 3) + 4 * (j >> 4))) & 1) << 4)
        head = split[:, steps * rec_bytes:row].reshape(n, nb, 16)
        d = head[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        dmin = head[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        top = head[..., 4:8].copy().view("<u4").astype(np.int64)            # (n, nb, 1)
        top = (top >> (4 * np.arange(8))) & 15                              # (n, nb, 8)
        low = head[..., 8:16].astype(np.int64)
        scale = ((low & 15) | ((top & 3) << 4)).astype(np.float32)
        mins = ((low >> 4) | ((top >> 2) << 4)).astype(np.float32)
        a = (d[..., None] * scale).reshape(n, steps, 1)   # float32 throughout, as GGML's
        m = (dmin[..., None] * mins).reshape(n, steps, 1)
        got = (a * q.astype(np.float32) - m).reshape(n, k)
    assert np.array_equal(got, dequantize(w.data, qtype, (n, k)))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K], ids=lambda q: q.name)
def test_k_quant_split_on_the_pool_is_the_split_of_each_row(qtype: GGMLType) -> None:
    """ellm_split_rows cuts a matrix's rows into chunks of ~64 KiB over the thread pool: 300
    rows of 4096 weights are 11-14 chunks, each row's split the same as that row's alone."""
    from ellm._native import _kernels
    from ellm.ops.cuda import rows_split
    rows = np.random.default_rng(7).integers(0, 256, (300, row_bytes(qtype, 4096)), dtype=np.uint8)
    threads = _kernels.num_threads()
    try:
        _kernels.set_num_threads(2)
        whole = rows_split(rows, qtype)
    finally:
        _kernels.set_num_threads(threads)
    assert np.array_equal(whole, np.concatenate([rows_split(rows[i:i + 1], qtype) for i in range(300)]))


def test_split_rows_says_what_is_wrong() -> None:
    from ellm._native import _quant
    from ellm.ops.cuda import rows_split
    with pytest.raises(ValueError, match="Q6_K rows of 100 bytes are not whole 210-byte blocks"):
        rows_split(np.zeros((3, 100), np.uint8), GGMLType.Q6_K)
    rows = np.zeros((2, 210), np.uint8)
    with pytest.raises(ValueError, match="not Q6_K rows of 512 weights"):
        _quant.split_rows(rows, int(GGMLType.Q6_K), 512, np.zeros((2, 224), np.uint8))
    with pytest.raises(ValueError, match="needs 2 rows of at least 210 bytes"):
        _quant.split_rows(rows, int(GGMLType.Q6_K), 256, np.zeros((2, 208), np.uint8))
    with pytest.raises(ValueError, match="only Q4_K .*, Q5_K .* and Q6_K .* are rearranged, got Q8_0"):
        _quant.split_rows(rows, int(GGMLType.Q8_0), 256, np.zeros((2, 224), np.uint8))


def random_linear(rng: np.random.Generator, qtype: GGMLType, n: int, k: int) -> Linear:
    """A weight of n x k in qtype with random contents: floats from a normal, quantized
    blocks of random bytes whose f16 scales are set to small finite values."""
    if qtype == GGMLType.F32:
        return Linear(rng.standard_normal((n, k)).astype(np.float32), qtype, n, k)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        f = rng.standard_normal((n, k)).astype(np.float32)
        bits = f.astype(np.float16).view(np.uint16) if qtype == GGMLType.F16 else \
            (f.view(np.uint32) >> 16).astype(np.uint16)
        return Linear(bits, qtype, n, k)
    blk, size = BLOCK_LAYOUT[qtype]
    raw = rng.integers(0, 256, (n, k // blk, size), dtype=np.uint8)
    scale_at = {GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q8_0: [0], GGMLType.Q4_K: [0, 2],
                GGMLType.Q5_K: [0, 2], GGMLType.Q6_K: [208]}[qtype]
    for off in scale_at:
        d = (rng.uniform(0.001, 0.05, (n, k // blk))).astype(np.float16).view(np.uint8).reshape(n, k // blk, 2)
        raw[:, :, off:off + 2] = d
    return Linear(raw.reshape(n, row_bytes(qtype, k)), qtype, n, k)


QTYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0,
          GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


# -- ops against the reference ------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 5, 64, 200])
def test_linear_matches_reference(ops, qtype: GGMLType, T: int) -> None:
    rng = np.random.default_rng(int(qtype) * 1000 + T)
    n, k = 136, 2560   # mmv.cu: 80 steps of 32, 10 a warp (its loads in groups of 4, 4, 2)
    w = random_linear(rng, qtype, n, k)
    if T == 5:   # the bias epilogue
        w = replace(w, bias=rng.standard_normal(n).astype(np.float32))
    x = rng.standard_normal((T, k)).astype(np.float32)
    want = ReferenceOps().linear(x, w)
    got = ops.to_host(ops.linear(ops.upload(x), ops.upload_linear(w)))
    # T <= 64: f32 GEMV, or mmv.cu's split activations and F16 weights (near f32: bf16
    # weights or activations alone would give ~1e-6); above: tensor cores on bf16 inputs
    # (except f32 weights)
    limit = 1e-9 if T <= 64 else 1e-6 if qtype == GGMLType.F32 else 1e-3
    assert nmse(got, want) <= limit


@needs_gpu
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_embed_matches_reference(ops, qtype: GGMLType) -> None:
    rng = np.random.default_rng(7)
    w = random_linear(rng, qtype, 50, 256)
    ids = np.array([0, 49, 3, 3, 17], np.int32)
    want = ReferenceOps().embed(w, ids)
    got = ops.to_host(ops.embed(ops.upload_linear(w), ops.upload(ids)))
    assert nmse(got, want) <= 1e-12


@needs_gpu
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.BF16], ids=lambda q: q.name)
def test_decode_products_are_batch_invariant(ops, qtype: GGMLType) -> None:
    """A token's row of a product is the same bits alone or among 63 others (mmv.cu: one,
    two or, for BF16, four tiles a block)."""
    rng = np.random.default_rng(3)
    w = ops.upload_linear(random_linear(rng, qtype, 300, 512))
    x = rng.standard_normal((64, 512)).astype(np.float32)
    full = ops.to_host(ops.linear(ops.upload(x), w))
    for t in (0, 9, 63):
        alone = ops.to_host(ops.linear(ops.upload(x[t:t + 1]), w))
        assert np.array_equal(alone[0], full[t])
    for n in (17, 32, 33):
        assert np.array_equal(ops.to_host(ops.linear(ops.upload(x[:n]), w)), full[:n])


def random_experts(rng: np.random.Generator, gate_type: GGMLType, down_type: GGMLType, E: int, H: int,
                   F: int) -> R.Experts:
    """E SwiGLU experts of random weights: gate and up (F, H) of one type, down (H, F) of another."""
    return R.Experts([random_linear(rng, gate_type, F, H) for _ in range(E)],
                     [random_linear(rng, gate_type, F, H) for _ in range(E)],
                     [random_linear(rng, down_type, H, F) for _ in range(E)])


MOE_TYPES = [(GGMLType.BF16, GGMLType.BF16), (GGMLType.F16, GGMLType.Q8_0), (GGMLType.Q4_K, GGMLType.Q6_K),
             (GGMLType.Q4_0, GGMLType.Q4_1), (GGMLType.Q5_K, GGMLType.Q8_0)]


@needs_gpu
@pytest.mark.parametrize("types", MOE_TYPES, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_moe_on_the_device_matches_reference(ops, types: tuple[GGMLType, GGMLType]) -> None:
    """A mixture-of-experts block stays on the device (moe_route, moe.cu, moe_combine):
    within 1e-9 of the reference for 1, 5, 64, 70 and 200 tokens (~90 an expert: a slot's
    tokens in two blocks of 64) and both routings (renormalised or not), each token's row
    the same bits alone as in the batch."""
    ops.compile_kernels(("moe.cu",))   # every type's unit at once, side by side (NVRTC: seconds each)
    rng = np.random.default_rng(int(types[0]) * 100 + int(types[1]))
    E, H, F = 9, 256, 512
    experts = random_experts(rng, *types, E, H, F)
    router = random_linear(rng, GGMLType.F32, E, H)
    dexperts = R.Experts(*([ops.upload_linear(m) for m in ms] for ms in (experts.gate, experts.up, experts.down)))
    drouter = ops.upload_linear(router)
    assert ops._expert_tables(dexperts) is not None   # (the device path is taken)
    x = (rng.standard_normal((200, H)) * 0.02).astype(np.float32)   # (the K-quants' random rows are large)
    for T, k, norm in ((1, 3, True), (5, 2, False), (64, 4, True), (70, 3, True), (200, 4, False)):
        want = ReferenceOps().moe(x[:T], router, experts, k, norm)
        got = ops.to_host(ops.moe(ops.upload(x[:T]), drouter, dexperts, k, norm))
        assert nmse(got, want) <= 1e-9, (T, k, norm, nmse(got, want))
        for t in (0, T // 2, T - 1):
            alone = ops.to_host(ops.moe(ops.upload(x[t:t + 1]), drouter, dexperts, k, norm))
            assert np.array_equal(alone[0], got[t]), (T, t)


@needs_gpu
def test_moe_routing_on_the_device(ops) -> None:
    """moe_route against reference.moe_route: the same experts in the same order (most
    probable first, ties to the lower id), their weights within f32 rounding; every entry
    laid out by expert, the experts in ascending id, a token's entries in ascending expert
    id. Ties (equal logits) and an expert nobody picks included."""
    rng = np.random.default_rng(4)
    T, E, k = 7, 40, 5
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[1, [3, 17, 30]] = 2.5          # three tied experts, two of which are taken
    logits[:, 11] = -30.0                 # never chosen
    n, nslots = T * k, min(E, T * k)
    outs = {name: ops.upload(np.full(size, -7, np.int32)) for name, size in
            (("ids", n), ("slots", nslots), ("starts", nslots + 1), ("rows", n), ("pos", n))}
    wts, wpos = ops.upload(np.zeros(n, np.float32)), ops.upload(np.zeros(n, np.float32))
    for norm in (False, True):
        done = ops._counters(1, "moe_done")
        ops._launch("moe_route_f32", (T,), (32,),
                    (ops.upload(logits), outs["ids"], wts, outs["slots"], outs["starts"], outs["rows"], outs["pos"],
                     wpos, done, np.int32(T), np.int32(E), np.int32(k), np.int32(nslots), np.int32(norm)))
        got = {name: ops.to_host(a) for name, a in outs.items()}
        assert ops.to_host(done)[0] == 0   # the last block left the counter for the next launch
        want_ids, want_w = R.moe_route(logits, k, norm)
        ids, w = got["ids"].reshape(T, k), ops.to_host(wts).reshape(T, k)
        assert np.array_equal(ids, want_ids) and ids[1, :2].tolist() == [3, 17] and 11 not in ids
        np.testing.assert_allclose(w, want_w, rtol=1e-6)
        chosen = sorted(set(ids.ravel().tolist()))
        used = len(chosen)
        assert got["slots"][:used].tolist() == chosen and (got["slots"][used:] == -1).all()
        counts = [int((ids == e).sum()) for e in chosen]
        assert got["starts"][:used].tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        assert (got["starts"][used:] == n).all()
        rows = got["rows"]
        for s, e in enumerate(chosen):   # an expert's entries: its tokens, in order
            first = got["starts"][s]
            assert rows[first:first + counts[s]].tolist() == np.nonzero((ids == e).any(1))[0].tolist()
        pos, wp = got["pos"].reshape(T, k), ops.to_host(wpos).reshape(T, k)
        for t in range(T):
            assert (np.diff(pos[t]) > 0).all() and (rows[pos[t]] == t).all()
            order = np.argsort(ids[t])
            assert np.array_equal(wp[t], w[t][order])


@needs_gpu
@pytest.mark.parametrize("qtype", [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda q: q.name)
def test_decode_products_on_fewer_blocks_than_row_groups_are_the_same_bits(ops, qtype: GGMLType,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """mmv3 and mmv_glu on a grid capped at what is resident (a vocabulary head's or a
    wide MLP's many row groups): each block walks several groups, the next one's weights
    asked for ahead. Here the GPU is told it has one SM (2 blocks of one tile, 1 of two or
    four): the products, with a folded norm, a bias and added into a residual, and
    norm + gate/up + SiLU, are the same bits as one block a group."""
    rng = np.random.default_rng(11 + int(qtype))
    K, N, F = 256, 16 * 37 + 5, 8 * 41 + 3
    w = random_linear(rng, qtype, N, K)
    w = ops.upload_linear(replace(w, bias=rng.standard_normal(N).astype(np.float32)))
    gate, up = (ops.upload_linear(random_linear(rng, qtype, F, K)) for _ in range(2))
    g = ops.upload(rng.uniform(0.5, 1.5, K).astype(np.float32))
    x = rng.standard_normal((64, K)).astype(np.float32)
    res = rng.standard_normal((64, N)).astype(np.float32)

    def run(t: int) -> list[np.ndarray]:
        xs = ops.upload(x[:t])
        plain = ops.to_host(ops.linear(xs, w))
        normed = ops.to_host(ops.norm_linear_multi(xs, g, 1e-5, [(w, ops.empty((t, N)))])[0])
        added = ops.to_host(ops.linear_add(xs, w, ops.upload(res[:t])))
        glu = ops.to_host(ops.norm_linear_glu(xs, g, 1e-5, gate, up, "silu"))
        return [plain, normed, added, glu]

    for t in (1, 17, 33):   # one, two and (BF16, Q8_0) four tiles a group
        ops.mmv_loop = False
        want = run(t)
        ops.mmv_loop = True
        monkeypatch.setattr(ops, "num_sms", 1)
        got = run(t)
        monkeypatch.undo()
        for a, b in zip(got, want):
            assert np.array_equal(a, b), t
    assert ops.mmv_loop


@needs_gpu
def test_embed_refuses_a_hidden_size_not_a_multiple_of_8(ops) -> None:
    """embed_<type> takes a row 8 elements at a time (F16 / BF16 / F32 in one or two 16-byte
    loads, aligned when K % 8 == 0): another hidden size is a clear error, not a tail left
    out or a misaligned load."""
    w = random_linear(np.random.default_rng(3), GGMLType.F16, 10, 36)
    with pytest.raises(ValueError, match="hidden size 36 is not a multiple of 8"):
        ops.embed(ops.upload_linear(w), ops.upload(np.array([1], np.int32)))


@needs_gpu
@pytest.mark.parametrize("qtype", [GGMLType.BF16, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F16, GGMLType.F32],
                         ids=lambda q: q.name)
def test_a_greedy_head_takes_each_rows_argmax_in_its_own_launch(ops, qtype: GGMLType,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_linear_greedy, a captured decode step's head: on mmv.cu each block takes its
    tokens' largest (value, first index) as it stores their logits and the last block to
    finish writes the ids, in the product's one launch (F32, not on mmv.cu: the product,
    then argmax_rows). The logits are norm_linear_multi's bits and the ids argmax_rows'
    answer over them: the first of equal maxima (every row is here twice, 16 x 19 + 3 rows
    apart: in other blocks' groups), NaN and -inf never chosen, a row of nothing else 0;
    with one block a group and with blocks walking several (the GPU told it has one SM),
    at 1 to 64 tokens (one, two and, for BF16 and Q8_0, four tiles a group), call after call
    (the keys and the count of finished blocks left at zero)."""
    rng = np.random.default_rng(31 + int(qtype))
    K, half = 256, 16 * 19 + 3
    one = random_linear(rng, qtype, half, K)
    bias = rng.standard_normal(half).astype(np.float32)
    bias[3], bias[7] = np.nan, -np.inf
    twice = Linear(np.concatenate([one.data, one.data]), qtype, 2 * half, K, bias=np.concatenate([bias, bias]))
    w = ops.upload_linear(twice)
    nothing = ops.upload_linear(replace(twice, bias=np.full(2 * half, -np.inf, np.float32)))
    g = ops.upload(rng.uniform(0.5, 1.5, K).astype(np.float32))
    fused = ops._mmv(qtype, K)
    assert fused == (qtype != GGMLType.F32)
    for loop in (False, True):
        ops.mmv_loop = loop
        if loop:
            monkeypatch.setattr(ops, "num_sms", 1)
        for t in (1, 5, 17, 33, 64):
            x = ops.upload(rng.standard_normal((t, K)).astype(np.float32))
            want = ops.to_host(ops.norm_linear_multi(x, g, 1e-5, [(w, ops.empty((t, 2 * half)))])[0])
            logits, ids = ops.empty((t, 2 * half)), ops.upload(np.full(t, -1, np.int32))
            before = ops.launches
            assert ops.norm_linear_greedy(x, g, 1e-5, w, logits, ids) is ids
            assert ops.launches - before == (1 if fused else 2)
            got = ops.to_host(ids)
            assert np.array_equal(ops.to_host(logits), want, equal_nan=True), (loop, t)
            assert got.tolist() == R.argmax_ids(want).tolist() == ops.to_host(ops.argmax_rows(logits)).tolist()
            assert (got < half).all() and not np.isin(got, [3, 7]).any(), got
            none = ops.norm_linear_greedy(x, None, 1e-5, nothing, logits, ids)
            assert ops.to_host(none).tolist() == [0] * t
        monkeypatch.undo()
    assert ops.mmv_loop


@needs_gpu
@pytest.mark.parametrize("qtype", [GGMLType.BF16, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F16, GGMLType.F32],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("K", [1024, 96])   # 1024: four steps a warp of mmv.cu; 96: most warps none
def test_fused_decode_products_with_a_folded_norm_are_batch_invariant(ops, qtype: GGMLType, K: int) -> None:
    """norm + q/k/v and norm + gate/up: a token's rows are the same bits alone, among 15,
    16, 31 or 32 others (mmv.cu's one, two and, for BF16, Q8_0 and Q4_0, four tiles a
    block) and among 63 -- the norm's sum of squares included, which mmv.cu takes from the
    products' own loads."""
    rng = np.random.default_rng(5 + int(qtype) + K)
    parts = [ops.upload_linear(random_linear(rng, qtype, n, K)) for n in (72, 24, 24)]
    gate, up = (ops.upload_linear(random_linear(rng, qtype, 40, K)) for _ in range(2))
    x = (rng.standard_normal((64, K)) * rng.uniform(0.1, 3.0, (64, 1))).astype(np.float32)
    g = ops.upload(rng.uniform(0.5, 1.5, K).astype(np.float32))

    def run(rows: np.ndarray) -> list[np.ndarray]:
        t = len(rows)
        outs = ops.norm_linear_multi(ops.upload(rows), g, 1e-5, [(w, ops.empty((t, w.out_features))) for w in parts])
        glu = ops.norm_linear_glu(ops.upload(rows), g, 1e-5, gate, up, "silu", out=ops.empty((t, 40)))
        return [ops.to_host(o) for o in (*outs, glu)]

    full = run(x)
    for rows in (x[:16], x[:17], x[:32], x[:33], x[9:10], x[63:64], x[:1]):
        start = next(i for i in range(64) if np.array_equal(x[i], rows[0]))
        for got, want in zip(run(rows), full):
            assert np.array_equal(got, want[start:start + len(rows)]), (len(rows), start)


@needs_gpu
@pytest.mark.parametrize("qtype", [GGMLType.BF16, GGMLType.Q4_1, GGMLType.Q6_K], ids=lambda q: q.name)
def test_linear_multi_is_linear_bit_for_bit(ops, qtype: GGMLType) -> None:
    """q/k/v in one launch (gemv3) give each matrix's gemv bits; two parts, a bias, and
    parts of mixed types (separate launches) too."""
    rng = np.random.default_rng(int(qtype))
    x = ops.upload(rng.standard_normal((6, 256)).astype(np.float32))
    ws = [random_linear(rng, qtype, n, 256) for n in (128, 32, 32)]
    ws[1] = replace(ws[1], bias=rng.standard_normal(32).astype(np.float32))
    ws = [ops.upload_linear(w) for w in ws]
    alone = [ops.to_host(ops.linear(x, w)) for w in ws]
    for chosen in (ws, ws[:2]):
        outs = ops.linear_multi(x, [(w, ops.empty((6, w.out_features))) for w in chosen])
        for got, want in zip(outs, alone):
            assert np.array_equal(ops.to_host(got), want)
    mixed = [ws[0], ops.upload_linear(random_linear(rng, GGMLType.Q8_0, 32, 256))]
    outs = ops.linear_multi(x, [(w, ops.empty((6, w.out_features))) for w in mixed])
    assert np.array_equal(ops.to_host(outs[0]), alone[0])


@needs_gpu
def test_norms_and_elementwise_match_reference(ops) -> None:
    rng = np.random.default_rng(1)
    ref = ReferenceOps()
    x = rng.standard_normal((7, 640)).astype(np.float32)
    y = rng.standard_normal((7, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    up = ops.upload
    assert nmse(ops.to_host(ops.rmsnorm(up(x), up(w), 1e-6)), ref.rmsnorm(x, w, 1e-6)) <= 1e-12
    res_h, res_d = x.copy(), up(x)
    want = ref.add_rmsnorm(res_h, y, w, 1e-5)
    got = ops.to_host(ops.add_rmsnorm(res_d, up(y), up(w), 1e-5))
    assert nmse(got, want) <= 1e-12 and nmse(ops.to_host(res_d), res_h) <= 1e-14
    assert nmse(ops.to_host(ops.swiglu(up(x), up(y))), R.swiglu(x, y)) <= 1e-12
    assert nmse(ops.to_host(ops.geglu(up(x), up(y))), R.geglu(x, y)) <= 1e-12
    assert nmse(ops.to_host(ops.softcap(up(x * 40), 30.0)), R.softcap(x * 40, 30.0)) <= 1e-12
    assert nmse(ops.to_host(ops.scale(up(x), 0.125)), x * np.float32(0.125)) == 0.0
    assert np.array_equal(ops.to_host(ops.add(up(x), up(y))), x + y)
    rows = np.array([6, 0, 3], np.int32)
    assert np.array_equal(ops.to_host(ops.gather_rows(up(x), up(rows))), x[rows])


@needs_gpu
def test_dependent_launches_in_a_graph_wait_for_the_kernel_before(ops) -> None:
    """A chain of kernels each reading what the one before wrote, captured as programmatic
    dependent launches (ops/cuda_pdl.py) and replayed: a kernel that started reading
    before its predecessor finished would see stale values."""
    if ops.dependent_launcher is None:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+ and cuLaunchKernelEx")
    n, links, replays = 1 << 22, 40, 3   # thousands of blocks a kernel, so neighbours could overlap
    x0 = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    half = np.full(n, 0.5, np.float32)
    x, y = ops.upload(x0), ops.upload(half)
    ops.stream.synchronize()
    ops.dependent_launch = True
    try:
        ops.stream.begin_capture()
        try:
            for _ in range(links):
                ops.add(x, y)
                ops.scale(x, 0.5)
        finally:
            graph = ops.stream.end_capture()
    finally:
        ops.dependent_launch = False
    for _ in range(replays):
        graph.launch(ops.stream)
    want = x0.copy()
    for _ in range(links * replays):
        want = (want + half) * np.float32(0.5)
    assert np.array_equal(ops.to_host(x), want)


ATTN_CASES = {
    # name: (nh, nkv, hd, n_rot, window, softcap, interleaved, mscale, prompt lengths, new tokens)
    "llama_decode": (9, 3, 64, 32, 0, 0.0, False, 1.0, [37, 300], 1),
    "gemma_sliding": (4, 1, 256, 128, 48, 0.0, False, 1.0, [130, 5], 1),
    "softcap_interleaved": (8, 2, 128, 64, 0, 50.0, True, 1.0, [90], 3),
    "partial_rotary_mscale": (4, 4, 96, 16, 0, 0.0, False, 1.19, [70, 12], 2),
    "prefill": (9, 3, 64, 32, 0, 0.0, False, 1.0, [0, 0], 150),
    "prefill_window": (4, 1, 256, 128, 100, 0.0, False, 1.0, [0], 300),
    "tiny_head_dims": (4, 2, 24, 12, 0, 0.0, False, 1.0, [20, 3], 2),   # head_dim not a multiple of 32
    "odd_head_dims": (2, 1, 18, 8, 0, 0.0, False, 1.0, [150, 7], 2),   # nor of 4: scalar loads of K
}


@needs_gpu
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_rope_attention_matches_reference(ops, case: str) -> None:
    nh, nkv, hd, n_rot, window, cap, inter, msc, lengths, new = ATTN_CASES[case]
    rng = np.random.default_rng(len(case))
    bs, blocks = 16, 64
    k_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    v_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    perm = rng.permutation(blocks).astype(np.int32)
    width = 24
    tables = np.full((len(lengths), width), -1, np.int32)
    used = 0
    positions, seq_ids = [], []
    for b, n in enumerate(lengths):
        need = -(-(n + new) // bs)
        tables[b, :need] = perm[used:used + need]
        used += need
        positions += list(range(n, n + new))
        seq_ids += [b] * new
    T = len(positions)
    pos, sid = np.array(positions, np.int32), np.array(seq_ids, np.int32)
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    inv_freq = (1.0 / (10000.0 ** (np.arange(n_rot) / n_rot))).astype(np.float32)
    scale = hd ** -0.5
    kd, vd = ops.upload(k_cache), ops.upload(v_cache)
    want = R.rope_attention(q, k, v, pos, sid, tables, k_cache, v_cache, inv_freq, inter, scale,
                            window, cap, msc)
    up = ops.upload
    got = ops.rope_attention(up(q), up(k), up(v), up(pos), up(sid), up(tables), kd, vd, up(inv_freq),
                             inter, scale, window, cap, rope_mscale=msc)
    assert nmse(ops.to_host(got), want) <= 1e-6
    assert nmse(ops.to_host(kd), k_cache) <= 1e-12 and nmse(ops.to_host(vd), v_cache) == 0.0


PREFILL_CASES = {
    # name: (nh, nkv, hd, window, softcap, key_limit extra, prompts (context, new tokens))
    "hd128_three_prompts": (8, 2, 128, 0, 0.0, 0, [(0, 70), (5, 33), (40, 20)]),
    "hd64_window_softcap": (4, 1, 64, 40, 30.0, 0, [(0, 90), (17, 50)]),
    "hd96_image_limits": (6, 3, 96, 0, 0.0, 7, [(3, 75)]),
    "hd256_window_two_prompts": (8, 2, 256, 60, 0.0, 0, [(0, 80), (30, 40)]),   # attn_prefill_wide
    "hd160_softcap_limits": (4, 2, 160, 0, 40.0, 5, [(2, 70)]),   # its second block sums 32 dims
}


def _prefill_case(ops, case: str, kv_dtype: str) -> tuple[tuple, np.ndarray]:
    """PREFILL_CASES[case] -> (paged_attention's arguments on the device, the reference's
    answer)."""
    nh, nkv, hd, window, cap, extra, prompts = PREFILL_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    bs, blocks, width = 16, 64, 12
    tables = np.full((len(prompts), width), -1, np.int32)
    perm = rng.permutation(blocks).astype(np.int32)
    used, positions, seq_ids = 0, [], []
    for b, (ctx, new) in enumerate(prompts):
        need = -(-(ctx + new + extra) // bs)
        tables[b, :need] = perm[used:used + need]
        used += need
        positions += list(range(ctx, ctx + new))
        seq_ids += [b] * new
    pos, sid = np.array(positions, np.int32), np.array(seq_ids, np.int32)
    limit = None if not extra else (pos + extra).astype(np.int32)
    T = len(pos)
    assert T > 64
    k_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    v_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    if kv_dtype == "bfloat16":
        kd, vd = ops.kv_zeros(k_cache.shape, R.KV_BF16), ops.kv_zeros(v_cache.shape, R.KV_BF16)
        kd.set(R.to_bf16_bits(k_cache))
        vd.set(R.to_bf16_bits(v_cache))
        k_cache, v_cache = R.from_bf16_bits(R.to_bf16_bits(k_cache)), R.from_bf16_bits(R.to_bf16_bits(v_cache))
    else:
        kd, vd = ops.upload(k_cache), ops.upload(v_cache)
    want = R.paged_attention(q, pos, sid, tables, k_cache, v_cache, hd ** -0.5, window, cap, limit)
    up = ops.upload
    args = (up(q), up(pos), up(sid), up(tables), kd, vd, hd ** -0.5, window, cap,
            None if limit is None else up(limit))
    return args, want


@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention_on_tensor_cores_matches_reference(ops, case: str, kv_dtype: str) -> None:
    """attn_prefill (more than 64 tokens, head_dim a multiple of 32 up to 256: above 128
    attn_prefill_wide, a head's output dims over two blocks) against the reference's
    paged_attention: several prompts in one step (a warp's 16 tokens then span two
    sequences), earlier context in the cache, sliding window and soft-capping, key limits
    past the position (an image's tokens), f32 and bf16 caches."""
    args, want = _prefill_case(ops, case, kv_dtype)
    assert nmse(ops.to_host(ops.paged_attention(*args)), want) <= 1e-9


@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [c for c, spec in PREFILL_CASES.items() if spec[2] <= 128])
def test_prefill_attention_blocks_of_one_warp_give_the_same_bits(ops, case: str, kv_dtype: str) -> None:
    """attn_prefill's blocks of 4 warps, a step's keys and values staged once a block,
    against blocks of one warp each staging its own (ELLM_CUDA_FA_WARPS=1, the device
    check's comparison): the same bits, prompts sharing a block or not."""
    args, _ = _prefill_case(ops, case, kv_dtype)
    shared = ops.to_host(ops.paged_attention(*args))
    assert ops.fa_warps == 4
    ops.fa_warps = 1
    try:
        alone = ops.to_host(ops.paged_attention(*args))
    finally:
        ops.fa_warps = 4
    assert np.array_equal(shared.view(np.uint32), alone.view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hd,window", [(64, 0), (64, 40), (256, 50)])
def test_prefill_attention_bits_do_not_depend_on_the_prompts_beside_it(ops, hd: int, window: int,
                                                                        kv_dtype: str) -> None:
    """A prompt's prefill attention alone and behind another prompt of 37 tokens (its rows
    then start mid-warp and mid-block, beside another sequence's): the same bits. Each
    block walks the keys in steps starting at multiples of FA_KEYS, so which rows share a
    block does not change how a row's keys are grouped (nor its running max and sums)."""
    nh, nkv, bs = 4, 2, 16
    rng = np.random.default_rng(hd + window)
    prompts = {"other": (0, 37), "ours": (9, 75)}   # (context, new tokens)
    blocks = 16
    k_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    v_cache = rng.standard_normal((blocks, bs, nkv, hd)).astype(np.float32)
    if kv_dtype == "bfloat16":
        kd, vd = ops.kv_zeros(k_cache.shape, R.KV_BF16), ops.kv_zeros(v_cache.shape, R.KV_BF16)
        kd.set(R.to_bf16_bits(k_cache))
        vd.set(R.to_bf16_bits(v_cache))
    else:
        kd, vd = ops.upload(k_cache), ops.upload(v_cache)
    q = {name: rng.standard_normal((new, nh, hd)).astype(np.float32) for name, (_, new) in prompts.items()}
    tables = np.full((2, 8), -1, np.int32)
    tables[0, :3] = [11, 4, 7]
    tables[1, :6] = [2, 9, 14, 0, 5, 12]

    def attend(names: list[str]) -> np.ndarray:
        pos = np.concatenate([np.arange(ctx, ctx + new) for ctx, new in (prompts[n] for n in names)]).astype(np.int32)
        sid = np.concatenate([np.full(prompts[n][1], i, np.int32) for i, n in enumerate(names)])
        tab = tables[[0 if n == "other" else 1 for n in names]]
        up = ops.upload
        got = ops.paged_attention(up(np.concatenate([q[n] for n in names])), up(pos), up(sid), up(tab), kd, vd,
                                  hd ** -0.5, window, 0.0, None)
        return ops.to_host(got)

    alone, behind = attend(["ours"]), attend(["other", "ours"])[prompts["other"][1]:]
    assert np.array_equal(alone.view(np.uint32), behind.view(np.uint32))


# -- the real models ---------------------------------------------------------------------------

PROMPT = "The capital of France is Paris. The largest planet of the solar system is"
# more than 64 tokens (SmolLM2: 134, Gemma 3: 135): the prefill path
LONG_PROMPT = " ".join(["The capital of France is Paris, the capital of Italy is Rome and the capital of "
                        "Spain is Madrid."] * 6) + " The largest planet of the solar system is"


MODEL_FIXTURES = {"smollm2-gguf": "smollm2_gguf", "gemma3-gguf": "gemma3_gguf",
                  "smollm2-bf16": "smollm2_hf_bf16", "gemma3-bf16": "gemma3_hf_bf16"}


@needs_gpu
@pytest.mark.parametrize("name", list(MODEL_FIXTURES))
def test_model_logits_and_greedy_match_cpu_f32(name: str, request: pytest.FixtureRequest) -> None:
    src = request.getfixturevalue(MODEL_FIXTURES[name])
    cpu = ellm.load(src, device="cpu", activations="f32", max_model_len=512)
    gpu = ellm.load(src, device="cuda", max_model_len=512, kv_cache_dtype="float32")
    try:
        ids = cpu.encode_prompt(PROMPT)
        want, got = cpu.logits(ids), gpu.logits(ids)
        # prompt of < 64 tokens: the f32 GEMV kernels, so close to the CPU's f32 arithmetic
        rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        assert rel <= 1e-3, rel
        p = SamplingParams(temperature=0.0, max_tokens=24)
        g_ids = gpu.generate([ids], p)[0].token_ids
        c_ids = cpu.generate([ids], p)[0].token_ids
        # compare up to the first step where the CPU's top-2 margin is small
        full = cpu.logits(ids + list(c_ids))[len(ids) - 1:]
        top2 = np.sort(full, axis=1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        small = np.flatnonzero(margins < 0.05)
        upto = int(small[0]) if small.size else len(c_ids)
        assert list(g_ids[:upto]) == list(c_ids[:upto]), (upto, g_ids, c_ids)
        # a prompt of more than 64 tokens takes the prefill path: products through cuBLAS
        # on bf16-rounded activations, attention on the tensor cores (attn_prefill; Gemma's
        # head_dim 256 on attn_prefill_wide). Every row within the bf16 products' error: on
        # the host stand-in at most 1.7% of a row's largest logit (SmolLM2 GGUF; Gemma 3's
        # 0.6%), every row's argmax the CPU's but at a near tie (one of Gemma's 135 rows,
        # whose top two differ by 0.002)
        ids = cpu.encode_prompt(LONG_PROMPT)
        assert len(ids) > 64
        want, got = cpu.logits(ids), gpu.logits(ids)
        rel_rows = np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)
        assert rel_rows.max() <= 4e-2, rel_rows.max()
        agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
        assert agree.mean() >= 0.95, np.flatnonzero(~agree)
        top2 = np.sort(want[-1])[-2:]
        assert agree[-1] or top2[1] - top2[0] < 0.5
        _bfloat16_cache_near_cpu_f32(cpu, src)
    finally:
        cpu.close(), gpu.close()


def _bfloat16_cache_near_cpu_f32(cpu: Any, src: Path) -> None:
    """cuda's default cache (bfloat16) against the CPU's f32 path: the short prompt's
    logits within 2% of its largest (the host stand-in: 0.57% on SmolLM2's GGUF, where
    the f32 cache gives 0.0016%), and greedy ids equal up to the first step whose CPU top-2
    margin is under twice the prompt's largest logit error (two logits that far apart
    cannot swap)."""
    gpu = ellm.load(src, device="cuda", max_model_len=512)
    try:
        assert gpu.engine.cfg.kv_cache_dtype == "bfloat16"
        ids = cpu.encode_prompt(PROMPT)
        want, got = cpu.logits(ids), gpu.logits(ids)
        err = float(np.max(np.abs(got - want)))
        assert err <= 2e-2 * float(np.max(np.abs(want))), err
        p = SamplingParams(temperature=0.0, max_tokens=24)
        g_ids, c_ids = gpu.generate([ids], p)[0].token_ids, cpu.generate([ids], p)[0].token_ids
        full = cpu.logits(ids + list(c_ids))[len(ids) - 1:]
        top2 = np.sort(full, axis=1)[:, -2:]
        small = np.flatnonzero(top2[:, 1] - top2[:, 0] < max(2 * err, 0.05))
        upto = int(small[0]) if small.size else len(c_ids)
        assert list(g_ids[:upto]) == list(c_ids[:upto]), (upto, g_ids, c_ids)
    finally:
        gpu.close()


@needs_gpu
def test_batched_equals_single_and_graphs_equal_eager(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, device="cuda", max_model_len=512)
    try:
        prompts = ["Once upon a time", "The three primary colours are", "def fibonacci(n):"]
        p = SamplingParams(temperature=0.0, max_tokens=20)
        together = [o.token_ids for o in llm.generate(prompts, p)]
        alone = [llm.generate(q, p).token_ids for q in prompts]
        assert together == alone
        executor = llm.engine.runner.executor   # ops/cuda_graphs.py GraphStep
        assert executor.stats["replays"] > 0 and executor.stats["fed"] > 0, executor.stats
        llm.engine.overlap = False   # each step's tokens read before the next is launched
        assert [o.token_ids for o in llm.generate(prompts, p)] == together
        llm.engine.overlap = True
        if executor.ops.dependent_launcher is not None:   # sm_90+: captured as dependent launches
            assert executor.stats["dependent_captures"] == executor.stats["captures"], executor.stats
        executor.use_graphs = False
        eager = [o.token_ids for o in llm.generate(prompts, p)]
        assert eager == together
        # seeded sampling on the device: the same draws in any batch
        ps = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11, max_tokens=12)
        executor.use_graphs = True
        a = llm.generate(prompts[0], ps).token_ids
        b = [o.token_ids for o in llm.generate(prompts, ps)][0]
        assert a == b
    finally:
        llm.close()


@needs_gpu
@pytest.mark.parametrize("family, per_layer, more", [("llama", 5, 3), ("granite", 7, 6), ("qwen3", 6, 3),
                                                     ("olmo2", 8, 3), ("gemma3_text", 8, 4)])
def test_a_decode_steps_kernels_are_counted(tiny_models_dir: Path, family: str, per_layer: int,
                                            more: int) -> None:
    """A captured decode step (ops/fused_stack.py). Llama: the embedding, five kernels a
    layer, the head and the greedy argmax (these models' heads are F32, which mmv.cu does
    not take: the argmax is a launch of its own; the q8_0 test below counts a head that
    takes it); the first layer's input norm goes into its q/k/v and the final norm into
    the head (no rmsnorm of their own). Granite: two more
    a layer (o and down as plain products, each then scaled into the residual by one
    norm_add) and, around the layers, the embedding's scale and the final norm, the
    head's logits scale beside them. Qwen3: one more a layer (q/k/v, then the q/k norms
    with RoPE and the KV write: qk_norm_rope_write). OLMo 2 (no input norms; q/k norms of
    the whole projection, post norms) and Gemma 3 (both, and the embedding's scale): eight
    a layer. The tokens are the CPU's (f32), and so are the logits of a one-token forward
    and of a prompt's last row within 1e-4."""
    gpu = ellm.load(tiny_models_dir / family, device="cuda", max_model_len=256, kv_cache_dtype="float32")
    cpu = ellm.load(tiny_models_dir / family, device="cpu", activations="f32", max_model_len=256)
    try:
        ids = np.random.default_rng(3).integers(3, 320, 11).tolist()
        p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        assert gpu.generate(ids, p).token_ids == cpu.generate(ids, p).token_ids
        graphs = gpu.engine.runner.executor.graphs
        layers = len(gpu.model.layers)
        assert graphs and {g.kernels for g in graphs.values()} == {per_layer * layers + more}, \
            {b: g.kernels for b, g in graphs.items()}
        for probe in ([ids[0]], ids):
            got, want = gpu.engine.logits(probe)[-1], cpu.engine.logits(probe)[-1]
            assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max())), len(probe)
    finally:
        gpu.close(), cpu.close()


@needs_gpu
def test_a_model_quantized_to_q8_0_at_load_runs_split_rows(tiny_models_dir: Path) -> None:
    """quantize="q8_0" on cuda: the matrices go up as split rows (rows_split), and the
    model gives the CPU's tokens (its own q8_0 weights, f32 activations) and its logits
    within 1e-4. Its captured decode step is the embedding, five kernels a layer and the
    head, which takes each row's greedy token in its own launch (mmv.cu)."""
    gpu = ellm.load(tiny_models_dir / "llama", device="cuda", quantize="q8_0", max_model_len=256,
                    kv_cache_dtype="float32")
    cpu = ellm.load(tiny_models_dir / "llama", device="cpu", quantize="q8_0", activations="f32", max_model_len=256)
    try:
        q = gpu.model.layers[0].attn.q
        assert q.qtype == GGMLType.Q8_0 and q.data.strides[0] % 16 == 0
        assert q.data.strides[0] - q.data.shape[1] == (-q.data.shape[1]) % 16
        ids = np.random.default_rng(8).integers(3, 320, 13).tolist()
        p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        assert gpu.generate(ids, p).token_ids == cpu.generate(ids, p).token_ids
        assert gpu.model.lm_head.qtype == GGMLType.Q8_0
        graphs = gpu.engine.runner.executor.graphs
        assert graphs and {g.kernels for g in graphs.values()} == {5 * len(gpu.model.layers) + 2}
        got, want = gpu.engine.logits(ids)[-1], cpu.engine.logits(ids)[-1]
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    finally:
        gpu.close(), cpu.close()


@needs_gpu
def test_a_mixture_of_experts_model_decodes_on_the_device(tiny_models_dir: Path) -> None:
    """Qwen3-MoE (a dense layer among MoE ones) quantized to q8_0 at load: its decode steps
    route and run the experts on the device (moe_route, moe.cu), so they are captured as
    graphs (a step that copied the routing back could not be), and give the CPU's tokens
    (its own q8_0 weights, f32 activations) and its logits within 1e-4. The layer stack
    takes the MoE layers: nine kernels each (q/k/v, the q/k norms with RoPE and the KV
    write, attention, o + residual, the router with the norm folded in, routing, gate/up
    reading each entry's token in place, down, the sum into the residual), six the dense
    one."""
    folder = tiny_models_dir / "qwen3_moe_mixed"
    gpu = ellm.load(folder, device="cuda", quantize="q8_0", max_model_len=256, kv_cache_dtype="float32")
    cpu = ellm.load(folder, device="cpu", quantize="q8_0", activations="f32", max_model_len=256)
    try:
        moe = gpu.model.layers[0].mlp
        assert moe.experts.gate[0].qtype == GGMLType.Q8_0
        ids = np.random.default_rng(9).integers(3, 320, 11).tolist()
        p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        assert gpu.generate(ids, p).token_ids == cpu.generate(ids, p).token_ids
        executor = gpu.engine.runner.executor
        assert executor.graphs and executor.stats["replays"] >= 8 and executor.use_graphs
        moe_layers = sum(hasattr(layer.mlp, "experts") for layer in gpu.model.layers)
        assert moe_layers == 3
        assert {g.kernels for g in executor.graphs.values()} == {9 * moe_layers + 6 + 2}
        assert gpu.model.ops._expert_tables(moe.experts) is not None
        got, want = gpu.engine.logits(ids)[-1], cpu.engine.logits(ids)[-1]
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
        # a 100-token prompt in chunks of 64: every product on mmv.cu (f32-like), so the
        # routing is the CPU's; with cuBLAS's bf16 inputs (chunks over 64 tokens) a random
        # router's near ties flip and the logits differ by percents (docs/gpu.md)
        gpu.engine.cfg.max_batch_tokens = 64
        long_ids = np.random.default_rng(10).integers(3, 320, 100).tolist()
        got, want = gpu.engine.logits(long_ids)[-1], cpu.engine.logits(long_ids)[-1]
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    finally:
        gpu.close(), cpu.close()


def _scripted(eng, script: dict[int, list], between: dict[int, object] | None = None) -> dict[str, tuple]:
    """Steps the engine, adding (id, prompt ids, params) at the step numbers of `script`
    and calling between[i](), if given, before step i -> per request (ids, text, reason)."""
    done: dict[str, tuple] = {}
    for i in range(300):
        for rid, ids, params in script.get(i, []):
            eng.add_request(ids, params, request_id=rid)
        if between and i in between:
            between[i]()
        if not eng.has_unfinished() and i > max(script):
            break
        for o in eng.step():
            assert o.request_id not in done, o.request_id
            if o.finished:
                done[o.request_id] = (o.token_ids, o.text, o.finish_reason)
    return done


@needs_gpu
def test_overlapped_decode_feeds_each_steps_ids_to_the_next(tiny_models_dir: Path) -> None:
    """On cuda the engine launches decode step N+1 before it reads step N's tokens, N+1's
    token ids copied from N's on the device (GraphStep.launch_decode: the graph's argmax,
    or sample_rows after the replay for a seeded sampled row): the same tokens, text and
    finish reasons as one step at a time and as eager steps, with a stop token mid-run, a
    late arrival, and a one-token engine.logits() between two steps (which replays the
    batch-1 graph: the engine then reads before it launches again)."""
    llm = ellm.load(tiny_models_dir / "llama", device="cuda", max_model_len=256)
    try:
        eng, executor = llm.engine, llm.engine.runner.executor
        assert eng.overlap and executor.overlaps
        rng = np.random.default_rng(4)
        prompts = [rng.integers(3, 320, n).tolist() for n in (7, 19, 4)]
        free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        eng.overlap = False
        first = _scripted(eng, {0: [("probe", prompts[1], free)]})["probe"][0]
        stop = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[first[9]])
        seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
        # penalised rows run ahead too: the device counts the token it has not handed back
        # yet. Token 7, pushed up by 3, comes while its count is under 3: the fourth time
        # is decided by whether the step before's 7 was counted
        penalised = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=1.0,
                                   logit_bias={7: 3.0})
        script = {0: [("a", prompts[0], free), ("b", prompts[1], stop), ("s", prompts[2], seeded),
                      ("p", prompts[0], penalised)],
                  5: [("c", prompts[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]}
        poke = {3: lambda: eng.logits([5]), 25: lambda: eng.logits([9])}   # at 25 "a" runs alone
        plain = _scripted(eng, script, poke)
        assert plain["b"][2] == "stop" and len(plain["b"][0]) <= 10
        assert plain["p"][0][:3] == [7, 7, 7] and plain["p"][0][3] != 7, plain["p"]
        eng.overlap = True
        fed, padded = executor.stats["fed"], eng.stats["padding_rows"]
        ahead = _scripted(eng, script, poke)
        assert ahead == plain
        assert executor.stats["fed"] - fed > 20, executor.stats
        assert eng.stats["padding_rows"] > padded   # "b" stopped while the others ran on
        executor.use_graphs = False   # launch_decode declines: the plain path, eager steps
        assert _scripted(eng, script, poke) == plain
        eng.blocks.clear_prefix_cache()
        assert eng.blocks.num_used() == 0 and not eng.has_unfinished()
    finally:
        llm.close()


def _with_logprobs(eng, requests: list[tuple]) -> dict[str, tuple]:
    """Runs the requests (id, prompt ids, params) to the end -> per request its ids and,
    per token, (id, logprob, top logprobs)."""
    for rid, ids, params in requests:
        eng.add_request(ids, params, request_id=rid)
    got: dict[str, tuple] = {rid: ([], []) for rid, _, _ in requests}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend((t.token_id, t.logprob, t.top) for t in o.new_logprobs)
    return got


@needs_gpu
def test_logprob_requests_run_ahead_with_the_logprobs_of_the_plain_loop(tiny_models_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows asking for logprobs are sampled on the device, their logprobs taken there
    (logprob_rows), so they run ahead like the others: the same tokens and logprobs, bit
    for bit, as one step at a time, with no launch waiting for the step before it; a
    penalised seeded request and a plain one beside them; the greedy request's tokens and
    logprobs against the CPU's host sampler."""
    gpu = ellm.load(tiny_models_dir / "llama", device="cuda", max_model_len=256, kv_cache_dtype="float32")
    cpu = ellm.load(tiny_models_dir / "llama", device="cpu", activations="f32", max_model_len=256)
    try:
        eng, executor = gpu.engine, gpu.engine.runner.executor
        assert eng.runner.logprobs_ahead and not cpu.engine.runner.logprobs_ahead
        rng = np.random.default_rng(8)
        prompts = [rng.integers(3, 320, n).tolist() for n in (9, 5, 14)]
        params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True, logprobs=0,
                                 frequency_penalty=0.5, logit_bias={7: 1.0}),
                  SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)]
        requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        eng.overlap = False
        plain = _with_logprobs(eng, requests)
        eng.overlap = True
        fed, steps = executor.stats["fed"], eng.stats["overlapped_steps"]
        # a launch never waits for the step launched before it (such a step's uploads,
        # copied after its replay, are not taken again until it has been read)
        import cupy
        waits: list[bool] = []
        launching = [False]
        sync, launch = cupy.cuda.Event.synchronize, executor.launch_decode

        def watched_sync(event) -> None:
            if launching[0]:
                waits.append(bool(event.done))
            sync(event)

        def watched_launch(*args, **kwargs):
            launching[0] = True
            try:
                return launch(*args, **kwargs)
            finally:
                launching[0] = False
        monkeypatch.setattr(cupy.cuda.Event, "synchronize", watched_sync)
        monkeypatch.setattr(executor, "launch_decode", watched_launch)
        ahead = _with_logprobs(eng, requests)
        assert ahead == plain
        assert executor.stats["fed"] - fed > 8 and eng.stats["overlapped_steps"] - steps > 8
        assert waits and all(waits), waits
        assert [len(plain[r][1]) for r in ("r0", "r1", "r2")] == [14, 14, 0]
        assert all(len(top) == 3 for _, _, top in plain["r0"][1]) and all(top == [] for _, _, top in plain["r1"][1])
        want = _with_logprobs(cpu.engine, requests[:1])["r0"]
        assert plain["r0"][0] == want[0]
        for (t, lp, top), (wt, wlp, wtop) in zip(plain["r0"][1], want[1]):
            assert t == wt and abs(lp - wlp) <= 1e-3 and [i for i, _ in top] == [i for i, _ in wtop]
    finally:
        gpu.close(), cpu.close()


@needs_gpu
def test_grammar_requests_are_masked_and_sampled_on_the_device(tiny_models_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A constrained request's mask goes up to the device and its row is sampled there: no
    row of logits comes back, and its tokens and logprobs are those the host's sampler
    takes from the same logits (the backend then told to decline masked rows), beside an
    unconstrained request; the text keeps to the grammar."""
    import re
    llm = ellm.load(tiny_models_dir / "llama", device="cuda", max_model_len=256)
    try:
        eng = llm.engine
        copies: list[tuple] = []
        to_host = eng.runner.to_host
        monkeypatch.setattr(eng.runner, "to_host", lambda x: copies.append(tuple(x.shape)) or to_host(x))
        regex = r"[a-e]{3}( [a-e]{2,4}){2}"
        requests = [("g", [5, 9, 14], SamplingParams(temperature=0.0, max_tokens=14, regex=regex, logprobs=2)),
                    ("s", [7, 3], SamplingParams(temperature=0.8, seed=2, max_tokens=6, regex=regex)),
                    ("f", [8, 8, 1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
        dev = _with_logprobs(eng, requests)
        assert copies == []
        for rid in ("g", "s"):
            text = llm.tokenizer.decode(dev[rid][0], skip_special_tokens=True)
            assert re.fullmatch(r"[a-e ]*", text) and text[:3].isalpha(), (rid, text)
        ops = eng.runner.ops
        device_sample = type(ops).sample
        monkeypatch.setattr(type(ops), "sample",
                            lambda self, logits, samplers, masks=None, rows=None:
                            None if masks is not None else device_sample(self, logits, samplers, rows=rows))
        host = _with_logprobs(eng, requests[::2])
        assert copies   # the host's sampler had the rows copied back
        assert host["g"][0] == dev["g"][0] and host["f"] == dev["f"]
        for (t, lp, top), (ht, hlp, htop) in zip(dev["g"][1], host["g"][1]):
            assert t == ht and abs(lp - hlp) <= 1e-5 and [i for i, _ in top] == [i for i, _ in htop]
    finally:
        llm.close()


@needs_gpu
def test_speculative_guesses_are_checked_on_the_device(tiny_models_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With n-gram guesses the rows of a step are sampled on the device, as without
    guesses: greedy rows (logprobs or not) all at once, and beside a seeded sampled
    request with penalties, in rounds (row i of each sequence still checking, after the
    tokens kept before it), so the seeded request draws from the device's generator once
    per output token and counts the kept tokens. Only ids and logprob records come back,
    no row of logits, and every request's tokens and logprobs are those of decoding
    without guesses. With the device declining, the host's sampler takes the rows."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "adaptive": False}
    base = ellm.load(tiny_models_dir / "llama", device="cuda", max_model_len=256)
    spec = ellm.load(tiny_models_dir / "llama", device="cuda", max_model_len=256, speculative_config=ngram)
    try:
        eng = spec.engine
        copies: list[tuple] = []
        to_host = eng.runner.to_host
        monkeypatch.setattr(eng.runner, "to_host", lambda x: copies.append(tuple(x.shape)) or to_host(x))
        loop = [5, 9, 14, 22, 31] * 4
        greedy = [("g", loop, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
                  ("l", loop[3:] + [7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2))]
        sampled = [("s", loop[1:], SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)),
                   ("p", loop[2:], SamplingParams(temperature=0.7, seed=9, max_tokens=24, ignore_eos=True,
                                                  frequency_penalty=0.8, logprobs=1))]
        for requests in (greedy, greedy[:1] + sampled):
            checks, accepted = eng.stats["spec_checks"], eng.stats["spec_accepted_tokens"]
            want = _with_logprobs(base.engine, requests)
            assert _with_logprobs(eng, requests) == want
            assert eng.stats["spec_checks"] > checks and eng.stats["spec_accepted_tokens"] > accepted, eng.stats
        assert copies == []
        ops = eng.runner.ops
        monkeypatch.setattr(type(ops), "sample", lambda self, logits, samplers, masks=None, rows=None: None)
        host = _with_logprobs(eng, greedy)
        assert copies   # the host's sampler had the rows copied back
        assert host["g"] == want["g"]
        for (t, lp, top), (wt, wlp, wtop) in zip(host["l"][1], _with_logprobs(base.engine, greedy)["l"][1]):
            assert t == wt and abs(lp - wlp) <= 1e-5 and [i for i, _ in top] == [i for i, _ in wtop]
    finally:
        base.close(), spec.close()


@needs_gpu
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_trace_recording_on_the_gpu_matches_the_cpu(smollm2_gguf: Path, kv: str) -> None:
    """`ellm trace` on device="cuda": the recorder copies each op's rows back, reads k
    after RoPE from the device cache (widened from bfloat16), and the logit lens runs the
    head there; every recorded op against the CPU f32 pass's, and the lens's top token."""
    from ellm.trace.capture import record
    cpu = ellm.load(smollm2_gguf, device="cpu", activations="f32", max_model_len=256)
    gpu = ellm.load(smollm2_gguf, device="cuda", max_model_len=256, kv_cache_dtype=kv)
    try:
        ids = cpu.encode_prompt("Paris is the capital of")[:4]
        want = record(cpu, ids, lens_top_k=3)
        if kv == "float32":   # one token: a decode-shaped pass, which must still run eagerly
            assert set(record(gpu, [ids[0]]).arrays) == set(record(cpu, [ids[0]]).arrays)
        got = record(gpu, ids, lens_top_k=3)
        assert set(got.arrays) == set(want.arrays)
        tol = 1e-4 if kv == "float32" else 3e-2   # bf16 rounds each stored key and value
        for key, a in want.arrays.items():
            b = got.arrays[key]
            assert b.shape == a.shape, key
            err = float(np.max(np.abs(b - a)) / max(float(np.max(np.abs(a))), 1e-30))
            assert err <= tol, (key, err)
        assert np.array_equal(got.lens["ids"][-1, :, 0], want.lens["ids"][-1, :, 0])
    finally:
        cpu.close(), gpu.close()


# -- the device sampler ------------------------------------------------------------------------

@needs_gpu
def test_device_greedy_with_penalties_and_bias_is_argmax_of_host_processing(ops) -> None:
    rng = np.random.default_rng(5)
    V = 5000
    for params in (SamplingParams(temperature=0.0),
                   SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 5.0, 9: -3.0}),
                   SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4)):
        s = SequenceSampler(params, rng.integers(0, V, 30).tolist(), V)
        for t in rng.integers(0, V, 12).tolist():
            s.append(t)
        row = rng.standard_normal(V).astype(np.float32) * 3
        want = int(np.argmax(s.process(row)))
        got = ops.sample(ops.upload(row[None, :].copy()), [s])[0].token_id
        assert got == want


@needs_gpu
def test_device_penalties_count_the_pending_token_as_the_host_would(ops) -> None:
    """A step launched ahead samples before the host has appended the step before's token:
    sample_ids(pending=...) counts it on the device. The pending token is new, in the
    prompt only, or already generated; repetition, frequency and presence penalties; all
    rows in one launch. Each row's runner-up sits halfway between the token's penalised
    value counted and not counted (the host's own numbers), so only counting it as the
    host does picks the same token."""
    rng = np.random.default_rng(6)
    V = 3000
    devs, rows, pend, want = [], [], [], []
    for params in (SamplingParams(temperature=0.0, repetition_penalty=1.3),
                   SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
                   SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5,
                                  presence_penalty=0.3, logit_bias={11: 2.0})):
        for where in ("new", "prompt", "output"):
            prompt, outs = rng.integers(0, V - 2, 20).tolist(), rng.integers(0, V - 2, 6).tolist()
            token, runner_up = {"new": V - 2, "prompt": prompt[3], "output": outs[2]}[where], V - 1
            if where == "prompt":
                outs = [t for t in outs if t != token]
            dev, host = SequenceSampler(params, prompt, V), SequenceSampler(params, prompt, V)
            for t in outs:
                dev.append(t)
                host.append(t)
            row = rng.uniform(-4.0, -3.0, V).astype(np.float32)   # below both, whatever a penalty does
            row[token] = 3.0
            uncounted = float(dev.process(row.copy())[token])
            host.append(token)
            counted = float(host.process(row.copy())[token])
            if counted == uncounted:   # repetition alone, the token already seen: nothing to tell
                continue
            row[runner_up] = (counted + uncounted) / 2
            assert int(np.argmax(host.process(row.copy()))) == runner_up
            assert int(np.argmax(dev.process(row.copy()))) == token
            devs.append(dev)
            rows.append(row)
            pend.append(token)
            want.append(runner_up)
    assert len(want) == 7   # all but repetition alone on a token already seen (prompt, output)
    got = ops.sample_ids(ops.upload(np.stack(rows)), devs, pending=ops.upload(np.array(pend, np.int32)))
    assert got.get().tolist() == want
    # without `pending` the device uses the samplers' own counts
    assert ops.sample_ids(ops.upload(np.stack(rows)), devs).get().tolist() == pend


def _first_argmax(x: np.ndarray) -> int:
    """numpy's first index of the maximum, -inf and NaN never chosen (none left: 0)."""
    ok = np.flatnonzero(x > -np.inf)
    return int(ok[np.argmax(x[ok])]) if ok.size else 0


@needs_gpu
def test_greedy_argmax_on_many_blocks_matches_the_one_block_sampler(ops) -> None:
    """argmax_rows (plain greedy rows, a row cut into chunks of 2,048) against numpy and
    against sample_rows' greedy branch (a logit_bias of 0 sends rows there): ties across
    chunks go to the first index, rows of -inf or NaN give 0, lengths around a chunk."""
    rng = np.random.default_rng(9)
    for V in (1, 5, 2047, 2048, 2049, 49159):
        x = rng.standard_normal((6, V)).astype(np.float32)
        x[1] = -np.inf
        x[2, V // 3] = x[2, V - 1] = 9.0
        x[3, ::2] = np.nan
        x[4] = np.nan
        x[5, :V // 2] = -np.inf
        want = [_first_argmax(row) for row in x]
        got = ops.to_host(ops.argmax_rows(ops.upload(x))).tolist()
        assert got == want, (V, got, want)
        samplers = [SequenceSampler(SamplingParams(temperature=0.0, logit_bias={0: 0.0}), [], V)
                    for _ in range(len(x))]
        assert not any(s.plain_greedy for s in samplers)
        one_block = [r.token_id for r in ops.sample(ops.upload(x), samplers)]
        assert one_block == want, (V, one_block, want)
        plain = [SequenceSampler(SamplingParams(temperature=0.0), [], V) for _ in range(len(x))]
        assert [r.token_id for r in ops.sample(ops.upload(x), plain)] == want


def _want_logprobs(row: np.ndarray, k: int) -> tuple[float, list[tuple[int, float]]]:
    """numpy's log-sum-exp (float64) of a raw row and its k best (id, logprob): larger
    value first, lower index among equal values, NaN never."""
    x = row.astype(np.float64)
    mx = float(np.max(x))
    lse = mx + float(np.log(np.sum(np.exp(x - mx))))
    ok = np.flatnonzero(~np.isnan(row))
    order = ok[np.lexsort((ok, -row[ok]))][:k]
    return lse, [(int(i), float(row[i]) - lse) for i in order]


@needs_gpu
def test_device_logprobs_are_the_host_samplers(ops) -> None:
    """Rows asking for logprobs are sampled on the device and only their records come back
    (logprob_rows: log-sum-exp, the chosen token's raw logit, the n best): against the
    host's SequenceSampler on the same rows (greedy: the same token, logprob and top ids),
    and against numpy for every row: seeded draws, logit_bias and penalties (the row is
    copied before sample_rows changes it: the logprobs are of the raw logits), 0..20 top
    logprobs, rows without logprobs beside them, vocabularies around a chunk of 2,048,
    equal values across chunks, a row mostly -inf; a NaN row or one with +inf gets the
    host's error in its place, its neighbours unharmed. At 210,001 entries a row of 20
    logprobs has more chunks' keys (103 x 20) than the last block keeps in registers
    (sample.cu LOGPROB_HELD: 2,048), which it reads in each round instead."""
    from ellm.engine.sampler import SampleResult
    rng = np.random.default_rng(12)
    for V in (5, 2048, 2049, 49159, 210001):
        x = (rng.standard_normal((9, V)) * 3).astype(np.float32)
        x[2, V // 3] = x[2, V - 1] = x[2].max() + 1.0   # ties across chunks: the lower index first
        x[5, 3:] = -np.inf                              # fewer finite entries than asked
        x[7, V // 2] = np.nan
        x[8, 0] = np.inf
        params = [SamplingParams(temperature=0.0, logprobs=5),
                  SamplingParams(temperature=0.0),                                  # no logprobs
                  SamplingParams(temperature=0.0, logprobs=20),
                  SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=3),
                  SamplingParams(temperature=0.0, logprobs=4, logit_bias={1: 50.0},
                                 repetition_penalty=1.5, frequency_penalty=0.5),
                  SamplingParams(temperature=0.0, logprobs=6),
                  SamplingParams(temperature=0.0, logprobs=0),
                  SamplingParams(temperature=0.0, logprobs=2),
                  SamplingParams(temperature=0.0, logprobs=1)]
        prompt = [0, 1, 2, min(3, V - 1)]
        samplers = [SequenceSampler(p, prompt, V) for p in params]
        hosts = [SequenceSampler(p, prompt, V) for p in params]
        for s in (*samplers, *hosts):
            s.append(1)
        got = ops.sample(ops.upload(x), samplers)
        for b, (p, r) in enumerate(zip(params, got)):
            if b in (7, 8):
                assert isinstance(r, ValueError) and "no finite maximum" in str(r), (V, b, r)
                with pytest.raises(ValueError, match="no finite maximum"):
                    hosts[b].sample(x[b].copy())
                continue
            assert isinstance(r, SampleResult), (V, b, r)
            if p.logprobs is None:
                assert math.isnan(r.logprob) and r.top_logprobs is None
                assert r.token_id == _first_argmax(x[b])
                continue
            lse, top = _want_logprobs(x[b], p.logprobs)
            assert abs(r.logprob - (float(x[b, r.token_id]) - lse)) <= 1e-5, (V, b)
            assert [i for i, _ in r.top_logprobs] == [i for i, _ in top], (V, b, r.top_logprobs[:3], top[:3])
            assert np.allclose([v for _, v in r.top_logprobs], [v for _, v in top], atol=1e-5), (V, b)
            if p.temperature == 0.0:   # the host's choice, logprob and top ids
                want = hosts[b].sample(x[b].copy())
                assert r.token_id == want.token_id, (V, b)
                assert abs(r.logprob - want.logprob) <= 1e-5, (V, b)
                if b != 5:   # (a row mostly -inf: the host's order among -inf entries is its own)
                    assert [i for i, _ in r.top_logprobs] == [i for i, _ in want.top_logprobs], (V, b)
        if V > 5:
            assert got[4].token_id == 1   # the bias chose it; its logprob is its raw one's
            assert got[2].top_logprobs[0][0] == V // 3
        assert len(got[5].top_logprobs) == min(6, V) and got[6].top_logprobs == []
        # every row asking (no indices go up, the ids come back in the records), one of them
        # changed by bias and penalties (the whole batch copied first)
        every = [0, 2, 4, 5]
        again = [SequenceSampler(params[b], prompt, V) for b in every]
        for s in again:
            s.append(1)
        assert ops.sample(ops.upload(x[every]), again) == [got[b] for b in every]


def _bitmask(allowed: np.ndarray, words: int | None = None) -> np.ndarray:
    """A grammar mask row (int32 words, token i at bit i % 32 of word i // 32) allowing the
    True entries of `allowed`; `words` cuts or pads it."""
    n = words if words is not None else -(-len(allowed) // 32)
    bits = np.zeros(n * 32, bool)
    m = min(len(allowed), n * 32)
    bits[:m] = allowed[:m]
    return np.packbits(bits.reshape(-1, 8), axis=1, bitorder="little").reshape(-1).view("<u4").astype(np.int32)


@needs_gpu
def test_device_sampling_applies_grammar_masks_as_the_host_does(ops) -> None:
    """Grammar masks go up as bits and sample_rows applies them first, as the host's
    sampler does: greedy rows (also with bias and penalties, also with logprobs, which are
    the raw row's) choose the host's token; seeded draws only ever allowed tokens; a mask
    shorter than the vocabulary forbids the rest; a mask allowing nothing below the
    vocabulary is the host's NoAllowedTokenError in that row's place; rows without a mask
    beside them are untouched."""
    from ellm.engine.sampler import NoAllowedTokenError, SampleResult
    rng = np.random.default_rng(21)
    for V in (2049, 49159):
        x = (rng.standard_normal((7, V)) * 3).astype(np.float32)
        allowed = rng.random((7, V)) < 0.1
        favourite = int(np.flatnonzero(allowed[1])[0])
        params = [SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.0, logit_bias={favourite: 30.0, 0: 50.0}, repetition_penalty=1.4),
                  SamplingParams(temperature=0.0, logprobs=3),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.0, seed=4)]
        masks: list[np.ndarray | None] = [_bitmask(a) for a in allowed]
        nothing = np.zeros(V, bool)
        masks[3] = _bitmask(nothing)
        if V % 32:
            masks[3][-1] = np.int32(-1 << (V % 32))   # bits only past the vocabulary
        masks[4] = _bitmask(allowed[4], words=V // 32 - 3)   # the last tokens past the mask: forbidden
        masks[5] = None
        samplers = [SequenceSampler(p, [1, 2, 3], V) for p in params]
        hosts = [SequenceSampler(p, [1, 2, 3], V) for p in params]
        got = ops.sample(ops.upload(x), samplers, masks)
        for b in range(7):
            if b == 3:
                assert isinstance(got[b], NoAllowedTokenError), got[b]
                with pytest.raises(NoAllowedTokenError):
                    hosts[b].sample(x[b].copy(), masks[b])
                continue
            assert isinstance(got[b], SampleResult), (V, b, got[b])
            if b == 6:
                assert allowed[6][got[b].token_id]
                continue
            want = hosts[b].sample(x[b].copy(), masks[b])
            assert got[b].token_id == want.token_id, (V, b)
            if b == 2:
                assert abs(got[b].logprob - want.logprob) <= 1e-5
                assert [i for i, _ in got[b].top_logprobs] == [i for i, _ in want.top_logprobs]
        assert got[1].token_id == favourite and got[5].token_id == _first_argmax(x[5])
        assert got[4].token_id < (V // 32 - 3) * 32
        # seeded draws among 3 allowed tokens of very different weights: never another
        few = np.zeros(V, bool)
        few[[5, V // 2, V - 1]] = True
        row = x[0].copy()
        row[[5, V // 2, V - 1]] = [4.0, -6.0, 0.0]
        n = 64
        draws = ops.sample(ops.upload(np.tile(row, (n, 1))),
                           [SequenceSampler(SamplingParams(temperature=1.0, seed=9), [], V, sibling=i)
                            for i in range(n)], [_bitmask(few)] * n)
        toks = {r.token_id for r in draws}
        assert toks <= {5, V // 2, V - 1} and 5 in toks, toks


@needs_gpu
def test_logprobs_and_masks_go_to_the_host_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """ELLM_CUDA_LOGPROBS=0 (read when the backend is made): a batch with a row asking for
    logprobs or under a grammar is left to the host's sampler (sample() says None) and such
    rows do not run ahead; other batches are still sampled on the device."""
    from types import SimpleNamespace

    from ellm.ops.cuda import CudaOps
    from ellm.ops.cuda_graphs import GraphStep
    monkeypatch.setenv("ELLM_CUDA_LOGPROBS", "0")
    off = CudaOps()
    V = 300
    x = off.upload(np.random.default_rng(2).standard_normal((2, V)).astype(np.float32))
    greedy = [SequenceSampler(SamplingParams(temperature=0.0), [], V) for _ in range(2)]
    asks = SequenceSampler(SamplingParams(temperature=0.0, logprobs=2), [], V)
    assert off.sample(x, [asks, greedy[0]]) is None
    assert off.sample(x, greedy, [_bitmask(np.ones(V, bool)), None]) is None
    assert [r.token_id for r in off.sample(x, greedy)] == [_first_argmax(row) for row in off.to_host(x)]
    assert not GraphStep.returns_logprobs.fget(SimpleNamespace(ops=off))
    monkeypatch.delenv("ELLM_CUDA_LOGPROBS")
    assert GraphStep.returns_logprobs.fget(SimpleNamespace(ops=CudaOps()))


@needs_gpu
def test_device_sampling_distribution_and_filters(ops) -> None:
    """Frequencies of many seeded draws against the softmax the filters leave."""
    V, n = 40, 4000
    logits = np.linspace(-2.0, 2.0, V).astype(np.float32)[::-1].copy()   # token 0 most likely
    for params, keep in ((SamplingParams(temperature=0.7, seed=1), V),
                         (SamplingParams(temperature=1.0, top_k=5, seed=2), 5),
                         (SamplingParams(temperature=1.0, top_p=0.5, seed=3), None),
                         (SamplingParams(temperature=1.0, min_p=0.3, seed=4), None)):
        samplers = [SequenceSampler(params, [], V, sibling=i) for i in range(n)]
        rows = ops.upload(np.tile(logits, (n, 1)))
        toks = np.array([r.token_id for r in ops.sample(rows, samplers)])
        p = np.exp((logits - logits.max()) / params.temperature)
        p /= p.sum()
        if keep is None and params.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        if keep is None:
            keep = int(np.count_nonzero(p >= params.min_p * p.max()))
        assert toks.max() < keep, (params, toks.max(), keep)
        q = p[:keep] / p[:keep].sum()
        freq = np.bincount(toks, minlength=keep)[:keep] / n
        assert np.max(np.abs(freq - q)) < 0.03, (params, freq, q)


def _kept_by_filters(row: np.ndarray, params: SamplingParams) -> set[int]:
    """The tokens min_p, top_k and top_p keep (in that order) at temperature 1, in float64:
    the k-th largest value and all equal to it; the fewest largest values whose
    probabilities reach top_p of what is left, and all equal to the last."""
    x = row.astype(np.float64)
    keep = x >= x.max() + math.log(params.min_p) if params.min_p > 0 else np.ones(len(x), bool)
    if 0 < params.top_k <= keep.sum():
        keep &= x >= np.sort(x[keep])[::-1][params.top_k - 1]
    if params.top_p < 1.0:
        vals = np.sort(x[keep])[::-1]
        cum = np.cumsum(np.exp(vals - x.max()))
        keep &= x >= vals[int(np.searchsorted(cum, params.top_p * cum[-1]))]
    return set(np.flatnonzero(keep).tolist())


@needs_gpu
def test_device_top_k_and_top_p_keep_what_their_rules_keep(ops) -> None:
    """The thresholds of top_k, top_p and min_p on a row of 3,000 (sample.cu: a radix
    selection over the entries' order keys, 8 bits a pass): the tokens drawn by 400 seeded
    rows are exactly those the rules keep (_kept_by_filters), among twelve near-equal
    largest values, some of them equal."""
    V, n = 3000, 400
    rng = np.random.default_rng(12)
    row = rng.standard_normal(V).astype(np.float32)
    row[rng.choice(V, 12, replace=False)] = 5.0 + np.round(rng.uniform(0.0, 0.3, 12), 1).astype(np.float32)
    for kw in ({"top_k": 6}, {"top_k": 7}, {"top_p": 0.1}, {"top_p": 0.05}, {"top_k": 9, "top_p": 0.5},
               {"min_p": 0.9, "top_p": 0.6}):
        params = SamplingParams(temperature=1.0, seed=21, **kw)
        samplers = [SequenceSampler(params, [], V, sibling=i) for i in range(n)]
        drawn = {r.token_id for r in ops.sample(ops.upload(np.tile(row, (n, 1))), samplers)}
        kept = _kept_by_filters(row, params)
        assert 1 < len(kept) < 12 and drawn == kept, (kw, sorted(drawn), sorted(kept))


@needs_gpu
def test_the_draw_walks_a_long_segment_in_rounds(ops) -> None:
    """A row of 300,001 entries: a segment of the draw (one of 32) is 293 chunks of 32
    entries, which sample.cu's walk scans in rounds of 256. Four tokens hold all the
    weight (1 : 2 : 1 : 4), three of them in one segment's first and second round, the
    fourth in another segment: 64 seeded draws take only those, each of them, and the
    heaviest most."""
    V, n, seg = 300001, 64, 9376
    a, b, c, d = 5 * seg + 32 * 3 + 5, 5 * seg + 32 * 270 + 17, 5 * seg + 32 * 292 + 31, 20 * seg + 100
    row = np.full(V, -np.inf, np.float32)
    row[[a, b, c, d]] = np.log(np.array([1.0, 2.0, 1.0, 4.0], np.float32))
    samplers = [SequenceSampler(SamplingParams(temperature=1.0, seed=5), [], V, sibling=i) for i in range(n)]
    drawn = [r.token_id for r in ops.sample(ops.upload(np.tile(row, (n, 1))), samplers)]
    counts = {t: drawn.count(t) for t in (a, b, c, d)}
    assert sum(counts.values()) == n and min(counts.values()) > 0, counts
    assert counts[d] == max(counts.values()), counts


@needs_gpu
def test_device_sampling_is_reproducible_per_seed(ops) -> None:
    V = 1000
    row = np.random.default_rng(0).standard_normal(V).astype(np.float32)
    draws = []
    for _ in range(2):
        s = SequenceSampler(SamplingParams(temperature=1.0, seed=42), [], V)
        draws.append([ops.sample(ops.upload(row[None, :].copy()), [s])[0].token_id for _ in range(10)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


@needs_gpu
def test_kernels_that_do_not_compile_fail_the_load_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel files are compiled when the backend is made (not at the first request):
    a compiler that fails (here, on a broken source) gives CudaUnavailableError naming
    the file, NVRTC and what to install."""
    from ellm.ops import cuda, cuda_kernels
    monkeypatch.setattr(cuda_kernels, "kernel_source", lambda name: "this is not CUDA C++")
    with pytest.raises(cuda.CudaUnavailableError) as info:
        cuda.CudaOps()
    msg = str(info.value)
    assert "linear.cu" in msg and "NVRTC" in msg and "ellm-engine[gpu]" in msg and "device='cpu'" in msg, msg


@needs_gpu
def test_a_cache_layer_past_the_gpus_memory_is_a_clear_error(ops) -> None:
    from ellm.ops.memory import DeviceMemoryError
    with pytest.raises(DeviceMemoryError, match="KV cache does not fit") as info:
        ops.kv_zeros((1 << 23, 16, 8, 128), np.float32)   # 512 GiB
    assert "kv_cache_tokens" in str(info.value) and "512.00 GiB" in str(info.value)


@needs_gpu
def test_a_gpu_too_small_for_the_weights_or_the_cache_says_so(tiny_models_dir: Path) -> None:
    """With CuPy's pool capped (what a process sharing its GPU does): weights that do not
    fit, and a KV cache that does not, fail at load with DeviceMemoryError naming sizes and
    what to change; a default cache that fits only in part is cut to what fits."""
    import gc

    import cupy

    from ellm.engine.runner import KV_HEADROOM
    from ellm.ops.memory import DeviceMemoryError
    folder = tiny_models_dir / "llama"
    pool = cupy.get_default_memory_pool()
    before = pool.get_limit()

    def cap(extra: int) -> None:
        gc.collect()
        pool.set_limit(size=pool.used_bytes() + extra)
    try:
        llm = ellm.load(folder, device="cuda", max_model_len=256, kv_cache_tokens=1024, progress=False)
        weights, per_token = llm.model.ops.weight_bytes, llm.engine.kv.bytes_per_token
        llm.close()
        del llm
        assert weights > 0 and per_token > 0
        cap(weights // 2)
        with pytest.raises(DeviceMemoryError, match="weights do not fit") as info:
            ellm.load(folder, device="cuda", max_model_len=256, progress=False)
        assert "quantize=" in str(info.value) and "device='cpu'" in str(info.value)
        cap(weights + KV_HEADROOM + 4096 * per_token + per_token)
        llm = ellm.load(folder, device="cuda", max_model_len=256, progress=False)
        tokens = llm.engine.kv.num_blocks[0] * llm.engine.kv.block_size
        assert 256 <= tokens <= 4096 + 1, tokens    # the default 16,384, cut to what fits
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        llm.close()
        del llm
        cap(weights + KV_HEADROOM + 64 * per_token)
        with pytest.raises(DeviceMemoryError, match="max_model_len=256"):
            ellm.load(folder, device="cuda", max_model_len=256, progress=False)
        with pytest.raises(DeviceMemoryError, match="kv_cache_tokens=1024"):
            ellm.load(folder, device="cuda", max_model_len=32, kv_cache_tokens=1024, progress=False)
    finally:
        pool.set_limit(size=before)


# -- host-side parts of the CUDA backend (no GPU needed) ----------------------------------------

def test_graph_buckets_and_decode_shape() -> None:
    from ellm.ops.cuda_graphs import bucket_for, is_decode_step
    assert [bucket_for(n) for n in (1, 2, 3, 5, 16, 17, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, None]
    tables = {0: np.array([[3, 4], [5, -1], [6, -1]], np.int32)}
    decode = Batch(np.array([7, 8, 9], np.int32), np.array([20, 3, 9], np.int32),
                   np.arange(3, dtype=np.int32), tables, np.arange(3, dtype=np.int32))
    assert is_decode_step(decode)
    prefill = Batch.single(np.array([1, 2, 3], np.int32), 0, {0: tables[0][:1]})
    assert not is_decode_step(prefill)   # one sequence, three tokens, one logits row


def test_graph_inputs_pack_and_unpack_with_padding() -> None:
    from ellm.ops.cuda_graphs import pack_inputs, unpack_inputs
    widths = {0: 6, 512: 3}
    batch = Batch(np.array([7, 8, 9], np.int32), np.array([20, 3, 9], np.int32), np.arange(3, dtype=np.int32),
                  {0: np.array([[3, 4], [5, -1], [6, 1]], np.int32), 512: np.array([[0], [2], [9]], np.int32)},
                  np.arange(3, dtype=np.int32))
    buf = pack_inputs(batch, 4, widths)
    static = unpack_inputs(buf, 4, widths)
    assert static.token_ids.tolist() == [7, 8, 9, 0] and static.positions.tolist() == [20, 3, 9, 0]
    assert static.seq_ids.tolist() == [0, 1, 2, 3] and static.logits_rows.tolist() == [0, 1, 2, 3]
    assert static.block_tables[0].tolist() == [[3, 4, -1, -1, -1, -1], [5, -1, -1, -1, -1, -1],
                                               [6, 1, -1, -1, -1, -1], [-1] * 6]
    assert static.block_tables[512].tolist() == [[0, -1, -1], [2, -1, -1], [9, -1, -1], [-1] * 3]
    # the views share the buffer: the next step's copy into it changes what the graph reads
    buf[:] = pack_inputs(None, 4, widths)
    assert static.token_ids.tolist() == [0, 0, 0, 0] and static.block_tables[0].max() == -1


def test_graph_input_image_refilled_in_place_equals_a_fresh_pack() -> None:
    """GraphStep refills one host image per bucket each step (InputImage): after batches
    of any size in any order it holds what pack_inputs builds from scratch."""
    from ellm.ops.cuda_graphs import InputImage, pack_inputs
    rng = np.random.default_rng(3)
    widths = {0: 7, 256: 2}
    image = InputImage(8, widths)
    for t in (5, 8, 2, 1, 7, 3, 8, 8, 1):
        tables = {0: rng.integers(-1, 50, (t, int(rng.integers(1, 8)))).astype(np.int32),
                  256: rng.integers(-1, 50, (t, int(rng.integers(1, 3)))).astype(np.int32)}
        batch = Batch(rng.integers(0, 1000, t).astype(np.int32), rng.integers(0, 500, t).astype(np.int32),
                      np.arange(t, dtype=np.int32), tables, np.arange(t, dtype=np.int32))
        assert np.array_equal(image.fill(batch), pack_inputs(batch, 8, widths)), t


def test_decode_step_shape_check() -> None:
    from ellm.ops.cuda_graphs import is_decode_step
    t = 4
    ar = np.arange(t, dtype=np.int32)
    tables = {0: np.zeros((t, 3), np.int32)}
    assert is_decode_step(Batch(ar, ar, ar, tables, ar))
    assert is_decode_step(Batch(ar, ar, ar.astype(np.int64), tables, ar.astype(np.int64)))   # other dtypes
    assert not is_decode_step(Batch(ar, ar, ar, tables, ar[::-1].copy()))            # rows out of order
    assert not is_decode_step(Batch(ar, ar, np.array([0, 0, 1, 1], np.int32), tables, ar))   # a prefill
    assert not is_decode_step(Batch(ar, ar, ar, tables, ar[:2].copy()))                 # not every row
    assert not is_decode_step(Batch(ar, ar, ar, {0: np.zeros((2, 3), np.int32)}, ar))
    big = np.arange(65, dtype=np.int32)
    assert not is_decode_step(Batch(big, big, big, {0: np.zeros((65, 1), np.int32)}, big))


def test_device_sampler_rows_carry_the_host_samplers_state() -> None:
    from ellm.ops.cuda import _SampleRows
    V = 100
    rep = SequenceSampler(SamplingParams(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.5,
                                         logit_bias={3: 1.0}, seed=3), [1, 2, 3], V)
    for t in (5, 5, 2):
        rep.append(t)
    freq = SequenceSampler(SamplingParams(temperature=1.0, top_k=7, top_p=0.8, min_p=0.1,
                                          presence_penalty=0.3), [4], V)
    freq.append(9)
    greedy = SequenceSampler(SamplingParams(temperature=0.0), [1], V)
    rows = _SampleRows(3)
    for b, (s, rng) in enumerate(((rep, [7, 1]), (freq, [8, 0]), (greedy, [0, 0]))):
        rows.add(b, s, rng)
    a = rows.arrays()
    assert a["inv_temp"].tolist() == [2.0, 1.0, 0.0]
    assert a["top_k"].tolist() == [0, 7, 0] and np.allclose(a["top_p"], [0, 0.8, 0])
    assert np.allclose(a["log_min_p"][1], np.log(0.1)) and np.isneginf(a["log_min_p"][[0, 2]]).all()
    assert a["bias_off"].tolist() == [0, 1, 1, 1] and a["bias_ids"][0] == 3 and a["bias_vals"][0] == 1.0
    off = a["pen_off"]
    row0 = dict(zip(a["pen_ids"][off[0]:off[1]].tolist(), a["pen_counts"][off[0]:off[1]].tolist()))
    assert row0 == {1: 0.0, 2: 1.0, 3: 0.0, 5: 2.0}   # prompt ids count 0, output ids their count
    row1 = dict(zip(a["pen_ids"][off[1]:off[2]].tolist(), a["pen_counts"][off[1]:off[2]].tolist()))
    assert row1 == {9: 1.0}   # no repetition penalty: the prompt is not penalised
    assert off[3] == off[2]
    assert a["rep"].tolist()[0] == pytest.approx(1.2) and a["pres"][1] == pytest.approx(0.3)
    assert a["seeds"].tolist() == [7, 8, 0] and a["steps"].tolist() == [1, 0, 0]
