"""cupy.cuda.runtime for the host stand-in: one device."""
from __future__ import annotations

import ctypes

# cudaMemcpyKind values, as CuPy names them
memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 0, 1, 2, 3


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount() -> int:
    return 1


def memGetInfo() -> tuple[int, int]:
    """(free, total) bytes of the device (memory.py: ELLM_CUDA_HOST_MEMORY)."""
    from . import memory
    return memory.free(), memory.TOTAL


def profilerStart() -> None:   # no profiler attaches to the host stand-in
    pass


def profilerStop() -> None:
    pass


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """Both sides are host addresses here ("device" arrays are host memory); the copy is
    done at once, as every launch is. A real capture would record it as a node of its
    own, which this stand-in does not replay, so it raises while a stream captures."""
    from . import _capture, _enqueue
    if _capture is not None:
        raise CUDARuntimeError("memcpyAsync while a CUDA graph is captured (the stand-in records kernels only)")
    if kind not in (0, 1, 2, 3):
        raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: kind {kind}")
    if size < 0:
        raise CUDARuntimeError(f"cudaErrorInvalidValue: size {size}")
    if size:   # read and written when the queue reaches it (deferred execution)
        _enqueue(lambda: ctypes.memmove(dst, src, size))
