"""LangChain on ellm, in-process (extra `ellm-engine[langchain]`): ChatEllm, a chat model, and
EllmEmbeddings.

    from ellm.integrations.langchain import ChatEllm
    chat = ChatEllm(model="smollm2-135m-instruct", max_tokens=64)   # or llm=ellm.load(...)
    chat.invoke("Hello").content

invoke / stream / batch run on the calling thread against the engine loop; their async
twins (ainvoke, astream, abatch) run on the engine's asyncio API, not in worker threads.
bind_tools parses the model's calls into AIMessage.tool_calls; tool_choice "required"
("any") or a tool's name constrains the output to valid calls. with_structured_output
generates through the schema's grammar (method="json_schema", the default), so the reply
always parses; method="function_calling" goes through a constrained tool call instead.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.embeddings import Embeddings
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, \
    PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..llm import LLM
from . import _chat
from .shared import get_llm

# ChatEllm's sampling fields, named as SamplingParams names them
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "seed")
# what a call's kwargs (bind(), bind_tools(), invoke(..., **kwargs)) may carry besides them
_CALL_KEYS = frozenset(_SAMPLING) | {"tools", "tool_choice", "parallel_tool_calls", "json_schema", "stop",
                                     "ls_structured_output_format"}


def _is_pydantic_class(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, BaseModel)


def _json_schema(schema: dict[str, Any] | type) -> dict[str, Any]:
    """The JSON schema that constrains a structured reply: a pydantic class's, a JSON schema
    as given, or one made from another tool form (an OpenAI tool or function, a TypedDict)."""
    if _is_pydantic_class(schema):
        return schema.model_json_schema()   # type: ignore[union-attr]
    if isinstance(schema, dict) and ("type" in schema or "properties" in schema or "anyOf" in schema) \
            and "function" not in schema and "parameters" not in schema:
        return schema
    return convert_to_json_schema(schema)


def _tool_choice(choice: Any) -> Any:
    """LangChain's tool_choice spellings -> OpenAI's: "any" / True -> "required", a bare
    tool name -> the named function."""
    if choice is None or choice is False:
        return None
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _ai_message(reply: _chat.Reply) -> AIMessage:
    return AIMessage(
        content=reply.content or "",
        tool_calls=[tool_call(name=c.name, args=_args(c.arguments), id=c.id) for c in reply.tool_calls],
        usage_metadata=_usage(reply),
        response_metadata={"finish_reason": reply.finish_reason, "model_provider": "ellm"},
    )


def _args(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}


def _usage(reply: _chat.Reply) -> UsageMetadata:
    return UsageMetadata(input_tokens=reply.prompt_tokens, output_tokens=reply.completion_tokens,
                         total_tokens=reply.total_tokens)


class ChatEllm(BaseChatModel):
    """A LangChain chat model running an ellm LLM in this process.

    model: a model name, folder or .gguf path, loaded once per process (shared with the
    other integrations); or llm: an LLM already loaded. The sampling fields left None
    take the model's own defaults (generation_config.json / GGUF metadata)."""

    model: str | None = None
    llm: Any = Field(default=None, exclude=True)
    load_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _engine: LLM = PrivateAttr()

    @model_validator(mode="after")
    def _load(self) -> ChatEllm:
        self._engine = get_llm(self.model, self.llm, **self.load_kwargs)
        if self.model is None:
            self.model = self._engine.source
        return self

    @property
    def _llm_type(self) -> str:
        return "ellm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **{k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}}

    # -- one request ---------------------------------------------------------------------

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _chat.Prepared:
        unknown = sorted(set(kwargs) - _CALL_KEYS)
        if unknown:
            raise TypeError(f"ChatEllm got unknown argument(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(_CALL_KEYS))}")
        sampling = {k: kwargs.get(k, getattr(self, k)) for k in _SAMPLING}
        stops = stop if stop is not None else kwargs.get("stop", self.stop)
        return _chat.prepare(self._engine, convert_to_openai_messages(messages),
                             tools=kwargs.get("tools"), tool_choice=_tool_choice(kwargs.get("tool_choice")),
                             parallel_tool_calls=kwargs.get("parallel_tool_calls"),
                             json_schema=kwargs.get("json_schema"), stop=stops or None, **sampling)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        reply = _chat.run(self._engine, self._prepare(messages, stop, kwargs))
        return ChatResult(generations=[ChatGeneration(message=_ai_message(reply))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        reply = await _chat.arun(self._engine, self._prepare(messages, stop, kwargs))
        return ChatResult(generations=[ChatGeneration(message=_ai_message(reply))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        calls = 0
        for delta in _chat.stream(self._engine, self._prepare(messages, stop, kwargs)):
            chunk, calls = _chunk(delta, calls)
            if run_manager is not None:
                run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        calls = 0
        async for delta in _chat.astream(self._engine, self._prepare(messages, stop, kwargs)):
            chunk, calls = _chunk(delta, calls)
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    # -- tools and structured output -----------------------------------------------------

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: str | dict[str, Any] | bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with these tools offered (any LangChain tool form: a BaseTool, a
        pydantic class, a function, an OpenAI tool dict). tool_choice: "auto" (default),
        "none", "required" or "any" (at least one call, constrained), or a tool's name
        (exactly that call, constrained)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=formatted, tool_choice=_tool_choice(tool_choice),
                         parallel_tool_calls=parallel_tool_calls, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """A runnable whose output is schema's (a pydantic instance for a pydantic class,
        else a dict). json_schema (default): generation is constrained by the schema, so
        the reply always parses and validates; json_mode: any JSON object;
        function_calling: one constrained call of a tool made from the schema."""
        if kwargs:
            raise TypeError(f"with_structured_output got unknown argument(s) {', '.join(sorted(kwargs))}")
        if strict is False:
            raise ValueError("ellm always generates structured output under the schema's grammar; "
                             "strict=False cannot be honoured")
        fmt = {"kwargs": {"method": method}, "schema": schema}
        parser: Runnable[Any, Any]
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            bound = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=fmt)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if _is_pydantic_class(schema)
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            js = {"type": "object"} if method == "json_mode" else _json_schema(schema)
            bound = self.bind(json_schema=js, ls_structured_output_format=fmt)
            parser = (PydanticOutputParser(pydantic_object=schema) if _is_pydantic_class(schema) and
                      method == "json_schema" else JsonOutputParser())
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        parser = RunnableLambda(_complete) | parser
        if not include_raw:
            return bound | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=bound) | parsed.with_fallbacks([failed], exception_key="parsing_error")


def _complete(message: AIMessage) -> AIMessage:
    """A structured reply cut by max_tokens is incomplete JSON, whatever the grammar: say
    so, rather than let a lenient parser return part of it."""
    if message.response_metadata.get("finish_reason") == "length":
        raise OutputParserException(f"the structured reply was cut at max_tokens "
                                    f"({(message.usage_metadata or {}).get('output_tokens')} tokens) before it was "
                                    f"complete; raise max_tokens", llm_output=str(message.content))
    return message


def _chunk(delta: _chat.Delta, calls: int) -> tuple[ChatGenerationChunk, int]:
    """A stream Delta as LangChain's chunk; calls: how many tool calls came before."""
    if delta.reply is not None:
        reply = delta.reply
        msg = AIMessageChunk(content="", usage_metadata=_usage(reply), chunk_position="last",
                             response_metadata={"finish_reason": reply.finish_reason, "model_provider": "ellm"})
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": reply.finish_reason}), calls
    chunks = [tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=calls + i)
              for i, c in enumerate(delta.tool_calls)]
    return ChatGenerationChunk(message=AIMessageChunk(content=delta.text, tool_call_chunks=chunks)), calls + len(chunks)


class EllmEmbeddings(Embeddings):
    """LangChain Embeddings from an ellm model: its final-normed hidden states pooled over
    each text ("mean", "last" or "cls"), L2-normalised when normalize (LLM.embed)."""

    def __init__(self, model: str | None = None, *, llm: LLM | None = None, pooling: str = "mean",
                 normalize: bool = True, **load_kwargs: Any) -> None:
        self.llm = get_llm(model, llm, **load_kwargs)
        self.pooling, self.normalize = pooling, normalize

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return self.llm.embed(list(texts), self.pooling, self.normalize).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return (await self.llm.aembed(list(texts), self.pooling, self.normalize)).tolist()

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.aembed_documents([text]))[0]
