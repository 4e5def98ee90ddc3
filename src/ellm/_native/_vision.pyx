# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Thin typed shims over csrc/vision.h: layernorm with bias, GELU (tanh) and attention
over independent sequences without a mask, for the vision towers.

float32 only; a wrong dtype, shape or layout is a ValueError naming the argument. Row
matrices may have any row stride with contiguous rows; attention takes contiguous
(T, heads, head_dim) arrays. The GIL is released while the C kernels run.
"""

import numpy as np

from libc.stdint cimport int64_t


cdef extern from "vision.h":
    void ellm_layernorm(const float *x, int64_t ldx, const float *w, const float *b, float eps,
                        float *out, int64_t ldo, int64_t rows, int64_t n) nogil
    void ellm_gelu_tanh(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t n) nogil
    void ellm_full_attention(const float *q, const float *k, const float *v, float *out, int64_t T,
                             int64_t nh, int64_t hd, int64_t seq_len, float scale) nogil
    int ELLM_FULL_ATTENTION_MAX_HD


cdef object _rows(object a, str fn, str name, bint writable):
    """a as a 2-D (rows, n) float32 array with contiguous rows (N-D C-contiguous arrays
    are seen as (-1, last axis))."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{fn}: {name} must be a numpy float32 array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise ValueError(f"{fn}: {name} must be float32, got {a.dtype}")
    if a.ndim != 2:
        if a.ndim == 0 or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be 2-D (rows, n) or C-contiguous, got shape {a.shape}")
        a = a.reshape(-1, a.shape[a.ndim - 1])
    if a.shape[1] > 1 and a.strides[1] != 4:
        raise ValueError(f"{fn}: {name} needs contiguous rows (inner stride {a.strides[1]} bytes)")
    if a.strides[0] % 4 != 0 or a.strides[0] < 0:
        raise ValueError(f"{fn}: {name} row stride {a.strides[0]} is not a positive multiple of 4 bytes")
    if writable and not a.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only")
    return a


cdef object _vec(object a, str fn, str name, Py_ssize_t n):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be a contiguous 1-D float32 array")
    if a.shape[0] != n:
        raise ValueError(f"{fn}: {name} has {a.shape[0]} elements, x rows have {n}")
    return a


def layernorm(x, weight, bias, double eps, out=None):
    """out = (x - mean) / sqrt(var + eps) * weight + bias over the last axis.
    x (R, n) float32 (or C-contiguous (..., n)); weight, bias (n,); out like x or None
    (allocated); out may be x itself. Returns out."""
    x2 = _rows(x, "layernorm", "x", False)
    cdef Py_ssize_t R = x2.shape[0], n = x2.shape[1]
    _vec(weight, "layernorm", "weight", n)
    _vec(bias, "layernorm", "bias", n)
    if not eps > 0:
        raise ValueError(f"layernorm: eps must be > 0, got {eps}")
    if out is None:
        out = np.empty(np.shape(x), np.float32)
    o2 = _rows(out, "layernorm", "out", True)
    if o2.shape[0] != R or o2.shape[1] != n:
        raise ValueError(f"layernorm: out has shape {o2.shape} as rows, expected ({R}, {n})")
    cdef const float[:, :] xv = x2
    cdef float[:, :] ov = o2
    cdef const float[::1] wv = weight
    cdef const float[::1] bv = bias
    if R == 0 or n == 0:
        return out
    with nogil:
        ellm_layernorm(&xv[0, 0], xv.strides[0] // 4, &wv[0], &bv[0], <float>eps, &ov[0, 0],
                       ov.strides[0] // 4, R, n)
    return out


def gelu_tanh(x, out=None):
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); out may be x. Returns out."""
    x2 = _rows(x, "gelu_tanh", "x", False)
    cdef Py_ssize_t R = x2.shape[0], n = x2.shape[1]
    if out is None:
        out = np.empty(np.shape(x), np.float32)
    o2 = _rows(out, "gelu_tanh", "out", True)
    if o2.shape[0] != R or o2.shape[1] != n:
        raise ValueError(f"gelu_tanh: out has shape {o2.shape} as rows, expected ({R}, {n})")
    cdef const float[:, :] xv = x2
    cdef float[:, :] ov = o2
    if R == 0 or n == 0:
        return out
    with nogil:
        ellm_gelu_tanh(&xv[0, 0], xv.strides[0] // 4, &ov[0, 0], ov.strides[0] // 4, R, n)
    return out


cdef object _thd(object a, str name, tuple shape):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise ValueError(f"full_attention: {name} must be a float32 numpy array")
    if a.ndim != 3 or not a.flags.c_contiguous:
        raise ValueError(f"full_attention: {name} must be a C-contiguous (T, heads, head_dim) array, "
                         f"got shape {a.shape}")
    if shape and a.shape != shape:
        raise ValueError(f"full_attention: {name} has shape {a.shape}, q has {shape}")
    return a


def full_attention(q, k, v, Py_ssize_t seq_len, double scale, out=None):
    """q, k, v (T, nh, hd) float32, T a multiple of seq_len: each block of seq_len rows is
    one sequence whose rows all see each other; hd <= 256.
    -> out (T, nh, hd) = softmax(q k^T scale) v."""
    _thd(q, "q", ())
    shape = tuple(q.shape)
    _thd(k, "k", shape)
    _thd(v, "v", shape)
    cdef Py_ssize_t T = shape[0], nh = shape[1], hd = shape[2]
    if hd > ELLM_FULL_ATTENTION_MAX_HD:
        raise ValueError(f"full_attention: head_dim {hd} is above the {ELLM_FULL_ATTENTION_MAX_HD} supported")
    if seq_len < 1 or T % seq_len:
        raise ValueError(f"full_attention: {T} rows are not a whole number of sequences of {seq_len}")
    if out is None:
        out = np.empty(shape, np.float32)
    _thd(out, "out", shape)
    if not out.flags.writeable:
        raise ValueError("full_attention: out is read-only")
    if np.shares_memory(out, q) or np.shares_memory(out, k) or np.shares_memory(out, v):
        raise ValueError("full_attention: out must not overlap q, k or v")
    if T == 0 or nh == 0 or hd == 0:
        return out
    cdef const float[:, :, ::1] qv = q
    cdef const float[:, :, ::1] kv = k
    cdef const float[:, :, ::1] vv = v
    cdef float[:, :, ::1] ov = out
    with nogil:
        ellm_full_attention(&qv[0, 0, 0], &kv[0, 0, 0], &vv[0, 0, 0], &ov[0, 0, 0], T, nh, hd, seq_len,
                            <float>scale)
    return out
