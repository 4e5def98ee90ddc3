"""Programmatic dependent launch (Hopper and newer) for the kernels of a captured step.

A decode step is a chain of ~5 small kernels a layer, each waiting for the one before.
Launched plainly, a kernel's blocks are scheduled only once the previous kernel has
ended, and that gap (a few microseconds) is paid ~150 times a token on a small model.
Launched with the attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, the
next kernel's blocks may be scheduled as soon as every block of the running one has
passed `griddepcontrol.launch_dependents`; they then stop at `griddepcontrol.wait` until
the running kernel has finished and its writes are visible. Every kernel in csrc/cuda/
does both first (common.cuh `grid_dependency_sync`, checked by tests/test_cuda_compile.py),
so the results are those of plain launches: only the gap goes.

CuPy launches with `cuLaunchKernel` and has no way to pass launch attributes, so this
module calls the driver's `cuLaunchKernelEx` through ctypes with the CUfunction CuPy
compiled (`RawKernel.kernel.ptr`). The structures below mirror cuda.h (CUDA 12.0 and
later; tests/test_cuda_pdl.py compares them with the header where one is installed).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Sequence

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID
CUDA_SUCCESS = 0


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: 64 bytes; the one member used here."""
    _fields_ = [("programmaticStreamSerializationAllowed", ctypes.c_int), ("pad", ctypes.c_char * 64)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, the value."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# numpy scalar types a kernel argument may have, and the C type CuPy would pass for each
SCALARS: dict[type, Any] = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
                            np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
                            np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def kernel_params(name: str, args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The `void** kernelParams` of a launch (one pointer to each argument's value) and
    the ctypes objects it points into, which must live until the launch returns. Device
    arrays pass their data pointer, numpy scalars their value, as CuPy passes them."""
    values: list[Any] = []
    for i, a in enumerate(args):
        ctype = SCALARS.get(type(a))
        if ctype is not None:
            values.append(ctype(a.item()))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):   # a CuPy array
            values.append(ctypes.c_void_p(int(a.data.ptr)))
        else:
            raise TypeError(f"{name}: argument {i} is {type(a).__name__}; a dependent launch takes "
                            "device arrays and numpy scalars")
    params = (ctypes.c_void_p * max(len(values), 1))(*(ctypes.addressof(v) for v in values))
    return params, values


LaunchFn = Callable[[Any, ctypes.c_void_p, Any, ctypes.c_void_p | None], int]   # the last: `extra`, NULL


class DependentLauncher:
    """Launches a CuPy kernel with programmatic stream serialization allowed.

    `launch_ex` is the driver's cuLaunchKernelEx (the default) or anything with its
    signature; `context` the CUcontext to make current on a thread that has none yet
    (the engine thread may launch before CuPy has touched the device there)."""

    def __init__(self, launch_ex: LaunchFn, context: int | None = None,
                 set_context: Callable[[int], int] | None = None,
                 get_context: Callable[[], int] | None = None) -> None:
        self._launch_ex = launch_ex
        self._context, self._set_context, self._get_context = context, set_context, get_context
        self._threads = threading.local()
        attr = self._attr = LaunchAttribute()
        attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1

    @classmethod
    def from_driver(cls) -> "DependentLauncher":
        """The launcher over libcuda's cuLaunchKernelEx; OSError or AttributeError where
        the driver or the entry point is missing (drivers before CUDA 12.0)."""
        lib = ctypes.CDLL("libcuda.so.1")
        launch_ex = lib.cuLaunchKernelEx
        launch_ex.restype = ctypes.c_int
        launch_ex.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        get_ctx, set_ctx = lib.cuCtxGetCurrent, lib.cuCtxSetCurrent
        get_ctx.restype = set_ctx.restype = ctypes.c_int
        get_ctx.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        set_ctx.argtypes = [ctypes.c_void_p]

        def current() -> int:
            ctx = ctypes.c_void_p()
            return int(ctx.value or 0) if get_ctx(ctypes.byref(ctx)) == CUDA_SUCCESS else 0

        context = current()   # the caller (CudaOps) has just made CuPy's context current
        if not context:
            raise OSError("no CUDA context is current on this thread")
        return cls(launch_ex, context, lambda c: set_ctx(ctypes.c_void_p(c)), current)

    def _ensure_context(self) -> None:
        if getattr(self._threads, "ready", False):
            return
        if self._get_context is not None and self._set_context is not None and self._context:
            if not self._get_context():
                rc = self._set_context(self._context)
                if rc != CUDA_SUCCESS:
                    raise RuntimeError(f"cuCtxSetCurrent failed with CUDA error {rc}")
        self._threads.ready = True

    def __call__(self, function: int, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
                 stream: int, name: str = "kernel") -> None:
        self._ensure_context()
        g = (tuple(int(v) for v in grid) + (1, 1, 1))[:3]
        b = (tuple(int(v) for v in block) + (1, 1, 1))[:3]
        config = LaunchConfig(*g, *b, 0, ctypes.c_void_p(stream), ctypes.pointer(self._attr), 1)
        params, keep = kernel_params(name, args)
        rc = self._launch_ex(ctypes.byref(config), ctypes.c_void_p(function), params, None)
        del keep
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx({name}, grid {g}, block {b}) failed with CUDA error {rc}")
