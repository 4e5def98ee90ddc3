"""POST /v1/chat/completions: messages in (text, images, tool calls and results), an
assistant message out -- its content, or its tool calls parsed from the model's text
(ellm.server.tools); streamed as chat.completion.chunk events or answered whole."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ...engine.sequence import RequestOutput
from .. import generation as G
from .. import protocol as P
from .. import responses as R
from ..core import Server
from ..errors import APIError
from ..openapi import streamed
from ..streaming import SSEResponse
from ..tools import ToolError, ToolPlan


async def create_chat_completion(server: Server, request: Request, req: P.ChatCompletionRequest) -> Response:
    adapter = server.check_model(req.model)   # [lora] the adapter named by "model", or None
    plan = server.tool_plan(req)
    messages = req.template_messages()
    fetched = await server.fetch_images(messages)   # [vision] image URLs, in the fetcher's threads
    try:
        ids, images = await server.off_loop(server.chat_prompt, messages, True, req.chat_template_kwargs, plan,
                                            fetched)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    # [structured] the constraint (and [tools] the call grammar) compiled once, off the loop
    params = await server.compile_params(req, plan)
    run = await G.start(server, req, [ids], params, what="messages", rid=R.new_id("chatcmpl"),
                        max_tokens_param=req.max_tokens_param, images=[images], adapter=adapter)
    if req.stream:
        return SSEResponse(chat_events(server, req, run, plan))
    return await G.answer(server, request, req, run, lambda choices: chat_body(server, req, run, choices, plan))


def chat_body(server: Server, req: P.ChatCompletionRequest, run: G.Run, choices: list[G.Choice],
              plan: ToolPlan | None) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        # [tools] (a call cut short by max_tokens is dropped, not returned as text)
        content, calls = plan.parse(c.text, cut=c.finish_reason == "length") if plan is not None else (c.text, [])
        out.append(R.ChatChoice(
            index=i, message=R.AssistantMessage(content=content, tool_calls=[t.to_openai() for t in calls] or None),
            finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
            logprobs=R.ChatLogprobs.model_validate(R.chat_logprobs(c.logprobs, server.token_text))
            if c.logprobs is not None else None))
    return R.ChatCompletion(id=run.rid, created=R.now(), model=server.reported_model(req.model), choices=out,
                            usage=G.usage(req, run, choices)).model_dump()


def chat_events(server: Server, req: P.ChatCompletionRequest, run: G.Run, plan: ToolPlan | None) -> Any:
    """The SSE body: each choice's role first (before any token, and before prefill ends),
    then its content deltas or [tools] its calls as the parser finds them, then a last
    chunk with its finish_reason."""
    want_logprobs = P.logprob_count(req) is not None
    head = {"id": run.rid, "object": "chat.completion.chunk", "created": R.now(),
            "model": server.reported_model(req.model), "system_fingerprint": None}
    n = len(run.prompts) * run.n
    parsers = [plan.stream_parser() if plan is not None else None for _ in range(n)]
    calls_sent = [0] * n

    def deltas(i: int, events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for kind, v in events:
            if kind == "content":
                out.append({"content": v})
            else:
                out.append({"tool_calls": [{"index": calls_sent[i], **v.to_openai()}]})
                calls_sent[i] += 1
        return out

    def on_output(i: int, out: RequestOutput) -> list[dict[str, Any]]:
        lp = R.chat_logprobs(out.new_logprobs, server.token_text) if want_logprobs and out.new_logprobs else None
        parser = parsers[i]
        if parser is None:
            pieces = [{"content": out.new_text}] if out.new_text else []
        else:  # [tools] content and calls as the parser finds them
            events = parser.feed(out.new_text)
            if out.finished:
                events += parser.finish(cut=out.finish_reason == "length")
            pieces = deltas(i, events)
        if lp is not None and not pieces:
            pieces = [{"content": ""}]
        chunks: list[dict[str, Any]] = [{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                         "finish_reason": None} for k, delta in enumerate(pieces)]
        if out.finished:
            reason = "tool_calls" if calls_sent[i] and out.finish_reason == "stop" else out.finish_reason
            chunks.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
        return chunks

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(n)]
    return G.events(server, req, run, head, opening, on_output)


def register(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions", responses=streamed(R.ChatCompletion))
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, request, body)
