"""A stand-in for CuPy that runs ellm's CUDA kernels on the CPU, for checking them on
machines without a GPU. Not CuPy: only the part of its interface ops/cuda.py and
ops/cuda_graphs.py use.

"Device" arrays are host numpy arrays (a subclass with CuPy's `.data.ptr`, `.get()` and
`.set()`); `RawModule` compiles the kernel source with g++ against cuda_host.h (the CUDA
built-ins, threads as fibers) and `RawKernel.__call__` runs the grid through it. Stream
capture records kernel launches and a graph replays them, as CUDA does; any other write
to a device array while capturing raises, since a real capture would record it as a
node this stand-in does not have. tests/cuda_host/README.md says what it can and cannot
show.

Use: put tests/cuda_host on PYTHONPATH (`bash tests/cuda_host/run.sh` does).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import cuda

__all__ = ["RawModule", "RawKernel", "ndarray", "asarray", "ascontiguousarray", "asnumpy", "empty",
           "zeros", "cuda", "get_default_memory_pool"]

__version__ = "0+cuda-host"   # (what benchmarks/gpu/check.sh prints of CuPy, in a rehearsal)
HEADER = Path(__file__).resolve().parents[1] / "cuda_host.h"


class CaptureError(RuntimeError):
    """A device array was written other than by a kernel while a stream was captured."""


def _not_capturing(what: str) -> None:
    if cuda._capture is not None:
        raise CaptureError(f"{what} while a CUDA graph is captured: a real capture records it as a "
                           "node of its own, which this stand-in does not replay")


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray(np.ndarray):
    """A "device" array: host memory with CuPy's pointer and copy methods."""

    @property
    def data(self) -> _Pointer:   # type: ignore[override]
        return _Pointer(int(self.__array_interface__["data"][0]))

    def get(self, stream: Any = None) -> np.ndarray:
        _not_capturing("a copy to the host")
        cuda._flush()
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, arr: Any, stream: Any = None) -> None:
        _not_capturing("a copy from the host")
        cuda._flush()
        np.copyto(self.view(np.ndarray), np.asarray(arr))

    def copy(self, order: str = "C") -> "ndarray":   # type: ignore[override]
        _not_capturing("a device copy")
        cuda._flush()
        return cuda.memory._allocate(self.shape, self.dtype,
                                     lambda: np.ndarray.copy(self, order=order)).view(ndarray)

    def fill(self, value: Any) -> None:
        _not_capturing("a fill")
        cuda._flush()
        np.ndarray.fill(self, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        _not_capturing("an assignment")
        cuda._flush()
        np.ndarray.__setitem__(self, key, value)

    def __getitem__(self, key: Any) -> Any:
        item = np.ndarray.__getitem__(self, key)
        if not isinstance(item, np.ndarray):   # a value read on the host: the work before it first
            cuda._flush()
            item = np.ndarray.__getitem__(self, key)
        return item

    def tolist(self) -> Any:
        cuda._flush()
        return np.ndarray.tolist(self)

    def item(self, *args: Any) -> Any:
        cuda._flush()
        return np.ndarray.item(self, *args)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _not_capturing(f"numpy's {ufunc.__name__}")
        cuda._flush()
        plain = [x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, ndarray) else o for o in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        if isinstance(result, np.ndarray):
            return result.view(ndarray)
        return result


def _device(a: np.ndarray) -> ndarray:
    return a.view(ndarray)


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _not_capturing("a copy to the device")
    cuda._flush()
    host = np.asarray(a)
    return _device(cuda.memory._allocate(host.shape, dtype or host.dtype,
                                         lambda: np.array(host, dtype=dtype, copy=True)))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _not_capturing("a contiguous copy")
    cuda._flush()
    host = np.asarray(a)
    return _device(cuda.memory._allocate(host.shape, dtype or host.dtype,
                                         lambda: np.array(host, dtype=dtype, order="C", copy=True)))


def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get()
    return np.asarray(a)


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    # filled with NaN bits (floats) or a pattern, as uninitialised device memory may hold anything
    a = cuda.memory._allocate(shape, dtype, lambda: np.empty(shape, dtype))
    a.view(np.uint8)[...] = 0xff
    return _device(a)


def zeros(shape: Any, dtype: Any = np.float32) -> ndarray:
    return _device(cuda.memory._allocate(shape, dtype, lambda: np.zeros(shape, dtype)))


def get_default_memory_pool() -> cuda.memory.MemoryPool:
    return cuda.memory.MemoryPool()


# -- kernels -------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ellm" / "cuda_host"
    root.mkdir(parents=True, exist_ok=True)
    return root


_BOUNDS_MARK = "cuda_host_launch_bounds("
_CONSTANT = re.compile(r"[\d\s+\-*/()]+")


def launch_bounds(preprocessed: str) -> dict[str, int]:
    """Each kernel's most threads a block (its __launch_bounds__' first argument), from the
    source preprocessed with the bound left in the text as cuda_host_launch_bounds(...)."""
    bounds: dict[str, int] = {}
    at = preprocessed.find(_BOUNDS_MARK)
    while at >= 0:
        i, depth, comma = at + len(_BOUNDS_MARK), 1, -1
        start = i
        while depth:   # to the bound's closing parenthesis, noting its first top-level comma
            c = preprocessed[i]
            depth += (c == "(") - (c == ")")
            if c == "," and depth == 1 and comma < 0:
                comma = i
            i += 1
        expr = preprocessed[start:comma if comma >= 0 else i - 1]
        name = re.match(r"\s*(\w+)\s*\(", preprocessed[i:])
        if name and _CONSTANT.fullmatch(expr):
            bounds[name.group(1)] = int(eval(expr, {"__builtins__": {}}))   # digits and arithmetic only
        at = preprocessed.find(_BOUNDS_MARK, i)
    return bounds


def compile_source(code: str) -> tuple[Path, dict[str, int]]:
    """The shared library g++ makes of a kernel source, and each kernel's launch bound
    (cached by the text of both)."""
    header = HEADER.read_text()
    asan = bool(os.environ.get("ELLM_CUDA_HOST_ASAN"))
    key = hashlib.sha256((header + "\0" + code + "\0" + str(asan)).encode()).hexdigest()[:24]
    so = _cache_dir() / f"{key}.so"
    bounds_file = so.with_suffix(".bounds.json")
    if so.exists() and bounds_file.exists():
        return so, json.loads(bounds_file.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(code)
        scan = subprocess.run(["g++", "-std=c++17", "-E", "-P", "-DCUDA_HOST_SCAN_BOUNDS=1", "-include", str(HEADER),
                               "-x", "c++", str(src)], capture_output=True, text=True)
        if scan.returncode:
            raise RuntimeError(f"g++ could not preprocess the kernels:\n{scan.stderr[-4000:]}")
        bounds = launch_bounds(scan.stdout)
        out = Path(tmp) / "kernels.so"
        cmd = ["g++", "-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden",
               "-ffp-contract=off", "-fsanitize=alignment",   # (cuda_host.h takes the sanitizer's reports)
               "-Wno-unknown-pragmas", "-include", str(HEADER), "-x", "c++", str(src), "-o", str(out), "-lffi"]
        if asan:
            cmd[1:1] = ["-fsanitize=address", "-fno-omit-frame-pointer"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"g++ could not build the kernels for the host:\n{proc.stderr[-4000:]}")
        os.replace(out, so)
    bounds_file.write_text(json.dumps(bounds))
    return so, bounds


class RawKernel:
    def __init__(self, lib: ctypes.CDLL, name: str, code: str = "", max_threads: int = 1024) -> None:
        self.name = name
        self._lib = lib
        self._code = code
        self.max_threads = max_threads   # its __launch_bounds__, where it has one
        self._fn = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    def __call__(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
                 shared_mem: int = 0) -> None:
        launch = (self, tuple(int(g) for g in grid), tuple(int(b) for b in block), _pack(self.name, args))
        if cuda._capture is not None:
            cuda._capture.append(launch)
        else:
            cuda._enqueue(lambda: _run(*launch))


def _pack(name: str, args: Sequence[Any]) -> tuple[bytes, Any, list[Any]]:
    """The argument letters, their 8-byte slots, and the arrays to keep alive."""
    types, keep = [], []
    slots = (ctypes.c_uint64 * max(len(args), 1))()
    for i, a in enumerate(args):
        if isinstance(a, ndarray):
            types.append("p")
            slots[i] = a.data.ptr
            keep.append(a)
        elif isinstance(a, np.ndarray):
            raise TypeError(f"{name}: argument {i} is a host numpy array, not a device array")
        elif isinstance(a, (np.int32, np.uint32)):
            types.append("i")
            slots[i] = int(a) & 0xffffffff
        elif isinstance(a, (np.int64, np.uint64)):
            types.append("q")
            slots[i] = int(a) & 0xffffffffffffffff
        elif isinstance(a, np.float32):
            types.append("f")
            slots[i] = int(np.array(a, np.float32).view(np.uint32))
        elif isinstance(a, np.float64):
            types.append("d")
            slots[i] = int(np.array(a, np.float64).view(np.uint64))
        else:   # CuPy would pass a Python scalar as a 64-bit value: a kernel taking int reads garbage
            raise TypeError(f"{name}: argument {i} is {type(a).__name__} {a!r}; pass a numpy scalar of the "
                            "kernel parameter's type")
    return "".join(types).encode(), slots, keep


def _run(kernel: RawKernel, grid: tuple[int, ...], block: tuple[int, ...], packed: tuple) -> None:
    types, slots, _ = packed
    g = (grid + (1, 1, 1))[:3]
    b = (block + (1, 1, 1))[:3]
    if b[0] * b[1] * b[2] > kernel.max_threads:   # a GPU refuses the launch (CUDA_ERROR_INVALID_VALUE)
        raise RuntimeError(f"{kernel.name} grid {g} block {b}: {b[0] * b[1] * b[2]} threads a block, more than "
                           f"its __launch_bounds__ of {kernel.max_threads}")
    lib = kernel._lib
    rc = lib.cuda_host_launch(ctypes.c_void_p(kernel._fn), *(ctypes.c_uint(v) for v in g + b),
                              ctypes.c_int(len(types)), ctypes.c_char_p(types), slots)
    if rc:
        error = lib.cuda_host_error().decode()
        sites = re.search(r"different (?:__syncthreads|warp exchanges): lines (\d+) and (\d+)", error)
        if sites:   # the two lines of the kernel's text
            lines = kernel._code.splitlines()
            error += "".join(f"\n  line {n}: {lines[n - 1].strip()}" for n in map(int, sites.groups())
                             if 0 < n <= len(lines))
        raise RuntimeError(f"{kernel.name} grid {g} block {b}: {error}")


class RawModule:
    def __init__(self, code: str, options: Sequence[str] = (), **_: Any) -> None:
        self._code = code
        so, self._bounds = compile_source(code)
        self._lib = ctypes.CDLL(str(so))
        self._lib.cuda_host_error.restype = ctypes.c_char_p
        self._lib.cuda_host_launch.restype = ctypes.c_int
        self._kernels: dict[str, RawKernel] = {}

    def get_function(self, name: str) -> RawKernel:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = RawKernel(self._lib, name, self._code, self._bounds.get(name, 1024))
        return k
