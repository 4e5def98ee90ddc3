"""Responses that watch the client: server-sent events that stop the moment the client
leaves, a non-streamed request cancelled when its client disconnects, and the merge of
several engine request streams (n choices, several prompts) into one.

Every way a client can go away closes its engine requests, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.async_engine import RequestStream
from ..engine.sequence import RequestOutput

log = logging.getLogger("ellm.server")


def sse(obj: Any) -> str:
    """One server-sent event carrying obj as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


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


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
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


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as their deltas arrive: (stream index, delta)."""
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
