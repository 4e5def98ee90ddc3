"""`ellm serve` in a child process, for tests that talk to a real server: started on a
free loopback port, waited for through /health, stopped at the end; by default its exit
status and log are checked for a crash."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def child_server(command: Callable[[int], list[str]], log: Path, up_within: float = 180, poll: float = 0.3,
                 check_exit: bool = True) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Runs command(port) (a server listening on 127.0.0.1:port), its output into log, and
    yields (the process, its base URL) once /health answers. check_exit: the server must
    end by our SIGTERM (status 0 or -15), with no traceback in its log."""
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen(command(port), stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + up_within
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up in {up_within:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(poll)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if check_exit:
        assert proc.returncode in (0, -15), log.read_text()[-4000:]
        assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


@contextmanager
def serve_process(args: list[str], log: Path, up_within: float = 180, poll: float = 0.3,
                  check_exit: bool = True) -> Iterator[str]:
    """Runs `ellm serve ARGS --host 127.0.0.1 --port P` (child_server) and yields its base URL."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "ellm", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with child_server(command, log, up_within, poll, check_exit) as (_, url):
        yield url


@contextmanager
def python_server(code: str, args: list[str], log: Path, up_within: float = 180, poll: float = 0.2,
                  check_exit: bool = True) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Runs `python -c CODE ARGS... PORT` (child_server): for a server a test builds with
    create_app and settings the CLI does not have; CODE reads its port from sys.argv[-1]."""
    with child_server(lambda port: [sys.executable, "-c", code, *args, str(port)], log, up_within, poll,
                      check_exit) as started:
        yield started


def health_answers_during(url: str, request: Callable[[], T]) -> tuple[T, int]:
    """Runs request() while another thread asks url's /health every 10 ms; returns its
    result and how many /health answers came back while it ran (none, if the request
    held the server's event loop)."""
    answers: list[None] = []
    done = threading.Event()

    def pinger() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                if c.get(url + "/health").status_code == 200:
                    answers.append(None)
                time.sleep(0.01)

    t = threading.Thread(target=pinger)
    t.start()
    try:
        time.sleep(0.2)
        before = len(answers)
        result = request()
        during = len(answers) - before
    finally:
        done.set()
        t.join(30)
    return result, during
