"""ellm.integrations.langchain against the real langchain-core and the real SmolLM2:
invoke / stream / batch and their async twins, tools with a nested pydantic argument
(constrained, so every call validates), structured output into a nested model,
usage metadata and embeddings."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

import ellm  # noqa: E402
from ellm.integrations.langchain import ChatEllm, EllmEmbeddings  # noqa: E402
from integration_schemas import PERSON_PROMPT, QUESTION, WEATHER_TOOL, Location, Person, WeatherQuery, \
    check_weather_args  # noqa: E402

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    llm = ellm.load(smollm2_gguf, max_model_len=2048, progress=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def chat(engine):
    return ChatEllm(llm=engine, max_tokens=MAX_TOKENS, temperature=0)


PROMPT = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]


def test_invoke_matches_llm_chat_and_reports_usage(chat, engine):
    msg = chat.invoke(PROMPT)
    ref = engine.chat([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
                      max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(msg, AIMessage)
    assert msg.content == ref.text and msg.content
    assert msg.usage_metadata == {"input_tokens": len(ref.prompt_token_ids), "output_tokens": len(ref.token_ids),
                                  "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
    assert msg.response_metadata["finish_reason"] == ref.finish_reason
    assert chat.model == engine.source


def test_stream_pieces_add_up_to_invoke(chat):
    chunks = list(chat.stream(PROMPT))
    assert len(chunks) > 2
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.content == chat.invoke(PROMPT).content
    assert whole.usage_metadata["output_tokens"] == MAX_TOKENS or whole.response_metadata["finish_reason"] == "stop"


def test_batch_and_call_overrides(chat):
    a, b = chat.batch([PROMPT, "Say hi."], max_tokens=4)
    assert a.usage_metadata["output_tokens"] <= 4 and b.usage_metadata["output_tokens"] <= 4
    assert a.content == chat.invoke(PROMPT, max_tokens=4).content
    with pytest.raises(TypeError, match="unknown argument"):
        chat.invoke(PROMPT, temprature=0.5)


def test_async_twins_on_the_engine_loop(chat):
    async def main():
        one, many = await asyncio.gather(chat.ainvoke(PROMPT), chat.abatch([PROMPT, PROMPT]))
        pieces = [c.content async for c in chat.astream(PROMPT)]
        return one, many, pieces
    one, many, pieces = asyncio.run(main())
    ref = chat.invoke(PROMPT).content
    assert one.content == ref and [m.content for m in many] == [ref, ref] and "".join(pieces) == ref


@tool
def get_weather(location: Location, unit: str) -> str:
    """Get the current weather at a location."""
    return f"21 degrees {unit} in {location.city}"


@pytest.mark.parametrize("tools", [[get_weather], [WeatherQuery], [WEATHER_TOOL]], ids=["tool", "pydantic", "dict"])
def test_bound_tools_with_nested_argument_always_validate(chat, tools):
    bound = chat.bind_tools(tools, tool_choice="any", max_tokens=96)
    name = "get_weather" if tools[0] is not WeatherQuery else "WeatherQuery"
    questions = [QUESTION] + (["Weather in Tokyo, Japan, in fahrenheit please."] if tools[0] is WEATHER_TOOL else [])
    for question in questions:
        msg = bound.invoke(question)
        assert msg.tool_calls, msg
        for call in msg.tool_calls:
            assert call["name"] == name and call["id"]
            if tools[0] is get_weather:
                get_weather.args_schema.model_validate(call["args"])
            else:
                check_weather_args(call["args"])
        assert msg.response_metadata["finish_reason"] == "tool_calls"


def test_named_tool_choice_streams_calls_and_runs_a_round_trip(chat):
    bound = chat.bind_tools([get_weather, WEATHER_TOOL | {"function": {**WEATHER_TOOL["function"], "name": "other"}}],
                            tool_choice="get_weather", max_tokens=96)
    chunks = list(bound.stream(QUESTION))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    call = whole.tool_calls[0]
    get_weather.args_schema.model_validate(call["args"])
    result = get_weather.invoke(call)   # LangChain runs the tool on the parsed call
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    follow = chat.invoke([HumanMessage(QUESTION), AIMessage("", tool_calls=[call]), result])
    assert isinstance(follow.content, str) and follow.usage_metadata["input_tokens"] > 0


def test_async_tool_call(chat):
    bound = chat.bind_tools([WEATHER_TOOL], tool_choice="required", max_tokens=96)
    msg = asyncio.run(bound.ainvoke(QUESTION))
    assert msg.tool_calls and all(check_weather_args(c["args"]) for c in msg.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_into_a_nested_model(engine, method):
    for seed in range(2 if method == "json_schema" else 1):
        chat = ChatEllm(llm=engine, max_tokens=128, temperature=0.8, seed=seed)
        person = chat.with_structured_output(Person, method=method).invoke(PERSON_PROMPT)
        assert isinstance(person, Person) and isinstance(person.address.city, str)


def test_structured_output_include_raw_and_dict_schema(engine):
    chat = ChatEllm(llm=engine, max_tokens=128, temperature=0)
    out = chat.with_structured_output(Person.model_json_schema(), include_raw=True).invoke(PERSON_PROMPT)
    assert out["parsing_error"] is None and isinstance(out["raw"], AIMessage)
    Person.model_validate(out["parsed"])
    short = ChatEllm(llm=engine, max_tokens=8, temperature=0)
    cut = short.with_structured_output(Person, include_raw=True).invoke(PERSON_PROMPT)
    assert cut["parsed"] is None and "cut at max_tokens (8 tokens)" in str(cut["parsing_error"])
    with pytest.raises(ValueError, match="method"):
        chat.with_structured_output(Person, method="xml")


def test_embeddings_are_the_engines(engine):
    emb = EllmEmbeddings(llm=engine)
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    docs = np.array(emb.embed_documents(texts))
    assert docs.shape == (2, engine.config.hidden_size)
    np.testing.assert_allclose(docs, engine.embed(texts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(emb.embed_query(texts[0]), docs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(asyncio.run(emb.aembed_documents(texts)), docs, rtol=1e-5, atol=1e-6)
    assert emb.embed_documents([]) == []


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match="model= .* or llm="):
        ChatEllm()
    with pytest.raises(TypeError, match="ellm.LLM"):
        ChatEllm(llm="smollm2")
