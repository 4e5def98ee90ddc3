# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin typed shims over csrc/moe.h: top-k expert routing and the per-expert SwiGLU
matmuls of a mixture-of-experts layer (Qwen3-MoE).

An ExpertStack holds one pointer per expert into weights as they lie in the file (GGUF
3-D tensors, per-expert safetensors, row slices of a fused gate_up), checked once when it
is made. Every shape, dtype and id is checked before a pointer reaches C; the GIL is
released around the kernels.
"""

import threading

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc


cdef extern from "quant.h":
    int64_t ellm_qtype_block_elems(int qtype) nogil
    int64_t ellm_row_bytes(int qtype, int64_t n) nogil
    const char *ellm_status_str(int status) nogil
    enum:
        ELLM_T_F32
        ELLM_T_F16
        ELLM_T_BF16
        ELLM_E_INDEX


cdef extern from "moe.h":
    enum:
        ELLM_MOE_MAX_TOPK
    ctypedef struct ellm_expert_stack:
        int qtype
        int64_t N, K
        const uint8_t *const *w
    int ellm_moe_route(const float *logits, int64_t T, int32_t E, int32_t k, int norm_topk,
                       int32_t *ids, float *weights) nogil
    size_t ellm_moe_scratch_bytes(const ellm_expert_stack *gate, const ellm_expert_stack *up,
                                  const ellm_expert_stack *down, int64_t T, int32_t k,
                                  int32_t E, int64_t max_pass) nogil
    int ellm_moe_experts(const float *x, int64_t T, int64_t H, const int32_t *ids,
                         const float *weights, int32_t k, int32_t E,
                         const ellm_expert_stack *gate, const ellm_expert_stack *up,
                         const ellm_expert_stack *down, float *out, void *scratch,
                         size_t scratch_bytes, int64_t max_pass) nogil


# the kernels sort a token's choices on the stack
MAX_TOP_K = ELLM_MOE_MAX_TOPK


cdef int _raise_status(int status, str fn) except -1:
    if status == 0:
        return 0
    msg = f"{fn}: {ellm_status_str(status).decode()}"
    if status == ELLM_E_INDEX:
        raise IndexError(msg)
    raise ValueError(msg)


cdef class ExpertStack:
    """E weight matrices of one GGML type and shape (N, K): an MoE layer's gate, up or down.

    weights: a sequence of E arrays, each (N, row_bytes(qtype, K)) uint8 blocks, (N, K)
    float32 (F32) or (N, K) uint16 / float16 bits (F16, BF16), rows contiguous. They are
    referenced, never copied."""

    cdef const uint8_t **ptrs
    cdef tuple _arrays
    cdef readonly int qtype
    cdef readonly int n_experts
    cdef readonly int64_t out_features
    cdef readonly int64_t in_features

    def __cinit__(self, weights, int qtype, int64_t in_features):
        arrays = tuple(weights)
        cdef int E = len(arrays)
        if E < 1:
            raise ValueError("ExpertStack: no expert matrices")
        if ellm_qtype_block_elems(qtype) == 0:
            raise ValueError(f"ExpertStack: unsupported GGML type id {qtype}")
        cdef int64_t rb = ellm_row_bytes(qtype, in_features)
        if rb < 0:
            raise ValueError(f"ExpertStack: K={in_features} is not a whole number of blocks of "
                             f"type {qtype}")
        cdef bint is_float = qtype == ELLM_T_F32 or qtype == ELLM_T_F16 or qtype == ELLM_T_BF16
        cdef int64_t n_rows = -1
        for e, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or a.ndim != 2:
                raise ValueError(f"ExpertStack: expert {e} must be a 2-D numpy array")
            if not a.flags.c_contiguous:
                raise ValueError(f"ExpertStack: expert {e}'s rows must be contiguous")
            if qtype == ELLM_T_F32:
                ok = a.dtype == np.float32
            elif is_float:
                ok = a.dtype == np.uint16 or (qtype == ELLM_T_F16 and a.dtype == np.float16)
            else:
                ok = a.dtype == np.uint8
            if not ok:
                raise ValueError(f"ExpertStack: expert {e} has dtype {a.dtype}, wrong for type {qtype}")
            if a.shape[1] != (in_features if is_float else rb):
                raise ValueError(f"ExpertStack: expert {e} has {a.shape[1]} columns, expected "
                                 f"{in_features if is_float else rb}")
            if n_rows < 0:
                n_rows = a.shape[0]
            elif a.shape[0] != n_rows:
                raise ValueError(f"ExpertStack: expert {e} has {a.shape[0]} rows, expert 0 {n_rows}")
        self.ptrs = <const uint8_t **>malloc(sizeof(uint8_t *) * E)
        if self.ptrs == NULL:
            raise MemoryError()
        for e in range(E):
            self.ptrs[e] = <const uint8_t *><uintptr_t>arrays[e].ctypes.data
        self._arrays = arrays
        self.qtype = qtype
        self.n_experts = E
        self.out_features = n_rows
        self.in_features = in_features

    def __dealloc__(self):
        free(self.ptrs)

    cdef ellm_expert_stack c_stack(self):
        cdef ellm_expert_stack s
        s.qtype = self.qtype
        s.N = self.out_features
        s.K = self.in_features
        s.w = self.ptrs
        return s


SCRATCH_USE = "MoE"
include "scratch.pxi"


def route(const float[:, ::1] logits not None, int top_k, bint norm_topk_prob,
          int32_t[:, ::1] ids not None, float[:, ::1] weights not None) -> None:
    """logits (T, E) -> ids (T, top_k) int32 and weights (T, top_k) float32: each token's
    top_k experts by softmax probability (highest first, ties to the lower id), the
    probabilities renormalised over the chosen ones when norm_topk_prob."""
    cdef int64_t T = logits.shape[0], E = logits.shape[1]
    if E < 1 or E > 2**31 - 1:
        raise ValueError(f"moe route: {E} experts")
    if top_k < 1 or top_k > E or top_k > MAX_TOP_K:
        raise ValueError(f"moe route: top_k must be in [1, min(E={E}, {MAX_TOP_K})], got {top_k}")
    if ids.shape[0] != T or ids.shape[1] != top_k or weights.shape[0] != T or weights.shape[1] != top_k:
        raise ValueError(f"moe route: ids and weights must be ({T}, {top_k}), got "
                         f"({ids.shape[0]}, {ids.shape[1]}) and ({weights.shape[0]}, {weights.shape[1]})")
    if T == 0:
        return
    cdef int st
    with nogil:
        st = ellm_moe_route(&logits[0, 0], T, <int32_t>E, top_k, norm_topk_prob, &ids[0, 0],
                            &weights[0, 0])
    _raise_status(st, "moe route")


def experts(const float[:, ::1] x not None, const int32_t[:, ::1] ids not None,
            const float[:, ::1] weights not None, ExpertStack gate not None,
            ExpertStack up not None, ExpertStack down not None, float[:, ::1] out not None,
            int64_t max_pass_tokens=0) -> None:
    """out (T, H) = sum over each token's experts e = ids[t] (ascending e) of
    weights[t] * down[e] . (silu(gate[e] . x_t) * (up[e] . x_t)).

    x (T, H) float32; ids, weights (T, k); gate, up: E matrices (F, H); down: E (H, F).
    Batch invariant: out[t] depends only on x[t], ids[t], weights[t] and the weights.
    max_pass_tokens: tokens a pass at most (0: as many as the C side's scratch bound
    allows); the same bits either way."""
    if max_pass_tokens < 0:
        raise ValueError(f"moe experts: max_pass_tokens must be 0 or more, got {max_pass_tokens}")
    cdef int64_t T = x.shape[0], H = x.shape[1]
    cdef int E = gate.n_experts
    cdef int64_t k = ids.shape[1]
    if up.n_experts != E or down.n_experts != E:
        raise ValueError(f"moe experts: gate, up, down hold {E}, {up.n_experts}, {down.n_experts} experts")
    cdef int64_t F = gate.out_features
    if gate.in_features != H or up.in_features != H or up.out_features != F:
        raise ValueError(f"moe experts: gate {gate.out_features}x{gate.in_features} and up "
                         f"{up.out_features}x{up.in_features} must both be (F, H={H})")
    if down.out_features != H or down.in_features != F:
        raise ValueError(f"moe experts: down is {down.out_features}x{down.in_features}, expected "
                         f"(H={H}, F={F})")
    if ids.shape[0] != T or weights.shape[0] != T or weights.shape[1] != k:
        raise ValueError(f"moe experts: ids ({ids.shape[0]}, {ids.shape[1]}) and weights "
                         f"({weights.shape[0]}, {weights.shape[1]}) must both be (T={T}, k)")
    if k < 1 or k > E or k > MAX_TOP_K:
        raise ValueError(f"moe experts: k must be in [1, min(E={E}, {MAX_TOP_K})], got {k}")
    if out.shape[0] != T or out.shape[1] != H:
        raise ValueError(f"moe experts: out is ({out.shape[0]}, {out.shape[1]}), expected ({T}, {H})")
    if T == 0:
        return
    cdef uintptr_t o0 = <uintptr_t>&out[0, 0], o1 = o0 + 4 * <uintptr_t>(T * H)
    cdef uintptr_t x0 = <uintptr_t>&x[0, 0], x1 = x0 + 4 * <uintptr_t>(T * H)
    if H > 0 and o0 < x1 and x0 < o1:
        raise ValueError("moe experts: out overlaps x")
    cdef ellm_expert_stack g = gate.c_stack(), u = up.c_stack(), d = down.c_stack()
    cdef size_t need = ellm_moe_scratch_bytes(&g, &u, &d, T, <int32_t>k, E, max_pass_tokens)
    cdef _Scratch s = _scratch()
    s.reserve(need)
    cdef int st
    with nogil:
        st = ellm_moe_experts(&x[0, 0] if H else NULL, T, H, &ids[0, 0], &weights[0, 0],
                              <int32_t>k, E, &g, &u, &d, &out[0, 0] if H else NULL, s.ptr, s.cap,
                              max_pass_tokens)
    _raise_status(st, "moe experts")


def scratch_bytes() -> int:
    """Bytes of MoE scratch this thread holds (for tests and diagnostics)."""
    return _scratch().cap
