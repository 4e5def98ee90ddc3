"""BF16 weights on the AMX bf16 tiles (csrc/matmul_bf16_amx.c) and on every other level.

At the AMX level, where the CPU has AMX-BF16, BF16 linears split each f32 activation into
three exact bf16 parts and sum hi.w + mid.w + lo.w on the tile unit, at every T. Checked:
- batch invariance, bit for bit: a row's outputs are the same alone (T=1) and in calls
  of 5, 16, 64 and 512 rows, at any position, with 1 or 2 threads, at every SIMD level
  this machine runs (the tiles at T=1 too, so decode and prefill agree);
- accuracy: within an f32-accumulation bound of float64 numpy, and no worse than the
  AVX-512 FMA kernels (truncating x to one bf16 would be ~100x worse, which the bound
  catches);
- that the tiles really run at the AMX level (their sums differ from the FMA kernels' in
  the last bits) and agree with ellm.ops.reference.linear;
- the edge cases the tile unit handles its own way: k not a multiple of 32, rows not a
  multiple of 16 or 32, denormal activations (flushed by the tile unit), inf / nan;
- linear_multi mixing BF16 parts on the tiles with F32 / F16 / quantized parts elsewhere,
  and MoE experts with BF16 weights (the grouped path);
- the real bf16 folders (SmolLM2, Gemma 3): logits at the best level and at AVX-512
  against transformers computing in f32 on the same bf16 weights (ELLM_REF_PYTHON).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ellm._native import _core, _quant
from ellm.formats.ggml_types import GGMLType
from ellm.ops import reference

LEVELS = _core.supported_simd_levels()
BF16 = int(GGMLType.BF16)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# the bf16 tiles run where the AMX level is offered and the CPU lists amx_bf16
HAS_BF16_TILES = "amx" in LEVELS and "amx_bf16" in cpu_flags()


def use_level(level: str) -> None:
    _core.set_simd_level(level)
    _quant.set_simd_level(level)
    assert _quant.simd_level() == level


@pytest.fixture(autouse=True)
def _restore_level_and_threads():
    level, threads = _quant.simd_level(), _quant.num_threads()
    yield
    use_level(level)
    _quant.set_num_threads(threads)


def bf16_weights(n: int, k: int, rng: np.random.Generator, scale: float = 0.05):
    """(bf16 bits (n, k) uint16, their exact values as float64)."""
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def activations(t: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Model-like rows: normal values, each row its own scale over 4 decades."""
    x = rng.standard_normal((t, k)).astype(np.float32)
    return x * np.exp(rng.uniform(-4.0, 4.0, size=(t, 1))).astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray, qtype: int = BF16) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _quant.linear(np.ascontiguousarray(x), w, qtype, out)
    return out


def f32_bound(x: np.ndarray, wf: np.ndarray, k: int) -> np.ndarray:
    """An honest bound for an f32 sum of k exact products (3k for the split): a few
    units in the last place of sum |x w|, growing like sqrt(k) for random rounding."""
    return 4.0 * np.sqrt(3.0 * k) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(wf).T) + 1e-37


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n, k", [(192, 576), (37, 100), (64, 40)])
def test_bit_identical_across_batch_sizes_and_threads(level: str, n: int, k: int) -> None:
    use_level(level)
    rng = np.random.default_rng(n * 1000 + k)
    w, _ = bf16_weights(n, k, rng)
    x = activations(512, k, rng)
    rows = [0, 1, 15, 16, 17, 63, 64, 200, 511]
    alone = {i: linear(x[i:i + 1], w)[0] for i in rows}
    for threads in (1, 2):
        _quant.set_num_threads(threads)
        for t in (1, 5, 16, 64, 512):
            for start in sorted({0, 3, 512 - t}):
                if start + t > 512:
                    continue
                got = linear(x[start:start + t], w)
                for i in rows:
                    if start <= i < start + t:
                        assert np.array_equal(got[i - start], alone[i]), \
                            f"{level}: row {i} in T={t} from {start}, {threads} threads"


@pytest.mark.parametrize("level", LEVELS)
def test_accuracy_against_float64(level: str) -> None:
    use_level(level)
    rng = np.random.default_rng(7)
    for t, n, k in [(1, 1, 1), (1, 33, 7), (3, 16, 31), (5, 48, 33), (16, 32, 576), (17, 21, 1536),
                    (64, 96, 640), (100, 40, 2048)]:
        w, wf = bf16_weights(n, k, rng)
        x = activations(t, k, rng)
        got = linear(x, w)
        ref = x.astype(np.float64) @ wf.T
        err = np.abs(got - ref)
        assert np.all(err <= f32_bound(x, wf, k)), f"{level} T={t} N={n} K={k}: max err {err.max()}"


def needs_tiles() -> None:
    if not HAS_BF16_TILES:
        pytest.skip(f"no AMX bf16 tiles here (levels {LEVELS}, amx_bf16 "
                    f"{'listed' if 'amx_bf16' in cpu_flags() else 'not listed'} in /proc/cpuinfo)")


def test_tiles_run_at_the_amx_level_and_match_the_reference() -> None:
    """The tiles' sums are f32 sums in another order than the FMA kernels': equal to
    float64 within the f32 bound, as close as the FMA kernels, and not the same bits
    (which would mean the AMX level still ran the FMA kernels)."""
    needs_tiles()
    rng = np.random.default_rng(11)
    t, n, k = 64, 256, 1536
    w, wf = bf16_weights(n, k, rng)
    x = activations(t, k, rng)
    ref = x.astype(np.float64) @ wf.T
    use_level("avx512")
    fma = linear(x, w)
    use_level("amx")
    tiles = linear(x, w)
    assert not np.array_equal(tiles, fma)
    scale = np.abs(ref).max()
    err_tiles, err_fma = np.abs(tiles - ref).max() / scale, np.abs(fma - ref).max() / scale
    assert err_tiles <= 4 * err_fma + 1e-7, (err_tiles, err_fma)
    # one bf16 per activation (no split) is what the tiles alone would give: far worse
    x_bf16 = (x.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
    err_rounded = np.abs(x_bf16 @ wf.T - ref).max() / scale
    assert err_tiles * 50 < err_rounded, (err_tiles, err_rounded)
    rel = np.abs(tiles - reference.linear(x, wf.astype(np.float32))).max() / scale
    assert rel < 1e-6, rel


def test_tiles_at_t1_equal_prefill_rows_on_model_shapes() -> None:
    """Decode (T=1) runs the tiles too: its logits-path outputs are a prefill's rows."""
    needs_tiles()
    use_level("amx")
    rng = np.random.default_rng(5)
    for n, k in [(576, 576), (1536, 576), (576, 1536), (1024, 640), (256, 640)]:
        w, wf = bf16_weights(n, k, rng)
        x = activations(33, k, rng)
        many = linear(x, w)
        for i in (0, 16, 32):
            assert np.array_equal(linear(x[i:i + 1], w)[0], many[i]), f"N={n} K={k} row {i}"


def test_special_values() -> None:
    """Denormal activations: the tile unit reads denormal bf16 parts as 0, so a row of
    denormals gives 0 (at most ~1e-38 off); inf / nan in a row make that row's outputs
    non-finite and leave the other rows alone."""
    needs_tiles()
    use_level("amx")
    rng = np.random.default_rng(3)
    n, k = 40, 96
    w, wf = bf16_weights(n, k, rng)
    x = activations(20, k, rng)
    x[1] = np.float32(1e-39) * np.sign(x[1])
    x[2, 5] = np.inf
    x[3, 70] = np.nan
    got = linear(x, w)
    assert np.all(np.abs(got[1]) < 1e-36)
    assert not np.isfinite(got[2]).any() and np.isnan(got[3]).all()
    ok = [i for i in range(20) if i not in (1, 2, 3)]
    ref = x[ok].astype(np.float64) @ wf.T
    assert np.all(np.abs(got[ok] - ref) <= f32_bound(x[ok], wf, k))
    # the rows around the bad ones are what they are alone
    for i in (0, 4, 19):
        assert np.array_equal(linear(x[i:i + 1], w)[0], got[i])


@pytest.mark.parametrize("level", LEVELS)
def test_linear_multi_mixes_bf16_tiles_with_other_types(level: str) -> None:
    use_level(level)
    rng = np.random.default_rng(21)
    t, k = 70, 256
    w_bf, _ = bf16_weights(48, k, rng)
    w_bf2, _ = bf16_weights(21, k, rng)
    w_f32 = rng.standard_normal((9, k)).astype(np.float32)
    w_f16 = rng.standard_normal((13, k)).astype(np.float16).view(np.uint16)
    w_q8 = _quant.quantize(rng.standard_normal((17, k)).astype(np.float32), int(GGMLType.Q8_0))
    parts = [(w_bf, BF16), (w_f32, int(GGMLType.F32)), (w_f16, int(GGMLType.F16)),
             (w_q8, int(GGMLType.Q8_0)), (w_bf2, BF16)]
    x = activations(t, k, rng)
    alone = [linear(x, w, q) for w, q in parts]
    outs = [np.full((t, w.shape[0]), np.nan, np.float32) for w, _ in parts]
    bias = rng.standard_normal(21).astype(np.float32)
    _quant.linear_multi(x, [(w, q, o) for (w, q), o in zip(parts[:-1], outs[:-1])]
                        + [(w_bf2, BF16, outs[-1], bias)])
    for (w, q), o, a in zip(parts[:-1], outs[:-1], alone[:-1]):
        np.testing.assert_array_equal(o, a, err_msg=f"{level} qtype {q}")
    np.testing.assert_array_equal(outs[-1], alone[-1] + bias)


@pytest.mark.parametrize("level", LEVELS)
def test_moe_experts_with_bf16_weights(level: str) -> None:
    """The grouped path (one linear_groups call per projection, experts on the tokens
    routed to them) sizes and fills the split activations per group: each token's output
    is what it gets alone, and the reference's within the f32 bound."""
    from ellm._native import _moe
    use_level(level)
    rng = np.random.default_rng(31)
    E, top_k, H, F, T = 6, 2, 96, 80, 40
    gate = [bf16_weights(F, H, rng, 0.2) for _ in range(E)]
    up = [bf16_weights(F, H, rng, 0.2) for _ in range(E)]
    down = [bf16_weights(H, F, rng, 0.2) for _ in range(E)]
    stacks = [_moe.ExpertStack([w for w, _ in ws], BF16, ws[0][0].shape[1]) for ws in (gate, up, down)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.sort(np.stack([rng.choice(E, top_k, replace=False) for _ in range(T)]), axis=1).astype(np.int32)
    wts = rng.dirichlet(np.ones(top_k), size=T).astype(np.float32)
    out = np.full((T, H), np.nan, np.float32)
    _moe.experts(x, ids, wts, *stacks, out)
    for t in (0, 17, 39):
        one = np.full((1, H), np.nan, np.float32)
        _moe.experts(x[t:t + 1], ids[t:t + 1], wts[t:t + 1], *stacks, one)
        assert np.array_equal(one[0], out[t]), f"{level}: token {t}"
    ref = reference.moe_experts(x, ids, wts, [g for _, g in gate], [u for _, u in up], [d for _, d in down])
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


# transformers on a folder: the logits of every position, in f32 arithmetic on the
# folder's (bf16) weights -- the same exact products the kernels form
REF_LOGITS = r"""
import sys, numpy as np, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = [int(t) for t in sys.argv[3].split(",")]
with torch.no_grad():
    np.save(sys.argv[2], model(torch.tensor([ids])).logits[0].numpy())
"""
PROMPT = list(range(1000, 1064))  # ordinary ids of both vocabularies


@pytest.mark.parametrize("folder_fixture", ["smollm2_hf_bf16", "gemma3_hf_bf16"])
def test_bf16_folders_match_transformers(folder_fixture: str, request, tmp_path: Path) -> None:
    """Measured (Xeon, 100 positions): max |logit error| / max |logit| 2.1e-6 (SmolLM2) and
    4.3e-6 (Gemma 3) on the tiles, 2.5e-6 for both on the AVX-512 FMA kernels."""
    ref_python = os.environ.get("ELLM_REF_PYTHON")
    if not ref_python:
        pytest.fail("ELLM_REF_PYTHON is not set: run through `bash tests/run.sh`", pytrace=False)
    import ellm
    folder = request.getfixturevalue(folder_fixture)
    out = tmp_path / "ref.npy"
    subprocess.run([ref_python, "-c", REF_LOGITS, str(folder), str(out), ",".join(map(str, PROMPT))],
                   check=True, capture_output=True, text=True)
    ref = np.load(out)
    llm = ellm.load(str(folder), max_model_len=256, progress=False)
    scale = float(np.abs(ref).max())
    for level in sorted({LEVELS[-1], "avx512"} & set(LEVELS)):
        use_level(level)
        got = llm.logits(PROMPT)
        rel = float(np.abs(got - ref).max()) / scale
        assert rel < 2e-5, f"{folder.name} at {level}: {rel:.2e} of the largest logit"
