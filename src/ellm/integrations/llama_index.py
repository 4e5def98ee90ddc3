"""LlamaIndex on ellm, in-process (extra `ellm-engine[llamaindex]`): EllmLLM, a function-calling
LLM, and EllmEmbedding.

    from ellm.integrations.llama_index import EllmLLM
    llm = EllmLLM(model="smollm2-135m-instruct", max_tokens=64)    # or llm=ellm.load(...)
    llm.complete("Hello").text

complete / chat and their stream and async forms run on the engine (the async ones on
its asyncio API). Tool calling (chat_with_tools, predict_and_call, agents) parses the
model's calls into ToolCallBlocks; tool_required=True constrains the output to valid
calls. structured_predict generates through the output class's JSON schema grammar, so
the result always validates.
"""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen, \
    CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen, ImageBlock, LLMMetadata, MessageRole, \
    TextBlock, ToolCallBlock
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.types import PydanticProgramMode

from ..llm import LLM
from . import _chat
from .shared import get_llm

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "seed", "stop")
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


def _content(message: ChatMessage) -> Any:
    """A message's blocks as OpenAI content: a string, or parts when it holds images."""
    parts: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image", "image": block.resolve_image().read()})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's tool calls in OpenAI's form: its ToolCallBlocks, or OpenAI-style
    additional_kwargs["tool_calls"] (how older integrations kept them)."""
    calls = []
    for i, block in enumerate(b for b in message.blocks if isinstance(b, ToolCallBlock)):
        args = block.tool_kwargs if isinstance(block.tool_kwargs, str) else json.dumps(block.tool_kwargs)
        calls.append({"id": block.tool_call_id or f"call_{i}", "type": "function",
                      "function": {"name": block.tool_name, "arguments": args}})
    if calls:
        return calls
    legacy = message.additional_kwargs.get("tool_calls") or []
    return [c if isinstance(c, dict) else c.model_dump() for c in legacy]


def openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex ChatMessages -> OpenAI chat messages."""
    out = []
    for m in messages:
        role = _ROLES.get(m.role.value, m.role.value)
        msg: dict[str, Any] = {"role": role, "content": _content(m)}
        if role == "assistant" and (calls := _tool_calls(m)):
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = m.additional_kwargs.get("tool_call_id", "")
            if "name" in m.additional_kwargs:
                msg["name"] = m.additional_kwargs["name"]
        out.append(msg)
    return out


def _chat_response(reply: _chat.Reply) -> ChatResponse:
    blocks: list[Any] = [TextBlock(text=reply.content or "")]
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=json.loads(c.arguments))
               for c in reply.tool_calls]
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
                        additional_kwargs=_usage(reply))


def _usage(reply: _chat.Reply) -> dict[str, Any]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.total_tokens, "finish_reason": reply.finish_reason}


class EllmLLM(FunctionCallingLLM):
    """A LlamaIndex LLM running an ellm model in this process.

    model: a model name, folder or .gguf path, loaded once per process (shared with the
    other integrations); or llm: an LLM already loaded. Sampling fields left None take
    the model's own defaults."""

    model: str | None = Field(default=None, description="The model's name, folder or .gguf path.")
    llm: Any = Field(default=None, exclude=True, description="An ellm.LLM already loaded.")
    load_kwargs: dict[str, Any] = Field(default_factory=dict, description="ellm.load's options.")
    max_tokens: int | None = Field(default=None, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    _engine: LLM = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._engine = get_llm(self.model, self.llm, **self.load_kwargs)
        if self.model is None:
            self.model = self._engine.source

    @classmethod
    def class_name(cls) -> str:
        return "EllmLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._engine.engine.cfg.max_model_len,
                           num_output=self.max_tokens or -1, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model or self._engine.source)

    # -- requests -------------------------------------------------------------------------

    def _prepare(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _chat.Prepared:
        calls = {k: kwargs.pop(k) for k in ("tools", "tool_choice", "parallel_tool_calls", "json_schema")
                 if k in kwargs}
        sampling = {k: kwargs.pop(k, getattr(self, k)) for k in _SAMPLING}
        kwargs.pop("formatted", None)   # complete()'s flag: prompts are always templated here
        if kwargs:
            raise TypeError(f"EllmLLM got unknown argument(s) {', '.join(sorted(kwargs))}")
        return _chat.prepare(self._engine, openai_messages(messages), **calls, **sampling)

    @staticmethod
    def _user(prompt: str) -> list[ChatMessage]:
        return [ChatMessage(role=MessageRole.USER, content=prompt)]

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(_chat.run(self._engine, self._prepare(messages, kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(await _chat.arun(self._engine, self._prepare(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prep = self._prepare(messages, kwargs)

        def gen() -> Generator[ChatResponse, None, None]:
            acc = _Accumulated()
            for delta in _chat.stream(self._engine, prep):
                yield acc.add(delta)
        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prep = self._prepare(messages, kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            acc = _Accumulated()
            async for delta in _chat.astream(self._engine, prep):
                yield acc.add(delta)
        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        r = self.chat(self._user(prompt), **kwargs)
        return CompletionResponse(text=r.message.content or "", additional_kwargs=r.additional_kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        r = await self.achat(self._user(prompt), **kwargs)
        return CompletionResponse(text=r.message.content or "", additional_kwargs=r.additional_kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        chats = self.stream_chat(self._user(prompt), **kwargs)

        def gen() -> Generator[CompletionResponse, None, None]:
            for r in chats:
                yield CompletionResponse(text=r.message.content or "", delta=r.delta,
                                         additional_kwargs=r.additional_kwargs)
        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        chats = await self.astream_chat(self._user(prompt), **kwargs)

        async def gen() -> AsyncGenerator[CompletionResponse, None]:
            async for r in chats:
                yield CompletionResponse(text=r.message.content or "", delta=r.delta,
                                         additional_kwargs=r.additional_kwargs)
        return gen()

    # -- tools ----------------------------------------------------------------------------

    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """chat()'s arguments for a turn with tools: tool_required (or tool_choice
        "required" / a tool's name) constrains the reply to valid calls."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        specs = [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
        if tool_choice is None:
            tool_choice = "required" if tool_required else ("auto" if specs else None)
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        return {"messages": messages, "tools": specs or None, "tool_choice": tool_choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        if not allow_parallel_tool_calls:   # keep the first call, as other integrations do
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            for extra in calls[1:]:
                response.message.blocks.remove(extra)
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none; the reply was: {response.message.content!r}")
        return [ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name,
                              tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict)
                              else json.loads(b.tool_kwargs))
                for b in calls]

    # -- structured output ------------------------------------------------------------------

    def structured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        """output_cls from the prompt, generated under output_cls's JSON schema grammar
        (always valid). With a pydantic_program_mode other than DEFAULT, LlamaIndex's own
        program runs instead."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        r = self.chat(messages, json_schema=output_cls, **(llm_kwargs or {}))
        return output_cls.model_validate_json(r.message.content or "")

    async def astructured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        """structured_predict() on asyncio."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        r = await self.achat(messages, json_schema=output_cls, **(llm_kwargs or {}))
        return output_cls.model_validate_json(r.message.content or "")


class _Accumulated:
    """The stream so far, as LlamaIndex streams chat: each response holds all the text
    and calls up to now, and the new text as its delta."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[Any] = []

    def add(self, delta: _chat.Delta) -> ChatResponse:
        self.text += delta.text
        self.calls += delta.tool_calls
        blocks: list[Any] = [TextBlock(text=self.text)]
        blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=json.loads(c.arguments))
                   for c in self.calls]
        extra = _usage(delta.reply) if delta.reply is not None else {}
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks), delta=delta.text,
                            additional_kwargs=extra)


class EllmEmbedding(BaseEmbedding):
    """LlamaIndex embeddings from an ellm model: its final-normed hidden states pooled over
    each text ("mean", "last" or "cls"), L2-normalised when normalize (LLM.embed)."""

    model: str | None = Field(default=None, description="The model's name, folder or .gguf path.")
    llm: Any = Field(default=None, exclude=True, description="An ellm.LLM already loaded.")
    load_kwargs: dict[str, Any] = Field(default_factory=dict)
    pooling: str = Field(default="mean", description='"mean", "last" or "cls"')
    normalize: bool = True

    _engine: LLM = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._engine = get_llm(self.model, self.llm, **self.load_kwargs)
        if self.model is None:
            self.model = self._engine.source
        self.model_name = self.model

    @classmethod
    def class_name(cls) -> str:
        return "EllmEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return self._engine.embed(list(texts), self.pooling, self.normalize).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return (await self._engine.aembed(list(texts), self.pooling, self.normalize)).tolist()

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await self._aget_text_embedding(query)
