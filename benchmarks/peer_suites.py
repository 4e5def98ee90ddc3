"""The peers' own server tests, as a representative subset re-stated against `ellm serve`.

llama.cpp (tools/server/tests/unit: test_chat_completion, test_tool_call, test_embedding,
test_tokenize, test_completion, test_security, test_compat_oai_responses) and vLLM
(tests/entrypoints/openai: test_completion, test_chat, test_tokenization, the responses
tests) check their servers with their own requests. This script sends requests of the
same kinds, written here from what those tests check (not copied), to a running ellm
server or one it starts, and reports each check as passed or failed. Checks of features
only the peer has (llama.cpp's /completion and /slots endpoints, its `timings` and
`n_probs` fields, vLLM's beam search and prompt logprobs) are marked peer-only: for those
ellm must answer with a 400 that names the field, or (endpoints) a 404, never a 5xx and
never a silent success; that is what is checked for them.

    python benchmarks/peer_suites.py                      # starts ellm serve (SmolLM2)
    python benchmarks/peer_suites.py --url http://127.0.0.1:8000 --model NAME
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

CHECKS: list[Check] = []


@dataclass
class Check:
    suite: str
    name: str
    fn: Callable[[Any], None]
    peer_only: str = ""      # what the peer has that ellm does not (checked: refused by name)


def check(suite: str, peer_only: str = "") -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def add(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        CHECKS.append(Check(suite, fn.__name__, fn, peer_only))
        return fn
    return add


class Client:
    def __init__(self, url: str, model: str, key: str | None) -> None:
        self.model = model
        self.http = httpx.Client(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})

    def post(self, path: str, **body: Any) -> httpx.Response:
        return self.http.post(path, json=body)

    def ok(self, path: str, **body: Any) -> Any:
        r = self.post(path, **body)
        assert r.status_code == 200, f"{r.status_code}: {r.text[:300]}"
        return r.json()

    def chat(self, content: str = "Say hi.", **body: Any) -> Any:
        return self.ok("/v1/chat/completions", model=self.model,
                       messages=[{"role": "user", "content": content}], **body)

    def events(self, path: str, **body: Any) -> list[Any]:
        r = self.post(path, stream=True, **body)
        assert r.status_code == 200, r.text[:300]
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]" or path == "/v1/responses", lines[-1:]
        return [json.loads(x) for x in lines if x != "[DONE]"]

    def refused(self, path: str, param: str, **body: Any) -> None:
        r = self.post(path, **body)
        assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
        assert r.json()["error"]["param"] == param, r.text[:300]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
PYTHON = {"type": "function", "function": {"name": "python", "description": "Run Python code",
                                           "parameters": {"type": "object", "properties": {
                                               "code": {"type": "string", "maxLength": 60}}, "required": ["code"]}}}


# -- llama.cpp: test_chat_completion --------------------------------------------------------

@check("llama.cpp/test_chat_completion")
def chat_basic(c: Client) -> None:
    b = c.chat(max_tokens=8, temperature=0)
    ch = b["choices"][0]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert ch["finish_reason"] in ("stop", "length") and b["usage"]["completion_tokens"] <= 8
    assert b["object"] == "chat.completion" and b["id"]


@check("llama.cpp/test_chat_completion")
def chat_stream_matches(c: Client) -> None:
    whole = c.chat(max_tokens=10, temperature=0)["choices"][0]["message"]["content"]
    ev = c.events("/v1/chat/completions", model=c.model, messages=[{"role": "user", "content": "Say hi."}],
                  max_tokens=10, temperature=0)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e["choices"]) == whole
    assert ev[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@check("llama.cpp/test_chat_completion")
def chat_stream_include_usage(c: Client) -> None:
    ev = c.events("/v1/chat/completions", model=c.model, messages=[{"role": "user", "content": "Hi"}],
                  max_tokens=4, stream_options={"include_usage": True})
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] >= 1


@check("llama.cpp/test_chat_completion")
def chat_response_format_json_object(c: Client) -> None:
    out = c.chat("Give me a JSON object about a cat.", max_tokens=60, response_format={"type": "json_object"})
    ch = out["choices"][0]
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(ch["message"]["content"]), dict)


@check("llama.cpp/test_chat_completion")
def chat_response_format_schema(c: Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    out = c.chat("A number.", max_tokens=20, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema}})
    v = json.loads(out["choices"][0]["message"]["content"])
    assert set(v) == {"n"} and 0 <= v["n"] <= 9


@check("llama.cpp/test_chat_completion")
def chat_invalid_response_format(c: Client) -> None:
    c.refused("/v1/chat/completions", "response_format.type", model=c.model,
              messages=[{"role": "user", "content": "x"}], response_format={"type": "sql"})


@check("llama.cpp/test_chat_completion")
def chat_logprobs(c: Client) -> None:
    out = c.chat(max_tokens=5, logprobs=True, top_logprobs=3, temperature=0)
    lps = out["choices"][0]["logprobs"]["content"]
    assert len(lps) == out["usage"]["completion_tokens"] and all(len(x["top_logprobs"]) == 3 for x in lps)
    assert "".join(x["token"] for x in lps) == out["choices"][0]["message"]["content"]


@check("llama.cpp/test_chat_completion")
def chat_template_kwargs(c: Client) -> None:
    c.chat(max_tokens=2, chat_template_kwargs={"enable_thinking": False})


@check("llama.cpp/test_chat_completion")
def chat_context_overflow_is_400(c: Client) -> None:
    r = c.post("/v1/chat/completions", model=c.model, messages=[{"role": "user", "content": "word " * 9000}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]


@check("llama.cpp/test_chat_completion", peer_only="llama.cpp's n_probs (refused by name; logprobs is OpenAI's)")
def chat_n_probs(c: Client) -> None:
    c.refused("/v1/chat/completions", "n_probs", model=c.model, messages=[{"role": "user", "content": "x"}], n_probs=3)


# -- llama.cpp: test_tool_call ----------------------------------------------------------

@check("llama.cpp/test_tool_call")
def tool_required(c: Client) -> None:
    out = c.chat("What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=60)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])["city"], str)


@check("llama.cpp/test_tool_call")
def tool_named(c: Client) -> None:
    out = c.chat("Print hello.", tools=[WEATHER, PYTHON], max_tokens=80,
                 tool_choice={"type": "function", "function": {"name": "python"}})
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["name"] for t in calls] == ["python"]


@check("llama.cpp/test_tool_call")
def tool_none(c: Client) -> None:
    out = c.chat("What is the weather in Paris?", tools=[WEATHER], tool_choice="none", max_tokens=10)
    assert "tool_calls" not in out["choices"][0]["message"] or not out["choices"][0]["message"]["tool_calls"]


@check("llama.cpp/test_tool_call")
def tool_stream(c: Client) -> None:
    ev = c.events("/v1/chat/completions", model=c.model, messages=[{"role": "user", "content": "Weather in Rome?"}],
                  tools=[WEATHER], tool_choice="required", max_tokens=60)
    calls = [tc for e in ev if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and json.loads(calls[0]["function"]["arguments"])
    assert ev[-1]["choices"][0]["finish_reason"] == "tool_calls"


@check("llama.cpp/test_tool_call")
def tool_history_round_trip(c: Client) -> None:
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    c.ok("/v1/chat/completions", model=c.model, messages=msgs, tools=[WEATHER], max_tokens=10)


# -- llama.cpp: test_embedding ----------------------------------------------------------

@check("llama.cpp/test_embedding")
def embedding_single_and_many(c: Client) -> None:
    one = c.ok("/v1/embeddings", model=c.model, input="I believe the meaning of life is")
    many = c.ok("/v1/embeddings", model=c.model, input=["a", "bb", "I believe the meaning of life is"])
    assert len(many["data"]) == 3 and [d["index"] for d in many["data"]] == [0, 1, 2]
    assert abs(sum(x * x for x in one["data"][0]["embedding"]) - 1) < 1e-3
    assert max(abs(a - b) for a, b in zip(one["data"][0]["embedding"], many["data"][2]["embedding"])) < 1e-4


@check("llama.cpp/test_embedding")
def embedding_base64(c: Client) -> None:
    import base64
    import struct
    f = c.ok("/v1/embeddings", model=c.model, input="hello")["data"][0]["embedding"]
    b = c.ok("/v1/embeddings", model=c.model, input="hello", encoding_format="base64")["data"][0]["embedding"]
    raw = base64.b64decode(b)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == [struct.unpack("<f", struct.pack("<f", x))[0] for x in f]


@check("llama.cpp/test_embedding")
def embedding_token_ids(c: Client) -> None:
    ids = c.ok("/tokenize", model=c.model, prompt="hello world")["tokens"]
    a = c.ok("/v1/embeddings", model=c.model, input=ids)["data"][0]["embedding"]
    b = c.ok("/v1/embeddings", model=c.model, input="hello world")["data"][0]["embedding"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@check("llama.cpp/test_embedding", peer_only="llama.cpp's non-OpenAI /embedding endpoint")
def embedding_native_endpoint(c: Client) -> None:
    assert c.post("/embedding", content="hi").status_code == 404


@check("llama.cpp/test_embedding")
def embedding_empty_input_is_400(c: Client) -> None:
    assert c.post("/v1/embeddings", model=c.model, input="").status_code == 400


# -- llama.cpp: test_tokenize -----------------------------------------------------------

@check("llama.cpp/test_tokenize")
def tokenize_round_trip(c: Client) -> None:
    text = "What is the capital of France ? é 日本"
    ids = c.ok("/tokenize", content=text, add_special=False)["tokens"]
    assert c.ok("/detokenize", tokens=ids)["content"] == text


@check("llama.cpp/test_tokenize")
def tokenize_with_pieces(c: Client) -> None:
    toks = c.ok("/tokenize", content="Hello world", with_pieces=True)["tokens"]
    assert "".join(t["piece"] for t in toks).endswith("Hello world") and all(isinstance(t["id"], int) for t in toks)


# -- llama.cpp: test_completion ----------------------------------------------------------

@check("llama.cpp/test_completion")
def completion_basic_and_stream(c: Client) -> None:
    body = dict(model=c.model, prompt="I believe the meaning of life is", max_tokens=8, temperature=0)
    whole = c.ok("/v1/completions", **body)["choices"][0]["text"]
    ev = c.events("/v1/completions", **body)
    assert "".join(e["choices"][0]["text"] for e in ev if e["choices"]) == whole


@check("llama.cpp/test_completion")
def completion_seed_reproducible(c: Client) -> None:
    body = dict(model=c.model, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=42)
    first = c.ok("/v1/completions", **body)["choices"][0]["text"]
    assert c.ok("/v1/completions", **body)["choices"][0]["text"] == first


@check("llama.cpp/test_completion")
def completion_stop(c: Client) -> None:
    out = c.ok("/v1/completions", model=c.model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","])
    assert "," not in out["choices"][0]["text"] and out["choices"][0]["finish_reason"] == "stop"


@check("llama.cpp/test_completion")
def completion_batch_equals_single(c: Client) -> None:
    prompts = ["The sky is", "Paris is the capital of"]
    many = c.ok("/v1/completions", model=c.model, prompt=prompts, max_tokens=6, temperature=0)["choices"]
    for p, ch in zip(prompts, many):
        assert c.ok("/v1/completions", model=c.model, prompt=p, max_tokens=6, temperature=0)["choices"][0]["text"] \
            == ch["text"]


@check("llama.cpp/test_completion", peer_only="llama.cpp's native /completion endpoint")
def completion_native_endpoint(c: Client) -> None:
    assert c.post("/completion", prompt="hi", n_predict=4).status_code == 404


@check("llama.cpp/test_completion", peer_only="llama.cpp's /slots endpoint")
def slots_endpoint(c: Client) -> None:
    assert c.http.get("/slots").status_code == 404


# -- llama.cpp: test_security ------------------------------------------------------------

@check("llama.cpp/test_security")
def security_key_required(c: Client) -> None:
    if "Authorization" not in c.http.headers:
        return
    bare = httpx.post(str(c.http.base_url) + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}]})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(str(c.http.base_url) + "/health").status_code == 200


@check("llama.cpp/test_security")
def security_bad_json_is_400(c: Client) -> None:
    r = c.http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


# -- llama.cpp: test_compat_oai_responses --------------------------------------------------

@check("llama.cpp/test_compat_oai_responses")
def responses_basic(c: Client) -> None:
    out = c.ok("/v1/responses", model=c.model, input="Say hi.", max_output_tokens=8)
    assert out["object"] == "response" and out["output"][0]["content"][0]["type"] == "output_text"


@check("llama.cpp/test_compat_oai_responses")
def responses_stream(c: Client) -> None:
    ev = c.events("/v1/responses", model=c.model, input="Say hi.", max_output_tokens=8)
    kinds = [e["type"] for e in ev]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in ev if e["type"] == "response.output_text.delta")
    assert text == ev[-1]["response"]["output"][0]["content"][0]["text"]


# -- vLLM: test_completion ---------------------------------------------------------------

@check("vllm/test_completion")
def vllm_echo(c: Client) -> None:
    out = c.ok("/v1/completions", model=c.model, prompt="Hello, my name is", max_tokens=5, echo=True, temperature=0)
    assert out["choices"][0]["text"].startswith("Hello, my name is")


@check("vllm/test_completion")
def vllm_logprobs(c: Client) -> None:
    out = c.ok("/v1/completions", model=c.model, prompt="Hello", max_tokens=5, logprobs=3, temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) <= 3 for t in lp["top_logprobs"])


@check("vllm/test_completion")
def vllm_too_many_logprobs_is_400(c: Client) -> None:
    c.refused("/v1/completions", "logprobs", model=c.model, prompt="Hi", logprobs=100)


@check("vllm/test_completion", peer_only="prompt_logprobs (vLLM only; refused by name)")
def vllm_prompt_logprobs(c: Client) -> None:
    c.refused("/v1/completions", "prompt_logprobs", model=c.model, prompt="Hi", max_tokens=2, prompt_logprobs=1)


@check("vllm/test_completion", peer_only="beam search (vLLM only; refused by name)")
def vllm_beam_search(c: Client) -> None:
    c.refused("/v1/completions", "use_beam_search", model=c.model, prompt="Hi", max_tokens=2, use_beam_search=True,
              n=2)


@check("vllm/test_completion", peer_only="best_of > n (vLLM only; refused by name)")
def vllm_best_of(c: Client) -> None:
    c.refused("/v1/completions", "best_of", model=c.model, prompt="Hi", max_tokens=2, best_of=3)


@check("vllm/test_completion")
def vllm_n_and_best_of_equal(c: Client) -> None:
    out = c.ok("/v1/completions", model=c.model, prompt="Hi", max_tokens=3, n=2, best_of=2, seed=1)
    assert len(out["choices"]) == 2


@check("vllm/test_completion")
def vllm_guided_choice_regex_json(c: Client) -> None:
    out = c.ok("/v1/completions", model=c.model, prompt="Pick:", max_tokens=5, guided_choice=["yes", "no"])
    assert out["choices"][0]["text"] in ("yes", "no")
    out = c.ok("/v1/completions", model=c.model, prompt="IP:", max_tokens=20, guided_regex=r"\d{1,3}\.\d{1,3}")
    import re
    assert re.fullmatch(r"\d{1,3}\.\d{1,3}", out["choices"][0]["text"])
    out = c.ok("/v1/completions", model=c.model, prompt="JSON:", max_tokens=30,
               guided_json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert isinstance(json.loads(out["choices"][0]["text"])["a"], int)


@check("vllm/test_completion")
def vllm_stream_usage(c: Client) -> None:
    ev = c.events("/v1/completions", model=c.model, prompt="Hi", max_tokens=3, stream_options={"include_usage": True})
    assert ev[-1]["usage"]["completion_tokens"] == 3 or ev[-1]["usage"]["completion_tokens"] >= 1


# -- vLLM: test_chat ---------------------------------------------------------------------

@check("vllm/test_chat")
def vllm_chat_top_logprobs_without_logprobs_is_400(c: Client) -> None:
    r = c.post("/v1/chat/completions", model=c.model, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert r.status_code == 400


@check("vllm/test_chat")
def vllm_chat_guided_json(c: Client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    out = c.chat("A name.", guided_json=schema, max_tokens=30)
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["name"], str)


@check("vllm/test_chat")
def vllm_chat_structured_outputs(c: Client) -> None:
    out = c.chat("Yes or no?", structured_outputs={"choice": ["yes", "no"]}, max_tokens=4)
    assert out["choices"][0]["message"]["content"] in ("yes", "no")


@check("vllm/test_chat")
def vllm_chat_n(c: Client) -> None:
    out = c.chat(n=3, max_tokens=4, seed=3)
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]


@check("vllm/test_chat")
def vllm_chat_max_completion_tokens(c: Client) -> None:
    out = c.chat(max_completion_tokens=3, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"


@check("vllm/test_chat", peer_only="prompt_logprobs (vLLM only; refused by name)")
def vllm_chat_prompt_logprobs(c: Client) -> None:
    c.refused("/v1/chat/completions", "prompt_logprobs", model=c.model, messages=[{"role": "user", "content": "x"}],
              prompt_logprobs=-1)


@check("vllm/test_chat")
def vllm_chat_bad_model_is_404(c: Client) -> None:
    r = c.post("/v1/chat/completions", model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- vLLM: test_tokenization -------------------------------------------------------------

@check("vllm/test_tokenization")
def vllm_tokenize_special_tokens(c: Client) -> None:
    with_special = c.ok("/tokenize", model=c.model, prompt="Hi", add_special_tokens=True)
    without = c.ok("/tokenize", model=c.model, prompt="Hi", add_special_tokens=False)
    assert with_special["count"] >= without["count"] and with_special["max_model_len"] > 0


@check("vllm/test_tokenization")
def vllm_tokenize_chat(c: Client) -> None:
    out = c.ok("/tokenize", model=c.model, messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert out["count"] == len(out["tokens"]) > 2


@check("vllm/test_tokenization")
def vllm_tokenize_token_strs(c: Client) -> None:
    out = c.ok("/tokenize", model=c.model, prompt="Hello world", return_token_strs=True)
    assert len(out["token_strs"]) == out["count"]


@check("vllm/test_tokenization")
def vllm_detokenize(c: Client) -> None:
    ids = c.ok("/tokenize", model=c.model, prompt="Hello world", add_special_tokens=False)["tokens"]
    assert c.ok("/detokenize", model=c.model, tokens=ids)["prompt"] == "Hello world"


# -- vLLM: responses ----------------------------------------------------------------------

@check("vllm/responses")
def vllm_responses_instructions_and_items(c: Client) -> None:
    out = c.ok("/v1/responses", model=c.model, instructions="Be brief.", max_output_tokens=6, input=[
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs_0", "summary": []},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])
    assert out["status"] in ("completed", "incomplete")


@check("vllm/responses")
def vllm_responses_function_call(c: Client) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    out = c.ok("/v1/responses", model=c.model, input="Weather in Paris?", tools=[tool], tool_choice="required",
               max_output_tokens=60)
    assert out["output"][0]["type"] == "function_call" and json.loads(out["output"][0]["arguments"])["city"]


@check("vllm/responses")
def vllm_responses_logprobs(c: Client) -> None:
    out = c.ok("/v1/responses", model=c.model, input="Hi", max_output_tokens=4, top_logprobs=2,
               include=["message.output_text.logprobs"])
    assert all(len(x["top_logprobs"]) == 2 for x in out["output"][0]["content"][0]["logprobs"])


@check("vllm/responses")
def vllm_responses_stateful_refused(c: Client) -> None:
    c.refused("/v1/responses", "previous_response_id", model=c.model, input="Hi", previous_response_id="resp_1")


# -- running ------------------------------------------------------------------------------------

def _serve(model: str | None, name: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ellm", "serve", *([model] if model else []), "--port", str(port),
           "--served-model-name", name, "--api-key", "peer-key", "--max-model-len", "2048", "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"ellm serve exited with {proc.returncode}")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("ellm serve did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start ellm serve)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="what to serve, or the served name with --url")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("-k", default="", help="run only checks whose suite/name contains this")
    args = ap.parse_args()
    proc = None
    if args.url:
        url, name, key = args.url, args.model, args.api_key
    else:
        proc, url = _serve(args.model, "peer")
        name, key = "peer", "peer-key"
    client = Client(url, name, key)
    results: dict[str, list[tuple[Check, str]]] = {"passed": [], "failed": []}
    try:
        for chk in CHECKS:
            if args.k not in f"{chk.suite}/{chk.name}":
                continue
            try:
                chk.fn(client)
                results["passed"].append((chk, ""))
            except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
                results["failed"].append((chk, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
                if not isinstance(e, AssertionError):
                    traceback.print_exc(limit=2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
    passed, failed = results["passed"], results["failed"]
    suites = sorted({c.suite for c, _ in passed + failed})
    for s in suites:
        p = sum(1 for c, _ in passed if c.suite == s)
        f = sum(1 for c, _ in failed if c.suite == s)
        print(f"{s:40s} {p:3d} passed {f:3d} failed")
    peer = [c for c, _ in passed if c.peer_only]
    print(f"\n{len(passed)} of {len(passed) + len(failed)} passed "
          f"({len(peer)} of them peer-only features that ellm refuses by name, as checked)")
    for c in peer:
        print(f"  peer-only: {c.suite}::{c.name}: {c.peer_only}")
    for c, why in failed:
        print(f"  FAILED {c.suite}::{c.name}: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
