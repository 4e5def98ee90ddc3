"""litellm on ellm, in-process (extra `ellm-engine[litellm]`). Importing this module registers
the "ellm" provider:

    import litellm
    import ellm.integrations.litellm
    litellm.completion(model="ellm/smollm2-135m-instruct", messages=[...], max_tokens=64)

completion and acompletion (with stream=True too), tools and tool_choice (required or a
named function constrain the output to valid calls), response_format (json_object or
json_schema, generated through the schema's grammar) and embedding all run in this
process; the model after "ellm/" (a known name, a folder or a .gguf path) is loaded once
per process through ellm.integrations.shared. register(llm) serves an LLM loaded
elsewhere under its name.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import litellm
from litellm import CustomLLM
from litellm.types.utils import ChatCompletionMessageToolCall, Choices, EmbeddingResponse, Function, \
    GenericStreamingChunk, Message, ModelResponse, Usage

from ..llm import LLM
from . import _chat
from .shared import get_llm, share

PROVIDER = "ellm"

# OpenAI request fields -> SamplingParams fields
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
             "repetition_penalty": "repetition_penalty"}
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
# fields litellm may pass that change nothing here
_IGNORED = frozenset({"stream", "stream_options", "user", "max_retries", "extra_body"})


class UnsupportedParameterError(ValueError):
    """A request field ellm cannot honour; the message names it."""


def _json_schema(response_format: Any) -> Any:
    """OpenAI's response_format -> the schema that constrains the reply (None for text)."""
    if response_format is None:
        return None
    if isinstance(response_format, type):   # a pydantic class, as litellm also accepts
        return response_format
    if not isinstance(response_format, dict):
        raise UnsupportedParameterError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return response_format.get("schema") or {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise UnsupportedParameterError('response_format {"type": "json_schema"} needs json_schema.schema')
        return spec["schema"]
    raise UnsupportedParameterError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def _prepare(llm: LLM, messages: list[dict[str, Any]], optional_params: dict[str, Any]) -> _chat.Prepared:
    params = dict(optional_params)
    n = params.pop("n", None)
    if n not in (None, 1):
        raise UnsupportedParameterError(f"n={n}: the ellm provider returns one choice per request")
    sampling = {_SAMPLING[k]: params.pop(k) for k in list(params) if k in _SAMPLING}
    tools = {k: params.pop(k) for k in list(params) if k in _TOOLS}
    schema = _json_schema(params.pop("response_format", None))
    unknown = sorted(k for k in params if k not in _IGNORED)
    if unknown:
        raise UnsupportedParameterError(f"the ellm provider does not support {', '.join(unknown)}")
    return _chat.prepare(llm, [_plain(m) for m in messages], json_schema=schema, **tools, **sampling)


def _plain(message: Any) -> dict[str, Any]:
    """A message as a dict (litellm may hand over its own Message objects)."""
    if isinstance(message, dict):
        return message
    dump = getattr(message, "model_dump", None)
    return dump(exclude_none=True) if dump is not None else dict(message)


def _fill(response: ModelResponse, model: str, reply: _chat.Reply) -> ModelResponse:
    calls = [ChatCompletionMessageToolCall(id=c.id, type="function",
                                           function=Function(name=c.name, arguments=c.arguments))
             for c in reply.tool_calls] or None
    message = Message(role="assistant", content=reply.content if reply.tool_calls else reply.text, tool_calls=calls)
    response.choices = [Choices(index=0, finish_reason=reply.finish_reason, message=message)]
    response.model = f"{PROVIDER}/{model}"
    response.created = int(time.time())
    setattr(response, "usage", Usage(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                                     total_tokens=reply.total_tokens))
    return response


def _chunks(delta: _chat.Delta, calls: int) -> tuple[list[GenericStreamingChunk], int]:
    """A stream Delta as litellm's generic chunks; calls: how many tool calls came before."""
    if delta.reply is not None:
        r = delta.reply
        usage = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                 "total_tokens": r.total_tokens}
        return [GenericStreamingChunk(text="", tool_use=None, is_finished=True, finish_reason=r.finish_reason,
                                      usage=usage, index=0)], calls  # type: ignore[typeddict-item]
    out = [GenericStreamingChunk(text=delta.text, tool_use=None, is_finished=False, finish_reason="",
                                 usage=None, index=0)] if delta.text else []
    for c in delta.tool_calls:
        use = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments},
               "index": calls}
        out.append(GenericStreamingChunk(text="", tool_use=use, is_finished=False, finish_reason="",  # type: ignore[typeddict-item]
                                         usage=None, index=0))
        calls += 1
    return out, calls


def _stream(deltas: Iterator[_chat.Delta]) -> Iterator[GenericStreamingChunk]:
    calls = 0
    for delta in deltas:
        chunks, calls = _chunks(delta, calls)
        yield from chunks


async def _astream(deltas: AsyncIterator[_chat.Delta]) -> AsyncIterator[GenericStreamingChunk]:
    calls = 0
    async for delta in deltas:
        chunks, calls = _chunks(delta, calls)
        for c in chunks:
            yield c


def _embed_response(llm: LLM, model: str, texts: list[Any], response: EmbeddingResponse,
                    vectors: Any) -> EmbeddingResponse:
    response.model = f"{PROVIDER}/{model}"
    response.data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
    tokens = sum(len(llm.encode_prompt(t)) for t in texts)
    setattr(response, "usage", Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens))
    return response


def _embed_inputs(texts: Any, optional_params: dict[str, Any]) -> list[Any]:
    unknown = sorted(k for k in optional_params if k != "encoding_format")
    if unknown:
        raise UnsupportedParameterError(f"ellm embeddings do not support {', '.join(unknown)}")
    if optional_params.get("encoding_format") not in (None, "float"):
        raise UnsupportedParameterError("ellm embeddings come as floats (encoding_format 'float')")
    return [texts] if isinstance(texts, str) else list(texts)


class EllmProvider(CustomLLM):
    """litellm's custom provider "ellm": every call runs on the model named after "ellm/"."""

    def completion(self, model: str, messages: list[Any], *args: Any, model_response: ModelResponse,
                   optional_params: dict[str, Any], **kwargs: Any) -> ModelResponse:
        llm = get_llm(model)
        return _fill(model_response, model, _chat.run(llm, _prepare(llm, messages, optional_params)))

    async def acompletion(self, model: str, messages: list[Any], *args: Any, model_response: ModelResponse,
                          optional_params: dict[str, Any], **kwargs: Any) -> ModelResponse:
        llm = get_llm(model)
        return _fill(model_response, model, await _chat.arun(llm, _prepare(llm, messages, optional_params)))

    def streaming(self, model: str, messages: list[Any], *args: Any, optional_params: dict[str, Any],
                  **kwargs: Any) -> Iterator[GenericStreamingChunk]:
        llm = get_llm(model)
        prep = _prepare(llm, messages, optional_params)   # a bad request fails here, not mid-stream
        return _stream(_chat.stream(llm, prep))

    def astreaming(self, model: str, messages: list[Any], *args: Any, optional_params: dict[str, Any],  # type: ignore[override]
                   **kwargs: Any) -> AsyncIterator[GenericStreamingChunk]:
        llm = get_llm(model)
        prep = _prepare(llm, messages, optional_params)
        return _astream(_chat.astream(llm, prep))

    def embedding(self, model: str, input: list[Any], model_response: EmbeddingResponse, *args: Any,
                  optional_params: dict[str, Any], **kwargs: Any) -> EmbeddingResponse:
        llm = get_llm(model)
        texts = _embed_inputs(input, optional_params)
        return _embed_response(llm, model, texts, model_response, llm.embed(texts))

    async def aembedding(self, model: str, input: list[Any], model_response: EmbeddingResponse, *args: Any,
                         optional_params: dict[str, Any], **kwargs: Any) -> EmbeddingResponse:
        llm = get_llm(model)
        texts = _embed_inputs(input, optional_params)
        return _embed_response(llm, model, texts, model_response, await llm.aembed(texts))


provider = EllmProvider()


def register(llm: LLM | None = None, name: str | None = None) -> None:
    """Registers the "ellm" provider with litellm (done on import; again is harmless); with
    llm, also serves that loaded LLM as "ellm/<name>" (default: llm.source)."""
    if not any(p.get("provider") == PROVIDER for p in litellm.custom_provider_map):
        litellm.custom_provider_map.append({"provider": PROVIDER, "custom_handler": provider})
    litellm.utils.custom_llm_setup()
    if llm is not None:
        share(llm, name)


register()
