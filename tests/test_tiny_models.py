"""Every architecture, on tiny random models made by transformers (tests/goldens/tiny_models.py):
llama with llama-3 RoPE scaling, Gemma 1, Gemma 2 (soft-capping, sliding window), Gemma 3,
and the families of the registry: Qwen2 (qkv bias, sliding upper layers), Qwen3 (q/k norm,
own head_dim), Mistral (window on every layer), SmolLM3 (NoPE layers), OLMo 2 (post-norms,
whole-projection q/k norm), Granite (multipliers), Phi-3 (fused projections, partial rotary,
LongRoPE with its attention factor, a window), Qwen3-MoE (top-k experts; with and without
renormalisation, all-MoE and with a dense layer).

Each model's logits are compared with transformers' at every position, on the C kernels
and on the reference ops, in one pass and fed in chunks then one token at a time; its
greedy continuation with transformers' greedy ids; batched greedy with one at a time."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm.config import ModelConfig
from ellm.engine.kv_cache import BlockManager, KVCache
from ellm.formats.safetensors import SafetensorsFolder
from ellm.models import build_model
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.sampling_params import SamplingParams
from ellm.weights import SafetensorsWeights

ARCHS = ["llama", "gemma", "gemma2", "gemma3_text"]
FAMILIES = ["qwen2", "qwen3", "mistral", "smollm3", "olmo2", "granite", "phi3", "qwen3_moe", "qwen3_moe_mixed"]
CHUNKS = [13, 7, 10] + [1] * 10   # chunked prefill, then decode: 40 tokens
SCRIPT = Path(__file__).parent / "goldens" / "tiny_models.py"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    ref = os.environ.get("ELLM_REF_PYTHON")
    if not ref:
        pytest.fail("ELLM_REF_PYTHON is not set: run the tests through `bash tests/run.sh`, or point it at a "
                    "Python with torch and transformers", pytrace=False)
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([ref, str(SCRIPT), str(out)], check=True, capture_output=True, text=True)
    return out


def _forward(folder: Path, device: str, chunks: list[int]) -> np.ndarray:
    """Logits at every position, feeding the tokens in the given chunk sizes."""
    config = ModelConfig.from_folder(folder)
    model = build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), get_ops(device))
    ids = np.load(folder / "ids.npy")
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", ["cpu", "reference"])
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
@pytest.mark.parametrize("device", ["cpu", "reference"])
@pytest.mark.parametrize("chunks", [[40], CHUNKS], ids=["one-pass", "chunked+decode"])
def test_family_matches_transformers(tiny_dir, arch, device, chunks) -> None:
    want = np.load(tiny_dir / arch / "logits.npy")
    got = _forward(tiny_dir / arch, device, chunks)
    _assert_close_relative(got, want)
    # the same argmax wherever transformers' top two are further apart than the bound
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2e-3 * float(np.abs(want).max())
    assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


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
