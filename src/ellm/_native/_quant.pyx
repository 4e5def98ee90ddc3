# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin typed shims over csrc/quant.h and csrc/matmul.h: dequantize GGML blocks, run
linear layers on weights as they lie in the file (one matrix, or several sharing an
input), gather embedding rows, quantize.

Every shape, dtype and byte length is checked here and turned into a ValueError before
any pointer reaches C; the C side checks again and its status becomes an exception.
The GIL is released around every kernel call.
"""

import threading

import numpy as np

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc


cdef extern from "quant.h":
    int64_t ellm_qtype_block_elems(int qtype) nogil
    int64_t ellm_qtype_block_bytes(int qtype) nogil
    int64_t ellm_row_bytes(int qtype, int64_t n) nogil
    const char *ellm_status_str(int status) nogil
    int ellm_dequantize(int qtype, const uint8_t *src, size_t src_bytes, float *dst, int64_t n) nogil
    int ellm_get_rows(int qtype, const uint8_t *w, size_t w_bytes, int64_t n_rows, int64_t k,
                      const int32_t *ids, int64_t n_ids, float *out) nogil
    int ellm_quantize_rows(int qtype, const float *src, int64_t n_rows, int64_t k, uint8_t *dst,
                           size_t dst_bytes) nogil
    int ellm_split_rows(int qtype, const uint8_t *src, size_t src_bytes, int64_t n_rows, int64_t k,
                        uint8_t *dst, size_t dst_bytes, int64_t dst_stride) nogil
    enum:
        ELLM_T_F32
        ELLM_T_F16
        ELLM_T_Q4_0
        ELLM_T_Q8_0
        ELLM_T_BF16
        ELLM_E_INDEX


from _csrc cimport (ELLM_LINEAR_MAX_PARTS, ellm_linear, ellm_linear_multi, ellm_linear_multi_scratch_bytes,
                    ellm_linear_part, ellm_linear_scratch_bytes)


cdef extern from "quant_impl.h":
    int ellm_cpu_has_vnni() nogil
cdef extern from "simd.h":
    int ellm_cpu_amd_family() nogil
    void ellm_cpu_set_amd_family(int f) nogil


cdef extern from "threadpool.h":
    int ellm_num_threads()
    void ellm_set_num_threads(int n)


# GGML type ids this module handles (as in ellm.formats.ggml_types.GGMLType)
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


cdef str _tname(int qtype):
    return TYPE_NAMES.get(qtype, f"type {qtype}")


cdef int _check_type(int qtype, str fn) except -1:
    if ellm_qtype_block_elems(qtype) == 0:
        raise ValueError(f"{fn}: unsupported GGML type id {qtype}; supported: "
                         f"{', '.join(f'{v}={k}' for k, v in TYPE_NAMES.items())}")
    return 0


cdef int _raise_status(int status, str fn) except -1:
    if status == 0:
        return 0
    msg = f"{fn}: {ellm_status_str(status).decode()}"
    if status == ELLM_E_INDEX:
        raise IndexError(msg)
    raise ValueError(msg)


def row_bytes(int qtype, int64_t n) -> int:
    """Bytes of one row of n elements of qtype; ValueError when n is not whole blocks."""
    _check_type(qtype, "row_bytes")
    cdef int64_t rb = ellm_row_bytes(qtype, n)
    if rb < 0:
        raise ValueError(f"row_bytes: {_tname(qtype)} rows need a non-negative multiple of "
                         f"{ellm_qtype_block_elems(qtype)} elements, got {n}")
    return rb


def has_vnni() -> bool:
    """Whether the AVX-512 kernels may use VNNI (vpdpbusd) on this CPU."""
    return bool(ellm_cpu_has_vnni())


def cpu_amd_family() -> int:
    """The CPU family of an AMD CPU (25: Zen 3 and 4, 26: Zen 5), 0 for other vendors: which
    decode kernels stream from DRAM (matmul.c: decode_kernel)."""
    return ellm_cpu_amd_family()


def set_cpu_amd_family(family) -> None:
    """Tests: decode takes the kernels chosen for an AMD CPU of this family (0: another
    vendor's) on this CPU, whichever it is (same bits, other speed); None asks the CPU again."""
    ellm_cpu_set_amd_family(-1 if family is None else int(family))


# csrc/ is one shared library: the SIMD level is process-wide and _core owns its API.
# Re-exported so callers and tests may reach it from any kernel module.
from ._core import set_simd_level, simd_level  # noqa: E402,F401


def num_threads() -> int:
    """Threads this module's kernels split work over."""
    return ellm_num_threads()


def set_num_threads(int n) -> None:
    """Sets this module's pool size; n <= 0 means every CPU this process may use."""
    ellm_set_num_threads(n)


# ------------------------------------------------------------------------------------
# Weights: any C-contiguous 2-D buffer (numpy array or mmap view), never copied
# ------------------------------------------------------------------------------------

cdef int _get_weights(object w, int qtype, int64_t k, str fn, Py_buffer *buf) except -1:
    """Acquires w's buffer into *buf and checks it is a (N, row) matrix of qtype with K
    columns. On success the caller must PyBuffer_Release(buf); on error it is released."""
    try:
        PyObject_GetBuffer(w, buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, TypeError) as e:
        raise ValueError(f"{fn}: w must be a C-contiguous 2-D array ({e})") from None
    try:
        _check_weights(buf, qtype, k, fn)
    except BaseException:
        PyBuffer_Release(buf)
        raise
    return 0


cdef str _fmt(Py_buffer *buf):
    return (<bytes>buf.format).decode() if buf.format != NULL else "B"


cdef int _check_weights(Py_buffer *buf, int qtype, int64_t k, str fn) except -1:
    if buf.ndim != 2:
        raise ValueError(f"{fn}: w must be 2-D, got {buf.ndim} dimensions")
    cdef int64_t rb = ellm_row_bytes(qtype, k)
    if rb < 0:
        raise ValueError(f"{fn}: K={k} is not a whole number of {_tname(qtype)} blocks "
                         f"({ellm_qtype_block_elems(qtype)} elements each)")
    # buffer-protocol format: one code, maybe after a byte-order mark that means native
    # order ('<', '=', '@': this builds for little-endian machines only)
    cdef const char *f = buf.format
    if f == NULL:
        f = "B"
    if f[0] == b'<' or f[0] == b'=' or f[0] == b'@':
        f += 1
    cdef char code = f[0]
    cdef bint one_code = f[0] != 0 and f[1] == 0
    cdef bint ok
    if qtype == ELLM_T_F32 or qtype == ELLM_T_F16 or qtype == ELLM_T_BF16:
        ok = one_code and (
            (qtype == ELLM_T_F32 and code == b'f' and buf.itemsize == 4) or
            (qtype != ELLM_T_F32 and (code == b'H' or (qtype == ELLM_T_F16 and code == b'e'))
             and buf.itemsize == 2))
        if not ok:
            dt = ("float32" if qtype == ELLM_T_F32 else "uint16 or float16" if qtype == ELLM_T_F16
                  else "uint16 (bf16 bits)")
            raise ValueError(f"{fn}: {_tname(qtype)} weights must be {dt}, got format "
                             f"{_fmt(buf)!r}")
        if buf.shape[1] != k:
            raise ValueError(f"{fn}: w has {buf.shape[1]} columns, expected K={k}")
    else:
        if not (one_code and buf.itemsize == 1 and (code == b'B' or code == b'b' or code == b'c')):
            raise ValueError(f"{fn}: {_tname(qtype)} weights must be uint8 rows of blocks, "
                             f"got format {_fmt(buf)!r}")
        if buf.shape[1] != rb:
            raise ValueError(f"{fn}: w rows are {buf.shape[1]} bytes; a {_tname(qtype)} row "
                             f"of K={k} elements is {rb} bytes")
    return 0


# ------------------------------------------------------------------------------------
# Scratch for the quantized activations (scratch.pxi: one buffer per Python thread)
# ------------------------------------------------------------------------------------

SCRATCH_USE = "activation"
include "scratch.pxi"


def scratch_bytes() -> int:
    """Bytes of activation scratch this thread holds (for tests and diagnostics)."""
    return _scratch().cap


# ------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------

def dequantize(const uint8_t[::1] raw not None, int qtype, float[::1] out not None) -> None:
    """(row_bytes(qtype, n),) uint8 blocks -> out: (n,) float32."""
    _check_type(qtype, "dequantize")
    cdef int64_t n = out.shape[0]
    cdef int64_t rb = ellm_row_bytes(qtype, n)
    if rb < 0:
        raise ValueError(f"dequantize: {n} elements is not a whole number of {_tname(qtype)} "
                         f"blocks ({ellm_qtype_block_elems(qtype)} elements each)")
    if raw.shape[0] != rb:
        raise ValueError(f"dequantize: {n} {_tname(qtype)} elements take {rb} bytes, "
                         f"got {raw.shape[0]}")
    if n == 0:
        return
    cdef int st
    with nogil:
        st = ellm_dequantize(qtype, &raw[0], <size_t>raw.shape[0], &out[0], n)
    _raise_status(st, "dequantize")


cdef const float *_bias_pointer(object bias, int64_t N, float *y, int64_t T, int64_t ldy,
                                str fn) except? NULL:
    """NULL for bias None, else a pointer into bias after checking it is (N,) float32,
    contiguous and apart from the output rows y (T, ldy) it is added to. The caller
    keeps bias alive while C reads it."""
    if bias is None:
        return NULL
    if not isinstance(bias, np.ndarray) or bias.dtype != np.float32 or bias.ndim != 1:
        raise ValueError(f"{fn}: bias must be a 1-D float32 array, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} "
                         f"{getattr(bias, 'shape', '')}")
    if bias.shape[0] != N:
        raise ValueError(f"{fn}: bias has {bias.shape[0]} elements, expected N={N}")
    if not bias.flags.c_contiguous:
        raise ValueError(f"{fn}: bias must be contiguous")
    if N == 0:
        return NULL
    cdef const float[::1] bv = bias
    cdef uintptr_t b0 = <uintptr_t>&bv[0], b1 = b0 + 4 * <uintptr_t>N
    cdef uintptr_t y0 = <uintptr_t>y, y1 = y0 + 4 * <uintptr_t>((T - 1) * ldy + N)
    if T > 0 and b0 < y1 and y0 < b1:
        raise ValueError(f"{fn}: bias overlaps the output")
    return &bv[0]


def linear(const float[:, ::1] x not None, w, int qtype, float[:, ::1] out not None,
           bias=None) -> None:
    """out (T, N) = x (T, K) . w^T (+ bias).

    w: (N, row_bytes(qtype, K)) uint8 blocks for quantized types; (N, K) float32 for F32;
    (N, K) uint16 (or float16) for F16; (N, K) uint16 bf16 bits for BF16.
    bias: None or (N,) float32, added to each output after its sum.
    Batch invariant: out[i] is bit-identical to linear(x[i:i+1], ...) for every i,
    whatever T, the row's position and the thread count.
    """
    _check_type(qtype, "linear")
    cdef int64_t T = x.shape[0], K = x.shape[1]
    cdef Py_buffer wb
    _get_weights(w, qtype, K, "linear", &wb)
    cdef int64_t N = wb.shape[0]
    cdef size_t need
    cdef _Scratch s
    cdef int st
    cdef const float *bp
    try:
        if out.shape[0] != T or out.shape[1] != N:
            raise ValueError(f"linear: out is ({out.shape[0]}, {out.shape[1]}), expected "
                             f"(T, N) = ({T}, {N})")
        if T == 0 or N == 0:
            _bias_pointer(bias, N, NULL, 0, N, "linear")  # still reject a wrong bias
            return
        bp = _bias_pointer(bias, N, &out[0, 0], T, N, "linear")
        need = ellm_linear_scratch_bytes(qtype, T, K)
        s = _scratch()
        s.reserve(need)
        with nogil:
            st = ellm_linear(qtype, &x[0, 0] if K else NULL, T, K, <const uint8_t *>wb.buf,
                             <size_t>wb.len, N, bp, &out[0, 0], s.ptr, s.cap)
    finally:
        PyBuffer_Release(&wb)
    _raise_status(st, "linear")


# the stack arrays in linear_multi hold this many parts
cdef enum:
    _MAX_PARTS = 16
assert ELLM_LINEAR_MAX_PARTS == _MAX_PARTS
MAX_PARTS = _MAX_PARTS


def linear_multi(const float[:, ::1] x not None, parts) -> None:
    """For each (w, qtype, out[, bias]) in parts: out (T, N_p) = x (T, K) . w^T (+ bias).

    Several weight matrices against one x (q, k, v; gate, up) in one call: x is
    quantized once and every matrix runs in one parallel pass over their concatenated
    output rows. Each out is bit-identical to linear(x, w, qtype, out), so batch
    invariant the same way. w as for linear; out: float32 (T, N_p) with unit column
    stride, rows at any stride >= N_p (a column slice of a wider array works, so q, k, v
    can land side by side in one buffer). 1 <= len(parts) <= MAX_PARTS; the outs must
    not overlap x or one another.
    """
    cdef int n = len(parts)
    if n < 1 or n > _MAX_PARTS:
        raise ValueError(f"linear_multi: 1 to {_MAX_PARTS} (w, qtype, out) parts, got {n}")
    cdef int64_t T = x.shape[0], K = x.shape[1]
    cdef Py_buffer wbufs[_MAX_PARTS]
    cdef ellm_linear_part cparts[_MAX_PARTS]
    cdef int acquired = 0, i, st = 0
    cdef size_t need
    cdef _Scratch s
    outs = []  # keeps the out views and biases alive while C writes through their pointers
    try:
        for i in range(n):
            _take_part(parts[i], i, T, K, "linear_multi", &wbufs[i], &cparts[i], outs)
            acquired += 1
        if T == 0:
            return
        need = ellm_linear_multi_scratch_bytes(cparts, n, T, K)
        s = _scratch()
        s.reserve(need)
        with nogil:
            st = ellm_linear_multi(&x[0, 0] if K else NULL, T, K, cparts, n, s.ptr, s.cap)
    finally:
        for i in range(acquired):
            PyBuffer_Release(&wbufs[i])
    _raise_status(st, "linear_multi")



cdef int _take_part(object part, int i, int64_t T, int64_t K, str fn, Py_buffer *wbuf,
                    ellm_linear_part *p, list keep) except -1:
    """Checks one (w, qtype, out[, bias]) part of a linear_multi call and fills p; acquires
    *wbuf only when every check has passed (the caller releases it). keep holds the out
    view and the bias alive while C writes through their pointers."""
    cdef float[:, :] o
    if not isinstance(part, tuple) or len(part) not in (3, 4):
        raise ValueError(f"{fn}: part {i} must be a (w, qtype, out) or (w, qtype, out, bias) tuple")
    w, qtype, out = part[:3]
    _check_type(qtype, fn)
    # [step] the part's name goes into a message only when a check fails (formatting it
    # for every part of every call cost more than the checks)
    try:
        _get_weights(w, qtype, K, fn, wbuf)
    except ValueError as e:
        raise ValueError(_part_message(e, fn, i)) from None
    try:
        try:
            o = out
        except (ValueError, TypeError, BufferError) as e:
            raise ValueError(f"{fn} part {i}: out must be a writable 2-D float32 array ({e})") from None
        bias = part[3] if len(part) == 4 else None
        p.qtype = qtype
        p.w = <const uint8_t *>wbuf.buf
        p.w_bytes = <size_t>wbuf.len
        p.N = wbuf.shape[0]
        _out_pointer(o, T, wbuf.shape[0], i, p)
        try:
            p.bias = _bias_pointer(bias, p.N, p.y, T if p.y else 0, p.ldy, fn)
        except ValueError as e:   # [step]
            raise ValueError(_part_message(e, fn, i)) from None
    except BaseException:
        PyBuffer_Release(wbuf)
        raise
    keep.append(o)
    keep.append(bias)
    return 0

cdef str _part_message(object e, str fn, int i):   # [step]
    """e's message ("fn: ...") as the check of part i says it ("fn part i: ...")."""
    msg = str(e)
    return f"{fn} part {i}" + msg[len(fn):] if msg.startswith(fn + ":") else msg


cdef int _out_pointer(float[:, :] o, int64_t T, int64_t N, int i,
                      ellm_linear_part *p) except -1:
    """Checks out is (T, N) with unit column stride and a row stride >= N floats; sets
    p.y / p.ldy."""
    if o.shape[0] != T or o.shape[1] != N:
        raise ValueError(f"linear_multi part {i}: out is ({o.shape[0]}, {o.shape[1]}), "
                         f"expected (T, N) = ({T}, {N})")
    p.y = NULL
    p.ldy = N
    if T == 0 or N == 0:
        return 0
    if N > 1 and o.strides[1] != sizeof(float):
        raise ValueError(f"linear_multi part {i}: out columns must be contiguous float32")
    if T > 1:
        if o.strides[0] % <Py_ssize_t>sizeof(float) or o.strides[0] < N * <Py_ssize_t>sizeof(float):
            raise ValueError(f"linear_multi part {i}: out rows must be at least N floats apart, "
                             f"in increasing order (row stride {o.strides[0]} bytes)")
        p.ldy = o.strides[0] // <Py_ssize_t>sizeof(float)
    p.y = &o[0, 0]
    return 0


def get_rows(w, int qtype, const int32_t[::1] ids not None, float[:, ::1] out not None) -> None:
    """out (len(ids), K) = rows `ids` of w dequantized (an embedding lookup); K = out.shape[1]."""
    _check_type(qtype, "get_rows")
    cdef int64_t K = out.shape[1], n_ids = ids.shape[0]
    cdef Py_buffer wb
    _get_weights(w, qtype, K, "get_rows", &wb)
    cdef int st
    try:
        if out.shape[0] != n_ids:
            raise ValueError(f"get_rows: out has {out.shape[0]} rows for {n_ids} ids")
        if n_ids == 0 or K == 0:
            return
        with nogil:
            st = ellm_get_rows(qtype, <const uint8_t *>wb.buf, <size_t>wb.len, wb.shape[0], K,
                               &ids[0], n_ids, &out[0, 0])
    finally:
        PyBuffer_Release(&wb)
    _raise_status(st, "get_rows")


def quantize(const float[:, ::1] x not None, int qtype):
    """(N, K) float32 -> (N, row_bytes(qtype, K)) uint8 blocks, for Q8_0 or Q4_0."""
    if qtype != ELLM_T_Q8_0 and qtype != ELLM_T_Q4_0:
        raise ValueError(f"quantize: only Q8_0 (8) and Q4_0 (2) are supported, got "
                         f"{_tname(qtype)}")
    cdef int64_t N = x.shape[0], K = x.shape[1]
    cdef int64_t rb = ellm_row_bytes(qtype, K)
    if rb < 0:
        raise ValueError(f"quantize: K={K} is not a multiple of 32")
    res = np.empty((N, rb), dtype=np.uint8)
    if N == 0 or K == 0:
        return res
    cdef uint8_t[:, ::1] dst = res
    cdef int st
    with nogil:
        st = ellm_quantize_rows(qtype, &x[0, 0], N, K, &dst[0, 0], <size_t>(N * rb))
    _raise_status(st, "quantize")
    return res


def split_rows(const uint8_t[:, ::1] src not None, int qtype, int64_t k, uint8_t[:, ::1] out not None) -> None:
    """out (N, stride >= row bytes) = the (N, row_bytes(qtype, k)) Q4_K (12), Q5_K (13) or
    Q6_K (14) rows src as the GPU keeps them (csrc/quant.h ellm_split_rows; ops/cuda.py
    rows_split), padding zero."""
    if qtype not in (12, 13, 14):
        raise ValueError(f"split_rows: only Q4_K (12), Q5_K (13) and Q6_K (14) are rearranged, "
                         f"got {_tname(qtype)}")
    cdef int64_t N = src.shape[0], rb = ellm_row_bytes(qtype, k), stride = out.shape[1]
    if rb < 0 or src.shape[1] != rb:
        raise ValueError(f"split_rows: rows of {src.shape[1]} bytes are not {_tname(qtype)} rows of "
                         f"{k} weights (K must be a multiple of 256)")
    if out.shape[0] != N or stride < rb:
        raise ValueError(f"split_rows: out is {tuple(out.shape)}, needs {N} rows of at "
                         f"least {rb} bytes")
    if N == 0:
        return
    cdef int st
    with nogil:
        st = ellm_split_rows(qtype, &src[0, 0], <size_t>(N * rb), N, k, &out[0, 0],
                             <size_t>(N * stride), stride)
    _raise_status(st, "split_rows")


# ================================ exact activations ================================

cdef extern from "matmul_exact.h":
    size_t ellm_linear_exact_scratch_bytes(int64_t K, int max_threads) nogil
    int ellm_linear_multi_exact(const float *x, int64_t T, int64_t K,
                                const ellm_linear_part *parts, int n_parts, void *scratch,
                                size_t scratch_bytes) nogil


def linear_multi_exact(const float[:, ::1] x not None, parts) -> None:
    """linear_multi (parts (w, qtype, out[, bias])) with f32 activations: quantized weights are dequantized a few rows at
    a time and multiplied by x as it is (no 8-bit rounding of x), so the result is the
    dequantized-f32 matmul up to float summation order. Same parts, checks and batch
    invariance as linear_multi; float weight types give linear_multi's values."""
    cdef int n = len(parts)
    if n < 1 or n > _MAX_PARTS:
        raise ValueError(f"linear_multi_exact: 1 to {_MAX_PARTS} (w, qtype, out) parts, got {n}")
    cdef int64_t T = x.shape[0], K = x.shape[1]
    cdef Py_buffer wbufs[_MAX_PARTS]
    cdef ellm_linear_part cparts[_MAX_PARTS]
    cdef int acquired = 0, i, st = 0
    cdef size_t need
    cdef _Scratch s
    outs = []  # keeps the out views and biases alive while C writes through their pointers
    try:
        for i in range(n):
            _take_part(parts[i], i, T, K, "linear_multi_exact", &wbufs[i], &cparts[i], outs)
            acquired += 1
        if T == 0:
            return
        need = ellm_linear_exact_scratch_bytes(K, ellm_num_threads())
        if need == 0 and K > 0:
            raise ValueError(f"linear_multi_exact: K={K} is too large")
        s = _scratch()
        s.reserve(need)
        with nogil:
            st = ellm_linear_multi_exact(&x[0, 0] if K else NULL, T, K, cparts, n, s.ptr, s.cap)
    finally:
        for i in range(acquired):
            PyBuffer_Release(&wbufs[i])
    _raise_status(st, "linear_multi_exact")
