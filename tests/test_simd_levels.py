"""Every SIMD level this CPU can run gives the same model as the best one.

A prebuilt wheel carries scalar, AVX2 and AVX-512 kernels and picks one from CPUID, so
an older CPU runs code this machine never chooses by itself. Here each level the CPU
supports is forced in turn and the real SmolLM2 logits are compared with the best
level's. The kernels quantize activations to int8, so a last-bit difference in a float
sum can move a rounding and the difference grows over 30 layers: levels agree to about
1.5 logits (max abs) and a few percent (RMS), as each of them does with the dequantized
float reference. A wrong kernel gives an RMS error near 100%.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Iterator

import numpy as np
import pytest

import ellm
import ellm._native
from ellm._native import _core

# "The capital of France is Paris. The capital of Germany is" in SmolLM2's vocabulary.
PROMPT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]

MAX_ABS = 3.0        # logits; measured up to 1.46 between levels on an AVX-512 machine
MAX_REL_RMS = 0.25   # per position, RMS(diff) / RMS(best); measured up to 0.12
MEAN_REL_RMS = 0.08  # over positions; measured up to 0.04
SURE_MARGIN = 1.0    # where the best level's top-1 leads by this much, top-1 must agree


def native_modules() -> list[ModuleType]:
    """Every compiled ellm._native module that can get or set the SIMD level.

    Forcing a level goes through all of them, so the test holds whether the modules
    share csrc/ (one shared library, one level) or each link a copy of their own."""
    mods = []
    for info in pkgutil.iter_modules(ellm._native.__path__):
        if info.name.startswith("lib"):
            continue  # libellm_kernels.so: the C library itself, not a Python module
        mod = importlib.import_module(f"ellm._native.{info.name}")
        if hasattr(mod, "set_simd_level") and hasattr(mod, "simd_level"):
            mods.append(mod)
    return mods


def force_level(name: str) -> None:
    for mod in native_modules():
        mod.set_simd_level(name)


def best_level() -> str:
    return _core.supported_simd_levels()[-1]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> ellm.LLM:
    return ellm.load(str(smollm2_gguf), device="cpu", max_model_len=256)


@pytest.fixture
def restore_level() -> Iterator[None]:
    saved = {mod: mod.simd_level() for mod in native_modules()}
    yield
    for mod, name in saved.items():
        mod.set_simd_level(name)


@pytest.fixture(scope="module")
def best_logits(llm: ellm.LLM) -> np.ndarray:
    saved = {mod: mod.simd_level() for mod in native_modules()}
    force_level(best_level())
    try:
        return llm.logits(PROMPT_IDS)
    finally:
        for mod, name in saved.items():
            mod.set_simd_level(name)


# ---------------------------------------------------------------- the level API


def test_levels_are_ordered_and_end_at_the_best() -> None:
    levels = _core.supported_simd_levels()
    assert levels[0] == "scalar"
    assert _core.simd_best() == levels[-1]
    assert set(levels) <= {"scalar", "avx2", "avx512", "amx", "neon"}
    if "avx512" in levels:
        assert "avx2" in levels  # the AVX-512 kernels lean on AVX2 for their tails
    if "amx" in levels:
        assert levels[-2:] == ["avx512", "amx"]  # AMX adds tiles to the AVX-512 level


def test_bogus_level_raises_and_changes_nothing(restore_level: None) -> None:
    before = {mod.__name__: mod.simd_level() for mod in native_modules()}
    for mod in native_modules():
        with pytest.raises(ValueError, match="bogus"):
            mod.set_simd_level("bogus")
    assert {mod.__name__: mod.simd_level() for mod in native_modules()} == before


def test_unsupported_level_raises(restore_level: None) -> None:
    missing = [name for name in ("avx2", "avx512", "amx", "neon")
               if name not in _core.supported_simd_levels()]
    if not missing:
        pytest.skip("this CPU supports every level")
    before = _core.simd_level()
    for name in missing:
        with pytest.raises(ValueError, match="not supported"):
            _core.set_simd_level(name)
    assert _core.simd_level() == before


def test_forcing_a_level_reaches_every_module(restore_level: None) -> None:
    for name in _core.supported_simd_levels():
        force_level(name)
        assert {mod.__name__: mod.simd_level() for mod in native_modules()} == \
            {mod.__name__: name for mod in native_modules()}


# ---------------------------------------------------------------- the model at each level


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512", "amx", "neon"])
def test_level_logits_match_best(level: str, llm: ellm.LLM, best_logits: np.ndarray,
                                 restore_level: None) -> None:
    if level not in _core.supported_simd_levels():
        pytest.skip(f"this CPU cannot run {level}")
    if level == best_level():
        pytest.skip(f"{level} is the reference level")
    force_level(level)
    got = llm.logits(PROMPT_IDS)                                  # (positions, vocab)
    assert got.shape == best_logits.shape
    assert np.isfinite(got).all()
    diff = got - best_logits
    rel_rms = np.sqrt((diff ** 2).mean(-1)) / np.sqrt((best_logits ** 2).mean(-1))
    assert np.abs(diff).max() <= MAX_ABS, f"{level}: max abs diff {np.abs(diff).max():.3f}"
    assert rel_rms.max() <= MAX_REL_RMS, f"{level}: relative RMS per position {rel_rms.round(3)}"
    assert rel_rms.mean() <= MEAN_REL_RMS, f"{level}: mean relative RMS {rel_rms.mean():.3f}"
    top2 = np.sort(best_logits, axis=-1)[:, -2:]                  # (positions, 2)
    sure = (top2[:, 1] - top2[:, 0]) >= SURE_MARGIN
    np.testing.assert_array_equal(got.argmax(-1)[sure], best_logits.argmax(-1)[sure])


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512", "amx", "neon"])
def test_level_logits_on_float_weights_are_exact(level: str, smollm2_hf_f32: Path,
                                                 restore_level: None) -> None:
    """With f32 weights nothing is quantized, so every level must agree to float rounding."""
    if level not in _core.supported_simd_levels():
        pytest.skip(f"this CPU cannot run {level}")
    llm = ellm.load(str(smollm2_hf_f32), device="cpu", max_model_len=256)
    force_level(best_level())
    want = llm.logits(PROMPT_IDS)
    force_level(level)
    got = llm.logits(PROMPT_IDS)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


# ---------------------------------------------------------------- AMX tiles, bit for bit

# 40 tokens: past the 16 at which the many-token kernels (and so the AMX tiles) take over
LONG_PROMPT_IDS = PROMPT_IDS * 3 + PROMPT_IDS[:4]


@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_amx_model_logits_equal_avx512_bit_for_bit(model: str, request: pytest.FixtureRequest,
                                                   restore_level: None) -> None:
    """The AMX level's tiles form the same exact integer block sums as the VNNI kernels
    and then take the same float steps: a whole model's logits are the same bits (Gemma 3's
    Q4_K / Q6_K matrices run the AVX-512 kernels at the AMX level)."""
    if "amx" not in _core.supported_simd_levels():
        pytest.skip("this CPU (or its OS) offers no AMX tiles "
                    f"(levels: {_core.supported_simd_levels()})")
    llm = ellm.load(str(request.getfixturevalue(model)), device="cpu", max_model_len=256)
    force_level("avx512")
    want = llm.logits(LONG_PROMPT_IDS)
    force_level("amx")
    got = llm.logits(LONG_PROMPT_IDS)
    np.testing.assert_array_equal(got, want)
    # another T (other tile groups and padding): position 19 keeps its bits
    np.testing.assert_array_equal(llm.logits(LONG_PROMPT_IDS[:20])[-1], got[19])
