"""The README's commands run as shown.

Every fenced ```bash and ```python block of README.md is run, in its order, unless its
info string says otherwise:

- ```bash no-test / ```python no-test: not run, because it needs what a test here cannot
  have: the network (installing packages, Hugging Face repos), a GPU, or a terminal
  (`ellm chat`). Nothing else may carry it.
- ```bash server: started in the background (the server), and stopped after the blocks
  marked with-server have run against it. Its port is replaced by a free one, in it and
  in those blocks, so the test never meets another server; nothing else is changed.
- ```bash with-server / ```python with-server: run while the server block's server runs.

Shell blocks run under `bash -e -o pipefail` with this environment's `ellm` first on the
PATH, Python blocks in this interpreter, each in a fresh folder. The default model is in
the cache (tests/run.sh pulls it), so the README's `ellm run` commands with it run here;
they cap their replies with --max-tokens / max_tokens to keep this short.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"
# (cibuildwheel runs the tests against the wheel from a folder holding only tests/)
pytestmark = pytest.mark.skipif(not README.is_file(), reason="no README.md beside tests/ (a wheel's test run)")
MAX_LINES = 300
RUNNABLE = {"bash", "python"}
TAGS = {"no-test", "server", "with-server"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    language: str
    tags: frozenset[str]
    code: str
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.language} {' '.join(sorted(self.tags))})".rstrip()


def blocks(text: str) -> list[Block]:
    found = []
    for m in FENCE.finditer(text):
        words = m.group(1).split()
        if not words:
            continue
        found.append(Block(words[0], frozenset(words[1:]), m.group(2), text.count("\n", 0, m.start()) + 1))
    return found


def readme_blocks() -> list[Block]:
    return blocks(README.read_text())


def test_the_readme_is_short_and_its_blocks_are_marked() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    all_blocks = readme_blocks()
    runnable = [b for b in all_blocks if b.language in RUNNABLE]
    assert runnable, "no bash or python blocks found"
    for b in all_blocks:
        assert b.tags <= TAGS, f"{b}: unknown tag(s) {sorted(b.tags - TAGS)}"
        assert b.language in RUNNABLE or not b.tags, f"{b}: tags on a block that is never run"
    servers = [b for b in runnable if "server" in b.tags]
    assert len(servers) <= 1 and (servers or not any("with-server" in b.tags for b in runnable))
    # the README and docs stand alone: no link into the project's working notes
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        assert "../shared" not in page.read_text(), page


def test_the_fence_reader() -> None:
    text = "x\n```bash no-test\npip install a\n```\n```python\nprint(1)\n```\n```\nplain\n```\n"
    got = blocks(text)
    assert [(b.language, sorted(b.tags), b.code, b.line) for b in got] == [
        ("bash", ["no-test"], "pip install a\n", 2), ("python", [], "print(1)\n", 5)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["HF_HUB_OFFLINE"] = "1"   # a block that reached for the hub would be a wrongly marked one
    return env


def _run(block: Block, cwd: Path, env: dict[str, str], port: tuple[str, str] | None) -> None:
    code = block.code if port is None else block.code.replace(*port)
    if block.language == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{block} failed ({proc.returncode}):\n{code}\n--- stdout\n{proc.stdout}\n"
                                  f"--- stderr\n{proc.stderr}")
    assert proc.stdout.strip(), f"{block} printed nothing:\n{code}\n--- stderr\n{proc.stderr}"


def _server_port(code: str) -> str:
    m = re.search(r"--port\s+(\d+)", code)
    assert m, f"the server block names no --port:\n{code}"
    return m.group(1)


def _wait_healthy(server: subprocess.Popen[str], port: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the README's server exited with {server.returncode}:\n{server.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the README's server did not answer /health within {seconds} s")


def test_the_readme_blocks_run(smollm2_gguf: Path, tmp_path: Path) -> None:
    """smollm2_gguf: the default model in the cache, so no block waits for a download."""
    env = _environment()
    runnable = [b for b in readme_blocks() if b.language in RUNNABLE and "no-test" not in b.tags]
    plain = [b for b in runnable if not b.tags]
    for i, block in enumerate(plain):
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        _run(block, folder, env, None)
    server_blocks = [b for b in runnable if "server" in b.tags]
    if not server_blocks:
        return
    pytest.importorskip("uvicorn")
    server_block = server_blocks[0]
    shown, port = _server_port(server_block.code), _free_port()
    swap = (shown, str(port))
    # its own process group, so that stopping it stops the server whatever bash ran it as
    server = subprocess.Popen(["bash", "-e", "-c", server_block.code.replace(*swap)], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_healthy(server, port)
        for i, block in enumerate(b for b in runnable if "with-server" in b.tags):
            folder = tmp_path / f"client{i}"
            folder.mkdir()
            _run(block, folder, env, swap)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
