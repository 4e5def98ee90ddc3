"""cupy.cuda.memory for the host stand-in: the device's size, the bytes its live arrays
take, and CuPy's error when an allocation does not fit.

The "device" holds ELLM_CUDA_HOST_MEMORY bytes (default 80 GiB, an H100's), so the
backend's checks of what fits are exercised on the CPU with a small value. Every array
the stand-in allocates counts until numpy frees it."""
from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

TOTAL = int(os.environ.get("ELLM_CUDA_HOST_MEMORY", str(80 << 30)))
_used = 0
_limit = 0   # the pool's limit (MemoryPool.set_limit), 0: none


class OutOfMemoryError(MemoryError):
    """CuPy's: an allocation the device (or its pool) cannot satisfy."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


def _release(nbytes: int) -> None:
    global _used
    _used -= nbytes


def reserve(nbytes: int) -> None:
    """Counts an allocation about to be made, or raises as CuPy does when it cannot be."""
    global _used
    if _used + nbytes > (min(TOTAL, _limit) if _limit else TOTAL):
        raise OutOfMemoryError(nbytes, _used)
    _used += nbytes


def track(a: np.ndarray) -> np.ndarray:
    """`a` (a fresh array, reserved by `reserve`) gives its bytes back when numpy frees it."""
    weakref.finalize(a, _release, a.nbytes)
    return a


def used() -> int:
    return _used


def free() -> int:
    return TOTAL - _used


class MemoryPool:
    """CuPy's pool keeps freed blocks for reuse; this stand-in's arrays go straight back.
    Its limit (set_limit) caps what the process may allocate, as CuPy's does."""

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        global _limit
        _limit = int(size or 0) if fraction is None else int(fraction * TOTAL)

    def get_limit(self) -> int:
        return _limit

    def free_all_blocks(self) -> None:
        pass

    def free_bytes(self) -> int:
        return 0

    def used_bytes(self) -> int:
        return _used

    def total_bytes(self) -> int:
        return _used


def _allocate(shape: Any, dtype: Any, make: Any) -> Any:
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    reserve(n)
    try:
        return track(make())
    except BaseException:
        _release(n)
        raise
