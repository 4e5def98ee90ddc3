"""The `ellm` command line as a user drives it: `--version`, `ellm run` (a prompt from
stdin, --system, --raw, --ctx-size), and `ellm chat` on a real pseudo-terminal (line
editing and history through readline, a multi-line message, Ctrl-C stopping a reply
while the session goes on, Ctrl-D leaving). Every reply is compared with the Python API
(greedy, so the texts must be equal: batch invariance makes a sequence's tokens the same
in any process).
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ellm
from ellm.cli import CHAT_MAX_TOKENS

CTX = 1024
GREEDY = ["--temperature", "0"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Any:
    with ellm.load(str(smollm2_gguf), max_model_len=CTX, progress=False) as m:
        yield m


def ellm_cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ellm", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_version() -> None:
    proc = ellm_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ellm {ellm.__version__}"


def test_a_reader_that_leaves_early_ends_the_command_quietly() -> None:
    """`ellm info | head -1`: the reader closes the pipe after one line; the command stops
    with the shell's SIGPIPE status and no error message (it used to print 'error: [Errno
    32] Broken pipe' and exit 2)."""
    r, w = os.pipe()
    os.close(r)  # a reader already gone: the first write fails
    proc = subprocess.run([sys.executable, "-m", "ellm", "info"], stdout=w, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert "error" not in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr


def test_run_reads_stdin_and_takes_a_system_prompt(smollm2_gguf: Path, llm: Any) -> None:
    system, question = "Answer in one short sentence.", "What colour is the sky?\nAnswer briefly."
    proc = ellm_cli("run", str(smollm2_gguf), "-", "--system", system, "-n", "20", "-c", str(CTX), *GREEDY,
                    stdin=question)
    assert proc.returncode == 0, proc.stderr
    want = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": question}],
                    max_tokens=20, temperature=0.0).text
    assert proc.stdout == want + "\n"
    raw = ellm_cli("run", str(smollm2_gguf), "The capital of France is", "--raw", "-n", "8", *GREEDY)
    assert raw.returncode == 0 and raw.stdout == llm.generate("The capital of France is", max_tokens=8,
                                                               temperature=0.0).text + "\n"


def test_run_refuses_bad_combinations(smollm2_gguf: Path) -> None:
    empty = ellm_cli("run", str(smollm2_gguf), "-", stdin="  \n")
    assert empty.returncode != 0 and "no prompt on stdin" in empty.stderr
    both = ellm_cli("run", str(smollm2_gguf), "Hi", "--raw", "--system", "x")
    assert both.returncode == 2 and "--system needs the chat template" in both.stderr
    small = ellm_cli("run", str(smollm2_gguf), "word " * 100, "--raw", "-c", "32", "-n", "4")
    assert small.returncode == 2 and "32" in small.stderr and "Traceback" not in small.stderr


def test_run_quantizes_a_folder_at_load(tiny_models_dir: Path) -> None:
    """--quantize (run, chat, bench, serve): a Hugging Face folder's float weights in q8_0,
    as ellm.load(quantize=...) makes them; a type it cannot make is refused by name."""
    folder = tiny_models_dir / "llama"
    proc = ellm_cli("run", str(folder), "The small model", "--raw", "-n", "6", "-c", "256", "--quantize", "q8_0",
                    *GREEDY)
    assert proc.returncode == 0, proc.stderr
    with ellm.load(str(folder), quantize="q8_0", max_model_len=256, progress=False) as q8:
        assert q8.model.layers[0].attn.q.qtype.name == "Q8_0"
        want = q8.generate("The small model", max_tokens=6, temperature=0.0)
    assert proc.stdout == want.text + "\n"
    bad = ellm_cli("run", str(folder), "Hi", "--quantize", "q5_0")
    assert bad.returncode == 2 and "invalid choice: 'q5_0'" in bad.stderr and "q8_0" in bad.stderr


# ---------------------------------------------------------------------------------------
# ellm chat on a pseudo-terminal
# ---------------------------------------------------------------------------------------

class Terminal:
    """A child process on a pty that is its controlling terminal (so ^C is SIGINT)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import pty
        pid, fd = pty.fork()
        if pid == 0:   # the child
            # ^C reaches the program as it would a user's, also when this suite runs with
            # SIGINT ignored (started as a background job, which Python then leaves ignored)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, env)
        self.pid, self.fd, self.buffer = pid, fd, ""

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def read_until(self, marker: str, timeout: float = 120.0) -> str:
        """Everything up to and including the next marker (escape sequences and \\r removed)."""
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {marker!r} within {timeout} s; the screen holds:\n{self.buffer[-2000:]}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:   # the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the program left before {marker!r}:\n{self.buffer[-2000:]}")
                self.buffer += ANSI.sub("", data.decode("utf-8", "replace")).replace("\r", "")
        head, _, self.buffer = self.buffer.partition(marker)
        return head + marker

    def read_some(self, n: int, timeout: float = 120.0) -> str:
        """At least n more characters of the screen (they stay in the buffer)."""
        deadline = time.monotonic() + timeout
        while len(self.buffer) < n and time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                self.buffer += ANSI.sub("", os.read(self.fd, 4096).decode("utf-8", "replace")).replace("\r", "")
        return self.buffer

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with __import__("contextlib").suppress(OSError):
                select.select([self.fd], [], [], 0.2) and os.read(self.fd, 4096)
        os.kill(self.pid, 9)
        raise AssertionError("ellm chat did not exit")


def next_reply(term: Terminal, typed: str) -> str:
    """The model's answer: what the screen shows after the echo of the line `typed`
    (readline may redraw a line several times; the echo ends with the newline of Enter)
    and before the next prompt."""
    term.read_until(typed + "\n")
    return term.read_until(">>> ").removesuffix(">>> ").removesuffix("\n")


def test_chat_on_a_terminal(smollm2_gguf: Path, llm: Any, tmp_path: Path) -> None:
    env = {**os.environ, "ELLM_HOME": str(tmp_path), "TERM": "dumb", "INPUTRC": "/dev/null"}
    term = Terminal([sys.executable, "-m", "ellm", "chat", str(smollm2_gguf), "-c", str(CTX), *GREEDY,
                     "--system", "You are brief."], env)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are brief."}]

    def expect_reply(typed: str) -> None:
        got = next_reply(term, typed)
        want = llm.chat(messages, max_tokens=CHAT_MAX_TOKENS, temperature=0.0).text
        assert got == want, (got, want)
        messages.append({"role": "assistant", "content": got})

    term.read_until(">>> ")
    q1 = "What is the capital of Italy?"
    term.send(q1 + "\r")
    messages.append({"role": "user", "content": q1})
    expect_reply(q1)

    # A message over several lines between triple quotes.
    term.send('"""Name two fruits.\r')
    term.read_until("... ")
    term.send('One red, one yellow."""\r')
    messages.append({"role": "user", "content": "Name two fruits.\nOne red, one yellow."})
    expect_reply('yellow."""')

    # readline: the up arrow walks back through the lines typed (three up: the first question).
    term.send("\x1b[A\x1b[A\x1b[A\r")
    messages.append({"role": "user", "content": q1})
    expect_reply(q1)

    # Ctrl-C while the model writes stops the reply; the session goes on.
    long_q = "Write a long story about a dragon who learns to bake bread."
    term.send(long_q + "\r")
    term.read_until(long_q + "\n")
    term.read_some(40)                          # the reply has started
    term.send("\x03")
    screen = term.read_until(">>> ")
    assert " [stopped]" in screen, screen
    partial = screen.split(" [stopped]")[0].removesuffix("^C")   # the terminal echoes the ^C
    assert len(partial) >= 40
    messages.append({"role": "user", "content": long_q})
    messages.append({"role": "assistant", "content": partial})
    q2 = "Thanks. Say OK."
    term.send(q2 + "\r")
    messages.append({"role": "user", "content": q2})
    got = next_reply(term, q2)
    # The stopped reply is part of the conversation: the next answer follows from it.
    want = llm.chat(messages, max_tokens=None, temperature=0.0).text
    assert got == want, (got, want)

    # Ctrl-C at the prompt drops the line; /clear and an unknown command answer in words.
    term.send("half a line\x03")
    assert "Ctrl-D or /bye leaves" in term.read_until(">>> ")
    term.send("/nope\r")
    assert "unknown command /nope" in term.read_until(">>> ")
    term.send("/clear\r")
    assert "a new conversation" in term.read_until(">>> ")
    term.send("\x04")                          # Ctrl-D
    assert term.wait() == 0
    history = (tmp_path / "chat_history").read_text()
    assert q1 in history and long_q in history and "/clear" in history
