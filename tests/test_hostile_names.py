"""Name confusion: a file or folder in the working directory named like a known model
must not silently win over it. hub.resolve reads a bare known name as the known model
(saying that a local entry of that name was not used), anything path-like as a path,
and a bare unknown word as an unknown name even when a file of that name exists; and
ellm.load says what it loaded."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import ellm
from ellm import hub


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("make", ["folder", "gguf_folder", "file", "fifo"])
def test_local_entry_named_like_a_known_model_does_not_win(workdir: Path, smollm2_gguf: Path, make: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    name = "smollm2-135m-instruct"
    local = workdir / name
    if make == "folder":
        local.mkdir()
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"")
    elif make == "gguf_folder":
        local.mkdir()
        shutil.copy(smollm2_gguf, local / "impostor.gguf")
    elif make == "file":
        shutil.copy(smollm2_gguf, local)
    else:
        os.mkfifo(local)
    got = hub.resolve(name)
    assert got.origin == "known" and got.path == smollm2_gguf and got.name == name
    err = capsys.readouterr().err
    assert "not used" in err and f"./{name}" in err
    # written as a path, the local entry is what loads (or is refused, for the FIFO)
    if make == "fifo":
        with pytest.raises(hub.ModelNotFoundError, match="not a regular file"):
            hub.resolve(f"./{name}")
    else:
        as_path = hub.resolve(f"./{name}")
        assert as_path.origin == "path" and as_path.path != smollm2_gguf
        assert hub.resolve(local).origin == "path"  # a Path object is always a path


def test_bare_unknown_word_is_not_read_as_a_path(workdir: Path, smollm2_gguf: Path) -> None:
    shutil.copy(smollm2_gguf, workdir / "mymodel")
    with pytest.raises(hub.ModelNotFoundError, match=r"unknown model 'mymodel' \(a local mymodel exists: write ./mymodel"):
        hub.resolve("mymodel")
    assert hub.resolve("./mymodel").origin == "path"
    assert hub.resolve(str(workdir / "mymodel")).origin == "path"


def test_path_like_strings_are_paths(workdir: Path, smollm2_gguf: Path) -> None:
    shutil.copy(smollm2_gguf, workdir / "gemma-3-270m.gguf")  # the suffix makes it a path
    got = hub.resolve("gemma-3-270m.gguf")
    assert got.origin == "path" and got.path == workdir / "gemma-3-270m.gguf"
    (workdir / "org2" / "name").mkdir(parents=True)
    shutil.copy(smollm2_gguf, workdir / "org2" / "name" / "m.gguf")
    # "org2/name" matches a repo id, but an existing local path of that spelling is a path
    got = hub.resolve("org2/name")
    assert got.origin == "path" and got.path == workdir / "org2" / "name" / "m.gguf"


def test_load_says_what_it_loaded(workdir: Path, smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(smollm2_gguf, workdir / "copy.gguf")
    ellm.load("./copy.gguf", max_model_len=64, max_num_seqs=1).close()
    err = capsys.readouterr().err
    assert f"ellm: loading copy (local path, GGUF {workdir / 'copy.gguf'})" in err
    ellm.load("smollm2-135m-instruct", max_model_len=64, max_num_seqs=1).close()
    err = capsys.readouterr().err
    assert f"ellm: loading smollm2-135m-instruct (known model, GGUF {smollm2_gguf})" in err
    ellm.load("smollm2-135m-instruct", max_model_len=64, max_num_seqs=1, progress=False).close()
    assert "loading" not in capsys.readouterr().err
