"""The OpenAI-compatible HTTP API on Starlette: /v1/models, /v1/completions,
/v1/chat/completions (both with SSE streaming), /health and /metrics.

Requests are validated by ellm.server.protocol, tokenized here, and run through an
AsyncEngine (one engine thread, continuous batching). A request with n choices (or
several prompts) becomes one engine request per choice; their deltas are merged as they
come. Every way a client can go away (closing a stream, dropping a connection while a
non-streamed request runs) closes its engine requests, which frees their KV blocks.

Nothing a request does can stop the server: every exception becomes an OpenAI-shaped
error response ({"error": {"message", "type", "param", "code"}}), or an error event on
a stream that has already started.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ..engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from ..engine.engine import RequestError
from ..engine.sequence import RequestOutput, TokenLogprob
from . import protocol as P
from .metrics import Metrics

log = logging.getLogger("ellm.server")

MAX_BODY_BYTES = 8 << 20     # a request body larger than this is refused (413)
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")



@dataclass
class ServerConfig:
    model_name: str                 # what clients pass as "model" and see in responses
    max_model_len: int              # prompt + output tokens per sequence
    vocab_size: int
    api_key: str | None = None      # when set, every route but /health needs "Bearer <key>"
    source: str = ""                # where the model came from (shown by /v1/models)


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status)


def _api_error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------
# responses that watch the client
# ---------------------------------------------------------------------------------------

async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Streams server-sent events from an async generator of ready "data: ..." strings.
    Listens for the client's disconnect at the same time, so a client that leaves while
    nothing is being sent (a long prefill) still closes the generator at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, status_code=200, media_type=self.media_type,
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, pending = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if pump_task in done and pump_task.exception() is not None:
                exc = pump_task.exception()
                if not isinstance(exc, OSError):   # OSError: the client went away mid-send
                    log.error("stream failed", exc_info=exc)
        finally:
            pump_task.cancel()
            watch_task.cancel()
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Runs work until it ends or the client disconnects (then work is cancelled).
    -> (finished?, result)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:   # this handler was cancelled (shutdown): take the work down too
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task.done():
        return True, task.result()
    task.cancel()           # the client left first; cancelling closes (aborts) its requests
    await asyncio.gather(task, return_exceptions=True)
    return False, None


# ---------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------

@dataclass
class _Choice:
    """Running totals of one choice while its deltas arrive."""
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    text_offset: int = 0
    cached_tokens: int = 0


class Server:
    """Routes over one AsyncEngine. build_app() wires it into a Starlette app."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = config
        self.metrics = Metrics()
        self.token_text = P.TokenText(tokenizer)
        self.created = int(time.time())

    # -- plumbing ---------------------------------------------------------------------

    async def _json(self, request: Request) -> Any:
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise P.APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise P.APIError(400, "the client disconnected while sending the request") from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise P.APIError(400, "the request body is empty; expected a JSON object")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise P.APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise P.APIError(400, "the request body is nested too deeply", code="invalid_json") from None

    def _check_model(self, model: str) -> None:
        if model != self.cfg.model_name:
            raise P.APIError(404, f"the model '{model}' does not exist; this server serves "
                                  f"'{self.cfg.model_name}'", param="model", code="model_not_found")

    def _prompt_ids(self, prompt: P.Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            vocab = self.cfg.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise P.APIError(400, f"prompt token id {bad} is outside the vocabulary (size {vocab})",
                                 param="prompt")
            ids = list(prompt)
        if not ids:
            raise P.APIError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    def _chat_ids(self, req: P.GenerationRequest) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", True):
            raise P.APIError(400, f"the model '{self.cfg.model_name}' has no chat template; "
                                  "use /v1/completions", param="messages", code="no_chat_template")
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, **req.chat_template_kwargs)
        except TypeError as e:
            raise P.APIError(400, f"the chat template could not be applied: {e}", param="messages") from None
        except ValueError as e:   # the template raised (e.g. roles that do not alternate)
            raise P.APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        ids = list(tok.encode(text, add_special_tokens=False))
        # As LLM.chat: the template may or may not write BOS; a model that wants one gets one.
        bos = getattr(tok, "bos_token_id", None)
        if getattr(tok, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def _check_length(self, ids: list[int], req: P.GenerationRequest) -> None:
        limit, n = self.cfg.max_model_len, len(ids)
        what = "messages" if req.kind == "chat" else "prompt"
        if n >= limit:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens, but the {what} "
                                  f"has {n} tokens (prompt and completion together must fit, so at most "
                                  f"{limit - 1} prompt tokens). The prompt was not truncated; shorten it.",
                             param=what, code="context_length_exceeded")
        mt = req.params.max_tokens
        if req.max_tokens_param and mt is not None and n + mt > limit:
            name = req.max_tokens_param
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                  f"requested {n + mt} tokens ({n} in the {what}, {mt} for the completion). "
                                  f"Reduce the {what} or the completion length (at most {limit - n}).",
                             param=name, code="context_length_exceeded")

    # -- routes -------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.engine.is_running:
            return JSONResponse({"status": "error", "message": "the engine thread is not running"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": self.cfg.model_name,
                             "requests": self.engine.num_requests, "running": self.engine.num_running,
                             "waiting": self.engine.num_waiting})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        self._check_model(name)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "ellm",
                "root": self.cfg.source or self.cfg.model_name, "max_model_len": self.cfg.max_model_len}

    async def metrics_route(self, request: Request) -> Response:
        snap = await self.engine.snapshot() if self.engine.is_running else self.engine.snapshot_now()
        return PlainTextResponse(self.metrics.render(snap, self.cfg.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        req = P.parse_completion(await self._json(request))
        self._check_model(req.model)
        prompts = [self._prompt_ids(p) for p in req.prompts]
        return await self._generate(request, req, prompts)

    async def chat_completions(self, request: Request) -> Response:
        req = P.parse_chat(await self._json(request))
        self._check_model(req.model)
        return await self._generate(request, req, [self._chat_ids(req)])

    # -- generation ---------------------------------------------------------------------

    async def _generate(self, request: Request, req: P.GenerationRequest, prompts: list[list[int]]) -> Response:
        for ids in prompts:
            self._check_length(ids, req)
        bias = req.params.logit_bias or {}
        bad = next((t for t in bias if t >= self.cfg.vocab_size), None)
        if bad is not None:
            raise P.APIError(400, f"logit_bias names token {bad}, outside the vocabulary "
                                  f"(size {self.cfg.vocab_size})", param="logit_bias")
        total = len(prompts) * req.n
        if total > self.engine.max_queue:
            raise P.APIError(400, f"this request asks for {total} sequences ({len(prompts)} prompts x n={req.n}); "
                                  f"the server runs at most {self.engine.max_queue} at once", param="n")
        try:
            self.engine.check_capacity(total)
        except QueueFullError as e:
            raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        t0 = time.perf_counter()
        rid = P.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        streams: list[RequestStream] = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(req.n):
                    streams.append(self.engine.submit(ids, req.choice_params(j), f"{rid}-{p * req.n + j}"))
        except (QueueFullError, EngineDeadError) as e:
            for s in streams:
                s.close()
            status = 429 if isinstance(e, QueueFullError) else 503
            raise P.APIError(status, str(e), type="rate_limit_error" if status == 429 else "server_error",
                             code="queue_full" if status == 429 else "engine_stopped") from None
        prompt_lens = [len(ids) for ids in prompts for _ in range(req.n)]
        self.metrics.prompt_tokens += sum(len(ids) for ids in prompts)
        outputs = self._outputs(streams, t0)
        if req.stream:
            return SSEResponse(self._events(req, rid, outputs, prompt_lens))
        finished, result = await _unless_disconnected(request, self._collect(req, outputs, len(streams)))
        if not finished:
            return Response(status_code=499)   # nobody is listening; the requests were aborted
        if isinstance(result, P.APIError):
            return _api_error(result)
        return JSONResponse(self._final_body(req, rid, result, prompts))

    async def _outputs(self, streams: list[RequestStream], t0: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as they arrive from all streams; records the timing metrics;
        closes (aborts) every unfinished stream when the consumer stops early."""
        m = self.metrics
        last: dict[int, float] = {}
        try:
            async for i, out in _merge(streams):
                k = len(out.new_token_ids)
                if k:
                    now = time.perf_counter()
                    if i in last:
                        for _ in range(k):   # one decode step usually brings one token
                            m.itl.observe((now - last[i]) / k)
                    else:
                        m.ttft.observe(now - t0)
                    last[i] = now
                    m.generation_tokens += k
                if out.finished:
                    m.e2e.observe(time.perf_counter() - t0)
                    m.finished[out.finish_reason or "unknown"] += 1
                yield i, out
        finally:
            for s in streams:
                if not s.done:
                    m.finished["abort"] += 1
                s.close()

    async def _collect(self, req: P.GenerationRequest, outputs: AsyncIterator[tuple[int, RequestOutput]],
                       n: int) -> list[_Choice] | P.APIError:
        choices = [_Choice(logprobs=[] if req.logprobs is not None else None) for _ in range(n)]
        try:
            async for i, out in outputs:
                c = choices[i]
                c.text += out.new_text
                c.num_tokens += len(out.new_token_ids)
                if c.logprobs is not None:
                    c.logprobs.extend(out.new_logprobs)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.cached_tokens = out.num_cached_tokens
        except Exception as e:  # noqa: BLE001 - any engine failure becomes an error answer
            return self._engine_error(e)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return choices

    def _engine_error(self, e: BaseException) -> P.APIError:
        if isinstance(e, RequestError):
            return P.APIError(400, str(e))
        if isinstance(e, EngineDeadError):
            return P.APIError(503, str(e), type="server_error", code="engine_stopped")
        log.error("request failed in the engine", exc_info=e)
        return P.APIError(500, f"the engine failed on this request: {type(e).__name__}: {e}",
                          type="server_error", code="engine_error")

    def _final_body(self, req: P.GenerationRequest, rid: str, choices: list[_Choice],
                    prompts: list[list[int]]) -> dict[str, Any]:
        out_choices = []
        for i, c in enumerate(choices):
            if req.kind == "chat":
                lp = P.chat_logprobs(c.logprobs, self.token_text) if c.logprobs is not None else None
                out_choices.append({"index": i, "message": {"role": "assistant", "content": c.text,
                                                            "refusal": None, "tool_calls": []},
                                    "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = P.completion_logprobs(c.logprobs, self.token_text, 0)[0] if c.logprobs is not None else None
                out_choices.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        prompt_tokens = sum(len(ids) for ids in prompts)
        cached = sum(c.cached_tokens for c in choices[::req.n])   # one per prompt, as prompt_tokens
        return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": P.now(), "model": self.cfg.model_name, "system_fingerprint": None,
                "choices": out_choices,
                "usage": P.usage(prompt_tokens, sum(c.num_tokens for c in choices), cached)}

    async def _events(self, req: P.GenerationRequest, rid: str,
                      outputs: AsyncIterator[tuple[int, RequestOutput]], prompt_lens: list[int]) -> AsyncIterator[str]:
        """The SSE body: OpenAI chunks, then (include_usage) a usage chunk, then [DONE]."""
        chat = req.kind == "chat"
        created = P.now()
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.cfg.model_name, "system_fingerprint": None}
        n = len(prompt_lens)
        choices = [_Choice() for _ in range(n)]

        def chunk(choice_list: list[dict[str, Any]]) -> str:
            body = dict(head, choices=choice_list)
            if req.include_usage:
                body["usage"] = None
            return _sse(body)

        try:
            if chat:   # the role comes first, before any token (and before prefill ends)
                for i in range(n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for i, out in outputs:
                c = choices[i]
                c.num_tokens += len(out.new_token_ids)
                lp: dict[str, Any] | None = None
                if req.logprobs is not None and out.new_logprobs:
                    if chat:
                        lp = P.chat_logprobs(out.new_logprobs, self.token_text)
                    else:
                        lp, c.text_offset = P.completion_logprobs(out.new_logprobs, self.token_text, c.text_offset)
                if chat:
                    if out.new_text or lp is not None:
                        yield chunk([{"index": i, "delta": {"content": out.new_text}, "logprobs": lp,
                                      "finish_reason": None}])
                    if out.finished:
                        yield chunk([{"index": i, "delta": {}, "logprobs": None,
                                      "finish_reason": out.finish_reason}])
                elif out.new_text or lp is not None or out.finished:
                    yield chunk([{"index": i, "text": out.new_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
                if out.finished:
                    c.cached_tokens = out.num_cached_tokens
            if req.include_usage:
                prompt_tokens = sum(prompt_lens[::req.n])
                yield _sse(dict(head, choices=[], usage=P.usage(
                    prompt_tokens, sum(c.num_tokens for c in choices),
                    sum(c.cached_tokens for c in choices[::req.n]))))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            err = self._engine_error(e)
            yield _sse(err.body())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as their deltas arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# ---------------------------------------------------------------------------------------
# middleware and app
# ---------------------------------------------------------------------------------------

class _Guard:
    """Outermost ASGI layer: the API key check, the request counter, and a last net that
    turns any escaped exception into a 500 JSON error (never a dead server)."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server
        key = server.cfg.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] == "/health":
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value.strip(), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        state = {"status": 500, "started": False}

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                state["status"], state["started"] = msg["status"], True
            await send(msg)

        try:
            if not self._authorized(scope):
                resp = _error(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
                resp.headers["www-authenticate"] = "Bearer"
                await resp(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        except Exception as e:
            log.exception("unhandled error on %s", path)
            if not state["started"]:
                await _error(500, f"internal server error: {type(e).__name__}", type="server_error")(
                    scope, receive, send_status)
        finally:
            self.server.metrics.count_request(route, int(state["status"]))


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, P.APIError)
    return _api_error(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this answer; _Guard logs it once.
    return _error(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def build_app(server: Server, manage_engine: bool = True) -> Any:
    """The ASGI app. With manage_engine, the app's lifespan starts and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            server.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, server.engine.shutdown)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        P.APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_unexpected})
    return _Guard(app, server)
