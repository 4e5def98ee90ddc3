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
import os
import pkgutil
import subprocess
import sys
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


def _level_in_a_fresh_process(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ELLM_SIMD=value)
    return subprocess.run([sys.executable, "-c", "import ellm; from ellm._native import _core; "
                           "print(_core.simd_level())"], env=env, capture_output=True, text=True, timeout=120)


def test_ellm_simd_environment_variable_picks_the_level() -> None:
    """ELLM_SIMD=<level> at import runs that level's kernels; a level this CPU cannot run,
    or a misspelt one, stops the import with an error naming the variable and the levels
    it can run, not a silent fallback to the best."""
    lowest = _core.supported_simd_levels()[1] if len(_core.supported_simd_levels()) > 1 else "scalar"
    for value in ("scalar", lowest):
        p = _level_in_a_fresh_process(value)
        assert p.returncode == 0 and p.stdout.strip() == value, p.stderr[-800:]
    missing = [n for n in ("avx2", "avx512", "amx", "neon") if n not in _core.supported_simd_levels()]
    for bad in ["avx9", *missing[:1]]:
        p = _level_in_a_fresh_process(bad)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert f"ELLM_SIMD='{bad}'" in last and ", ".join(_core.supported_simd_levels()) in last, last


def test_a_bad_ellm_simd_is_one_line_from_the_cli() -> None:
    """The `ellm` command (its console script and `python -m ellm`) prints a bad ELLM_SIMD
    as its other errors, one `error: ...` line and status 2, where `import ellm` in a
    program raises the ValueError (above)."""
    script = Path(sys.executable).parent / ("ellm.exe" if os.name == "nt" else "ellm")
    commands = [[sys.executable, "-m", "ellm", "info"]]
    if script.exists():
        commands.append([str(script), "info"])
    for command in commands:
        p = subprocess.run(command, env=dict(os.environ, ELLM_SIMD="avx9"), capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and p.stdout == "", (command, p.stdout, p.stderr)
        assert p.stderr.splitlines() == [p.stderr.strip()] and p.stderr.startswith("error: ELLM_SIMD='avx9'"), \
            (command, p.stderr)


def test_a_bad_ellm_simd_raises_in_a_program_started_with_dash_m(tmp_path: Path) -> None:
    """Another program started with `python -m` that imports ellm while Python looks for
    its __main__ gets the ValueError to catch, not the CLI's exit."""
    package = tmp_path / "uses_ellm"
    package.mkdir()
    (package / "__init__.py").write_text("try:\n    import ellm\nexcept ValueError as e:\n"
                                         "    print('caught', 'ELLM_SIMD' in str(e))\n")
    (package / "__main__.py").write_text("")
    env = dict(os.environ, ELLM_SIMD="avx9", PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    p = subprocess.run([sys.executable, "-m", "uses_ellm"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "caught True", (p.stdout, p.stderr)


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


# ---------------------------------------------------------------- MoE and partial rotary at each level
# Tiny Qwen3-MoE and Phi-3 models (random f32 weights written here; their agreement with
# transformers is test_tiny_models'): at every level the C kernels give the reference ops'
# logits, and feeding the prompt in chunks gives one pass's logits bit for bit.

import json  # noqa: E402
import struct  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_CONFIGS = {
    "qwen3_moe": dict(TINY, model_type="qwen3_moe", head_dim=16, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "phi3": dict(TINY, model_type="phi3", original_max_position_embeddings=64, sliding_window=24,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                      short_factor=[1.0, 1.4, 2.1, 3.3], long_factor=[2.0, 3.0, 5.0, 8.0])),
}


def _tiny_tensors(arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = TINY_CONFIGS[arch]
    H, V, nh, nkv = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", H // nh)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.15).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.4 * rng.standard_normal(n)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H), "model.norm.weight": norm(H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attn.o_proj.weight"] = w(H, nh * hd)
        if arch == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = w((nh + 2 * nkv) * hd, H)
            t[p + "mlp.gate_up_proj.weight"] = w(2 * c["intermediate_size"], H)
            t[p + "mlp.down_proj.weight"] = w(H, c["intermediate_size"])
            continue
        for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = w(rows, H)
        t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        F = c["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = w(c["num_experts"], H) * 4   # decisive routing
        for e in range(c["num_experts"]):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = w(F, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = w(F, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = w(H, F)
    return t


def _write_folder(folder: Path, arch: str) -> Path:
    """config.json + model.safetensors (the format's plain layout: header length, JSON, data)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIGS[arch]))
    header, blobs, at = {}, [], 0
    for name, a in _tiny_tensors(arch, np.random.default_rng(5)).items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return folder


def _tiny_logits(folder: Path, device: str, chunks: list[int], ids: np.ndarray) -> np.ndarray:
    from ellm.models import config_from_folder
    from ellm.engine.kv_cache import BlockManager, KVCache
    from ellm.formats.safetensors import SafetensorsFolder
    from ellm.models import build_model
    from ellm.models.batch import Batch
    from ellm.ops import get_ops
    from ellm.weights import SafetensorsWeights

    config = config_from_folder(folder)
    model = build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), get_ops(device))
    kv = KVCache(config, num_blocks=16, block_size=4)
    blocks = BlockManager(kv, enable_prefix_caching=False)
    assert blocks.allocate("s", len(ids))
    out, start = [], 0
    for n in chunks:
        blocks.release_out_of_window("s", start)
        tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in kv.windows}
        out.append(model.forward(Batch.single(ids[start:start + n], start, tables, all_logits=True), kv).copy())
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512", "neon"])
def test_level_moe_and_partial_rotary_models(arch: str, level: str, tmp_path: Path,
                                             restore_level: None) -> None:
    if level not in _core.supported_simd_levels():
        pytest.skip(f"this CPU cannot run {level}")
    folder = _write_folder(tmp_path / arch, arch)
    ids = np.random.default_rng(6).integers(0, TINY["vocab_size"], 40).astype(np.int32)
    want = _tiny_logits(folder, "reference", [40], ids)
    force_level(level)
    got = _tiny_logits(folder, "cpu", [40], ids)
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * float(np.abs(want).max()), f"{arch} at {level}: max error {err:.3g}"
    chunked = _tiny_logits(folder, "cpu", [13, 7, 10] + [1] * 10, ids)
    assert np.array_equal(chunked, got), f"{arch} at {level}: chunked prefill + decode is not bit-identical"


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
