"""What agent frameworks sent that ellm got wrong (issue 32), each checked where it lives:
the call grammars and parsers (ellm.server.tools) on SmolLM2's real tokenizer, LLM.chat,
a real `ellm serve` driven by raw HTTP, and the real clients: the openai SDK's parse()
with nested pydantic models, langchain-openai tools and structured output, openai-agents
(tools + an output type) and pydantic-ai (a nested output type).

Nested pydantic models give JSON schemas with $defs / $ref, which a call schema must carry
along (its parameters sit under "arguments", so "#/$defs/X" must still resolve). Outputs
are validated with `jsonschema` and the pydantic models themselves; constrained decoding
makes SmolLM2's answers valid even when they are silly.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from served import serve_process
from pydantic import BaseModel, Field

import ellm
from ellm.sampling_params import SamplingParams
from ellm.server import tools as T
from ellm.server.constraints import constraint_fields

API_KEY = "sk-round-two"
MODEL = "smol"


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Person(BaseModel):
    """A person and where they live."""
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: Address


class Team(BaseModel):
    """A team: its name and members."""
    team: str = Field(max_length=16)
    members: list[Person] = Field(min_length=1, max_length=2)


PERSON_TOOL = {"type": "function", "function": {"name": "save_person", "description": "Save a person",
                                                "parameters": Person.model_json_schema()}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
# an object inside an object, neither saying anything of other keys
NESTED = {"type": "object", "properties": {"point": {"type": "object", "properties": {
    "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}, "required": ["point"]}
PLOT = {"type": "function", "function": {"name": "plot", "description": "Plot a point", "parameters": NESTED}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"],
          "additionalProperties": False}


def _validate(schema: dict[str, Any], value: Any) -> None:
    jsonschema.validate(value, schema)


# ---------------------------------------------------------------------------------------
# the grammars and parsers, on SmolLM2's tokenizer
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Any:
    return ellm.load(smollm2_gguf, max_model_len=2048, progress=False)


@pytest.fixture(scope="module")
def accepts(smollm2: Any) -> Any:
    """accepts(params, text): whether params' constraint takes text as a whole output."""
    from ellm.engine.structured import GrammarState, llg_tokenizer
    llt = llg_tokenizer(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.engine.eos_ids)

    def check(params: SamplingParams, text: str) -> bool:
        assert params.constraint is not None
        st = GrammarState(llt, params.constraint[1])
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
        return st.matcher.try_consume_tokens(ids) == len(ids) and st.matcher.is_accepting()
    return check


def _call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _plan(smollm2: Any, tools: list[dict[str, Any]], choice: Any, parallel: bool = True) -> T.ToolPlan:
    return T.ToolPlan.make(smollm2.tokenizer, tools, choice, parallel)


def test_defs_and_refs_resolve_inside_the_call_schema(smollm2: Any, accepts: Any) -> None:
    params = _plan(smollm2, [PERSON_TOOL], "required").sampling(SamplingParams())
    good = {"name": "Ann", "age": 30, "address": {"street": "Main St 1", "city": "Oslo"}}
    assert accepts(params, _call("save_person", good))
    assert not accepts(params, _call("save_person", {**good, "address": {"street": "x"}}))   # city missing
    # every way of writing a reference: $defs, definitions, the root itself (recursion)
    tree = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 5},
                                             "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
            "required": ["label"]}
    old = {"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}}, "required": ["p"],
           "definitions": {"P": {"type": "integer"}}}
    for schema, text in ((tree, {"label": "a", "kids": [{"label": "b"}]}), (old, {"p": 3})):
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        assert accepts(_plan(smollm2, [tool], "required").sampling(SamplingParams()), _call("f", text))


def test_a_schema_that_cannot_be_used_names_the_tool(smollm2: Any) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}}}
    with pytest.raises(T.ToolError) as e:
        _plan(smollm2, [ADD, bad], "required").sampling(SamplingParams())
    assert e.value.param == "tools[1].function.parameters"
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        smollm2.chat([{"role": "user", "content": "hi"}], tools=[bad], tool_choice="required", max_tokens=8)


def test_additional_properties_are_closed_at_every_level(smollm2: Any, accepts: Any) -> None:
    params = _plan(smollm2, [PLOT], "required").sampling(SamplingParams())
    assert accepts(params, _call("plot", {"point": {"x": 1, "y": 2}}))
    assert not accepts(params, _call("plot", {"point": {"x": 1, "y": 2, "z": 3}}))
    assert not accepts(params, _call("plot", {"point": {"x": 1, "y": 2}, "extra": 1}))
    # response_format strict: true closes nested objects too; without strict the schema stands
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": NESTED, "strict": True}}
    strict = SamplingParams(**constraint_fields({"response_format": fmt}))
    assert accepts(strict, '{"point": {"x": 1, "y": 2}}')
    assert not accepts(strict, '{"point": {"x": 1, "y": 2, "z": 3}}')
    loose = SamplingParams(**constraint_fields({"response_format": {**fmt, "json_schema": {
        "name": "p", "schema": NESTED}}}))
    assert accepts(loose, '{"point": {"x": 1, "y": 2, "z": 3}}')


def test_required_calls_each_function_at_most_once(smollm2: Any, accepts: Any) -> None:
    params = _plan(smollm2, [WEATHER, ADD], "required").sampling(SamplingParams())
    one, two = _call("get_weather", {"city": "Oslo"}), _call("add", {"a": 1, "b": 2})
    assert accepts(params, one) and accepts(params, two) and accepts(params, one + "\n" + two)
    assert not accepts(params, two + "\n" + two)
    assert not accepts(params, one + "\n" + one)


def test_auto_with_a_response_format_allows_a_call_or_an_answer(smollm2: Any, accepts: Any) -> None:
    plan = _plan(smollm2, [WEATHER], "auto")
    params = plan.sampling(SamplingParams(json_schema=ANSWER))
    assert accepts(params, _call("get_weather", {"city": "Oslo"}))
    assert accepts(params, '{"answer": "sunny"}')
    assert not accepts(params, "It is sunny.")
    assert not accepts(params, '{"answer": "sunny", "x": 1}')
    content, calls = plan.parse('{"answer": "sunny"}')
    assert content == '{"answer": "sunny"}' and calls == []


def test_required_or_named_with_a_response_format_is_accepted(smollm2: Any, accepts: Any) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        params = _plan(smollm2, [ADD], choice).sampling(SamplingParams(json_schema=ANSWER))
        assert accepts(params, _call("add", {"a": 1, "b": 2}))
        assert not accepts(params, '{"answer": "3"}')   # the turn is the call
    with pytest.raises(T.ToolError, match="cannot be combined"):
        _plan(smollm2, [ADD], "required").sampling(SamplingParams(regex="a+"))


def test_streamed_calls_carry_no_whitespace_content() -> None:
    fns = T.parse_tools([WEATHER, ADD])
    text = _call("get_weather", {"city": "Oslo"}) + "\n" + _call("add", {"a": 1, "b": 2}) + "\n"
    for step in (1, 3, 7, len(text)):
        p = T.StreamParser("generic", fns)
        events = [e for i in range(0, len(text), step) for e in p.feed(text[i:i + step])] + p.finish()
        assert [k for k, _ in events] == ["call", "call"], events
    # text stays text, its spaces with it; a reply of whitespace alone is still a reply
    p = T.StreamParser("generic", fns)
    events = p.feed("Hello") + p.feed(" ") + p.feed("\n") + p.feed("world") + p.finish()
    assert "".join(v for k, v in events if k == "content") == "Hello \nworld"
    p = T.StreamParser("generic", fns)
    assert p.feed("\n") + p.finish() == [("content", "\n")]


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_a_call_cut_by_max_tokens_is_not_text(fmt: str) -> None:
    fns = T.parse_tools([WEATHER, ADD])
    cut = {"hermes": 'Sure. <tool_call>\n{"name": "add", "argu', "generic": '<tool_call>\n{"name": "ad',
           "llama3": '<|python_tag|>{"name": "add", "parameters": {"a"', "mistral": '[TOOL_CALLS][{"name": "a'}[fmt]
    content, calls = T.parse_calls(cut, fmt, fns, cut=True)
    assert calls == [] and (content or "") in ("", "Sure."), content
    p = T.StreamParser(fmt, fns)
    events = [e for ch in cut for e in p.feed(ch)] + p.finish(cut=True)
    streamed = "".join(v for k, v in events if k == "content")
    assert "tool_call" not in streamed and "TOOL_CALLS" not in streamed and '"name"' not in streamed, events
    # a finished call before the cut stands
    whole = _call("get_weather", {"city": "Oslo"}) + "\n" + '<tool_call>\n{"name": "add"'
    content, calls = T.parse_calls(whole, "generic", fns, cut=True)
    assert content is None and [c.name for c in calls] == ["get_weather"]


# ---------------------------------------------------------------------------------------
# LLM.chat
# ---------------------------------------------------------------------------------------

def test_llm_chat_nested_tools_and_response_format(smollm2: Any) -> None:
    msgs = [{"role": "user", "content": "Save Ann, 30, who lives at Main St 1 in Oslo."}]
    out = smollm2.chat(msgs, tools=[PERSON_TOOL], tool_choice="required", temperature=0.0, max_tokens=200,
                       json_schema=Team)
    assert out.finish_reason == "stop" and out.content is None and len(out.tool_calls) == 1
    Person.model_validate_json(out.tool_calls[0].arguments)
    # auto + a response format: a call (as for a weather question) or an answer in the schema,
    # never free text
    called = []
    for q in ("What is the weather in Oslo?", "Name a team with one member, Bob, 40, of Elm St 2, Rome."):
        out = smollm2.chat([{"role": "user", "content": q}], tools=[WEATHER], tool_choice="auto", temperature=0.0,
                           max_tokens=200, json_schema=Team)
        called.append(bool(out.tool_calls))
        if out.tool_calls:
            assert out.content is None and out.tool_calls[0].name == "get_weather"
        else:
            Team.model_validate_json(out.content)
    assert called[0]
    # cut by max_tokens: no raw call text comes back as content
    out = smollm2.chat(msgs, tools=[PERSON_TOOL], tool_choice="required", temperature=0.0, max_tokens=6)
    assert out.finish_reason == "length" and not out.tool_calls and out.content is None


# ---------------------------------------------------------------------------------------
# a real server
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [str(smollm2_gguf), "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "2048",
            "--max-num-seqs", "8", "--log-level", "warning"]
    with serve_process(args, tmp_path_factory.mktemp("round2") / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as c:
        yield c


def _chat(http: httpx.Client, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Save Ann, 30, of Main St 1, Oslo."}])
    return http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_server_nested_tools_required_and_named(http: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "save_person"}}
    for choice in ("required", named):
        for fmt in (None, {"type": "json_schema", "json_schema": {"name": "team", "schema": Team.model_json_schema(),
                                                                  "strict": True}}):
            body: dict[str, Any] = {"tools": [PERSON_TOOL, ADD], "tool_choice": choice, "max_tokens": 200}
            if fmt is not None:
                body["response_format"] = fmt
            r = _chat(http, **body)
            assert r.status_code == 200, r.text
            choice0 = r.json()["choices"][0]
            calls = choice0["message"]["tool_calls"]
            assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
            assert len({c["function"]["name"] for c in calls}) == len(calls)   # each function at most once
            for c in calls:
                if c["function"]["name"] == "save_person":
                    Person.model_validate_json(c["function"]["arguments"])
                else:
                    _validate(ADD["function"]["parameters"], json.loads(c["function"]["arguments"]))


def test_server_bad_tool_schema_is_a_400_naming_it(http: httpx.Client) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}}}
    r = _chat(http, tools=[ADD, bad], tool_choice="required", max_tokens=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1].function.parameters"


def test_server_auto_with_response_format(http: httpx.Client) -> None:
    """The model may still call the tool (it does, for a weather question), or answer in the
    schema; never free text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    called = []
    for q in ("What is the weather in Oslo? Use the tool.", "Say hello in the answer field."):
        r = _chat(http, messages=[{"role": "user", "content": q}], tools=[WEATHER], tool_choice="auto",
                  response_format=fmt, max_tokens=80)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        called.append(bool(msg.get("tool_calls")))
        if msg.get("tool_calls"):
            assert msg["content"] is None and r.json()["choices"][0]["finish_reason"] == "tool_calls"
            _validate(WEATHER["function"]["parameters"], json.loads(msg["tool_calls"][0]["function"]["arguments"]))
        else:
            _validate(ANSWER, json.loads(msg["content"]))
    assert called[0], "the weather question should be answered with a call"


def test_server_no_empty_tool_calls_and_cut_calls(http: httpx.Client) -> None:
    r = _chat(http, max_tokens=5)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"], r.text
    r = _chat(http, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert "tool_calls" not in r.json()["choices"][0]["message"], r.text
    # a call cut by max_tokens: finish_reason length, no raw call text anywhere
    r = _chat(http, tools=[PERSON_TOOL], tool_choice="required", max_tokens=6)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, r.text
    assert "tool_calls" not in choice["message"]
    chunks = _events(_chat(http, tools=[PERSON_TOOL], tool_choice="required", max_tokens=6, stream=True))
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "tool_call" not in content and "save_person" not in content, chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_server_streamed_calls_have_no_newline_deltas(http: httpx.Client) -> None:
    q = "Weather in Oslo, and what is 2 + 3? Call both tools."
    chunks = _events(_chat(http, messages=[{"role": "user", "content": q}], tools=[WEATHER, ADD],
                           tool_choice="required", max_tokens=200, stream=True, seed=1))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert any(d.get("tool_calls") for d in deltas)
    assert all(not d.get("content") for d in deltas), deltas   # no "\n" (or any) content beside the calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_server_completions_echo(http: httpx.Client) -> None:
    prompt = "The capital of France is"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    plain = r.json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [prompt, prompt + " not"], "max_tokens": 4,
                                           "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts[0] == prompt + plain and texts[1].startswith(prompt + " not")
    chunks = _events(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0, "echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + plain
    # token ids: the echo is their text
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0,
                                           "echo": True})
    assert r.json()["choices"][0]["text"] == prompt + plain


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_server_vllm_fields_honoured_or_refused_by_name(http: httpx.Client, route: str) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    for field, value in (("prompt_logprobs", -1), ("prompt_logprobs", 1), ("use_beam_search", True),
                         ("best_of", 3), ("n_probs", 2)):
        r = http.post(route, json={**base, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    for field, value in (("prompt_logprobs", None), ("use_beam_search", False), ("best_of", 1), ("n_probs", 0)):
        r = http.post(route, json={**base, field: value})
        assert r.status_code == 200, (field, value, r.text)
    r = http.post(route, json={**base, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_server_responses_reasoning_items_and_logprobs(http: httpx.Client) -> None:
    history = [{"type": "message", "role": "user", "content": "Hi"},
               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "greet back"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
               {"type": "message", "role": "user", "content": "Say it again."}]
    r = http.post("/v1/responses", json={"model": MODEL, "input": history, "max_output_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    # the reasoning item is not part of the prompt: the same answer without it
    r2 = http.post("/v1/responses", json={"model": MODEL, "input": [history[0], *history[2:]],
                                          "max_output_tokens": 6, "temperature": 0})
    assert r.json()["output"][0]["content"][0]["text"] == r2.json()["output"][0]["content"][0]["text"]
    bad = http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "reasoning"}, *history],
                                           "max_output_tokens": 2})
    assert bad.status_code == 200, bad.text   # (an id is not needed to be ignored)
    for extra in ({"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2},
                  {"include": ["message.output_text.logprobs"], "top_logprobs": 3}):
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 5,
                                             "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        part = r.json()["output"][0]["content"][0]
        lps = part["logprobs"]
        assert len(lps) == r.json()["usage"]["output_tokens"] and "".join(lp["token"] for lp in lps) == part["text"]
        for lp in lps:
            assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == extra.get("top_logprobs", 0)
        events = _events(http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 5,
                                                          "temperature": 0, "stream": True, **extra}))
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert sum(len(e["logprobs"]) for e in deltas) == len(lps)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "include": ["message.output_text.everything"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text


def test_server_tokenize_token_strs(http: httpx.Client, smollm2_gguf: Path) -> None:
    from gguf import GGUFReader  # the vocabulary as the file stores it, read without ellm
    field = GGUFReader(str(smollm2_gguf)).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello wörld", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["token_strs"] == [vocab[t] for t in body["tokens"]], body
    r = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                     "return_token_strs": True})
    assert r.json()["token_strs"] == [vocab[t] for t in r.json()["tokens"]]
    assert "token_strs" not in http.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()


# ---------------------------------------------------------------------------------------
# the real clients
# ---------------------------------------------------------------------------------------

def test_openai_sdk_parse_with_nested_models(url: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    msgs = [{"role": "user", "content": "Make a team called Owls with Ann, 30, of Main St 1, Oslo."}]
    done = parse(model=MODEL, messages=msgs, response_format=Team, temperature=0, max_tokens=300)
    assert isinstance(done.choices[0].message.parsed, Team)
    done = parse(model=MODEL, messages=msgs, tools=[openai.pydantic_function_tool(Person)], tool_choice="required",
                 temperature=0, max_tokens=200)
    call = done.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Person)


def test_langchain_tools_with_nested_models(url: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=url + "/v1", api_key=API_KEY, model=MODEL, temperature=0, max_tokens=300,
                        max_retries=0)
    ai = llm.bind_tools([Person, Team], tool_choice="required").invoke("Save Ann, 30, of Main St 1, Oslo.")
    assert ai.tool_calls and len({c["name"] for c in ai.tool_calls}) == len(ai.tool_calls)
    for c in ai.tool_calls:
        {"Person": Person, "Team": Team}[c["name"]].model_validate(c["args"])
    team = llm.with_structured_output(Team, method="function_calling").invoke("A team Owls: Ann, 30, Main St 1, Oslo.")
    assert isinstance(team, Team)
    team = llm.with_structured_output(Team, method="json_schema").invoke("A team Owls: Ann, 30, Main St 1, Oslo.")
    assert isinstance(team, Team)


def test_openai_agents_tools_and_output_type(url: str) -> None:
    """An agent with a tool whose argument is a nested model, an output type, and
    tool_choice required: its request carries tools ($defs), tool_choice and
    response_format together; the tool's (constrained) call ends the run with its result."""
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    registered: list[Team] = []

    @agents.function_tool
    def register_team(team: Team) -> Team:
        """Register a team and its members."""
        registered.append(team)
        return team

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300))
    agent = agents.Agent(name="teams", instructions="Register the team the user describes.", model=model,
                         tools=[register_team], output_type=Team, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=300))
    result = asyncio.run(agents.Runner.run(agent, "Register team Owls: Ann, 30, of Main St 1, Oslo.", max_turns=2))
    assert len(registered) == 1 and result.final_output == registered[0]
    Team.model_validate(registered[0].model_dump())


def test_pydantic_ai_nested_output_type(url: str) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key=API_KEY))
    agent = Agent(model, output_type=Team, model_settings={"temperature": 0, "max_tokens": 300}, retries=0)
    result = agent.run_sync("Make team Owls with Ann, 30, of Main St 1, Oslo.")
    assert isinstance(result.output, Team) and result.output.members
