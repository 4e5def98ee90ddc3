"""The generation pipeline every generating route shares (/v1/completions,
/v1/chat/completions, /v1/responses): the last checks of a request's token ids and
params, one engine request per prompt and choice, their deltas merged as they come
(with the timing metrics), and either the collected totals or a server-sent event
stream that ends with a usage chunk (when asked) and [DONE].

Every way a client can go away (closing a stream, dropping a connection while a
non-streamed request runs) closes its engine requests, which frees their KV blocks.
The shape of each route's answer (its choices and chunks) stays in the route's module.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineDeadError, QueueFullError, RequestStream
from ..engine.sequence import FinishReason, RequestOutput, TokenLogprob
from ..sampling_params import SamplingParams
from . import protocol as P
from . import responses as R
from .core import Server
from .errors import APIError
from .streaming import merge, sse, unless_disconnected

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]   # (closed with aclose())


@dataclass
class Choice:
    """Running totals of one choice while its deltas arrive."""
    text: str = ""
    finish_reason: FinishReason | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    text_offset: int = 0
    cached_tokens: int = 0


@dataclass
class Run:
    """The engine requests of one API request, merged: (choice index, delta) in outputs;
    choice k is prompt k // n's (k % n)-th completion."""
    rid: str
    prompts: list[list[int]]
    n: int
    outputs: Outputs

    @property
    def prompt_lens(self) -> list[int]:
        return [len(ids) for ids in self.prompts for _ in range(self.n)]


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Params of the i-th completion of a prompt: seed + i when seeded."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


async def start(server: Server, req: P.GenerationRequest, prompts: list[list[int]], params: SamplingParams, *,
                what: str, rid: str, max_tokens_param: str | None, images: list[Any] | None = None,
                adapter: str | None = None) -> Run:
    """Checks what only the server can (lengths, vocabulary, capacity) and submits one
    engine request per prompt and choice. what: the field the prompts came from.
    adapter: [lora] the LoRA adapter the requests run with (None: the base)."""
    for ids in prompts:
        server.check_length(ids, what, params.max_tokens, max_tokens_param)
    vocab = server.cfg.vocab_size
    bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"logit_bias names token {bad}, outside the vocabulary (size {vocab})",
                       param="logit_bias")
    if params.stop_token_ids:
        server.check_ids(params.stop_token_ids, "stop_token_ids", "stop token id")
    engine = server.engine
    if params.constraint is not None:  # [structured] llguidance's tokenizer and the matcher, off the engine thread
        await asyncio.get_running_loop().run_in_executor(None, engine.engine.prepare_constraints, params)
    total = len(prompts) * req.n
    if total > engine.max_queue:
        raise APIError(400, f"this request asks for {total} sequences ({len(prompts)} prompts x n={req.n}); "
                            f"the server runs at most {engine.max_queue} at once", param="n")
    try:
        engine.check_capacity(total)
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    t0 = time.perf_counter()
    streams: list[RequestStream] = []
    try:
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                extra = {} if adapter is None else {"adapter": adapter}   # [lora]
                streams.append(engine.submit(ids, choice_params(params, j), f"{rid}-{p * req.n + j}",
                                             images=images[p] if images else None, **extra))  # [vision]
    except (QueueFullError, EngineDeadError) as e:
        for s in streams:
            s.close()
        status = 429 if isinstance(e, QueueFullError) else 503
        raise APIError(status, str(e), type="rate_limit_error" if status == 429 else "server_error",
                       code="queue_full" if status == 429 else "engine_stopped") from None
    server.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    return Run(rid, prompts, req.n, outputs(server, streams, t0))


async def outputs(server: Server, streams: list[RequestStream], t0: float) -> Outputs:
    """(choice index, delta) as they arrive from all streams; records the timing metrics;
    closes (aborts) every unfinished stream when the consumer stops early."""
    m = server.metrics
    last: dict[int, float] = {}
    try:
        async for i, out in merge(streams):
            k = len(out.new_token_ids)
            if k:
                now = time.perf_counter()
                if i in last:
                    for _ in range(k):   # one decode step usually brings one token
                        m.itl.observe((now - last[i]) / k)
                else:
                    m.ttft.observe(now - t0)
                last[i] = now
                m.generation_tokens.inc(k)
            if out.finished:
                m.e2e.observe(time.perf_counter() - t0)
                m.count_finished(out.finish_reason)
            yield i, out
    finally:
        for s in streams:
            if not s.done:
                m.count_finished("abort")
            s.close()


async def collect(server: Server, req: P.GenerationRequest, run: Run) -> list[Choice] | APIError:
    """Every choice's totals once all have finished (or the engine's error)."""
    want_logprobs = P.logprob_count(req) is not None
    choices = [Choice(logprobs=[] if want_logprobs else None) for _ in range(len(run.prompts) * run.n)]
    try:
        async for i, out in run.outputs:
            c = choices[i]
            c.text += out.new_text
            c.num_tokens += len(out.new_token_ids)
            if c.logprobs is not None:
                c.logprobs.extend(out.new_logprobs)
            if out.finished:
                c.finish_reason = out.finish_reason
                c.cached_tokens = out.num_cached_tokens
    except Exception as e:  # noqa: BLE001 - any engine failure becomes an error answer
        return server.engine_error(e)
    finally:
        await run.outputs.aclose()
    return choices


async def answer(server: Server, request: Request, req: P.GenerationRequest, run: Run,
                 body: Callable[[list[Choice]], dict[str, Any]]) -> Response:
    """The non-streamed answer: body(choices) once all are done; 499 when the client left."""
    finished, result = await unless_disconnected(request, collect(server, req, run))
    if not finished:
        return Response(status_code=499)   # nobody is listening; the requests were aborted
    if isinstance(result, APIError):
        return JSONResponse(result.body(), status_code=result.status)
    return JSONResponse(body(result))


def usage(req: P.GenerationRequest, run: Run, choices: list[Choice]) -> R.Usage:
    """Token counts: the prompt and its cached part once per prompt, every choice's output."""
    prompt_tokens = sum(len(ids) for ids in run.prompts)
    cached = sum(c.cached_tokens for c in choices[::req.n])
    return R.usage(prompt_tokens, sum(c.num_tokens for c in choices), cached)


async def events(server: Server, req: P.GenerationRequest, run: Run, head: dict[str, Any],
                 opening: list[dict[str, Any]],
                 on_output: Callable[[int, RequestOutput], list[dict[str, Any]]]) -> AsyncIterator[str]:
    """An SSE body: a chunk for each of opening's choices, then on_output(i, delta)'s
    choices for every delta, then (include_usage) a usage chunk, then [DONE]. An engine
    failure after the stream started is reported in-band as an error event."""
    choices = [Choice() for _ in range(len(run.prompts) * run.n)]

    def chunk(choice: dict[str, Any]) -> str:
        body = dict(head, choices=[choice])
        if req.include_usage:
            body["usage"] = None
        return sse(body)

    try:
        for c in opening:
            yield chunk(c)
        async for i, out in run.outputs:
            ch = choices[i]
            ch.num_tokens += len(out.new_token_ids)
            for c in on_output(i, out):
                yield chunk(c)
            if out.finished:
                ch.cached_tokens = out.num_cached_tokens
        if req.include_usage:
            yield sse(dict(head, choices=[], usage=usage(req, run, choices).model_dump()))
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield sse(server.engine_error(e).body())
    finally:
        await run.outputs.aclose()
    yield "data: [DONE]\n\n"
