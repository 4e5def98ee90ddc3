"""Every architecture, on tiny random models made by transformers (tests/goldens/tiny_models.py):
llama with llama-3 RoPE scaling, Gemma 1, Gemma 2 (soft-capping, sliding window), Gemma 3,
and the families of the registry: Qwen2 (qkv bias, sliding upper layers), Qwen3 (q/k norm,
own head_dim), Mistral (window on every layer), SmolLM3 (NoPE layers), OLMo 2 (post-norms,
whole-projection q/k norm), Granite (multipliers), Phi-3 (fused projections, partial rotary,
LongRoPE with its attention factor, a window), Qwen3-MoE (top-k experts; with and without
renormalisation, all-MoE and with a dense layer).

Each model's logits are compared with transformers' at every position, on the C kernels
and on the reference ops, in one pass and fed in chunks then one token at a time; its
greedy continuation with transformers' greedy ids; batched greedy with one at a time.

GGUF: each family's folder converted by llama.cpp's own converter (tests/goldens/
convert_tiny.py, at f32 and q8_0) is the file llama.cpp's logits were recorded on
(tests/goldens/make_llamacpp_tiny.py, same sha256), and ellm on it matches them; where
the converter keeps every setting, the f32 file also matches the folder's transformers
logits (it drops Mistral's window, SmolLM3's NoPE interval and Qwen2's window; llama.cpp
ignores Phi-3's)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm.engine.engine import EngineConfig
from ellm.engine.kv_cache import BlockManager, KVCache
from ellm.engine.runner import ModelRunner
from ellm.formats.gguf import GGUFFile
from ellm.formats.safetensors import SafetensorsFolder
from ellm.models import build_model, config_from_folder, config_from_gguf, gguf_weights
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.sampling_params import SamplingParams
from ellm.weights import SafetensorsWeights
from conftest import ops_or_skip

ARCHS = ["llama", "gemma", "gemma2", "gemma3_text"]
FAMILIES = ["qwen2", "qwen3", "mistral", "smollm3", "olmo2", "granite", "phi3", "qwen3_moe", "qwen3_moe_mixed"]
CHUNKS = [13, 7, 10] + [1] * 10   # chunked prefill, then decode: 40 tokens
GOLDENS = Path(__file__).parent / "goldens"
SCRIPT = GOLDENS / "tiny_models.py"
# llama.cpp's converter writes no dense layer into a qwen3moe file
GGUF_FAMILIES = [f for f in FAMILIES if f != "qwen3_moe_mixed"]
LLAMACPP_FAMILIES = GGUF_FAMILIES
# the families whose GGUF keeps every setting of the folder (not phi3: llama.cpp ignores
# Phi-3's window, so its GGUF means full attention)
GGUF_KEEPS_ALL = ["qwen3", "olmo2", "granite", "qwen3_moe"]


@pytest.fixture(scope="session")
def tiny_dir(tiny_models_dir: Path) -> Path:
    """The folders of SCRIPT (conftest.py makes them once for the session)."""
    return tiny_models_dir


def _ops(device: str):
    """The backend `device`; "opaque": the cpu backend behind arrays NumPy cannot read;
    "fused": the cpu backend (f32 activations) running every layer through
    ops/fused_stack.py, the fused ops as their compositions (the plan cuda runs)."""
    if device == "opaque":
        from opaque_ops import OpaqueOps
        return OpaqueOps(get_ops("cpu"))
    if device == "fused":
        from ellm.ops.cpu import CpuOps
        from ellm.ops.fused_stack import fused_layer_stack

        class FusedCpu(CpuOps):
            def layer_stack(self, specs, t, hidden, residual, proj, h_buf, eps):   # noqa: ANN001, ANN201
                return fused_layer_stack(self, specs, t, hidden, residual, proj, h_buf, eps)
        return FusedCpu(activations="f32")
    return ops_or_skip(device)


def _forward(folder: Path, device: str, chunks: list[int], gguf: Path | None = None,
             all_logits: bool = True, no_rows: int = 0) -> np.ndarray:
    """Logits at every position (with all_logits False, at each chunk's last; none of the
    first no_rows chunks'), feeding the tokens in the given chunk sizes (of the folder's
    model, or of the GGUF file when one is given), through a model runner whose KV cache
    (16 blocks of 4) and workspace the backend allocates."""
    if gguf is None:
        config = config_from_folder(folder)
        weights = SafetensorsWeights(SafetensorsFolder(folder))
    else:
        config = config_from_gguf(GGUFFile(gguf))
        weights = gguf_weights(GGUFFile(gguf))
    model = build_model(config, weights, _ops(device))
    ids = np.load(folder / "ids.npy")
    runner = ModelRunner(model, EngineConfig(kv_cache_tokens=64, block_size=4, max_num_seqs=1))
    kv = runner.kv
    blocks = BlockManager(kv, enable_prefix_caching=False)
    assert blocks.allocate("s", len(ids))
    out, start = [], 0
    for n in chunks:
        blocks.release_out_of_window("s", start)
        tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in kv.windows}
        batch = Batch.single(ids[start:start + n], start, tables, all_logits=all_logits)
        if len(out) < no_rows:   # a chunk in the middle of a prompt: no row's logits
            batch.logits_rows = batch.logits_rows[:0]
        out.append(runner.forward(batch).copy())
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ARCHS + FAMILIES)
def test_forward_uses_only_ops(tiny_dir, arch) -> None:
    """Every family, chunked prefill then decode, on a backend whose arrays NumPy cannot
    read (tests/opaque_ops.py): the cpu backend's logits bit for bit, so no model code
    computes or allocates with NumPy (a device backend is an added file)."""
    got = _forward(tiny_dir / arch, "opaque", CHUNKS)
    assert got.tobytes() == _forward(tiny_dir / arch, "cpu", CHUNKS).tobytes()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", ["cpu", "reference", "cuda"])
def test_tiny_model_matches_transformers(tiny_dir, arch, device) -> None:
    want = np.load(tiny_dir / arch / "logits.npy")
    got = _forward(tiny_dir / arch, device, [40])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_chunked_prefill_and_decode(tiny_dir, arch) -> None:
    """Prefill in chunks, then one token at a time: the same logits as one pass."""
    want = np.load(tiny_dir / arch / "logits.npy")
    got = _forward(tiny_dir / arch, "cpu", [13, 7, 10] + [1] * 10)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def _assert_close_relative(got: np.ndarray, want: np.ndarray) -> None:
    """max |got - want| <= 1e-3 x the largest |logit|, at every position."""
    bound = 1e-3 * float(np.abs(want).max())
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= bound, f"max error {err.max():.3g} at position {int(err.argmax())} > {bound:.3g}"


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("device", ["cpu", "reference", "cuda", "fused"])
@pytest.mark.parametrize("chunks", [[40], CHUNKS], ids=["one-pass", "chunked+decode"])
def test_family_matches_transformers(tiny_dir, arch, device, chunks) -> None:
    want = np.load(tiny_dir / arch / "logits.npy")
    got = _forward(tiny_dir / arch, device, chunks)
    _assert_close_relative(got, want)
    # the same argmax wherever transformers' top two are further apart than the bound
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2e-3 * float(np.abs(want).max())
    assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("device", ["cpu", "reference", "cuda", "fused"])
def test_family_last_rows_alone(tiny_dir, arch, device) -> None:
    """Chunks asking for their last row's logits alone run the last layer past attention
    on that row (Decoder._last_layer_rows): the rows of chunks asking for every row's,
    bit for bit on cpu (its kernels give a row the same bits in any batch). The first two
    chunks asking for none (as in the middle of a prompt) still leave their keys and
    values for the rest."""
    every = _forward(tiny_dir / arch, device, CHUNKS)
    want = every[np.cumsum(CHUNKS) - 1]
    for no_rows in (0, 2):
        last = _forward(tiny_dir / arch, device, CHUNKS, all_logits=False, no_rows=no_rows)
        if device == "cpu":
            assert last.tobytes() == want[no_rows:].tobytes()
        else:
            np.testing.assert_allclose(last, want[no_rows:], atol=1e-5 * float(np.abs(want).max()), rtol=0)


@pytest.fixture(scope="module")
def family_llms(tiny_dir) -> dict:
    return {arch: ellm.load(str(tiny_dir / arch), max_model_len=256, progress=False) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_greedy_ids_match_transformers(tiny_dir, family_llms, arch) -> None:
    ids = np.load(tiny_dir / arch / "ids.npy").tolist()
    want = np.load(tiny_dir / arch / "greedy.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True)
    assert family_llms[arch].generate(ids, params).token_ids == want


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_batched_greedy_equals_one_at_a_time(tiny_dir, family_llms, arch) -> None:
    """Batch invariance: a sequence's greedy ids do not depend on what it is batched with."""
    llm = family_llms[arch]
    ids = np.load(tiny_dir / arch / "ids.npy").tolist()
    rng = np.random.default_rng(7)
    prompts = [ids[:5], ids[:23], rng.integers(3, 320, 61).tolist(), ids + ids[:17]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [llm.generate(p, params).token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone


# -- GGUF files written by llama.cpp's converter ----------------------------------------

@pytest.fixture(scope="session")
def tiny_ggufs(tiny_dir) -> Path:
    """Every family's folder converted at f32 and q8_0: <dir>/<family>-<type>.gguf."""
    from ref_python import llama_cpp_dir
    converter = llama_cpp_dir()
    out = tiny_dir / "gguf"
    subprocess.run([os.environ["ELLM_REF_PYTHON"], str(GOLDENS / "convert_tiny.py"), converter, str(out),
                    *(str(tiny_dir / f) for f in GGUF_FAMILIES)], check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="session")
def llamacpp() -> tuple[dict, dict]:
    record = json.loads((GOLDENS / "llamacpp-tiny.json").read_text())
    with np.load(GOLDENS / "llamacpp-tiny.npz") as z:
        return record["files"], {k: z[k] for k in z.files}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("arch", LLAMACPP_FAMILIES)
def test_gguf_is_the_file_llamacpp_ran(tiny_ggufs, llamacpp, arch, outtype) -> None:
    name = f"{arch}-{outtype}"
    got = hashlib.sha256((tiny_ggufs / f"{name}.gguf").read_bytes()).hexdigest()
    assert got == llamacpp[0][name]["sha256"], f"{name}.gguf differs from the file the goldens were made on"


@pytest.mark.parametrize("arch", LLAMACPP_FAMILIES)
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_gguf_f32_matches_llamacpp(tiny_dir, tiny_ggufs, llamacpp, arch, device) -> None:
    want = llamacpp[1][f"{arch}-f32.logits"]
    _assert_close_relative(_forward(tiny_dir / arch, device, CHUNKS, tiny_ggufs / f"{arch}-f32.gguf"), want)


def _agree_where_margins_allow(got: np.ndarray, want_ids: list[int], margins: list[float], floor: float) -> None:
    """The same ids wherever the reference's top-two margin is above floor; greedy
    sequences are compared up to their first step under it."""
    n = next((i for i, m in enumerate(margins) if m <= floor), len(margins))
    assert list(got[:n]) == list(want_ids[:n])


@pytest.mark.parametrize("arch", LLAMACPP_FAMILIES)
def test_gguf_q8_0_matches_llamacpp(tiny_dir, tiny_ggufs, llamacpp, arch) -> None:
    """q8_0: both engines round activations to 8 bits their own way, so argmax and greedy
    ids are compared where the top-two margins are clear. A position is clear when both
    engines' margins are: a near-tie in either one is inside the 8-bit noise (measured on
    the tiny Phi-3: llama.cpp's margin 2.4% of the largest logit at position 0, ellm's 0.8%,
    and ellm's q8_0 logits 13% from the f32 file's)."""
    rec = llamacpp[0][f"{arch}-q8_0"]
    got = _forward(tiny_dir / arch, "cpu", [40], tiny_ggufs / f"{arch}-q8_0.gguf")
    floor = 0.02 * float(np.abs(got).max())
    top2 = np.sort(got, axis=1)[:, -2:]
    clear = (np.asarray(rec["argmax_margins"]) > floor) & (top2[:, 1] - top2[:, 0] > floor)
    assert clear.sum() >= len(clear) // 4
    assert np.array_equal(got.argmax(1)[clear], np.asarray(rec["argmax"])[clear])
    llm = ellm.load(str(tiny_ggufs / f"{arch}-q8_0.gguf"), max_model_len=256, progress=False)
    ids = np.load(tiny_dir / arch / "ids.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(rec["greedy_ids"]), ignore_eos=True)
    _agree_where_margins_allow(np.asarray(llm.generate(ids, params).token_ids), rec["greedy_ids"],
                               rec["greedy_margins"], floor)


@pytest.mark.parametrize("arch", LLAMACPP_FAMILIES)
def test_gguf_f32_greedy_matches_llamacpp(tiny_dir, tiny_ggufs, llamacpp, arch) -> None:
    rec = llamacpp[0][f"{arch}-f32"]
    llm = ellm.load(str(tiny_ggufs / f"{arch}-f32.gguf"), max_model_len=256, progress=False)
    ids = np.load(tiny_dir / arch / "ids.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(rec["greedy_ids"]), ignore_eos=True)
    _agree_where_margins_allow(np.asarray(llm.generate(ids, params).token_ids), rec["greedy_ids"],
                               rec["greedy_margins"], 1e-3)


@pytest.mark.parametrize("arch", GGUF_KEEPS_ALL)
def test_gguf_matches_the_folder_where_the_converter_keeps_everything(tiny_dir, tiny_ggufs, arch) -> None:
    want = np.load(tiny_dir / arch / "logits.npy")
    _assert_close_relative(_forward(tiny_dir / arch, "cpu", [40], tiny_ggufs / f"{arch}-f32.gguf"), want)
    got = _forward(tiny_dir / arch, "cpu", [40], tiny_ggufs / f"{arch}-q8_0.gguf")   # q8_0: clear argmaxes
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * float(np.abs(want).max())
    assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


@pytest.mark.parametrize("arch", ["gemma2", "olmo2", "granite"])
def test_hidden_only_is_what_the_head_reads(tiny_dir, arch) -> None:
    """forward(hidden_only=True): the final-normed hidden states whose head product (and the
    family's logits scaling / capping) are the logits."""
    folder = tiny_dir / arch
    config = config_from_folder(folder)
    model = build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), get_ops("cpu"))
    ids = np.load(folder / "ids.npy")
    runs = []
    for hidden_only in (False, True):
        kv = KVCache(config, num_blocks=16, block_size=4)
        blocks = BlockManager(kv, enable_prefix_caching=False)
        assert blocks.allocate("s", len(ids))
        tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in kv.windows}
        batch = Batch(ids, np.arange(len(ids), dtype=np.int32), np.zeros(len(ids), np.int32), tables,
                      np.array([3, 17, 39], np.int32))
        runs.append(model.forward(batch, kv, hidden_only=hidden_only).copy())
    logits, hidden = runs
    assert hidden.shape == (3, config.hidden_size)
    again = model.ops.linear(hidden, model.lm_head)
    model.ops.scale(again, model.logits_scale)
    model.ops.softcap(again, model.final_softcap)
    np.testing.assert_array_equal(again, logits)


def test_gguf_tokenizer_is_the_folders(tiny_dir, tiny_ggufs) -> None:
    """The vocabulary llama.cpp's converter wrote (byte-level BPE, gpt-2 pre-tokenizer), as ellm
    rebuilds it, encodes and decodes like the folder's tokenizer.json."""
    from ellm.tokenizer import Tokenizer
    folder = Tokenizer.from_folder(tiny_dir / "qwen3")
    gguf = Tokenizer.from_gguf(GGUFFile(tiny_ggufs / "qwen3-f32.gguf"))
    text = "The window limits how far back a layer may look: 12 + 345 = 357 <|im_end|> ünïcödé  spaces\n\tend"
    assert gguf.encode(text) == folder.encode(text) and len(folder.encode(text)) > 20
    assert gguf.decode(folder.encode(text)) == text


def test_cli_shows_the_architecture_and_its_choices(tiny_dir, capsys) -> None:
    from ellm.cli import main
    assert main(["info", str(tiny_dir / "smollm3")]) == 0
    out = capsys.readouterr().out
    assert "architecture: smollm3 (family module ellm.models.smollm3)" in out and "nope_layers: [1, 3]" in out
    assert main(["info", str(tiny_dir / "qwen2")]) == 0
    assert "sliding_window: [8]" in capsys.readouterr().out
    assert main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()[-1]
    assert listed.startswith("architectures (model_type): ") and "olmo2" in listed and "granite" in listed
