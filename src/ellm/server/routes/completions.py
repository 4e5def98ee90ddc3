"""POST /v1/completions: text (or token ids) in, text out; several prompts and n
choices each, streamed as server-sent events or answered whole."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ...engine.sequence import RequestOutput
from .. import generation as G
from .. import protocol as P
from .. import responses as R
from ..core import Server
from ..openapi import streamed
from ..streaming import SSEResponse


async def create_completion(server: Server, request: Request, req: P.CompletionRequest) -> Response:
    adapter = server.check_model(req.model)   # [lora] the adapter named by "model", or None
    sources = req.prompts()
    prompts = [await server.off_loop(server.prompt_ids, p) for p in sources]
    params = await server.compile_params(req)   # [structured] off the loop, once
    run = await G.start(server, req, prompts, params, what="prompt", rid=R.new_id("cmpl"),
                        max_tokens_param=req.max_tokens_param, adapter=adapter)
    # echo: each choice's text starts with its prompt's (token ids: their decoded text)
    echoes = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in sources] if req.echo else []
    if req.stream:
        return SSEResponse(completion_events(server, req, run, echoes))
    return await G.answer(server, request, req, run,
                          lambda choices: completion_body(server, req, run, choices, echoes))


def completion_body(server: Server, req: P.CompletionRequest, run: G.Run, choices: list[G.Choice],
                    echoes: list[str]) -> dict[str, Any]:
    text = [R.CompletionChoice(index=i, text=(echoes[i // run.n] if echoes else "") + c.text,
                               finish_reason=c.finish_reason,
                               logprobs=R.CompletionLogprobs.model_validate(
                                   R.completion_logprobs(c.logprobs, server.token_text, 0)[0])
                               if c.logprobs is not None else None)
            for i, c in enumerate(choices)]
    return R.Completion(id=run.rid, created=R.now(), model=server.reported_model(req.model), choices=text,
                        usage=G.usage(req, run, choices)).model_dump()


def completion_events(server: Server, req: P.CompletionRequest, run: G.Run, echoes: list[str]) -> Any:
    """The SSE body: (echo) each choice's prompt text first, then text_completion chunks,
    one per delta that carries something."""
    want_logprobs = P.logprob_count(req) is not None
    head = {"id": run.rid, "object": "text_completion", "created": R.now(), "model": server.reported_model(req.model),
            "system_fingerprint": None}
    offsets = [0] * (len(run.prompts) * run.n)   # where each choice's next token starts in its text

    def on_output(i: int, out: RequestOutput) -> list[dict[str, Any]]:
        lp: dict[str, Any] | None = None
        if want_logprobs and out.new_logprobs:
            lp, offsets[i] = R.completion_logprobs(out.new_logprobs, server.token_text, offsets[i])
        if not (out.new_text or lp is not None or out.finished):
            return []
        return [{"index": i, "text": out.new_text, "logprobs": lp,
                 "finish_reason": out.finish_reason if out.finished else None}]

    opening = [{"index": i, "text": echoes[i // run.n], "logprobs": None, "finish_reason": None}
               for i in range(len(offsets))] if echoes else []
    return G.events(server, req, run, head, opening, on_output)


def register(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions", responses=streamed(R.Completion))
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await create_completion(server, request, body)
