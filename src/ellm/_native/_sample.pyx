# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin typed shims over csrc/sample.c: top-k selection, exp-sums, inverse-CDF draws and
the grammar mask over one row of float32 logits. See csrc/sample.h for the exact weight
definition and the mask layout."""

from libc.stdint cimport int32_t, int64_t, uint32_t


cdef extern from "sample.h":
    int64_t ellm_topk_f32(const float *x, int64_t n, int64_t k, int32_t *idx, float *val,
                          int64_t cap) nogil
    double ellm_expsum_f32(const float *x, int64_t n, float mx, float scale, float lo) nogil
    int64_t ellm_draw_f32(const float *x, int64_t n, float mx, float scale, float lo,
                          double target) nogil
    void ellm_mass_hist_f32(const float *x, int64_t n, float mx, float scale, float lo,
                            float span, int64_t nbins, double *hist) nogil
    int64_t ellm_bin_collect_f32(const float *x, int64_t n, float mx, float scale, float lo,
                                 float span, int64_t nbins, int64_t bin, int32_t *idx,
                                 float *val, float *w, int64_t cap) nogil
    int64_t ellm_mask_apply_f32(float *x, int64_t n, const uint32_t *bits, int64_t nwords) nogil


def topk(const float[::1] x, Py_ssize_t k, int32_t[::1] idx, float[::1] val) -> int:
    """Writes the k largest entries of x (n,) into idx[:k] / val[:k], by value descending
    then index ascending; NaNs skipped. Returns how many were written. The buffers are
    scratch beyond that; at 4k or more entries the kernel can pre-filter (much faster
    for k >= 64 on a large vocabulary)."""
    cdef Py_ssize_t n = x.shape[0]
    cdef Py_ssize_t cap = min(idx.shape[0], val.shape[0])
    if k < 0:
        raise ValueError(f"topk: k must be >= 0, got {k}")
    if cap < k:
        raise ValueError(f"topk: output buffers hold {cap} < k={k}")
    if n > 2147483647:
        raise ValueError("topk: more than 2**31-1 entries")
    if n == 0 or k == 0:
        return 0
    cdef int64_t got
    with nogil:
        got = ellm_topk_f32(&x[0], n, k, &idx[0], &val[0], cap)
    return got


def expsum(const float[::1] x, float mx, float scale, float lo) -> float:
    """Sum over x (n,) of exp((x - mx) * scale) where x >= lo (see sample.h)."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return 0.0
    cdef double s
    with nogil:
        s = ellm_expsum_f32(&x[0], n, mx, scale, lo)
    return s


def draw(const float[::1] x, float mx, float scale, float lo, double target) -> int:
    """First index whose running weight sum exceeds target (see sample.h); -1 if all
    weights are 0."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return -1
    cdef int64_t i
    with nogil:
        i = ellm_draw_f32(&x[0], n, mx, scale, lo, target)
    return i


def mass_hist(const float[::1] x, float mx, float scale, float lo, float span,
              double[::1] hist) -> None:
    """Overwrites hist (nbins,) with the weight mass of each exponent bin over (-span, 0]
    (see sample.h)."""
    cdef Py_ssize_t n = x.shape[0], nbins = hist.shape[0]
    if nbins == 0:
        raise ValueError("mass_hist: hist is empty")
    with nogil:
        ellm_mass_hist_f32(&x[0] if n else NULL, n, mx, scale, lo, span, nbins, &hist[0])


def bin_collect(const float[::1] x, float mx, float scale, float lo, float span,
                Py_ssize_t nbins, Py_ssize_t bin, int32_t[::1] idx, float[::1] val,
                float[::1] w) -> int:
    """Writes the entries of histogram bin `bin` (ids, logits, weights) in index order;
    returns the count, or -1 when the buffers are too small."""
    cdef Py_ssize_t n = x.shape[0]
    cdef Py_ssize_t cap = min(idx.shape[0], val.shape[0], w.shape[0])
    if not 0 <= bin < nbins:
        raise ValueError(f"bin_collect: bin {bin} outside 0..{nbins - 1}")
    if n > 2147483647:
        raise ValueError("bin_collect: more than 2**31-1 entries")
    if n == 0:
        return 0
    # Empty buffers still need valid pointers; with cap 0 the kernel never writes.
    cdef int32_t no_idx = 0
    cdef float no_val = 0, no_w = 0
    cdef int32_t *pi = &idx[0] if cap else &no_idx
    cdef float *pv = &val[0] if cap else &no_val
    cdef float *pw = &w[0] if cap else &no_w
    cdef int64_t c
    with nogil:
        c = ellm_bin_collect_f32(&x[0], n, mx, scale, lo, span, nbins, bin, pi, pv, pw, cap)
    return c


def mask_apply(float[::1] x, const int32_t[::1] bits) -> int:
    """Sets x[i] = -inf wherever bit i of bits is 0 (token i is bit i % 32 of word i // 32,
    llguidance's int32 bitmask rows), and past the mask's end; returns how many entries of
    x are allowed."""
    cdef Py_ssize_t n = x.shape[0], nwords = bits.shape[0]
    if n == 0:
        return 0
    cdef int32_t no_bits = 0
    cdef const uint32_t *pb = <const uint32_t *>(&bits[0] if nwords else &no_bits)
    cdef int64_t allowed
    with nogil:
        allowed = ellm_mask_apply_f32(&x[0], n, pb, nwords)
    return allowed


# csrc/ is one shared library: the SIMD level is process-wide and _core owns its API.
# Re-exported so callers and tests may reach it from any kernel module.
from ._core import set_simd_level, simd_level  # noqa: E402,F401

