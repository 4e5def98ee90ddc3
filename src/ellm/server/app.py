"""The OpenAI-compatible HTTP API on FastAPI, assembled: the routes of ellm.server.routes
(/health, /metrics, /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings,
/v1/responses, /tokenize, /detokenize) over one Server (ellm.server.core), their error
handlers, /openapi.json (ellm.server.openapi), and the outer layer every request passes
first (_Guard).

Request bodies are validated by the pydantic models of ellm.server.protocol (FastAPI
parses and checks them before a route runs; a bad field is a 400 naming it). Nothing a
request does can stop the server: every exception becomes an OpenAI-shaped error
response ({"error": {"message", "type", "param", "code"}}), or an error event on a
stream that has already started. A body that stops arriving is a 408 after
read_timeout; a response the client stops reading is given up after write_timeout,
which aborts its generation. Header deadlines are the protocol's (server/timeouts.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core import Server, ServerConfig
from .errors import APIError, error_body, from_validation
from .openapi import served_openapi
from .request_shape import RequestShape
from .routes import chat, completions, embeddings, health, models, responses, tokenize
from .streaming import drain_on_signals

log = logging.getLogger("ellm.server")

MAX_BODY_BYTES = 8 << 20     # a request body larger than this is refused (413)
PUBLIC_PATHS = ("/health", "/openapi.json")   # answered without the API key


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


class _Guard:
    """The API key check, the body size limit, the request counter, and a last net that
    turns any escaped exception into a 500 JSON error (never a dead server)."""

    def __init__(self, app: ASGIApp, server: Server, routes: Sequence[BaseRoute]) -> None:
        self.app, self.server, self.routes = app, server, routes
        key = server.cfg.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] in PUBLIC_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value.strip(), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"status": 500, "started": False}
        cfg = self.server.cfg

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                state["status"], state["started"] = msg["status"], True
            # Bounded write: a client that stops reading fills the socket, and send() then
            # waits for it forever; past write_timeout it counts as gone (a stream's
            # generation is then aborted, as on a disconnect).
            try:
                await _within(send(msg), cfg.write_timeout)
            except asyncio.TimeoutError:
                raise ConnectionAbortedError(f"the client read nothing for {cfg.write_timeout:g} s") from None

        received = 0
        body_done = False

        async def receive_limited() -> Message:
            nonlocal received, body_done
            if body_done:   # afterwards receive() only waits for the disconnect: no deadline
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), cfg.read_timeout)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {cfg.read_timeout:g} s") from None
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise HTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
                body_done = not msg.get("more_body", False)
            else:
                body_done = True
            return msg

        try:
            if not self._authorized(scope):
                resp = _error(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                              code="invalid_api_key", headers={"www-authenticate": "Bearer"})
                await resp(scope, receive, send_status)
            elif _declared_length(scope) > MAX_BODY_BYTES:
                await _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")(
                    scope, receive, send_status)
            else:
                await self.app(scope, receive_limited, send_status)
        except ConnectionAbortedError as e:   # the bounded write gave up on this client
            log.warning("%s: %s; connection dropped", scope["path"], e)
        except Exception as e:
            log.exception("unhandled error on %s", scope["path"])
            if not state["started"]:
                await _error(500, f"internal server error: {type(e).__name__}", type="server_error")(
                    scope, receive, send_status)
        finally:
            self.server.metrics.count_request(self._route_label(scope), int(state["status"]))

    def _route_label(self, scope: Scope) -> str:
        """The route's path template (bounded label values), also for requests refused before
        routing (401, 413); 'other' for paths no route serves."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return str(getattr(route, "path", "other"))
        return "other"


_timeout = getattr(asyncio, "timeout", None)   # Python 3.11+


async def _within(step: Awaitable[None], seconds: float) -> None:
    """await step, raising asyncio.TimeoutError past `seconds`. Every message of every
    response passes here (each chunk of a stream): asyncio.timeout arms a timer around the
    await, where wait_for (Python 3.10) also wraps it in a task of its own, several times
    the event loop's work per chunk."""
    if _timeout is None:
        await asyncio.wait_for(step, seconds)
        return
    async with _timeout(seconds):
        await step


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    e = from_validation(exc.errors())
    return JSONResponse(e.body(), status_code=e.status)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        # FastAPI's answer to a body that is not UTF-8, or JSON that Python cannot hold.
        message = "the request body could not be read as JSON (is it UTF-8, with numbers of sane size?)"
        return _error(400, message, code="invalid_json")
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind,
                  headers=dict(exc.headers or {}))



def _freeze_startup_heap() -> None:
    """Moves every object alive at startup (the model's and tokenizer's Python objects,
    the app, the modules) out of the garbage collector's generations (gc.freeze): they
    live as long as the server, and otherwise every collection of the older generations
    walks all of them again (~87k objects for the tiny SmolVLM), holding the GIL: each
    one stalls every client and /health. Garbage made later is collected as before.
    The chat-template sandbox (jinja2), which a plain load leaves for the first chat, is
    imported first, so that the first chat request does not pay for it."""
    from ..tokenization import template  # noqa: F401
    gc.collect()
    gc.freeze()


def build_app(server: Server, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With manage_engine, the app's lifespan starts and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            server.engine.start()
            # [structured] llguidance's view of the vocabulary, built before the first
            # request: building it holds the GIL for a second or more (a 262k vocabulary:
            # several), which, at the first constrained request, would stall every client
            await asyncio.get_running_loop().run_in_executor(None, server.engine.engine.prepare_constraints)
        _freeze_startup_heap()
        # SIGTERM / Ctrl-C end running streams with an error event and [DONE] at once,
        # before the server's grace period cuts them (streaming.DRAIN)
        restore_signals = drain_on_signals()
        try:
            yield
        finally:
            restore_signals()
            gc.unfreeze()
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, server.engine.shutdown)

    from .. import __version__
    app = FastAPI(title="ellm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json",
                  description="OpenAI-compatible API of ellm. Errors are {\"error\": {message, type, param, code}}.",
                  exception_handlers={APIError: _on_api_error, RequestValidationError: _on_invalid_request,
                                      HTTPException: _on_http_error})
    # (in this order: it is the order of /openapi.json)
    for module in (health, models, completions, chat, embeddings, responses, tokenize):
        module.register(app, server)
    app.openapi = lambda: served_openapi(app, server.cfg)  # type: ignore[method-assign]
    # inside the guard (added first): ambiguous framing and too-deep JSON refused before any route
    app.add_middleware(RequestShape)
    app.add_middleware(_Guard, server=server, routes=app.router.routes)
    if server.cfg.allowed_origins:   # added last: outermost, so preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cfg.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.state.server = server
    return app


__all__ = ["MAX_BODY_BYTES", "Server", "ServerConfig", "build_app"]
