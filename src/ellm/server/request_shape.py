"""Requests refused for their shape before any route sees them (an ASGI middleware):

- framing: a request with both Content-Length and Transfer-Encoding is a 400 and its
  connection is closed. The two headers disagree on where the body ends; a proxy in
  front that believes the other one would forward a second request hidden in this one's
  body (request smuggling), so nothing more is read from that connection;
- nesting: a JSON body that nests arrays and objects past MAX_JSON_DEPTH is a 400 naming
  the limit (body_limits), for every route, before FastAPI or a route parses it. The body
  is read here (the size limit of the middleware outside this one applies) and handed on
  unchanged.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from .body_limits import MAX_JSON_DEPTH, depth_error

Scope = dict[str, Any]


def _error(status: int, message: str, code: str, close: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False})


class RequestShape:
    def __init__(self, app: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.max_depth = app, max_depth

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name.lower() for name, _ in scope.get("headers", [])}
        if b"content-length" in names and b"transfer-encoding" in names:
            for msg in _error(400, "the request has both Content-Length and Transfer-Encoding, which disagree "
                                   "on where its body ends; send one of them", "ambiguous_framing", close=True):
                await send(msg)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Read the whole body (the outer middleware bounds its size and time), measure it,
        # then replay it to the app as one message.
        chunks = []
        while True:
            try:
                msg = await receive()
            except HTTPException as e:   # the outer middleware's size or time limit
                for out in _error(e.status_code, str(e.detail), "request_body"):
                    await send(out)
                return
            if msg["type"] != "http.request":
                await self.app(scope, _replay([msg], receive), send)
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = depth_error(body, self.max_depth)
        if problem is not None:
            for out in _error(400, problem, "body_too_deep"):
                await send(out)
            return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """receive() that gives `messages` first, then the real receive (the disconnect)."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()
    return replayed
