"""POST /v1/responses, stateless: OpenAI's Responses API over the chat path.

A request's `input` (text, or items: messages, function_call, function_call_output) and
`instructions` become chat messages (`reasoning` items, which clients replay from earlier
responses, are skipped: a model without a reasoning channel never sees them, as OpenAI
does not show them to one); `tools` (flat function tools), `tool_choice` and
`parallel_tool_calls` go through ellm.server.tools like chat's; `text.format` (text,
json_object, json_schema) becomes the output constraint; `top_logprobs` and `include:
["message.output_text.logprobs"]` give each output_text its tokens' logprobs (in the
deltas too). Nothing is stored:
`previous_response_id` and `conversation` are refused by name (send the history as
input items instead), and `store` is accepted but never keeps anything.

The answer is a `response` object whose `output` holds one assistant message (when
there is text) and one function_call item per call. Streamed, the same arrives as the
API's events: response.created, response.in_progress, then per output item
response.output_item.added, (response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done) or
(response.function_call_arguments.delta, response.function_call_arguments.done),
response.output_item.done, and finally response.completed (or response.incomplete when
max_output_tokens cut it short).
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from . import generation as G
from . import protocol as P
from . import responses as R
from .core import Server
from .errors import APIError, from_validation
from .streaming import SSEResponse, unless_disconnected
from .tools import ToolCall, ToolError

# Fields of a request that a stateless server cannot honour.
_STATEFUL = ("previous_response_id", "conversation")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise ToolError(f"{where}.content[{j}]", f"{where}.content[{j}] must be an input_text or "
                                                         f"output_text part (only text is supported)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise ToolError(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def input_messages(input_: Any, instructions: str | None = None) -> list[dict[str, Any]]:
    """Chat messages from a Responses `input` and `instructions`."""
    msgs: list[dict[str, Any]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        if not input_:
            raise ToolError("input", "input is empty")
        return msgs + [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ToolError("input", "input must be a non-empty string or a non-empty list of items")
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ToolError(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ToolError(f"{where}.role", f"{where}.role must be user, assistant, system or developer")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content", ""), where)})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise ToolError(where, f"{where}: a function_call item needs a name and arguments (a JSON string)")
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": name, "arguments": args}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)   # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":   # a model's earlier reasoning, replayed: not part of the prompt
            continue
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(out, (str, list)):
                raise ToolError(f"{where}.output", f"{where}.output must be a string")
            msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        else:
            raise ToolError(f"{where}.type", f"{where}.type {kind!r} is not supported (message, function_call, "
                                             f"function_call_output, reasoning are)")
    return msgs


def format_fields(text: Any) -> dict[str, Any]:
    """The structured-output field (as chat's response_format) for `text.format`."""
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ToolError("text.format", 'text.format must be {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ToolError("text.format.schema", "text.format json_schema needs a 'schema' object")
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                    "strict": fmt.get("strict")}}}
    return {"response_format": {"type": fmt["type"]}}


# include values for output this server never produces (no built-in tools, no reasoning):
# asking for them changes nothing. Logprobs are the one it honours.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                              "web_search_call.action.sources", "message.input_image.image_url",
                              "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


def logprob_fields(body: dict[str, Any]) -> dict[str, Any]:
    """chat's logprobs / top_logprobs for `include` and `top_logprobs` (either asks)."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise ToolError("include", "include must be a list of strings")
    bad = [v for v in include if v != LOGPROBS_INCLUDE and v not in _INCLUDE_NOTHING]
    if bad:
        raise ToolError("include", f"include value {bad[0]!r} is not supported ({LOGPROBS_INCLUDE!r} is)")
    top = body.get("top_logprobs")
    if top is None and LOGPROBS_INCLUDE not in include:
        return {}
    return {"logprobs": True, "top_logprobs": 0 if top is None else top}


def check_stateless(body: dict[str, Any]) -> None:
    for name in _STATEFUL:
        if body.get(name) is not None:
            raise ToolError(name, f"'{name}' is not supported: this server keeps no state; send the earlier "
                                  f"turns as input items")


class ResponseBuilder:
    """Builds a response object and, for a stream, its events, from the parsed output:
    feed content deltas and calls as they come, then finish()."""

    def __init__(self, request: dict[str, Any], model: str) -> None:
        self.id = new_id("resp")
        self.created = int(time.time())
        self.model = model
        self.request = request
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None   # the open assistant message item
        self._seq = 0
        self.logprobs = bool(logprob_fields(request))   # output_text parts carry logprobs

    # -- the response object ------------------------------------------------------------

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
            "model": self.model, "output": list(self.output),
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": r.get("temperature"), "top_p": r.get("top_p"),
            "text": r.get("text") or {"format": {"type": "text"}},
            "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
            "truncation": "disabled", "usage": usage, "user": r.get("user"), "metadata": r.get("metadata") or {},
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Events for a piece of the message's text; logprobs: its tokens' (when asked)."""
        if not text:
            return []
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
            self.output.append(self._message)
            idx = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=idx,
                                      item={**self._message, "content": []}))
            def empty() -> dict[str, Any]:
                lps: dict[str, Any] = {"logprobs": []} if self.logprobs else {}
                return {"type": "output_text", "text": "", "annotations": [], **lps}
            self._message["content"].append(empty())
            events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                      output_index=idx, content_index=0, part=empty()))
        part = self._message["content"][0]
        part["text"] += text
        extra = {}
        if self.logprobs:
            part["logprobs"] += logprobs or []
            extra["logprobs"] = logprobs or []
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self.output.index(self._message), content_index=0, delta=text,
                                  **extra))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        m = self._message
        if m is None:
            return []
        self._message = None
        idx = self.output.index(m)
        m["status"] = "completed"
        part = m["content"][0]
        return [self._event("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0,
                            text=part["text"]),
                self._event("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=idx, item=m)]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close_message()
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        idx = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=idx, item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                  delta=call.arguments))
        item["arguments"], item["status"] = call.arguments, "completed"
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=idx, item=dict(item)))
        return events

    def finish(self, finish_reason: str | None, input_tokens: int, output_tokens: int,
               cached_tokens: int = 0) -> list[dict[str, Any]]:
        events = self._close_message()
        usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": input_tokens + output_tokens}
        if finish_reason == "length":
            self.final = self.response("incomplete", usage, incomplete="max_output_tokens")
            events.append(self._event("response.incomplete", response=self.final))
        else:
            self.final = self.response("completed", usage)
            events.append(self._event("response.completed", response=self.final))
        return events


def sse_event(ev: dict[str, Any]) -> str:
    """One Responses stream event as SSE (the event name and the JSON data)."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- the route

def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request that a Responses request means."""
    check_stateless(body)
    msgs = input_messages(body.get("input"), body.get("instructions"))
    out: dict[str, Any] = {"messages": msgs, **format_fields(body.get("text")), **logprob_fields(body)}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("tools", "tools"), ("tool_choice", "tool_choice"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
        if body.get(src) is not None:
            out[dst] = body[src]
    return out


async def create_response(server: Server, request: Request, body: Any) -> Response:
    """POST /v1/responses on an ellm.server.core.Server."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = P.ChatCompletionRequest.model_validate(chat_body(body))
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    except ValidationError as e:
        raise from_validation(e.errors()) from None
    adapter = server.check_model(req.model)   # [lora] the adapter named by "model", or None
    plan = server.tool_plan(req)
    messages = req.template_messages()
    fetched = await server.fetch_images(messages)   # [vision] in the fetcher's threads
    try:
        ids = await server.off_loop(server.chat_ids, messages, True, None, plan, fetched)  # (CPU work)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    params = await server.compile_params(req, plan)   # [structured] off the loop, once
    outputs = (await G.start(server, req, [ids], params, what="input", rid=new_id("resp"),
                             max_tokens_param="max_output_tokens" if req.max_completion_tokens else None,
                             adapter=adapter)).outputs
    builder = ResponseBuilder(body, server.reported_model(req.model))
    parser = plan.stream_parser() if plan is not None else None

    pending_lps: list[dict[str, Any]] = []

    def content(text: str) -> list[dict[str, Any]]:
        events = builder.content(text, list(pending_lps))
        if events:
            pending_lps.clear()
        return events

    def parsed(events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, v in events:
            out += content(v) if kind == "content" else builder.call(v)
        return out

    async def run(emit: bool) -> Any:
        """Feeds the builder; yields SSE text when emit (a stream)."""
        n_out, cached = 0, 0
        try:
            if emit:
                for ev in builder.start():
                    yield sse_event(ev)
            async for _, out in outputs:
                n_out += len(out.new_token_ids)
                if builder.logprobs:   # (held until some text comes out to carry them)
                    pending_lps.extend(R.chat_logprobs(out.new_logprobs, server.token_text)["content"])
                if parser is not None:
                    found = parser.feed(out.new_text)
                    if out.finished:
                        found += parser.finish(cut=out.finish_reason == "length")
                    events = parsed(found)
                else:
                    events = content(out.new_text)
                if out.finished:
                    cached = out.num_cached_tokens
                    events += builder.finish(out.finish_reason, len(ids), n_out, cached)
                if emit:
                    for ev in events:
                        yield sse_event(ev)
        except Exception as e:  # noqa: BLE001 - an engine failure ends the stream with an error event
            err = server.engine_error(e)
            if not emit:
                raise err from None
            yield sse_event({"type": "error", "sequence_number": builder._seq, "code": err.code,
                             "message": str(err), "param": None})
        finally:
            await outputs.aclose()

    if body.get("stream"):
        return SSEResponse(run(True))

    async def collect() -> Any:
        try:
            async for _ in run(False):
                pass
        except APIError as e:
            return e
        return builder.final

    finished, result = await unless_disconnected(request, collect())
    if not finished:
        return Response(status_code=499)
    if isinstance(result, APIError):
        return JSONResponse(result.body(), status_code=result.status)
    return JSONResponse(result)
