# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Thin typed shims over csrc/: the thread pool, fused RoPE + paged attention, and the
elementwise kernels (RMSNorm, residual add + RMSNorm, SwiGLU / GeGLU, add, scale, softcap).

Every array is float32 (int32 for indices); nothing is converted silently: a wrong dtype,
shape or layout is a ValueError naming the argument. Matrices are (rows, n) with
contiguous rows and any row stride, so column slices of a wider buffer work without a
copy. The GIL is released while the C kernels run.
"""

import math
import threading

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint16_t, uintptr_t
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport usleep


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()
    int pthread_equal(pthread_t a, pthread_t b)


cdef extern from "threadpool.h":
    ctypedef void (*ellm_task_fn)(void *ctx, int64_t begin, int64_t end, int thread_id) noexcept nogil
    void ellm_parallel_for(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx) nogil
    void ellm_parallel_for_threads(int64_t n, int64_t grain, int max_threads, ellm_task_fn fn,
                                   void *ctx) nogil
    void ellm_parallel_for_regions(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx) nogil
    int ellm_num_threads() nogil
    void ellm_set_num_threads(int n) nogil
    int ellm_cpu_count() nogil
    int ellm_set_spin_us(int us) nogil
    int ellm_in_parallel_region() nogil


from _csrc cimport (ellm_add, ellm_add_rmsnorm, ellm_attn_args, ellm_exp_row, ellm_geglu, ellm_rmsnorm,
                    ellm_rope_attention, ellm_rope_attention_scratch_floats,
                    ellm_rope_attention_scratch_wanted, ellm_scale, ellm_softcap, ellm_swiglu, ellm_tanh_row)


# ================================ thread pool ================================

def set_num_threads(int n) -> None:
    """Threads every kernel uses (the caller included); n <= 0 means all CPUs this
    process may use (its affinity mask). Takes effect at the next parallel call."""
    ellm_set_num_threads(n)


def num_threads() -> int:
    return ellm_num_threads()


def cpu_count() -> int:
    """CPUs this process may run on (sched_getaffinity)."""
    return ellm_cpu_count()


def set_spin_us(int us) -> int:
    """How long idle workers spin before sleeping (µs, default 200); returns the old value."""
    return ellm_set_spin_us(us)


# ================================ SIMD level ================================
# csrc/ is one shared library: the SIMD level is process-wide and _core owns its API.
# Re-exported so callers and tests may reach it from any kernel module.
from ._core import set_simd_level, simd_level  # noqa: E402,F401


# ============================ argument checking ============================

cdef const float[:, :] _in2(object a, str fn, str name) except *:
    """A read-only (rows, n) float32 view with contiguous rows; N-D C-contiguous arrays are
    viewed as (-1, last axis), 1-D as one row."""
    cdef const float[:, :] mv
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{fn}: {name} must be a numpy float32 array, got {type(a).__name__}")
    if a.ndim != 2:
        if a.ndim == 0 or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be 2-D (rows, n) or C-contiguous, got shape {a.shape}")
        a = a.reshape(-1, a.shape[a.ndim - 1])
    try:
        mv = a
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: {name} must be float32, got {a.dtype} ({e})") from None
    if mv.shape[1] > 1 and mv.strides[1] != 4:
        raise ValueError(f"{fn}: {name} needs contiguous rows (inner stride {mv.strides[1]} bytes)")
    if mv.strides[0] % 4 != 0:
        raise ValueError(f"{fn}: {name} row stride {mv.strides[0]} is not a multiple of 4 bytes")
    return mv


cdef float[:, :] _out2(object a, str fn, str name, Py_ssize_t rows, Py_ssize_t n) except *:
    """Like _in2 for a writable array, which must have the shape (rows, n) once viewed."""
    cdef float[:, :] mv
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{fn}: {name} must be a numpy float32 array, got {type(a).__name__}")
    if a.ndim != 2:
        if a.ndim == 0 or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be 2-D (rows, n) or C-contiguous, got shape {a.shape}")
        a = a.reshape(-1, a.shape[a.ndim - 1])
    try:
        mv = a
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: {name} must be a writable float32 array, got {a.dtype} ({e})") from None
    if mv.shape[0] != rows or mv.shape[1] != n:
        raise ValueError(f"{fn}: {name} has shape ({mv.shape[0]}, {mv.shape[1]}) as rows, expected ({rows}, {n})")
    if mv.shape[1] > 1 and mv.strides[1] != 4:
        raise ValueError(f"{fn}: {name} needs contiguous rows (inner stride {mv.strides[1]} bytes)")
    if mv.strides[0] % 4 != 0:
        raise ValueError(f"{fn}: {name} row stride {mv.strides[0]} is not a multiple of 4 bytes")
    return mv


cdef inline int64_t _ld(Py_ssize_t stride_bytes) noexcept nogil:
    return stride_bytes // 4


cdef inline void _same_rows(Py_ssize_t r, Py_ssize_t n, Py_ssize_t r2, Py_ssize_t n2, str fn, str a, str b) except *:
    if r != r2 or n != n2:
        raise ValueError(f"{fn}: {a} ({r}, {n}) and {b} ({r2}, {n2}) differ in shape")


cdef float[:, :] _inplace2(object x, str fn, str name="x") except *:
    """A writable (rows, n) view of x, whatever its shape (see _in2)."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{fn}: {name} must be a numpy float32 array, got {type(x).__name__}")
    if x.ndim == 2:
        return _out2(x, fn, name, x.shape[0], x.shape[1])
    if x.ndim == 0:
        raise ValueError(f"{fn}: {name} must have at least one axis")
    return _out2(x, fn, name, x.size // max(x.shape[x.ndim - 1], 1), x.shape[x.ndim - 1])


# ============================ elementwise kernels ============================

def rmsnorm(x, weight, double eps, out=None):
    """RMSNorm over the last axis: out = x / sqrt(mean(x^2) + eps) * weight.

    x (R, H) float32 (or any C-contiguous (..., H)), weight (H,) float32,
    out (R, H) float32 or None (allocated). out may be x itself. Returns out."""
    cdef const float[:, :] xv = _in2(x, "rmsnorm", "x")
    cdef const float[::1] wv
    try:
        wv = weight
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"rmsnorm: weight must be a contiguous 1-D float32 array ({e})") from None
    cdef Py_ssize_t R = xv.shape[0], H = xv.shape[1]
    if wv.shape[0] != H:
        raise ValueError(f"rmsnorm: weight has {wv.shape[0]} elements, x rows have {H}")
    if out is None:
        out = np.empty(np.shape(x), np.float32)
    cdef float[:, :] ov = _out2(out, "rmsnorm", "out", R, H)
    if R == 0 or H == 0:
        return out
    with nogil:
        ellm_rmsnorm(&xv[0, 0], _ld(xv.strides[0]), &wv[0], <float>eps, &ov[0, 0], _ld(ov.strides[0]), R, H)
    return out


def add_rmsnorm(residual, x, weight, double eps, out=None):
    """The residual add fused with the next RMSNorm: residual += x (in place), then
    out = rmsnorm(residual, weight, eps).

    residual (R, H) float32 (modified), x (R, H) float32, weight (H,) float32,
    out (R, H) float32 or None (allocated); out may be x but not residual. Returns out."""
    cdef float[:, :] rv = _inplace2(residual, "add_rmsnorm", "residual")
    cdef const float[:, :] xv = _in2(x, "add_rmsnorm", "x")
    cdef const float[::1] wv
    try:
        wv = weight
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"add_rmsnorm: weight must be a contiguous 1-D float32 array ({e})") from None
    cdef Py_ssize_t R = rv.shape[0], H = rv.shape[1]
    _same_rows(R, H, xv.shape[0], xv.shape[1], "add_rmsnorm", "residual", "x")
    if wv.shape[0] != H:
        raise ValueError(f"add_rmsnorm: weight has {wv.shape[0]} elements, rows have {H}")
    if out is None:
        out = np.empty(np.shape(residual), np.float32)
    cdef float[:, :] ov = _out2(out, "add_rmsnorm", "out", R, H)
    if R == 0 or H == 0:
        return out
    if &ov[0, 0] == &rv[0, 0]:
        raise ValueError("add_rmsnorm: out must not be residual (residual keeps the un-normalized sum)")
    with nogil:
        ellm_add_rmsnorm(&rv[0, 0], _ld(rv.strides[0]), &xv[0, 0], _ld(xv.strides[0]), &wv[0], <float>eps,
                         &ov[0, 0], _ld(ov.strides[0]), R, H)
    return out


cdef _gated(int which, gate, up, out):
    cdef str fn = "swiglu" if which == 0 else "geglu"
    cdef const float[:, :] gv = _in2(gate, fn, "gate")
    cdef const float[:, :] uv = _in2(up, fn, "up")
    cdef Py_ssize_t R = gv.shape[0], F = gv.shape[1]
    _same_rows(R, F, uv.shape[0], uv.shape[1], fn, "gate", "up")
    if out is None:
        out = np.empty((R, F) if np.ndim(gate) == 2 else np.shape(gate), np.float32)
    cdef float[:, :] ov = _out2(out, fn, "out", R, F)
    if R == 0 or F == 0:
        return out
    with nogil:
        if which == 0:
            ellm_swiglu(&gv[0, 0], _ld(gv.strides[0]), &uv[0, 0], _ld(uv.strides[0]), &ov[0, 0],
                        _ld(ov.strides[0]), R, F)
        else:
            ellm_geglu(&gv[0, 0], _ld(gv.strides[0]), &uv[0, 0], _ld(uv.strides[0]), &ov[0, 0],
                       _ld(ov.strides[0]), R, F)
    return out


def swiglu(gate, up, out=None):
    """Llama MLP activation: out = silu(gate) * up = gate / (1 + exp(-gate)) * up.

    gate (R, F), up (R, F) float32 -- e.g. the two column halves of a fused (R, 2F)
    projection, passed as views -- out (R, F) float32 or None (allocated); out may be
    gate or up. Returns out."""
    return _gated(0, gate, up, out)


def geglu(gate, up, out=None):
    """Gemma MLP activation: out = gelu_tanh(gate) * up. Shapes as swiglu. Returns out."""
    return _gated(1, gate, up, out)


def add(a, b):
    """a += b in place. a (R, H) float32 writable, b (R, H) float32. Returns a."""
    cdef float[:, :] av = _inplace2(a, "add", "a")
    cdef const float[:, :] bv = _in2(b, "add", "b")
    _same_rows(av.shape[0], av.shape[1], bv.shape[0], bv.shape[1], "add", "a", "b")
    if av.shape[0] == 0 or av.shape[1] == 0:
        return a
    with nogil:
        ellm_add(&av[0, 0], _ld(av.strides[0]), &bv[0, 0], _ld(bv.strides[0]), av.shape[0], av.shape[1])
    return a


def scale_(x, double s):
    """x *= s in place. x (R, H) (or C-contiguous N-D) float32. Returns x."""
    cdef float[:, :] xv = _inplace2(x, "scale_")
    if xv.shape[0] == 0 or xv.shape[1] == 0:
        return x
    with nogil:
        ellm_scale(&xv[0, 0], _ld(xv.strides[0]), <float>s, xv.shape[0], xv.shape[1])
    return x


def softcap_(x, double cap):
    """x = cap * tanh(x / cap) in place (cap <= 0: unchanged). x (R, H) (or C-contiguous
    N-D) float32. Returns x."""
    cdef float[:, :] xv = _inplace2(x, "softcap_")
    if xv.shape[0] == 0 or xv.shape[1] == 0 or not cap > 0:
        return x
    with nogil:
        ellm_softcap(&xv[0, 0], _ld(xv.strides[0]), <float>cap, xv.shape[0], xv.shape[1])
    return x


def fast_exp(const float[::1] x, float[::1] out=None):
    """exp on (n,) float32 with the kernels' vector exp (for tests). Returns out."""
    if out is None:
        out = np.empty(x.shape[0], np.float32)
    if out.shape[0] != x.shape[0]:
        raise ValueError("fast_exp: out and x differ in length")
    if x.shape[0]:
        with nogil:
            ellm_exp_row(&x[0], &out[0], x.shape[0])
    return np.asarray(out)


def fast_tanh(const float[::1] x, float[::1] out=None):
    """tanh on (n,) float32 with the kernels' vector tanh (for tests). Returns out."""
    if out is None:
        out = np.empty(x.shape[0], np.float32)
    if out.shape[0] != x.shape[0]:
        raise ValueError("fast_tanh: out and x differ in length")
    if x.shape[0]:
        with nogil:
            ellm_tanh_row(&x[0], &out[0], x.shape[0])
    return np.asarray(out)


# ============================ RoPE + paged attention ============================

# One grow-only scratch buffer reused across calls (decode calls this once per layer per
# token); a concurrent call from another Python thread finds it taken and allocates its own.
cdef object _scratch = np.empty(0, np.float32)
_scratch_lock = threading.Lock()


def attention_scratch_bytes(Py_ssize_t T, int nh, int nkv, int hd, int threads=0) -> int:
    """Bytes of scratch that always suffice for rope_attention on T tokens (threads <= 0:
    the pool's count). A small batch at long positions may use more, when given it, to
    spread each token's keys over threads; the result is the same either way."""
    if threads <= 0:
        threads = ellm_num_threads()
    return 4 * ellm_rope_attention_scratch_floats(T, nh, nkv, hd, threads)


cdef void _check_rows3(const float[:, :, :] a, str name, Py_ssize_t nheads, Py_ssize_t hd) except *:
    """(T, nheads, hd) with each token's heads contiguous; the token stride is free."""
    if a.shape[1] != nheads or a.shape[2] != hd:
        raise ValueError(f"rope_attention: {name} has shape ({a.shape[0]}, {a.shape[1]}, {a.shape[2]}), "
                         f"expected (T, {nheads}, {hd})")
    if (hd > 1 and a.strides[2] != 4) or (nheads > 1 and a.strides[1] != 4 * hd):
        raise ValueError(f"rope_attention: {name} must have each token's (heads, head_dim) block contiguous")
    if a.shape[0] > 1 and (a.strides[0] % 4 != 0 or a.strides[0] < 4 * nheads * hd):
        raise ValueError(f"rope_attention: {name} token stride {a.strides[0]} bytes overlaps or is misaligned")


def rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache, inv_freq,
                   bint interleaved, double scale, int window=0, double softcap=0.0, out=None,
                   scratch=None, double rope_mscale=1.0, key_limit=None):
    """RoPE on q and k, k/v written into the paged cache, then causal attention
    (reference.rope_attention).

    q (T, nh, hd), k (T, nkv, hd), v (T, nkv, hd) float32; each token's heads contiguous,
        any token stride (views into a fused QKV projection work);
    positions (T,) int32, seq_ids (T,) int32 (rows of block_tables);
    block_tables (B, max_blocks) int32, -1 where unused;
    k_cache, v_cache (num_blocks, block_size, nkv, hd) float32 C-contiguous, written in place;
        or both float16: K and V are stored rounded to f16 and read back exactly (head_dim
        <= 256, nkv * head_dim <= 8192);
    inv_freq (n_rot,) float32, 0 <= n_rot <= hd/2: dims [0, 2 n_rot) of each head rotate and
        the rest pass through (partial rotary; n_rot = hd/2 is full RoPE);
    interleaved: pairs (2i, 2i+1) instead of (i, i + n_rot);
    rope_mscale multiplies cos and sin (longrope's attention factor; 1.0 for plain RoPE);
    scale on q.k; window > 0: a token at p sees positions > p - window;
    softcap > 0: scores = softcap * tanh(scores / softcap);
    key_limit (T,) int32 or None: the last position each token sees, >= its own (an image
        token seeing its whole image); None is causal;
    out (T, nh, hd) float32 C-contiguous or None (allocated); must not overlap the caches.
    scratch: optional float32 buffer of at least attention_scratch_bytes(T, nh, nkv, hd, 1) / 4
    elements; by default an internal one is reused (and grown as the call wants). Returns out.

    Batch-invariant: a token's output row is bit-identical whatever else is in the call
    (other sequences, other tokens of its own), whatever the thread count or scratch
    size, and whether its k/v were cached in this call or an earlier one.

    q, k and v are left as they are: q is rotated into the scratch buffer, k straight into
    its cache slot. Every sequence id, position and block-table entry the call would follow
    is checked first; a bad one raises ValueError and nothing is written."""
    cdef str fn = "rope_attention"
    cdef const float[:, :, :] qv, kv, vv
    cdef const int32_t[::1] pv, sv, lv
    cdef const int32_t[:, ::1] bt
    cdef float[:, :, :, ::1] kc, vc
    cdef uint16_t[:, :, :, ::1] kc16, vc16
    cdef Py_ssize_t[4] ks, vs   # the caches' shapes
    cdef uintptr_t k0, v0, elem_bytes
    cdef int i
    cdef const float[::1] fv
    cdef float[:, :, ::1] ov
    cdef float[::1] scr
    try:
        qv = q
        kv = k
        vv = v
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: q, k, v must be 3-D float32 arrays (T, heads, head_dim) ({e})") from None
    try:
        pv = positions
        sv = seq_ids
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: positions and seq_ids must be contiguous 1-D int32 arrays ({e})") from None
    if key_limit is not None:
        try:
            lv = key_limit
        except (ValueError, TypeError, BufferError) as e:
            raise ValueError(f"{fn}: key_limit must be a contiguous 1-D int32 array or None ({e})") from None
    try:
        bt = block_tables
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: block_tables must be a C-contiguous 2-D int32 array ({e})") from None
    cdef bint half = isinstance(k_cache, np.ndarray) and k_cache.dtype == np.float16
    try:
        if half:   # f16 caches: their bits, as uint16
            if not (isinstance(v_cache, np.ndarray) and v_cache.dtype == np.float16):
                raise ValueError("k_cache is float16, v_cache is not")
            kc16 = k_cache.view(np.uint16)
            vc16 = v_cache.view(np.uint16)
            elem_bytes = 2
            for i in range(4):
                ks[i], vs[i] = kc16.shape[i], vc16.shape[i]
        else:
            kc = k_cache
            vc = v_cache
            elem_bytes = 4
            for i in range(4):
                ks[i], vs[i] = kc.shape[i], vc.shape[i]
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: k_cache and v_cache must be writable C-contiguous 4-D float32 (or both "
                         f"float16) arrays (num_blocks, block_size, nkv, head_dim) ({e})") from None
    try:
        fv = inv_freq
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: inv_freq must be a contiguous 1-D float32 array ({e})") from None

    cdef Py_ssize_t T = qv.shape[0], nh = qv.shape[1], hd = qv.shape[2], nkv = kv.shape[1]
    if nh < 1 or nkv < 1 or nh % nkv != 0:
        raise ValueError(f"{fn}: q has {nh} heads, k has {nkv}: need a positive multiple")
    if hd < 2 or hd % 2 != 0 or hd > 65536:
        raise ValueError(f"{fn}: head_dim must be even, got {hd}")
    _check_rows3(qv, "q", nh, hd)
    _check_rows3(kv, "k", nkv, hd)
    _check_rows3(vv, "v", nkv, hd)
    if kv.shape[0] != T or vv.shape[0] != T or pv.shape[0] != T or sv.shape[0] != T:
        raise ValueError(f"{fn}: q has {T} tokens but k {kv.shape[0]}, v {vv.shape[0]}, positions "
                         f"{pv.shape[0]}, seq_ids {sv.shape[0]}")
    if key_limit is not None and lv.shape[0] != T:
        raise ValueError(f"{fn}: key_limit has {lv.shape[0]} elements, q has {T} tokens")
    if (ks[0] != vs[0] or ks[1] != vs[1] or ks[2] != nkv or vs[2] != nkv or ks[3] != hd or vs[3] != hd):
        raise ValueError(f"{fn}: k_cache {tuple(np.shape(k_cache))} and v_cache {tuple(np.shape(v_cache))} must "
                         f"both be (num_blocks, block_size, {nkv}, {hd})")
    if ks[1] > 2**31 - 1 or bt.shape[1] > 2**31 - 1:
        raise ValueError(f"{fn}: block_size / max_blocks too large")
    if fv.shape[0] > hd // 2:
        raise ValueError(f"{fn}: inv_freq has {fv.shape[0]} elements, more than head_dim/2 = {hd // 2}")
    if not math.isfinite(rope_mscale):
        raise ValueError(f"{fn}: rope_mscale must be finite, got {rope_mscale}")
    if out is None:
        out = np.empty((T, nh, hd), np.float32)
    try:
        ov = out
    except (ValueError, TypeError, BufferError) as e:
        raise ValueError(f"{fn}: out must be a writable C-contiguous float32 array (T, nh, hd) ({e})") from None
    if ov.shape[0] != T or ov.shape[1] != nh or ov.shape[2] != hd:
        raise ValueError(f"{fn}: out has shape {tuple(np.shape(out))}, expected ({T}, {nh}, {hd})")
    if T == 0:
        return out
    if ks[0] == 0 or ks[1] == 0 or bt.shape[0] == 0 or bt.shape[1] == 0:
        raise ValueError(f"{fn}: empty cache or block table")
    # out is written while the caches are read: they must not share memory
    cdef uintptr_t o0 = <uintptr_t>&ov[0, 0, 0], o1 = o0 + 4 * <uintptr_t>(T * nh * hd)
    cdef uintptr_t cache_bytes = elem_bytes * <uintptr_t>(ks[0] * ks[1] * nkv * hd)
    if half:
        k0, v0 = <uintptr_t>&kc16[0, 0, 0, 0], <uintptr_t>&vc16[0, 0, 0, 0]
    else:
        k0, v0 = <uintptr_t>&kc[0, 0, 0, 0], <uintptr_t>&vc[0, 0, 0, 0]
    if (o0 < k0 + cache_bytes and k0 < o1) or (o0 < v0 + cache_bytes and v0 < o1):
        raise ValueError(f"{fn}: out overlaps k_cache or v_cache")
    if k0 < v0 + cache_bytes and v0 < k0 + cache_bytes:
        raise ValueError(f"{fn}: k_cache and v_cache overlap")

    cdef ellm_attn_args a
    a.q = &qv[0, 0, 0]
    a.k = &kv[0, 0, 0]
    a.v = &vv[0, 0, 0]
    a.q_stride = qv.strides[0] // 4 if T > 1 else nh * hd
    a.k_stride = kv.strides[0] // 4 if T > 1 else nkv * hd
    a.v_stride = vv.strides[0] // 4 if T > 1 else nkv * hd
    a.positions = &pv[0]
    a.seq_ids = &sv[0]
    a.key_limit = &lv[0] if key_limit is not None else NULL
    a.block_tables = &bt[0, 0]
    a.k_cache = NULL if half else &kc[0, 0, 0, 0]
    a.v_cache = NULL if half else &vc[0, 0, 0, 0]
    a.k_cache16 = &kc16[0, 0, 0, 0] if half else NULL
    a.v_cache16 = &vc16[0, 0, 0, 0] if half else NULL
    a.inv_freq = &fv[0] if fv.shape[0] else NULL
    a.n_rot = <int32_t>fv.shape[0]
    a.rope_mscale = <float>rope_mscale
    a.out = &ov[0, 0, 0]
    a.T = T
    a.B = bt.shape[0]
    a.max_blocks = bt.shape[1]
    a.num_blocks = ks[0]
    a.nh = <int32_t>nh
    a.nkv = <int32_t>nkv
    a.hd = <int32_t>hd
    a.block_size = <int32_t>ks[1]
    a.interleaved = 1 if interleaved else 0
    a.window = window
    a.scale = <float>scale
    a.softcap = <float>softcap if softcap > 0 else 0.0
    if window < 0:
        raise ValueError(f"{fn}: window must be >= 0, got {window}")

    global _scratch
    cdef int64_t need = ellm_rope_attention_scratch_wanted(&a, ellm_num_threads())
    cdef int64_t least = ellm_rope_attention_scratch_floats(T, a.nh, a.nkv, a.hd, 1)
    cdef char err[512]
    cdef int rc
    cdef bint locked = False
    if scratch is not None:
        try:
            scr = scratch
        except (ValueError, TypeError, BufferError) as e:
            raise ValueError(f"{fn}: scratch must be a writable contiguous 1-D float32 array ({e})") from None
    elif _scratch_lock.acquire(False):
        locked = True
        if (<object>_scratch).shape[0] < need:
            _scratch = np.empty(need, np.float32)
        scr = _scratch
    else:
        scr = np.empty(need, np.float32)
    try:
        if scr.shape[0] < least:
            raise ValueError(f"{fn}: scratch has {scr.shape[0]} floats, needs at least {least}")
        with nogil:
            rc = ellm_rope_attention(&a, &scr[0], scr.shape[0], err, sizeof(err))
    finally:
        if locked:
            _scratch_lock.release()
    if rc != 0:
        raise ValueError(f"{fn}: {err.decode('utf-8', 'replace')}")
    return out


# ============================ pool self-test (tests) ============================

ctypedef struct _check_ctx:
    int32_t *counts      # (n,) visits per index
    int32_t *tids        # (n,) thread that visited each index
    int32_t *nested      # (n,) visits per index by the nested call, or NULL
    int32_t *nested_ok   # (n,) 1 where the nested call ran on the outer thread, inside a region
    int64_t grain
    int32_t *oversize    # set when a chunk was larger than grain or a thread id out of range
    int64_t work_ns      # busy time per chunk
    int threads


cdef struct _nested_ctx:
    _check_ctx *outer
    int64_t base
    pthread_t thread


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000 + ts.tv_nsec


cdef void _nested_task(void *p, int64_t b, int64_t e, int tid) noexcept nogil:
    cdef _nested_ctx *c = <_nested_ctx *>p
    cdef int64_t i
    for i in range(b, e):
        c.outer.nested[c.base + i] += 1
        c.outer.nested_ok[c.base + i] = 1 if (tid == 0 and pthread_equal(pthread_self(), c.thread)
                                               and ellm_in_parallel_region()) else 0


cdef void _check_task(void *p, int64_t b, int64_t e, int tid) noexcept nogil:
    cdef _check_ctx *c = <_check_ctx *>p
    cdef int64_t i, t0
    cdef _nested_ctx nc
    if e - b > c.grain or tid < 0 or tid >= c.threads:
        c.oversize[0] = 1
    for i in range(b, e):
        c.counts[i] += 1
        c.tids[i] = tid
    if c.nested != NULL:
        nc.outer = c
        nc.base = b
        nc.thread = pthread_self()
        ellm_parallel_for(e - b, 1, _nested_task, &nc)
    if c.work_ns > 0:
        t0 = _now_ns()
        while _now_ns() - t0 < c.work_ns:
            pass


def pool_selftest(int64_t n, int64_t grain, bint nested=False, int64_t work_ns=0, int max_threads=0,
                  bint regions=False):
    """Runs parallel_for_threads(n, grain, max_threads) with a task that records which
    thread visited each index (each chunk then stays busy for work_ns).

    Returns (counts, tids, nested_counts, nested_ok, bad) as numpy arrays / bool: counts (n,)
    visits per index (all 1 if correct), tids (n,) the visiting thread's id, and for
    nested=True the visits made by a parallel_for nested in each chunk and whether it ran
    serially on the same thread; bad is True if a chunk exceeded grain or a thread id was
    out of range. regions=True runs parallel_for_regions(n, grain) instead (max_threads
    unused). The GIL is released while it runs."""
    counts = np.zeros(max(n, 0), np.int32)
    tids = np.full(max(n, 0), -1, np.int32)
    ncounts = np.zeros(max(n, 0), np.int32)
    nok = np.zeros(max(n, 0), np.int32)
    bad = np.zeros(1, np.int32)
    cdef int32_t[::1] cv = counts, tv = tids, nv = ncounts, okv = nok, bv = bad
    cdef _check_ctx c
    c.counts = &cv[0] if n > 0 else NULL
    c.tids = &tv[0] if n > 0 else NULL
    c.nested = (&nv[0] if n > 0 else NULL) if nested else NULL
    c.nested_ok = &okv[0] if n > 0 else NULL
    c.grain = grain if grain > 0 else 1
    c.oversize = &bv[0]
    c.work_ns = work_ns
    c.threads = max_threads if max_threads > 0 else ellm_num_threads()
    with nogil:
        if regions:
            ellm_parallel_for_regions(n, grain, _check_task, &c)
        else:
            ellm_parallel_for_threads(n, grain, max_threads, _check_task, &c)
    return counts, tids, ncounts, nok, bool(bad[0])


cdef void _busy_task(void *p, int64_t b, int64_t e, int tid) noexcept nogil:
    cdef int64_t work = (<int64_t *>p)[0]
    cdef int64_t t0
    if work > 0:
        t0 = _now_ns()
        while _now_ns() - t0 < work:
            pass


def pool_dispatch_ns(int iters=1000, int64_t chunks=0, int64_t work_ns=0, int sleep_us=0):
    """Times `iters` calls of parallel_for(chunks, 1) whose chunks each stay busy work_ns
    (chunks <= 0: one per thread), sleeping sleep_us between calls (0: back to back, so
    workers are still spinning; > spin time: they are asleep). Returns (iters,) int64 ns."""
    if chunks <= 0:
        chunks = ellm_num_threads()
    res = np.zeros(max(iters, 0), np.int64)
    cdef int64_t[::1] rv = res
    cdef int64_t work = work_ns, t0
    cdef int i
    with nogil:
        for i in range(iters):
            if sleep_us > 0:
                usleep(sleep_us)
            t0 = _now_ns()
            ellm_parallel_for(chunks, 1, _busy_task, &work)
            rv[i] = _now_ns() - t0
    return res
