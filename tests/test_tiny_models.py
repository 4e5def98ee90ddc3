"""Every architecture, on tiny random models made by transformers (tests/goldens/tiny_models.py):
llama with llama-3 RoPE scaling, Gemma 1, Gemma 2 (soft-capping, sliding window), Gemma 3."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ellm.config import ModelConfig
from ellm.engine.kv_cache import BlockManager, KVCache
from ellm.formats.safetensors import SafetensorsFolder
from ellm.models import build_model
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.weights import SafetensorsWeights

ARCHS = ["llama", "gemma", "gemma2", "gemma3_text"]
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
