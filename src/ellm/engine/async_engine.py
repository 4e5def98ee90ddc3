"""AsyncEngine: the Engine behind asyncio, for the server and other concurrent callers.

One background thread owns the Engine and is the only code that touches it (Engine is
not thread-safe). Callers on an asyncio loop never take the engine's lock, so the loop
is never blocked for the length of a forward pass: they post commands (add, abort,
snapshot) into an inbox that the engine thread drains between steps. The thread runs
step() while there is work and sleeps on a condition variable when there is none.

Outputs travel back per request: the engine thread puts each RequestOutput delta into
that request's sink, an asyncio.Queue (through loop.call_soon_threadsafe) for a caller
on an event loop, a queue.SimpleQueue for a blocking caller on any thread. A request
whose consumer goes away (task cancelled, generator closed, stream object dropped) is
aborted, which returns its KV blocks to the pool before the next step. Work that must
see the engine between two steps (logits, embeddings, counts) is posted as a callable
and runs on the engine thread too, so nothing else ever touches the Engine.

A failure inside step() (a bug, a MemoryError) fails the requests that were in the batch
with that exception and the thread keeps serving the others.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sampling_params import SamplingParams
from .engine import POOLINGS, Engine, RequestError, SequenceError
from .sequence import FinishReason, RequestOutput, TokenLogprob

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
    spec_proposed_tokens: int = 0    # [spec] speculative guesses checked, and those kept
    spec_accepted_tokens: int = 0


@dataclass
class FinalOutput:
    """Everything one request produced, gathered from its deltas by AsyncEngine.generate."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob]
    num_cached_tokens: int
    error: str | None = None         # why, when finish_reason is "error"


class _Sink:
    """Where the engine thread delivers one request's outputs. The engine keeps the sink,
    not the RequestStream, so a stream nobody references is collected (and aborts)."""

    __slots__ = ("closed", "loop", "queue", "sent")
    deltas = True   # every step's output (the server's streams and metrics need them)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False     # set by the consumer; an add still in the inbox is skipped
        self.sent = (0, 0)      # (characters, token ids) delivered so far

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


class _ThreadSink:
    """The sink of a blocking caller: a thread-safe queue any thread may wait on.

    deltas False: the caller wants the end of the request, not its deltas (generate()),
    and the engine emits one output, finished, holding all of it
    (Engine.add_request(deltas=False)): waking the caller's thread for every token of
    every request cost ~30% of the host's share of a 64-sequence decode step."""

    __slots__ = ("closed", "deltas", "queue", "sent")

    def __init__(self, deltas: bool = True) -> None:
        self.queue: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self.closed = False
        self.sent = (0, 0)
        self.deltas = deltas

    def put(self, item: RequestOutput | BaseException) -> None:
        self.queue.put(item)


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


class BlockingRequestStream:
    """RequestStream for code without an event loop: a plain iterator of one request's
    RequestOutput deltas that blocks the calling thread (any thread) until the next one.
    close() (or dropping the object) aborts the request when it has not finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, sink: _ThreadSink) -> None:
        self.request_id = request_id
        self._owner = owner
        self._sink = sink
        self.done = False

    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        if self.done:
            raise StopIteration
        item = self._sink.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def result(self) -> FinalOutput:
        """Waits for the end of the request and returns all of it."""
        logprobs: list[TokenLogprob] = []
        try:
            for out in self:
                logprobs.extend(out.new_logprobs)
                if out.finished:
                    return _final(out, logprobs)
        finally:
            self.close()
        raise EngineDeadError(f"request {self.request_id} ended without a final output")

    def close(self) -> None:
        """Aborts the request if it is still running; safe to call more than once."""
        if not self.done:
            self.done = True
            self._sink.closed = True
            self._owner.abort(self.request_id)

    def __del__(self) -> None:
        if not self.done:
            with contextlib.suppress(Exception):
                self.close()


def _final(out: RequestOutput, logprobs: list[TokenLogprob]) -> FinalOutput:
    return FinalOutput(out.request_id, out.text, list(out.token_ids), out.finish_reason,
                       list(out.prompt_token_ids), logprobs, out.num_cached_tokens, out.error)


class AsyncEngine:
    """Runs an Engine on its own thread; see the module docstring.

    max_queue bounds the requests queued or running at once; submit() raises
    QueueFullError beyond it (the server answers 429). None: no bound (ellm.LLM's own
    loop, whose callers wait rather than being refused).

    One Engine has at most one running AsyncEngine: start() refuses a second one, since
    two threads stepping one Engine corrupt each other's requests."""

    def __init__(self, engine: Engine, max_queue: int | None = 256) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be None or >= 1, got {max_queue}")
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
        self._sinks: dict[str, _Sink | _ThreadSink] = {}     # touched on the engine thread only
        self._pending: set[str] = set()                    # ids submitted, not yet finished
        self._pending_lock = threading.Lock()              # callers on many threads submit
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._life = threading.Lock()                      # serialises start() / shutdown()
        self.step_errors = 0
        # Cheap counts the thread publishes after each step (plain ints: safe to read anywhere).
        self.num_running = 0
        self.num_waiting = 0

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (a no-op when it runs). Safe from any thread."""
        with self._life:
            if self._thread is not None and self._thread.is_alive():
                return
            other = getattr(self.engine, "loop_owner", None)
            if other is not None and other is not self and other.is_running:
                raise RuntimeError("this Engine is already driven by another running AsyncEngine "
                                   "(use that one, e.g. llm.async_engine, or shut it down first)")
            self.engine.loop_owner = self
            with self._cv:
                self._stopping = False
            # A daemon: a program that forgets close() must still exit; LLM's finaliser and
            # atexit stop it cleanly before that.
            self._thread = threading.Thread(target=self._run, name="ellm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the thread after its current step; unfinished requests fail with
        EngineDeadError. Safe from any thread, more than once; start() runs it again."""
        with self._life:
            with self._cv:
                self._stopping = True
                self._cv.notify()
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("the engine thread did not stop within %ss", timeout)
                    return
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
               request_id: str | None = None, images: list[Any] | None = None,
               adapter: str | None = None) -> RequestStream:
        """Queues a request now (call from a running event loop) and returns its stream.
        Raises QueueFullError at once when max_queue requests are already in. Errors the
        engine finds when adding (an over-long prompt) come out of the stream. images:
        [vision] ImageInputs for the prompt's image tokens (Engine.add_request). adapter:
        [lora] an attached LoRA adapter's name (an unknown one is a RequestError here)."""
        loop = asyncio.get_running_loop()
        sink = _Sink(loop)
        return RequestStream(self, self._add(prompt_ids, params, request_id, sink, images, adapter), sink)

    def submit_blocking(self, prompt_ids: list[int], params: SamplingParams,
                        request_id: str | None = None, images: list[Any] | None = None,
                        adapter: str | None = None, final_only: bool = False) -> BlockingRequestStream:
        """submit() for code without an event loop, from any thread: the stream is a plain
        iterator that blocks until the next delta. final_only: it yields the finished
        output alone, all of the request in its deltas, for a caller that only waits
        for the end."""
        sink = _ThreadSink(deltas=not final_only)
        return BlockingRequestStream(self, self._add(prompt_ids, params, request_id, sink, images, adapter),
                                     sink)

    def _add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
             sink: _Sink | _ThreadSink, images: list[Any] | None = None, adapter: str | None = None) -> str:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if adapter is not None:   # [lora] an unknown name fails the caller now (model.lora is fixed at load)
            self.engine.adapter_slot(adapter)
        rid = request_id or self.new_request_id()
        with self._pending_lock:
            self._check_capacity_locked(1)
            if rid in self._pending:
                raise ValueError(f"request id {rid!r} is already in use")
            self._pending.add(rid)
        try:
            self._post(("add", (rid, list(prompt_ids), params, sink, images, adapter)))
        except EngineDeadError:
            self._pending_discard(rid, sink)
            raise
        return rid

    def check_capacity(self, n: int) -> None:
        """Raises QueueFullError unless n more requests fit under max_queue."""
        with self._pending_lock:
            self._check_capacity_locked(n)

    def _check_capacity_locked(self, n: int) -> None:
        if self.max_queue is not None and len(self._pending) + n > self.max_queue:
            raise QueueFullError(f"the server has {len(self._pending)} requests queued or running "
                                 f"(limit {self.max_queue}); retry later")

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, images: list[Any] | None = None,
                     adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput deltas; closing or cancelling the consumer
        aborts the request."""
        s = self.submit(prompt_ids, params, request_id, images, adapter)
        try:
            async for out in s:
                yield out
        finally:
            s.close()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, images: list[Any] | None = None,
                       adapter: str | None = None) -> FinalOutput:
        """Runs one request to the end and returns all of it."""
        s = self.submit(prompt_ids, params, request_id, images, adapter)
        logprobs: list[TokenLogprob] = []
        try:
            async for out in s:
                logprobs.extend(out.new_logprobs)
                if out.finished:
                    return _final(out, logprobs)
        finally:
            s.close()
        raise RuntimeError(f"request {s.request_id} ended without a final output")  # unreachable

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its blocks are freed before the next step."""
        with self._pending_lock:
            self._pending.discard(request_id)
        self._post(("abort", request_id))

    # -- work on the engine thread ------------------------------------------------------

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Runs fn(engine) on the engine thread between two steps; the future holds its
        result or its exception. From any thread; `await asyncio.wrap_future(...)` on a loop."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("call", (fn, fut)))
        return fut

    def logits_blocking(self, ids: list[int]) -> np.ndarray:
        """Engine.logits(ids), computed on the engine thread; blocks the caller."""
        return self.call(lambda eng: eng.logits(ids)).result()

    def embed_blocking(self, prompts: list[list[int]], pooling: str = "mean",
                       normalize: bool = True) -> np.ndarray:
        """Engine.embed on the engine thread, one forward's worth of prompts per call, so
        that decoding streams take a step between two groups. Blocks the caller."""
        groups = self._embed_groups(prompts, pooling)
        futs = [self.call(functools.partial(_embed_group, g, pooling, normalize)) for g in groups]
        try:
            return _stack([f.result() for f in futs], self.engine.model.config.hidden_size)
        except BaseException:
            for f in futs:   # failed or interrupted: the groups not yet started are dropped
                f.cancel()
            raise

    async def embed(self, prompts: list[list[int]], pooling: str = "mean",
                    normalize: bool = True) -> np.ndarray:
        """(len(prompts), hidden_size) float32 embeddings (see Engine.embed); the work runs
        on the engine thread between steps, one forward's worth of prompts at a time."""
        groups = self._embed_groups(prompts, pooling)
        futs = [asyncio.wrap_future(self.call(functools.partial(_embed_group, g, pooling, normalize)))
                for g in groups]
        try:
            parts = await asyncio.gather(*futs)
        except BaseException:
            for f in futs:   # cancelled: the groups not yet started are dropped
                f.cancel()
            raise
        return _stack(list(parts), self.engine.model.config.hidden_size)

    def _embed_groups(self, prompts: list[list[int]], pooling: str) -> list[list[list[int]]]:
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        prompts = [[int(t) for t in p] for p in prompts]
        budget = self.engine.cfg.max_batch_tokens
        groups: list[list[list[int]]] = []
        size = 0
        for p in prompts:
            if not groups or size + len(p) > budget:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += len(p)
        return groups

    async def snapshot(self) -> EngineSnapshot:
        """Engine counts, read on the engine thread between steps."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineSnapshot] = loop.create_future()
        self._post(("snapshot", (loop, fut)))
        return await fut

    def snapshot_blocking(self, timeout: float | None = 60.0) -> EngineSnapshot:
        """snapshot() for code without an event loop: read on the engine thread after every
        command posted before it (an abort included), so it sees that abort's effect."""
        return self.call(lambda _eng: self._snapshot()).result(timeout)

    def snapshot_now(self) -> EngineSnapshot:
        """The same counts read from the calling thread under the engine lock (blocks for
        up to one step). For code without an event loop, or a stopped engine thread."""
        with self.lock:
            return self._snapshot()

    # -- the engine thread ------------------------------------------------------------

    def _post(self, cmd: tuple[str, Any]) -> None:
        with self._cv:
            if self._stopping:
                # The thread has drained, or is draining, its last inbox: nothing posted now
                # would ever be answered. An abort has nothing left to abort.
                if cmd[0] == "abort":
                    return
                raise EngineDeadError("the engine is shutting down")
            self._inbox.append(cmd)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished():
                    self._cv.wait()
                if self._stopping:
                    break
                cmds = self._take_commands()
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

    def _take_commands(self) -> list[tuple[str, Any]]:
        """The inbox, except that only its first "call" is taken: a long job posted as
        many calls (embedding groups) lets a step run between two of them."""
        taken: list[tuple[str, Any]] = []
        rest: list[tuple[str, Any]] = []
        for cmd in self._inbox:
            if cmd[0] == "call" and any(c[0] == "call" for c in taken):
                rest.append(cmd)
            else:
                taken.append(cmd)
        self._inbox = rest
        return taken

    def _apply(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        try:
            if kind == "add":
                rid, prompt_ids, params, sink, images, adapter = arg
                if sink.closed:
                    return   # closed before it was added; its abort finds nothing to do
                self._sinks[rid] = sink
                try:
                    extra: dict[str, Any] = {}
                    if images:   # [vision]
                        extra["images"] = images
                    if adapter is not None:   # [lora]
                        extra["adapter"] = adapter
                    self.engine.add_request(prompt_ids, params, rid, deltas=sink.deltas, **extra)
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
            elif kind == "call":
                fn, cfut = arg
                if cfut.set_running_or_notify_cancel():
                    try:
                        cfut.set_result(fn(self.engine))
                    except BaseException as e:  # noqa: BLE001 - the caller gets it
                        cfut.set_exception(e)
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
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
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
            if isinstance(sink, _Sink):   # gathered: one wake-up of each event loop per step
                by_loop.setdefault(sink.loop, []).append((sink.queue, out))
            else:
                sink.put(out)
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    @staticmethod
    def _fix_delta(sink: _Sink | _ThreadSink, out: RequestOutput) -> None:
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

    def _pending_discard(self, rid: str, sink: _Sink | _ThreadSink) -> None:
        with self._pending_lock:
            self._pending.discard(rid)

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
                elif kind == "call":
                    _, cfut = arg
                    if cfut.set_running_or_notify_cancel():
                        cfut.set_exception(exc)

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
            step_errors=self.step_errors,
            spec_proposed_tokens=eng.stats.get("spec_proposed_tokens", 0),  # [spec]
            spec_accepted_tokens=eng.stats.get("spec_accepted_tokens", 0))


def _embed_group(prompts: list[list[int]], pooling: str, normalize: bool, engine: Engine) -> np.ndarray:
    return engine.embed(prompts, pooling, normalize)


def _stack(parts: list[np.ndarray], width: int) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty((0, width), np.float32)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Runs fn(*args) on loop's thread; a closed loop (its caller is gone) is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    """On a loop's thread: a step's outputs into their requests' queues, in step order."""
    for q, item in items:
        q.put_nowait(item)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
