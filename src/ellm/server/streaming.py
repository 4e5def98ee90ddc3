"""Responses that watch the client: server-sent events that stop the moment the client
leaves, a non-streamed request cancelled when its client disconnects, and the merge of
several engine request streams (n choices, several prompts) into one.

Every way a client can go away closes its engine requests, which frees their KV blocks.

Graceful shutdown: when the server is told to stop (SIGTERM or Ctrl-C, see
drain_on_signals), every running stream ends at once with an error event saying so and
`data: [DONE]`, its engine requests aborted, instead of being cut mid-body when the
server's grace period runs out.
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


SHUTDOWN_EVENT = ('data: {"error":{"message":"the server is shutting down; this stream was ended before '
                  'its generation finished","type":"server_error","param":null,"code":"server_shutting_down"}}'
                  '\n\ndata: [DONE]\n\n')


class _Drain:
    """The shutdown notice streams wait on: one asyncio.Event per event loop."""

    def __init__(self) -> None:
        self._events: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self.draining = False

    def event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        got = self._events.get(id(loop))
        if got is None or got[0] is not loop:
            got = self._events[id(loop)] = (loop, asyncio.Event())
            if self.draining:
                got[1].set()
        return got[1]

    def begin(self) -> None:
        """Ends every stream of every loop (callable from any thread or a signal handler)."""
        self.draining = True
        for loop, event in list(self._events.values()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def reset(self) -> None:
        self.draining = False
        self._events.clear()


DRAIN = _Drain()


def drain_on_signals() -> Any:
    """Makes SIGTERM and SIGINT end the running streams (DRAIN.begin) before the handler
    that was installed (uvicorn's, which starts its graceful shutdown). Called at the app's
    startup, after uvicorn installed its handlers; in a thread other than the main one
    (an app run in a test's thread) signals cannot be handled, and nothing is done.
    -> a function that puts the previous handlers back."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    DRAIN.reset()
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue

        def handler(signum: int, frame: Any, prev: Any = prev) -> None:
            DRAIN.begin()
            prev(signum, frame)
        previous[sig] = prev
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, prev in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)
    return restore


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
        drain_task = asyncio.ensure_future(DRAIN.event().wait())
        try:
            done, pending = await asyncio.wait({pump_task, watch_task, drain_task},
                                               return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if pump_task in done and pump_task.exception() is not None:
                exc = pump_task.exception()
                if not isinstance(exc, OSError):   # OSError: the client went away mid-send
                    log.error("stream failed", exc_info=exc)
            elif drain_task in done and pump_task not in done:   # shutting down: say so, then [DONE]
                with contextlib.suppress(Exception):
                    await self.events.aclose()  # type: ignore[attr-defined]
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(send({"type": "http.response.body", "body": SHUTDOWN_EVENT.encode(),
                                                 "more_body": False}), 2.0)
        finally:
            pump_task.cancel()
            watch_task.cancel()
            drain_task.cancel()
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
