"""Models from Hugging Face repos: which file `ellm run org/name[:TAG]` loads.

No hub is reachable here, so the choice (hub.choose_gguf) is tested on repo listings as
`huggingface_hub.list_repo_files` returns them, spelled the way the publishers of GGUF
repos name their files; and the whole path, through the real huggingface_hub, on a
Hugging Face cache laid out on disk as huggingface_hub lays it (refs/main -> a snapshot
folder), read with local_files_only (`resolve(..., pull=False)`), holding the real
SmolLM2 GGUF and Hugging Face folder.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from ellm import hub

huggingface_hub = pytest.importorskip("huggingface_hub")

# One publisher's layout: the model name, then "-<QUANT>.gguf", one file per quantization.
SMOLLM2_360M_GGUF = [".gitattributes", "README.md",
                     "SmolLM2-360M-Instruct-IQ4_XS.gguf", "SmolLM2-360M-Instruct-Q4_K.gguf",
                     "SmolLM2-360M-Instruct-Q4_K_M.gguf", "SmolLM2-360M-Instruct-Q4_K_S.gguf",
                     "SmolLM2-360M-Instruct-Q8_0.gguf", "SmolLM2-360M-Instruct-f16.gguf"]
# Lower-case names, and no Q4_K_M.
QWEN_GGUF = ["LICENSE", "README.md", "qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct-q8_0.gguf",
             "qwen2.5-0.5b-instruct-q5_0.gguf"]
# A vision model: the text model beside its projector.
SMOLVLM_GGUF = ["README.md", "SmolVLM-256M-Instruct-Q8_0.gguf", "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf",
                "SmolVLM-256M-Instruct-f16.gguf", "mmproj-SmolVLM-256M-Instruct-f16.gguf"]
# A large model: quantizations in folders, some split into parts.
SPLIT_GGUF = ["README.md", "Q2_K/Model-Q2_K.gguf",
              "Q4_K_M/Model-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/Model-Q4_K_M-00002-of-00002.gguf"]
# A safetensors repo that also ships one GGUF.
BOTH = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "model-q8_0.gguf"]
ONE_GGUF = ["README.md", "model.Q6_K.gguf"]


@pytest.mark.parametrize("files,selector,chosen", [
    (SMOLLM2_360M_GGUF, None, "SmolLM2-360M-Instruct-Q4_K_M.gguf"),        # the default tag
    (SMOLLM2_360M_GGUF, "Q8_0", "SmolLM2-360M-Instruct-Q8_0.gguf"),
    (SMOLLM2_360M_GGUF, "q4_k", "SmolLM2-360M-Instruct-Q4_K.gguf"),          # not Q4_K_M or Q4_K_S
    (SMOLLM2_360M_GGUF, "F16", "SmolLM2-360M-Instruct-f16.gguf"),
    (SMOLLM2_360M_GGUF, "SmolLM2-360M-Instruct-IQ4_XS.gguf", "SmolLM2-360M-Instruct-IQ4_XS.gguf"),
    (QWEN_GGUF, "Q5_0", "qwen2.5-0.5b-instruct-q5_0.gguf"),
    (SMOLVLM_GGUF, "Q8_0", "SmolVLM-256M-Instruct-Q8_0.gguf"),               # never the projector
    (SMOLVLM_GGUF, "mmproj-SmolVLM-256M-Instruct-f16.gguf", "mmproj-SmolVLM-256M-Instruct-f16.gguf"),
    (SPLIT_GGUF, "Q2_K", "Q2_K/Model-Q2_K.gguf"),
    (SPLIT_GGUF, "Model-Q2_K.gguf", "Q2_K/Model-Q2_K.gguf"),                 # a name alone, in a folder
    (BOTH, None, None),                                                       # the safetensors folder
    (BOTH, "Q8_0", "model-q8_0.gguf"),
    (ONE_GGUF, None, "model.Q6_K.gguf"),                                      # the only one
])
def test_a_repo_listing_gives_one_file(files: list[str], selector: str | None, chosen: str | None) -> None:
    assert hub.choose_gguf("org/repo", files, selector) == chosen


@pytest.mark.parametrize("files,selector,message", [
    (QWEN_GGUF, None, r"holds 3 GGUF files; choose one with org/repo:TAG.*q8_0"),   # no Q4_K_M to default to
    (SMOLLM2_360M_GGUF, "Q3_K_L", r"no GGUF file tagged 'Q3_K_L'.*Q4_K_M"),
    (SMOLLM2_360M_GGUF, "Q4", r"no GGUF file tagged 'Q4'"),                         # a part, not a prefix
    (SMOLLM2_360M_GGUF, "other.gguf", r"no file is named 'other.gguf'"),
    (SMOLVLM_GGUF, None, r"holds 2 GGUF files"),
    (SPLIT_GGUF, "Q4_K_M", r"one part of a split GGUF.*gguf-split --merge"),
    (["README.md", "weights.bin"], None, r"neither config.json \+ \*.safetensors nor a model .gguf"),
    (["a/x-Q8_0.gguf", "b/x-Q8_0.gguf"], "Q8_0", r"2 GGUF files are tagged 'Q8_0'; name one"),
    (["a/x-Q8_0.gguf", "b/x-Q8_0.gguf"], "x-Q8_0.gguf", r"several files are named"),
])
def test_a_listing_without_one_answer_is_a_clear_error(files: list[str], selector: str | None,
                                                       message: str) -> None:
    with pytest.raises(hub.ModelNotFoundError, match=message) as info:
        hub.choose_gguf("org/repo", files, selector)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["org/Repo-GGUF:Q4_K_M", "org/Repo-GGUF:model.Q4_K_M.gguf",
                                  "org/Repo-GGUF/model.gguf", "org/Repo-GGUF/sub/dir/model-Q8_0.gguf"])
def test_gguf_repo_sources_read_as_models(text: str) -> None:
    assert hub.names_a_model(text)
    m = hub._HUB_GGUF.match(text)
    assert m and m["repo"] == "org/Repo-GGUF"


# -- through the real huggingface_hub, on a cache laid out on disk ------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached_repo(cache: Path, repo_id: str, files: dict[str, Path | bytes]) -> Path:
    """A repo in huggingface_hub's cache layout: models--org--name/refs/main holds the
    commit, snapshots/<commit>/ the files (links to real ones, as the hub's blobs are)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content)
        else:
            path.write_bytes(content)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    # where huggingface_hub looks, and its offline switch, as its HF_HUB_CACHE and
    # HF_HUB_OFFLINE variables set them when it is imported
    constants = importlib.import_module("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_gguf_repo_resolves_by_tag_from_the_cache(hf_cache: Path, smollm2_gguf: Path) -> None:
    snapshot = _cached_repo(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {
        "README.md": b"# SmolLM2", "smollm2-135m-instruct-q4_1.gguf": smollm2_gguf,
        "smollm2-135m-instruct-q8_0.gguf": b"not pulled in this test"})
    got = hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", pull=False)
    assert got == hub.ResolvedModel("gguf", snapshot / "smollm2-135m-instruct-q4_1.gguf",
                                    "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1")
    assert got.origin == "hub" and got.path.resolve() == smollm2_gguf.resolve()
    by_file = hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-135m-instruct-q4_1.gguf", pull=False)
    assert by_file.path == got.path
    with pytest.raises(hub.ModelNotFoundError, match="holds 2 GGUF files"):
        hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", pull=False)
    with pytest.raises(hub.ModelNotFoundError, match="no GGUF file tagged 'Q2_K'"):
        hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q2_K", pull=False)


def test_a_safetensors_repo_resolves_to_its_folder(hf_cache: Path, smollm2_hf_f32: Path) -> None:
    snapshot = _cached_repo(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct",
                            {p.name: p for p in smollm2_hf_f32.iterdir() if p.is_file()})
    got = hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct", pull=False)
    assert got == hub.ResolvedModel("hf", snapshot, "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_repo_not_in_the_cache_is_a_pull_error_naming_it(hf_cache: Path) -> None:
    with pytest.raises(hub.PullError, match="org/absent:Q8_0"):
        hub.resolve("org/absent:Q8_0", pull=False)
    # pulling needs the hub's listing, which is offline here: the error names the repo too
    with pytest.raises(hub.PullError, match="org/absent"):
        hub.resolve("org/absent")


def test_a_gguf_repo_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(hub.ModelNotFoundError, match=r"ellm-engine\[hub\]"):
        hub.resolve("org/Repo-GGUF:Q4_K_M")
