"""cupy.cuda.runtime for the host stand-in: one device."""
from __future__ import annotations


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount() -> int:
    return 1


def profilerStart() -> None:   # no profiler attaches to the host stand-in
    pass


def profilerStop() -> None:
    pass
