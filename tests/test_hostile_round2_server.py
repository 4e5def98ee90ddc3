"""Hostile input, round two (issue #33), against the real server (uvicorn + SmolLM2 in a
child process):

- a grammar that crashed llguidance (3,000 chained rules) is a 400 naming the limit, and
  the server lives on;
- constraints compile off the event loop: /health answers while a 10,000-option
  guided_choice compiles; the compile is accounted to the request (its metric);
- /detokenize of millions of ids runs off the loop;
- JSON bodies nested past the limit are 400s naming it on every route, guided_json as
  JSON text too; {"$ref": "#"} and mutually recursive refs are 400s at validation;
- a request with both Content-Length and Transfer-Encoding is refused and its
  connection closed (the request smuggled behind it is never answered);
- SIGTERM ends a running stream with an error event and data: [DONE];
- a loopback image URL is refused without a byte of what answered there.
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from served import health_answers_during, python_server  # noqa: E402

_LAUNCH = r"""
import sys, uvicorn, ellm
from ellm.server import create_app
path, port = sys.argv[1], int(sys.argv[-1])
llm = ellm.load(path, max_model_len=512, max_num_seqs=8, progress=False)
app = create_app(llm, served_model_name="m", max_queue=64, allow_image_urls=True)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=20)
"""


@pytest.fixture(scope="module")
def url(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("hostile2-serve") / "server.log"
    with python_server(_LAUNCH, [str(smollm2_gguf)], log, up_within=120) as (_, base):
        yield base


def chat(url: str, timeout: float = 120, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 8, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _lark_chain(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{k}: "x" r{k + 1} | "y"' for k in range(n)] + [f'r{n}: "z"'])


@pytest.mark.parametrize("fields,words", [
    ({"guided_grammar": _lark_chain(3000)}, "number of rules"),
    ({"guided_grammar": _lark_chain(1000)}, "rule depth"),
    ({"grammar": "root ::= r0\n" + "\n".join(f'r{k} ::= "x" r{k + 1} | "y"' for k in range(1500)) + '\nr1500 ::= "z"'},
     "rule depth"),
    ({"guided_choice": [f"o{k}" for k in range(20_000)]}, "number of choices"),
    ({"guided_json": "[" * 5000 + "]" * 5000}, "nested"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}}, "$ref cycle"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "$ref cycle"),
])
def test_hostile_constraints_are_400s_naming_the_limit(url: str, fields: dict, words: str) -> None:
    r = chat(url, **fields)
    assert r.status_code == 400, r.text[:500]
    assert words in r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_constraints_compile_off_the_event_loop(url: str) -> None:
    """A 10,000-option choice takes a while to check and compile; the request is then
    refused (its prompt is over the context), so it lasts about as long as the compile.
    /health requests made meanwhile must be answered (with the compile on the event loop,
    as before, none could be)."""
    tag = time.time_ns() % 100_000   # options no earlier request compiled
    options = [f"opt {tag} {k}" for k in range(10_000)]
    r, during = health_answers_during(url, lambda: chat(
        url, guided_choice=options, messages=[{"role": "user", "content": "hello " * 600}]))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert during >= 3, f"only {during} /health answers while the constraint compiled"
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "ellm_constraint_compile_seconds_count" in metrics
    # and the same constraint runs (compiled once: the second time it is looked up)
    r = chat(url, guided_choice=options, max_tokens=12, temperature=1.0, seed=5)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in options, r.text[:300]


def test_detokenize_of_millions_of_ids_stays_off_the_loop(url: str) -> None:
    raw = json.dumps({"tokens": [42] * 2_000_000}).encode()
    r, during = health_answers_during(url, lambda: httpx.post(
        url + "/detokenize", content=raw, headers={"content-type": "application/json"}, timeout=300))
    assert r.status_code == 200, r.text[:300]
    assert during >= 3, f"only {during} /health answers while the ids were decoded"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/v1/completions", "/tokenize",
                                  "/v1/embeddings", "/detokenize"])
def test_deep_bodies_are_400_naming_the_limit(url: str, path: str) -> None:
    raw = b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert "levels deep" in r.json()["error"]["message"]


def test_content_length_with_transfer_encoding_is_refused_and_closed(url: str) -> None:
    host, port = url.split("//")[1].split(":")
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    req = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(req)
        got = b""
        s.settimeout(10)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            pytest.fail(f"the connection was left open: {got[:300]!r}")
    assert got.startswith(b"HTTP/1.1 400"), got[:300]
    assert got.count(b"HTTP/1.1 ") == 1, got   # the request behind it was never answered


def test_loopback_image_urls_are_refused_without_echo(url: str) -> None:
    port = url.rsplit(":", 1)[1]
    r = chat(url, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/openapi.json"}},
        {"type": "text", "text": "hi"}]}])
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "openapi" not in msg.replace(f"127.0.0.1:{port}/openapi.json", "") and "200" not in msg


def test_sigterm_ends_streams_with_an_error_event_and_done(smollm2_gguf: Path, tmp_path: Path) -> None:
    with python_server(_LAUNCH, [str(smollm2_gguf)], tmp_path / "server.log", up_within=120) as (proc, base):
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
        t = threading.Thread(target=read)
        t.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        t.join(30)   # (the server's grace period is 20 s: the stream ends well before it)
        assert not t.is_alive()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert "server_shutting_down" in lines[-2], lines[-3:]
        assert proc.wait(30) in (0, -signal.SIGTERM)   # (uvicorn re-raises the signal it caught)
