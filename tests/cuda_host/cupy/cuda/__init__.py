"""cupy.cuda for the host stand-in: one "device", streams, and graph capture that records
kernel launches (ops/cuda_graphs.py's use)."""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from . import device, memory, runtime

__all__ = ["Device", "Stream", "Graph", "Event", "get_elapsed_time", "alloc_pinned_memory", "device", "memory",
           "runtime"]

# the launches being recorded while a stream captures, else None
_capture: list[Any] | None = None

# Deferred execution (ELLM_CUDA_HOST_DEFER=1): kernels, graph replays and asynchronous
# copies wait in one queue, as work waits on a stream, until the host synchronizes with
# it (an event, the stream, a copy or a read on the host). A host write that races a
# copy still queued, or a read of results not yet waited for, then changes what is
# computed, as it would on a GPU. Off: everything runs when it is issued.
_defer = os.environ.get("ELLM_CUDA_HOST_DEFER") == "1"
_queue: list[Callable[[], None]] = []
_done = 0   # queued items run so far


def _enqueue(work: Callable[[], None]) -> None:
    if _defer:
        _queue.append(work)
    else:
        work()


def _flush(upto: int | None = None) -> None:
    """Runs the queued work in order: all of it, or up to item number `upto`."""
    global _done
    while _queue and (upto is None or _done < upto):
        work = _queue.pop(0)
        _done += 1
        work()


def _issued() -> int:
    return _done + len(_queue)


class Device:
    def __init__(self, device_id: int = 0) -> None:
        if device_id != 0:
            raise runtime.CUDARuntimeError(f"invalid device ordinal {device_id} (the host stand-in has one)")
        self.id = device_id
        # an H100's figures, so launch shapes sized from them are the ones a GPU gets
        self.attributes = {"MultiProcessorCount": 132}
        self.compute_capability = "90"

    def use(self) -> None:
        pass


class Graph:
    def __init__(self, launches: list[Any]) -> None:
        self._launches = launches

    def launch(self, stream: Any = None) -> None:
        from .. import _run

        def replay() -> None:
            for launch in self._launches:
                _run(*launch)
        _enqueue(replay)


class Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.non_blocking = non_blocking
        self.ptr = id(self)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def synchronize(self) -> None:
        _flush()

    def begin_capture(self) -> None:
        global _capture
        if _capture is not None:
            raise runtime.CUDARuntimeError("a capture is already under way")
        _capture = []

    def end_capture(self) -> Graph:
        global _capture
        if _capture is None:
            raise runtime.CUDARuntimeError("end_capture without begin_capture")
        launches, _capture = _capture, None
        return Graph(launches)


class Event:
    """Kernels run as they are launched here, so an event's time is the host's clock."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self._t: float | None = None
        self._upto = 0   # the queued work this event waits for (deferred execution)

    def record(self, stream: Any = None) -> None:
        if _capture is not None:
            raise runtime.CUDARuntimeError("event recording inside a capture is not supported here")
        self._t = time.perf_counter()
        self._upto = _issued()

    def synchronize(self) -> None:
        _flush(self._upto)

    @property
    def done(self) -> bool:
        """Whether the work before the event has run (CuPy: the event's query)."""
        return _done >= self._upto


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    if start._t is None or end._t is None:
        raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: an event was not recorded")
    return (end._t - start._t) * 1e3


def alloc_pinned_memory(size: int) -> bytearray:
    """Page-locked host memory in CuPy; here a plain buffer numpy can view (np.frombuffer)."""
    return bytearray(max(int(size), 1))
