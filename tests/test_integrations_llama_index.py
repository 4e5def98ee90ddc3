"""ellm.integrations.llama_index against the real llama-index-core and the real SmolLM2:
complete / chat / stream / async, tool calling with a nested pydantic argument
(FunctionTool, predict_and_call), structured_predict into a nested model, embeddings."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

import ellm  # noqa: E402
from ellm.integrations.llama_index import EllmEmbedding, EllmLLM  # noqa: E402
from integration_schemas import PERSON_PROMPT, QUESTION, Person, check_weather_args, get_weather  # noqa: E402

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    llm = ellm.load(smollm2_gguf, max_model_len=2048, progress=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def li(engine):
    return EllmLLM(llm=engine, max_tokens=MAX_TOKENS, temperature=0)


MESSAGES = [ChatMessage(role=MessageRole.SYSTEM, content="You are terse."),
            ChatMessage(role=MessageRole.USER, content="Name a colour.")]


def _reference(engine):
    return engine.chat([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
                       max_tokens=MAX_TOKENS, temperature=0)


def test_chat_and_complete(li, engine):
    ref = _reference(engine)
    r = li.chat(MESSAGES)
    assert r.message.role == MessageRole.ASSISTANT and r.message.content == ref.text and ref.text
    assert r.additional_kwargs["completion_tokens"] == len(ref.token_ids)
    c = li.complete("Name a colour.")
    ref2 = engine.chat([{"role": "user", "content": "Name a colour."}], max_tokens=MAX_TOKENS, temperature=0)
    assert c.text == ref2.text
    assert li.metadata.is_function_calling_model and li.metadata.context_window == 2048


def test_streams_accumulate(li, engine):
    ref = _reference(engine).text
    parts = list(li.stream_chat(MESSAGES))
    assert len(parts) > 2 and "".join(p.delta for p in parts) == ref and parts[-1].message.content == ref
    comp = list(li.stream_complete("Name a colour."))
    assert comp[-1].text == "".join(p.delta for p in comp)


def test_async_forms(li, engine):
    ref = _reference(engine).text

    async def main():
        r, c = await asyncio.gather(li.achat(MESSAGES), li.acomplete("Name a colour."))
        gen = await li.astream_chat(MESSAGES)
        deltas = [p.delta async for p in gen]
        return r, c, deltas
    r, c, deltas = asyncio.run(main())
    assert r.message.content == ref and "".join(deltas) == ref and c.text


def test_tool_required_with_a_nested_argument(li):
    tool = FunctionTool.from_defaults(fn=get_weather)
    assert "$defs" in tool.metadata.get_parameters_dict()   # the nested model is a $ref
    for question in (QUESTION, "Weather in Tokyo, Japan, in fahrenheit please."):
        r = li.chat_with_tools([tool], user_msg=question, tool_required=True, max_tokens=96)
        calls = li.get_tool_calls_from_response(r)
        assert len(calls) == 1 and calls[0].tool_name == "get_weather"
        check_weather_args(calls[0].tool_kwargs)
        assert isinstance(r.message.blocks[-1], ToolCallBlock)


def test_predict_and_call_runs_the_tool(li):
    tool = FunctionTool.from_defaults(fn=get_weather)
    out = li.predict_and_call([tool], user_msg=QUESTION, tool_required=True, max_tokens=96)
    assert out.sources and out.sources[0].tool_name == "get_weather" and not out.sources[0].is_error
    assert "degrees" in str(out)


def test_async_tool_call(li):
    tool = FunctionTool.from_defaults(fn=get_weather)
    r = asyncio.run(li.achat_with_tools([tool], user_msg=QUESTION, tool_required=True, max_tokens=96))
    check_weather_args(li.get_tool_calls_from_response(r)[0].tool_kwargs)


def test_structured_predict_into_a_nested_model(li):
    prompt = PromptTemplate("{request}")
    for seed in range(2):
        person = li.structured_predict(Person, prompt, llm_kwargs={"max_tokens": 96, "temperature": 0.8, "seed": seed},
                                       request=PERSON_PROMPT)
        assert isinstance(person, Person)
    person = asyncio.run(li.astructured_predict(Person, prompt, llm_kwargs={"max_tokens": 96}, request=PERSON_PROMPT))
    assert isinstance(person, Person)


def test_embedding(engine):
    emb = EllmEmbedding(llm=engine)
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    got = np.array(emb.get_text_embedding_batch(texts))
    np.testing.assert_allclose(got, engine.embed(texts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(emb.get_query_embedding(texts[1]), got[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(asyncio.run(emb.aget_text_embedding(texts[0])), got[0], rtol=1e-5, atol=1e-6)
