"""cublasGemmEx for the host stand-in: numpy on the memory the pointers name (column-major,
as cuBLAS reads it). Only what ops/cuda.py asks for: bf16 or f32 inputs, f32 output, f32
compute, host-memory alpha and beta. The sums are float64, not the tensor cores' f32."""
from __future__ import annotations

import ctypes

import numpy as np

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
_TYPES = {0: np.float32, 14: np.uint16}   # CUDA_R_32F, CUDA_R_16BF
CUBLAS_COMPUTE_32F = 68


def _memory(ptr: int, dtype: type, count: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize * count
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr)).view(dtype)


def _matrix(ptr: int, dtype_code: int, ld: int, rows: int, cols: int) -> np.ndarray:
    """The rows x cols column-major matrix at ptr (leading dimension ld), as float64."""
    if dtype_code not in _TYPES or ld < rows:
        raise ValueError(f"gemmEx stand-in: type {dtype_code} or ld {ld} < {rows} rows")
    raw = _memory(ptr, _TYPES[dtype_code], ld * cols).reshape(cols, ld)[:, :rows].T
    if dtype_code == 14:
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float64)


def setStream(handle: int, stream: int) -> None:
    pass


def gemmEx(handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, A: int, Atype: int,
           lda: int, B: int, Btype: int, ldb: int, beta: int, C: int, Ctype: int, ldc: int, computeType: int,
           algo: int) -> None:
    if computeType != CUBLAS_COMPUTE_32F or Ctype != 0:
        raise ValueError("gemmEx stand-in: f32 compute and output only")
    from cupy import cuda
    cuda._flush()   # (deferred execution) the work before it, then this at once: its pointers
                    # name arrays the caller may drop as soon as the call returns
    a = _matrix(A, Atype, lda, *((m, k) if transa == CUBLAS_OP_N else (k, m)))
    b = _matrix(B, Btype, ldb, *((k, n) if transb == CUBLAS_OP_N else (n, k)))
    a = a if transa == CUBLAS_OP_N else a.T
    b = b if transb == CUBLAS_OP_N else b.T
    al, be = float(_memory(alpha, np.float32, 1)[0]), float(_memory(beta, np.float32, 1)[0])
    c = _memory(C, np.float32, ldc * n).reshape(n, ldc)
    result = al * (a @ b)
    if be != 0.0:
        result += be * c[:, :m].T.astype(np.float64)
    c[:, :m] = result.T.astype(np.float32)
