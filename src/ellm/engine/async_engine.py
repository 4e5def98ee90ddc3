"""AsyncEngine: the Engine behind asyncio, for the server and other concurrent callers.

One background thread owns the Engine and is the only code that touches it (Engine is
not thread-safe). Callers on an asyncio loop never take the engine's lock, so the loop
is never blocked for the length of a forward pass: they post commands (add, abort,
snapshot) into an inbox that the engine thread drains between steps. The thread runs
step() while there is work and sleeps on a condition variable when there is none.

Outputs travel back per request: the engine thread puts each RequestOutput delta into
that request's asyncio.Queue through loop.call_soon_threadsafe. A request whose consumer
goes away (task cancelled, generator closed, stream object dropped) is aborted, which
returns its KV blocks to the pool before the next step.

A failure inside step() (a bug, a MemoryError) fails the requests that were in the batch
with that exception and the thread keeps serving the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..sampling_params import SamplingParams
from .engine import Engine, RequestError, SequenceError
from .sequence import RequestOutput, TokenLogprob

log = logging.getLogger("ellm.engine")


class QueueFullError(RuntimeError):
    """More requests are pending or running than the engine's max_queue allows."""


class EngineDeadError(RuntimeError):
    """The engine thread has been shut down; no request can run."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Counts read on the engine thread between two steps, so they agree with each other.

    kv_blocks_used counts blocks that running or waiting sequences hold; kv_blocks_cached
    counts blocks that only the prefix cache holds (free to evict); a block in neither is
    free. Totals are over every block pool (Gemma's sliding layers have their own)."""
    num_running: int
    num_waiting: int
    num_requests: int            # requests the AsyncEngine tracks (queued + running)
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    num_preemptions: int
    step_errors: int


@dataclass
class FinalOutput:
    """Everything one request produced, gathered from its deltas by AsyncEngine.generate."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob]
    num_cached_tokens: int


class _Sink:
    """Where the engine thread delivers one request's outputs. The engine keeps the sink,
    not the RequestStream, so a stream nobody references is collected (and aborts)."""

    __slots__ = ("closed", "loop", "queue", "sent")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False     # set by the consumer; an add still in the inbox is skipped
        self.sent = (0, 0)      # (characters, token ids) delivered so far

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


class RequestStream:
    """The async iterator of one request's RequestOutput deltas; ends after the finished
    one. Raises the engine's exception if the request fails. close() (or dropping the
    object) aborts the request when it has not finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, sink: _Sink) -> None:
        self.request_id = request_id
        self._owner = owner
        self._sink = sink
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def close(self) -> None:
        """Aborts the request if it is still running; safe to call more than once."""
        if not self.done:
            self.done = True
            self._sink.closed = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # A stream dropped without being closed must not keep decoding nobody's tokens.
        if not self.done:
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to free
                self.close()


class AsyncEngine:
    """Runs an Engine on its own thread; see the module docstring.

    max_queue bounds the requests queued or running at once; submit() raises
    QueueFullError beyond it (the server answers 429)."""

    def __init__(self, engine: Engine, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        # Held by the engine thread around every touch of the engine (commands + step);
        # other threads that must read the engine directly take it too.
        self.lock = threading.Lock()
        # Guards _inbox and _stopping. Reentrant: a RequestStream collected by the GC while
        # this thread holds it posts an abort, which takes it again.
        self._cv = threading.Condition(threading.RLock())
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._sinks: dict[str, _Sink] = {}                  # touched on the engine thread only
        self._pending: set[str] = set()                    # ids submitted, not yet finished (loop side)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.step_errors = 0
        # Cheap counts the thread publishes after each step (plain ints: safe to read anywhere).
        self.num_running = 0
        self.num_waiting = 0

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ellm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the thread after its current step; unfinished requests fail."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._pending)

    # -- requests -----------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"areq-{next(self._ids)}"

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queues a request now (call from a running event loop) and returns its stream.
        Raises QueueFullError at once when max_queue requests are already in. Errors the
        engine finds when adding (an over-long prompt) come out of the stream."""
        self.check_capacity(1)
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        rid = request_id or self.new_request_id()
        if rid in self._pending:
            raise ValueError(f"request id {rid!r} is already in use")
        sink = _Sink(loop)
        self._pending.add(rid)
        self._post(("add", (rid, list(prompt_ids), params, sink)))
        return RequestStream(self, rid, sink)

    def check_capacity(self, n: int) -> None:
        """Raises QueueFullError unless n more requests fit under max_queue."""
        if len(self._pending) + n > self.max_queue:
            raise QueueFullError(f"the server has {len(self._pending)} requests queued or running "
                                 f"(limit {self.max_queue}); retry later")

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput deltas; closing or cancelling the consumer
        aborts the request."""
        s = self.submit(prompt_ids, params, request_id)
        try:
            async for out in s:
                yield out
        finally:
            s.close()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> FinalOutput:
        """Runs one request to the end and returns all of it."""
        s = self.submit(prompt_ids, params, request_id)
        logprobs: list[TokenLogprob] = []
        try:
            async for out in s:
                logprobs.extend(out.new_logprobs)
                if out.finished:
                    return FinalOutput(out.request_id, out.text, list(out.token_ids), out.finish_reason,
                                       list(out.prompt_token_ids), logprobs, out.num_cached_tokens)
        finally:
            s.close()
        raise RuntimeError(f"request {s.request_id} ended without a final output")  # unreachable

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its blocks are freed before the next step."""
        self._pending.discard(request_id)
        self._post(("abort", request_id))

    async def snapshot(self) -> EngineSnapshot:
        """Engine counts, read on the engine thread between steps."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineSnapshot] = loop.create_future()
        self._post(("snapshot", (loop, fut)))
        return await fut

    def snapshot_now(self) -> EngineSnapshot:
        """The same counts read from the calling thread under the engine lock (blocks for
        up to one step). For code without an event loop, or a stopped engine thread."""
        with self.lock:
            return self._snapshot()

    # -- the engine thread ------------------------------------------------------------

    def _post(self, cmd: tuple[str, Any]) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished():
                    self._cv.wait()
                if self._stopping:
                    break
                cmds, self._inbox = self._inbox, []
            with self.lock:
                try:
                    for cmd in cmds:
                        self._apply(cmd)
                    if self.engine.has_unfinished():
                        self._step()
                except Exception as e:  # a bug outside step(): fail everything, keep the thread
                    self.step_errors += 1
                    log.exception("engine loop failed; failing every open request")
                    for rid in list(self._sinks):
                        self._fail(rid, e)
                self.num_running = self.engine.num_running
                self.num_waiting = self.engine.num_waiting
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _apply(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        try:
            if kind == "add":
                rid, prompt_ids, params, sink = arg
                if sink.closed:
                    return   # closed before it was added; its abort finds nothing to do
                self._sinks[rid] = sink
                try:
                    self.engine.add_request(prompt_ids, params, rid)
                except ValueError as e:  # the request's own fault (too long, bad ids, bad bias)
                    self._fail(rid, e if isinstance(e, RequestError) else RequestError(str(e)), in_engine=False)
                except Exception as e:  # noqa: BLE001 - anything else fails this request only
                    self._fail(rid, e, in_engine=False)
            elif kind == "abort":
                if self._sinks.pop(arg, None) is not None:
                    self.engine.abort(arg)
            elif kind == "snapshot":
                loop, fut = arg
                snap = self._snapshot()
                _call_soon(loop, _set_result, fut, snap)
        except Exception as e:  # never let a command take the thread down
            log.exception("engine command %s failed", kind)
            if kind == "snapshot":
                loop, fut = arg
                _call_soon(loop, _set_exception, fut, e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.step_errors += 1
            log.exception("engine step failed; failing the requests in the batch")
            victims = [s.request_id for s in self.engine.scheduler.running] or list(self.engine.seqs)
            for rid in victims:
                self._fail(rid, e)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue   # aborted by its consumer meanwhile
            if out.error is not None:  # this request alone failed inside step()
                self._fail(out.request_id, SequenceError(out.error), in_engine=False)
                continue
            self._fix_delta(sink, out)
            if out.finished:
                del self._sinks[out.request_id]
                self._pending_discard(out.request_id, sink)
            sink.put(out)

    @staticmethod
    def _fix_delta(sink: _Sink, out: RequestOutput) -> None:
        """Makes the deltas agree with the totals (text, token_ids), so that a delta the
        engine did not report (seen: the last token of a request finished by length or a
        stop) still reaches the stream. A no-op when the engine's deltas add up."""
        n_chars, n_ids = sink.sent
        if len(out.text) != n_chars + len(out.new_text) or len(out.token_ids) != n_ids + len(out.new_token_ids):
            out.new_text = out.text[n_chars:]
            out.new_token_ids = list(out.token_ids[n_ids:])
        sink.sent = (len(out.text), len(out.token_ids))

    def _fail(self, rid: str, exc: BaseException, in_engine: bool = True) -> None:
        if in_engine:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of failed request %s failed", rid)
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            self._pending_discard(rid, sink)
            sink.put(exc)

    def _pending_discard(self, rid: str, sink: _Sink) -> None:
        # _pending belongs to the loop thread; hand the removal over to it.
        _call_soon(sink.loop, self._pending.discard, rid)

    def _fail_all(self, exc: BaseException) -> None:
        with self.lock:
            for rid in list(self._sinks):
                self._fail(rid, exc)
            with self._cv:
                cmds, self._inbox = self._inbox, []
            for kind, arg in cmds:
                if kind == "add":
                    rid, _, _, sink = arg
                    self._pending_discard(rid, sink)
                    sink.put(exc)
                elif kind == "abort":
                    self.engine.abort(arg)
                elif kind == "snapshot":
                    loop, fut = arg
                    _call_soon(loop, _set_exception, fut, exc)

    def _snapshot(self) -> EngineSnapshot:
        eng = self.engine
        bm = eng.blocks
        total = sum(p.num_blocks for p in bm.pools.values())
        used = bm.num_used()
        # A block only the prefix cache references has refcount 1 and is in `cached`.
        cached_only = sum(1 for blocks in bm.cached.values() for w, b in blocks.items()
                          if bm.pools[w].refs[b] == 1)
        return EngineSnapshot(
            num_running=eng.num_running, num_waiting=eng.num_waiting,
            num_requests=len(self._sinks),
            kv_blocks_used=used - cached_only, kv_blocks_cached=cached_only, kv_blocks_total=total,
            prefix_cache_hits=bm.hits, prefix_cache_queries=bm.queries,
            prompt_tokens=eng.stats["prompt_tokens"], generation_tokens=eng.stats["generation_tokens"],
            steps=eng.stats["steps"], num_preemptions=eng.scheduler.num_preemptions,
            step_errors=self.step_errors)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Runs fn(*args) on loop's thread; a closed loop (its caller is gone) is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
