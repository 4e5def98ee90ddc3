"""The `llm` CLI's plugin for ellm (extra `ellm-engine[llm]`; entry point group "llm"), in-process:

    llm -m ellm/smollm2-135m-instruct "Tell me a joke" -o max_tokens 64
    llm -m ellm/smollm2-135m-instruct --schema 'name, age int' "Invent a person"
    llm -m ellm/smollm2-135m-instruct -T llm_time "What time is it?"
    llm embed -m ellm/smollm2-135m-instruct -c "some text"

Every model ellm knows by name is offered as "ellm/<name>" (chat and embedding); other
models (a folder, a .gguf file, a Hugging Face repo) are added with
`llm ellm register PATH [--name NAME]`, kept in llm's user folder. A schema constrains
the reply through its grammar (always valid JSON for it); tool calls are parsed from the
model's output in its chat template's format. Models load once per process
(ellm.integrations.shared).
"""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable, Iterator
from pathlib import Path
from typing import Any

import llm
from llm.parts import Message, TextPart, ToolCallPart, ToolResultPart
from pydantic import Field

from .. import hub
from . import _chat
from .shared import get_llm

PREFIX = "ellm/"
REGISTRY = "ellm-models.json"   # in llm.user_dir(): {name: path or model id}


class EllmOptions(llm.Options):
    max_tokens: int | None = Field(default=None, description="Most tokens to generate", ge=1)
    temperature: float | None = Field(default=None, description="Sampling temperature; 0 is greedy", ge=0)
    top_p: float | None = Field(default=None, description="Nucleus sampling mass", gt=0, le=1)
    top_k: int | None = Field(default=None, description="Keep the k most likely tokens; 0 is off", ge=0)
    min_p: float | None = Field(default=None, description="Drop tokens below min_p times the top one", ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, description="Repetition penalty; 1 is off", gt=0)
    seed: int | None = Field(default=None, description="Random seed")
    stop: str | None = Field(default=None, description="A string that ends the reply")
    tool_choice: str | None = Field(default=None, description="With tools: auto (default), none, required "
                                    "(the reply must call a tool, constrained to valid calls) or a tool's name")


def _registered() -> dict[str, str]:
    path = llm.user_dir() / REGISTRY
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _models() -> dict[str, str]:
    """name shown after "ellm/" -> what ellm.load is given."""
    return {**{name: name for name in hub.KNOWN_MODELS}, **_registered()}


def _text(parts: Iterable[Any]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """llm's Messages (text, tool calls, tool results) -> OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = [p for p in m.parts if isinstance(p, ToolCallPart)]
        results = [p for p in m.parts if isinstance(p, ToolResultPart)]
        if results:
            for r in results:
                content = r.output if r.exception is None else f"error: {r.exception}"
                out.append({"role": "tool", "tool_call_id": r.tool_call_id or "", "name": r.name, "content": content})
            continue
        msg: dict[str, Any] = {"role": m.role, "content": _text(m.parts)}
        if calls:
            msg["tool_calls"] = [{"id": c.tool_call_id or f"call_{i}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for i, c in enumerate(calls)]
        out.append(msg)
    return out


def _tool_choice(choice: str | None, messages: list[dict[str, Any]]) -> Any:
    """The option as OpenAI's tool_choice. "required" and a named tool hold for the turn
    that asks: once tool results come back (a chain, `llm -T`), the model answers freely."""
    if choice in (None, "auto", "none"):
        return choice
    if messages and messages[-1]["role"] == "tool":
        return "auto"
    return choice if choice == "required" else {"type": "function", "function": {"name": choice}}


class _Base:
    can_stream = True
    supports_schema = True
    supports_tools = True
    Options = EllmOptions

    def __init__(self, name: str, source: str) -> None:
        self.model_id = PREFIX + name
        self.source = source

    def _prepare(self, prompt: llm.Prompt) -> tuple[Any, _chat.Prepared]:
        engine = get_llm(self.source)
        opts = prompt.options
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in prompt.tools]
        sampling = {k: getattr(opts, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                  "repetition_penalty", "seed", "stop")}
        messages = openai_messages(prompt.messages)
        prep = _chat.prepare(engine, messages, tools=tools or None,
                             tool_choice=_tool_choice(opts.tool_choice, messages),
                             json_schema=prompt.schema or None, **sampling)
        return engine, prep

    @staticmethod
    def _finish(response: Any, reply: _chat.Reply) -> None:
        response.set_usage(input=reply.prompt_tokens, output=reply.completion_tokens)

    @staticmethod
    def _call(response: Any, call: Any) -> None:
        response.add_tool_call(llm.ToolCall(name=call.name, arguments=json.loads(call.arguments),
                                            tool_call_id=call.id))


class EllmModel(_Base, llm.Model):
    def execute(self, prompt: llm.Prompt, stream: bool, response: llm.Response,
                conversation: llm.Conversation | None) -> Iterator[str]:
        engine, prep = self._prepare(prompt)
        if not stream:
            reply = _chat.run(engine, prep)
            for c in reply.tool_calls:
                self._call(response, c)
            self._finish(response, reply)
            if reply.content:
                yield reply.content
            return
        for delta in _chat.stream(engine, prep):
            for c in delta.tool_calls:
                self._call(response, c)
            if delta.reply is not None:
                self._finish(response, delta.reply)
            if delta.text:
                yield delta.text


class AsyncEllmModel(_Base, llm.AsyncModel):
    async def execute(self, prompt: llm.Prompt, stream: bool, response: llm.AsyncResponse,
                      conversation: llm.AsyncConversation | None) -> AsyncGenerator[str, None]:
        engine, prep = self._prepare(prompt)
        async for delta in _chat.astream(engine, prep):
            for c in delta.tool_calls:
                self._call(response, c)
            if delta.reply is not None:
                self._finish(response, delta.reply)
            if delta.text:
                yield delta.text


class EllmEmbeddingModel(llm.EmbeddingModel):
    """Mean-pooled, L2-normalised final hidden states (LLM.embed)."""
    batch_size = 32

    def __init__(self, name: str, source: str) -> None:
        self.model_id = PREFIX + name
        self.source = source

    def embed_batch(self, items: Iterable[str | bytes]) -> Iterator[list[float]]:
        texts = [i.decode("utf-8") if isinstance(i, bytes) else i for i in items]
        if not texts:
            return iter([])
        return iter(get_llm(self.source).embed(texts).tolist())


@llm.hookimpl
def register_models(register: Any) -> None:
    for name, source in _models().items():
        register(EllmModel(name, source), AsyncEllmModel(name, source))


@llm.hookimpl
def register_embedding_models(register: Any) -> None:
    for name, source in _models().items():
        register(EllmEmbeddingModel(name, source))


@llm.hookimpl
def register_commands(cli: Any) -> None:
    import click

    @cli.group(name="ellm")
    def ellm_group() -> None:
        "Models run in-process by ellm"

    @ellm_group.command(name="register")
    @click.argument("source")
    @click.option("--name", help="The name after ellm/ (default: the file or folder name)")
    def register_command(source: str, name: str | None) -> None:
        """Offer SOURCE (a folder, a .gguf file or a Hugging Face repo id) as ellm/NAME."""
        path = Path(source).expanduser()
        target = str(path.resolve()) if path.exists() else source
        label = name or (path.stem if path.exists() else source.rsplit("/", 1)[-1])
        registry = _registered()
        registry[label] = target
        (llm.user_dir() / REGISTRY).write_text(json.dumps(registry, indent=2))
        click.echo(f"{PREFIX}{label} -> {target}")

    @ellm_group.command(name="models")
    def models_command() -> None:
        "List the ellm/ models"
        for name, source in _models().items():
            click.echo(PREFIX + name + ("" if source == name else f"  ({source})"))
