"""Shared test fixtures: the real models, their Hugging Face folders and the goldens.

Models come through ellm.hub (pulled into the cache on first use, instant after).
The Hugging Face folders are made by ``tests/goldens/make.py --folders`` (which
``bash tests/run.sh`` runs when they are missing); a test that needs one FAILS when
it is absent, naming the command, because a skipped test hides a broken setup.
The goldens (``tests/goldens/<model>.npz``) are committed and come from transformers.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ellm import hub

GOLDENS_DIR = Path(__file__).resolve().parent / "goldens"
SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma-3-270m"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: long-running tests (fuzzing, long contexts)"
    )


# ---------------------------------------------------------------------------
# GGUF files, pulled through ellm.hub
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture), 98 MB."""
    return hub.pull(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M (gemma3 architecture, base model), 253 MB."""
    return hub.pull(GEMMA3)


# ---------------------------------------------------------------------------
# Hugging Face folders made from the GGUFs by tests/goldens/make.py
# ---------------------------------------------------------------------------


def hf_folder(model: str, dtype: str) -> Path:
    """``<cache>/hf/<model>-<dtype>``; fails the test (not skips) when it was never made."""
    folder = hub.hf_cache_dir() / f"{model}-{dtype}"
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        pytest.fail(
            f"missing Hugging Face folder {folder}: make it with `bash tests/run.sh`, or "
            f"`python tests/goldens/make.py --folders {hub.hf_cache_dir()}` in a Python "
            "with torch, transformers and gguf",
            pytrace=False,
        )
    return folder


@pytest.fixture(scope="session")
def smollm2_hf_f32() -> Path:
    """SmolLM2 as f32 safetensors in several shards with model.safetensors.index.json."""
    return hf_folder(SMOLLM2, "f32")


@pytest.fixture(scope="session")
def smollm2_hf_bf16() -> Path:
    """SmolLM2 as one bf16 model.safetensors."""
    return hf_folder(SMOLLM2, "bf16")


@pytest.fixture(scope="session")
def gemma3_hf_f32() -> Path:
    """Gemma 3 270M as f32 safetensors in several shards (norm weights in HF form, without +1)."""
    return hf_folder(GEMMA3, "f32")


@pytest.fixture(scope="session")
def gemma3_hf_bf16() -> Path:
    """Gemma 3 270M as one bf16 model.safetensors."""
    return hf_folder(GEMMA3, "bf16")


# ---------------------------------------------------------------------------
# Tiny random models made by transformers (fixed seeds), once per session
# ---------------------------------------------------------------------------


def _made_by_reference(script: str, folder: Path) -> Path:
    """Runs tests/goldens/<script> FOLDER under the reference Python (torch, transformers)."""
    from ref_python import ref_python
    proc = subprocess.run([ref_python(), str(GOLDENS_DIR / script), str(folder)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/goldens/tiny_models.py's folders (<dir>/<family>: weights, ids, logits, greedy),
    shared by tests/test_tiny_models.py and tests/test_trace.py. Treat as read-only, but
    for new subfolders of one's own."""
    return _made_by_reference("tiny_models.py", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/goldens/tiny_vision_models.py's folders (<dir>/smolvlm, <dir>/gemma3, the
    images' pixel values), shared by tests/test_vision_models.py and tests/test_vision_api.py.
    Treat as read-only, but for new subfolders of one's own."""
    return _made_by_reference("tiny_vision_models.py", tmp_path_factory.mktemp("tiny-vision"))


@pytest.fixture(scope="session")
def tiny_vision_ggufs(tiny_vision_dir: Path) -> Path:
    """Both tiny vision folders converted by llama.cpp's converter at f32 (once for the
    session): <dir>/<name>-f32.gguf (the text model), <dir>/mmproj-<name>-f32.gguf (the
    tower and projector)."""
    from ref_python import llama_cpp_dir, ref_python
    llama_cpp = llama_cpp_dir()
    out = tiny_vision_dir / "gguf"
    proc = subprocess.run([ref_python(), str(GOLDENS_DIR / "convert_tiny.py"), llama_cpp, str(out),
                           *(str(tiny_vision_dir / m) for m in ("smolvlm", "gemma3")), "--outtypes", "f32",
                           "--mmproj"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def ops_or_skip(device: str, activations: str = "int8") -> Any:
    """ellm.ops.get_ops(device); for "cuda", a skip saying what is missing (ellm.ops.cuda,
    CuPy, a GPU) when the backend cannot start here. cpu and reference must always start."""
    from ellm.ops import get_ops
    try:
        return get_ops(device, activations=activations)
    except (ImportError, RuntimeError, ValueError, OSError) as e:
        if device != "cuda":
            raise
        pytest.skip(f"no cuda backend here: {e}")


# ---------------------------------------------------------------------------
# Goldens
# ---------------------------------------------------------------------------


@cache
def load_goldens(model: str) -> dict[str, Any]:
    """Read ``tests/goldens/<model>.npz`` into ``{"meta": {...}, "prompts": {name: {...}}}``.

    Each prompt dict merges the readable fields (text, n_tokens, greedy_text,
    messages/template for "chat") with the arrays: ids, last_top_values/ids (64),
    last_argmax, last_logsumexp, greedy_ids, greedy_margins, step_top_values/ids
    (32, 16); "short" also has all_top_values/ids (n_tokens, 16). Prompts: short,
    medium (~300 tokens), chat, and for gemma-3-270m long (~700 tokens).
    The result is cached and shared between tests: treat it as read-only.
    """
    path = GOLDENS_DIR / f"{model}.npz"
    if not path.is_file():
        pytest.fail(
            f"missing goldens {path}: make them with `python tests/goldens/make.py --goldens`"
        )
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        prompts: dict[str, dict[str, Any]] = {
            k: dict(v) for k, v in meta["prompts"].items()
        }
        for key in npz.files:
            if key == "meta":
                continue
            prompt, field = key.split(".", 1)
            value = npz[key]
            prompts[prompt][field] = value.item() if value.ndim == 0 else value
    return {"meta": meta, "prompts": prompts}


@pytest.fixture(scope="session")
def goldens() -> Callable[[str], dict[str, Any]]:
    """``goldens("smollm2-135m-instruct")`` -> the dict described in :func:`load_goldens`."""
    return load_goldens
