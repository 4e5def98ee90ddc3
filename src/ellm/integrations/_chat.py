"""The one engine path under every integration: OpenAI-style messages, tools and a JSON
schema in; a reply (text, tool calls, finish reason, token counts) or its stream out,
blocking (any thread) or on asyncio (the engine's own async API, no worker threads).

Tools go through ellm's ToolPlan exactly as LLM.chat and the server use it: the chat
template renders them, tool_choice "required" or a named function constrains the output
with the call grammar (so such calls always parse and their arguments always validate),
and the model's text is parsed back into calls."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.sequence import RequestOutput
from ..llm import LLM
from ..sampling_params import SamplingParams
from ..server.tools import StreamParser, ToolCall, ToolPlan


class GenerationError(RuntimeError):
    """The engine ended a request with finish_reason "error" (a constraint failed)."""


@dataclass
class Reply:
    text: str                    # everything the model wrote
    content: str | None          # the text beside the tool calls (all of it when there are none)
    tool_calls: list[ToolCall]
    finish_reason: str           # "stop" | "length" | "tool_calls" | "abort"
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Delta:
    """One piece of a stream: new text, calls whose block just closed, and on the last
    piece only, the whole Reply."""
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reply: Reply | None = None


@dataclass
class Prepared:
    ids: list[int]
    images: list[Any] | None
    params: SamplingParams
    plan: ToolPlan | None


def prepare(llm: LLM, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
            tool_choice: Any = None, parallel_tool_calls: bool | None = None,
            json_schema: Any = None, **sampling: Any) -> Prepared:
    """The prompt ids and SamplingParams of one chat request. sampling: SamplingParams
    fields (None values are left to the model's defaults); json_schema constrains the reply
    to that schema (a dict or a pydantic model class)."""
    given = {k: v for k, v in sampling.items() if v is not None}
    if json_schema is not None:
        given["json_schema"] = json_schema
    params = llm.sampling_params(**given)
    if tools or tool_choice is not None:
        from ..vision.chat import has_images
        from ..vision.images import ImageError
        if has_images(messages):
            raise ImageError("images together with tools are not supported yet: send them in separate calls")
        plan = ToolPlan.make(llm.tokenizer, tools or [], tool_choice,
                             True if parallel_tool_calls is None else parallel_tool_calls)
        return Prepared(plan.prompt_ids(llm.tokenizer, messages), None, plan.sampling(params), plan)
    ids, images = llm.encode_chat_with_images(messages)
    return Prepared(ids, images, params, None)


def _reply(last: RequestOutput | None, prep: Prepared) -> Reply:
    if last is None:
        raise GenerationError("the request ended without a final output")
    if last.finish_reason == "error":
        raise GenerationError(f"generation failed: {last.error}")
    content: str | None = last.text
    calls: list[ToolCall] = []
    if prep.plan is not None:
        content, calls = prep.plan.parse(last.text, cut=last.finish_reason == "length")
    return Reply(last.text, content, calls, "tool_calls" if calls else (last.finish_reason or "stop"),
                 len(last.prompt_token_ids), len(last.token_ids))


def run(llm: LLM, prep: Prepared) -> Reply:
    """The whole reply, blocking the calling thread."""
    stream = llm.submit(prep.ids, prep.params, images=prep.images)
    last = None
    try:
        for last in stream:
            pass
    finally:
        stream.close()
    return _reply(last, prep)


async def arun(llm: LLM, prep: Prepared) -> Reply:
    """run() on asyncio; cancelling the task aborts the request."""
    stream = llm.asubmit(prep.ids, prep.params, images=prep.images)
    last = None
    try:
        async for last in stream:
            pass
    finally:
        stream.close()
    return _reply(last, prep)


class _Splitter:
    """Turns a request's deltas into Deltas: text as it comes, each tool call when its
    block closes (ellm.server.tools.StreamParser), the Reply last."""

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.parser: StreamParser | None = prep.plan.stream_parser() if prep.plan is not None else None
        self.last: RequestOutput | None = None

    def feed(self, out: RequestOutput) -> list[Delta]:
        self.last = out
        if not out.new_text:
            return []
        if self.parser is None:
            return [Delta(text=out.new_text)]
        return self._events(self.parser.feed(out.new_text))

    def finish(self) -> list[Delta]:
        reply = _reply(self.last, self.prep)
        cut = self.last is not None and self.last.finish_reason == "length"
        tail = self._events(self.parser.finish(cut=cut)) if self.parser is not None else []
        return tail + [Delta(reply=reply)]

    @staticmethod
    def _events(events: list[tuple[str, Any]]) -> list[Delta]:
        return [Delta(text=v) if kind == "content" else Delta(tool_calls=[v]) for kind, v in events]


def stream(llm: LLM, prep: Prepared) -> Iterator[Delta]:
    """The reply piece by piece; closing the generator aborts the request."""
    split = _Splitter(prep)
    s = llm.submit(prep.ids, prep.params, images=prep.images)
    try:
        for out in s:
            yield from split.feed(out)
    finally:
        s.close()
    yield from split.finish()


async def astream(llm: LLM, prep: Prepared) -> AsyncIterator[Delta]:
    """stream() on asyncio."""
    split = _Splitter(prep)
    s = llm.asubmit(prep.ids, prep.params, images=prep.images)
    try:
        async for out in s:
            for d in split.feed(out):
                yield d
    finally:
        s.close()
    for d in split.finish():
        yield d
