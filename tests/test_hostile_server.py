"""Hostile HTTP clients against the real server (uvicorn + the real model in a child
process, with short timeouts so the tests stay quick):

- a lone UTF-16 surrogate anywhere a text reaches the tokenizer, and JSON numbers of
  thousands of digits, are 400s naming the field, never 500s;
- tokenizing runs off the event loop: /health keeps answering while a long prompt is
  tokenized; prompts over the character limit are refused before tokenizing;
- a client that sends its headers or its body too slowly is dropped (header timeout,
  408), and one that stops reading a stream has its generation aborted (bounded write,
  driven at the ASGI level with a client whose socket never drains);
- a wrong method is a 405 with an Allow header.
"""
from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from served import health_answers_during, python_server  # noqa: E402

TIMEOUT_S = 2.0
MAX_PROMPT_CHARS = 300_000

_LAUNCH = r"""
import sys, uvicorn, ellm
from ellm.server import create_app
from ellm.server.timeouts import header_timeout_protocol
path, timeout, max_chars, port = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = ellm.load(path, max_model_len=512, max_num_seqs=8, progress=False)
app = create_app(llm, served_model_name="m", max_queue=16)
cfg = app.state.server.cfg
cfg.read_timeout = cfg.write_timeout = timeout
cfg.max_prompt_chars = max_chars
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=header_timeout_protocol(timeout),
            timeout_keep_alive=5)
"""


@pytest.fixture(scope="module")
def url(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("hostile-serve") / "server.log"
    with python_server(_LAUNCH, [str(smollm2_gguf), str(TIMEOUT_S), str(MAX_PROMPT_CHARS)], log,
                       up_within=120) as (_, base):
        yield base


def post(url: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}'),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}],'
                              b' "max_tokens": 2}')),
    ("/v1/chat/completions", (b'{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content":'
                              b' "a\\udbff\\u0041"}], "max_tokens": 2, "stream": true}')),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["fine", "\\udc00"], "max_tokens": 2}'),
    ("/tokenize", b'{"prompt": "a\\ud800b"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/embeddings", b'{"input": "\\ud83d"}'),
])
def test_lone_surrogates_are_400(url: str, path: str, body: bytes) -> None:
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] in ("messages", "prompt", "input", "prompt[1]")


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "seed", "top_k", "n", "logprobs"])
def test_integers_of_thousands_of_digits_are_400(url: str, field: str) -> None:
    raw = b'{"prompt": "hi", "max_tokens": 2, "' + field.encode() + b'": ' + b"7" * 5000 + b"}"
    r = post(url, "/v1/completions", raw.replace(b'"max_tokens": 2, "max_tokens"', b'"max_tokens"'))
    assert r.status_code == 400, r.text
    r = post(url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "' + field.encode()
             + b'": -' + b"9" * 4500 + b"}")
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"),
                                               ("POST", "/health", "GET"), ("DELETE", "/v1/models", "GET")])
def test_405_has_allow(url: str, method: str, path: str, allow: str) -> None:
    r = httpx.request(method, url + path, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == allow and "error" in r.json()


def test_prompt_over_the_character_limit_is_refused_before_tokenizing(url: str) -> None:
    big = "word " * (MAX_PROMPT_CHARS // 5 + 1)
    r = httpx.post(url + "/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"


def test_health_answers_while_a_long_prompt_is_tokenized(url: str) -> None:
    """The long prompt (just under the limit, far over the context) is refused only after
    it is tokenized, which takes a while; /health requests made meanwhile must be answered
    before it (with tokenizing on the event loop, none could be)."""
    long_prompt = "hello world, " * (MAX_PROMPT_CHARS // 13 - 10)
    r, during = health_answers_during(url, lambda: httpx.post(
        url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}, timeout=120))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert during >= 3, f"only {during} /health answers while the prompt was tokenized"


def test_slow_headers_are_dropped(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    for partial in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n", b"POST /v1/completions HTTP/1.1\r\n"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(partial)
            s.settimeout(TIMEOUT_S * 10)
            assert s.recv(100) == b""  # closed by the server, not answered


def test_slow_body_is_408(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"prompt\": ")
        s.settimeout(TIMEOUT_S * 10)
        head = s.recv(200)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert httpx.get(url + "/health", timeout=10).json()["requests"] == 0


# -- bounded write: a client that never reads -------------------------------------------------

def test_stream_to_a_client_that_never_reads_is_aborted(smollm2_gguf: Path) -> None:
    """Drives the app at the ASGI level: the 'socket' accepts the headers and a first event,
    then never drains (send() blocks, as uvicorn's does when the client's window is full).
    The write deadline must give up, and the request's generation must be aborted with
    its KV blocks back, long before its 400 tokens are done."""
    import ellm
    from ellm.server import create_app

    llm = ellm.load(smollm2_gguf, max_model_len=512, max_num_seqs=4, progress=False)
    app = create_app(llm, served_model_name="m")
    server = app.state.server
    server.cfg.write_timeout = 0.5
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    scope: dict[str, Any] = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("t", 80),
                             "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def main() -> tuple[int, Any]:
        server.engine.start()
        gave_body = False
        forever = asyncio.Event()

        async def receive() -> dict:
            nonlocal gave_body
            if not gave_body:
                gave_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await forever.wait()  # the client never hangs up
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            sent.append(msg)
            if msg["type"] == "http.response.body" and len(sent) > 2:
                await forever.wait()  # the client's window is full from here on

        await asyncio.wait_for(app(scope, receive, send), 60)
        for _ in range(200):  # the abort reaches the engine thread within a step
            snap = server.engine.snapshot_now()
            if snap.num_requests == 0:
                break
            await asyncio.sleep(0.05)
        return len(sent), server.engine.snapshot_now()

    try:
        n_sent, snap = asyncio.run(main())
    finally:
        server.engine.shutdown()
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert n_sent < 10  # it stopped at the first send that did not finish
    assert snap.num_requests == 0 and snap.kv_blocks_used == 0, snap
    assert llm.engine.stats["generation_tokens"] < 400, "the generation ran to the end for nobody"
