"""LLM.embed against transformers' last hidden states on both real models (f32 folders).

The reference runs in a subprocess under ELLM_REF_PYTHON (torch + transformers), on the
same token ids, pooled the same three ways. One prompt is longer than a forward's token
budget, so the chunked path is checked too; a prompt's vector must not depend on the
other prompts in its batch (bit for bit).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm.engine.engine import RequestError
from ref_python import ref_python

SCRIPT = Path(__file__).parent / "goldens" / "hf_embeddings.py"
MAX_BATCH_TOKENS = 64
TEXTS = ["The capital of France is Paris.",
         "def add(a, b):\n    return a + b",
         "Embeddings map text to vectors; similar texts land close together.",
         # longer than MAX_BATCH_TOKENS: runs alone, in chunks
         " ".join(f"word{i}" for i in range(60))]


def reference(folder: Path, prompts: list[list[int]], tmp_path: Path) -> dict[str, np.ndarray]:
    ref = ref_python()
    ids_path, out = tmp_path / "ids.json", tmp_path / "ref.npz"
    ids_path.write_text(json.dumps(prompts))
    subprocess.run([ref, str(SCRIPT), str(folder), str(ids_path), str(out)], check=True,
                   capture_output=True, text=True, timeout=600)
    with np.load(out) as npz:
        return {k: npz[k] for k in npz.files}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("fixture", ["smollm2_hf_f32", "gemma3_hf_f32"])
def test_embed_matches_transformers(fixture, request, tmp_path) -> None:
    folder = request.getfixturevalue(fixture)
    with ellm.load(folder, max_model_len=512, max_batch_tokens=MAX_BATCH_TOKENS, progress=False) as llm:
        prompts = [llm.encode_prompt(t) for t in TEXTS]
        assert len(prompts[-1]) > MAX_BATCH_TOKENS
        want = reference(folder, prompts, tmp_path)
        for pooling in ("mean", "last", "cls"):
            raw = llm.embed(TEXTS, pooling=pooling, normalize=False)
            assert raw.dtype == np.float32 and raw.shape == (len(TEXTS), llm.config.hidden_size)
            cos = cosines(raw, want[pooling])
            assert cos.min() >= 0.999, (pooling, cos)
            np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(want[pooling], axis=1),
                                       rtol=1e-2)
            if pooling == "mean":
                raw_mean = raw
        mean = llm.embed(TEXTS)   # normalize=True is the default
        np.testing.assert_allclose(np.linalg.norm(mean, axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(mean, raw_mean / np.linalg.norm(raw_mean, axis=1, keepdims=True),
                                   rtol=1e-5, atol=1e-7)
        # batch invariance: alone (as token ids), through asyncio in another order: the same bits
        np.testing.assert_array_equal(llm.embed(prompts[1]), mean[1:2])
        np.testing.assert_array_equal(asyncio.run(llm.aembed(TEXTS[::-1])), mean[::-1])


def test_embed_refuses_bad_input(smollm2_gguf) -> None:
    with ellm.load(smollm2_gguf, max_model_len=64, progress=False) as llm:
        with pytest.raises(ValueError, match="pooling"):
            llm.embed("x", pooling="max")
        with pytest.raises(RequestError, match="context of 64"):
            llm.embed(["ok", [1] * 65])
        with pytest.raises(ValueError, match="empty"):
            llm.embed([[]])
        with pytest.raises(RequestError, match="vocabulary"):
            llm.embed([[10 ** 9]])
        assert llm.embed([]).shape == (0, llm.config.hidden_size)
        snap = llm.async_engine.snapshot_now()
        assert snap.kv_blocks_used == 0
