"""ellm.integrations.litellm against the real litellm and the real SmolLM2: the "ellm/"
provider's completion, acompletion, streaming (sync and async), tools with a nested
pydantic argument, response_format into a nested model, and embedding."""
from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

# litellm fetches its model cost map from the network on import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

import ellm  # noqa: E402
from ellm.integrations import shared  # noqa: E402
from ellm.integrations import litellm as ellm_litellm  # noqa: E402
from integration_schemas import PERSON_PROMPT, QUESTION, WEATHER_TOOL, Person, check_weather_args  # noqa: E402

NAME = "smollm2-litellm-test"     # the name the tests' LLM is served under
MODEL = f"ellm/{NAME}"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    llm = ellm.load(smollm2_gguf, max_model_len=2048, progress=False)
    ellm_litellm.register(llm, NAME)
    yield llm
    shared.release(NAME)


def test_completion_matches_llm_chat(engine):
    ref = engine.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    r = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref.text and ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


def test_streaming_and_async(engine):
    ref = engine.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0).text
    chunks = list(litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                     stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref

    async def main():
        r = await litellm.acompletion(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
        s = await litellm.acompletion(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in s])
        return r.choices[0].message.content, text
    assert asyncio.run(main()) == (ref, ref)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tools_with_a_nested_argument(engine, tool_choice):
    questions = [QUESTION] + (["Weather in Tokyo, Japan, in fahrenheit please."] if tool_choice == "required" else [])
    for question in questions:
        r = litellm.completion(model=MODEL, messages=[{"role": "user", "content": question}], tools=[WEATHER_TOOL],
                               tool_choice=tool_choice, max_tokens=96, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        for c in calls:
            assert c.function.name == "get_weather" and c.id
            check_weather_args(c.function.arguments)


def test_streamed_tool_call_and_round_trip(engine):
    messages = [{"role": "user", "content": QUESTION}]
    chunks = list(litellm.completion(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
                                     max_tokens=96, temperature=0, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and all(check_weather_args(tc.function.arguments) for tc in calls)
    call = calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "21 degrees celsius"}]
    r = litellm.completion(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens > 0


def test_response_format_into_a_nested_model(engine):
    messages = [{"role": "user", "content": PERSON_PROMPT}]
    schema = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    for seed in range(2):
        r = litellm.completion(model=MODEL, messages=messages, response_format=schema, max_tokens=128,
                               temperature=0.8, seed=seed)
        Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(model=MODEL, messages=messages, response_format=Person, max_tokens=128, temperature=0)
    Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=128,
                           temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_embedding(engine):
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    r = litellm.embedding(model=MODEL, input=texts)
    got = np.array([d["embedding"] for d in r.data])
    np.testing.assert_allclose(got, engine.embed(texts), rtol=1e-5, atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(engine.encode_prompt(t)) for t in texts)
    r2 = asyncio.run(litellm.aembedding(model=MODEL, input=texts[0]))
    np.testing.assert_allclose(r2.data[0]["embedding"], got[0], rtol=1e-5, atol=1e-6)


def test_unsupported_fields_are_named(engine):
    with pytest.raises(Exception, match="tool_choice 'required' needs tools"):
        litellm.completion(model=MODEL, messages=MESSAGES, tool_choice="required", max_tokens=4, stream=True)
    with pytest.raises(Exception, match="n=2"):
        litellm.completion(model=MODEL, messages=MESSAGES, n=2, max_tokens=4)
    with pytest.raises(Exception, match="response_format type 'xml'"):
        litellm.completion(model=MODEL, messages=MESSAGES, response_format={"type": "xml"}, max_tokens=4)
