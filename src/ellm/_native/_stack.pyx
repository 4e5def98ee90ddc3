# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A decoder's layers as one call: every kernel of every layer of a forward pass, run
from C without returning to Python between them.

A decode step of a small model is short (SmolLM2-135M: ~5 ms a token on two cores), and
going through Python for each of its ~240 kernel calls -- argument checks, buffer
acquisition, the op methods -- cost about a fifth of it. A LayerStack checks every
weight, buffer and shape once, when it is built for one workspace and one row count,
and keeps the pointers; `run` then takes only what changes from step to step (the
positions, sequence ids, block tables) and calls the same C kernels in the same order as
the per-op path (models/blocks.py), so the results are bit-identical to it.

The arrays a stack points into are held by it, so none can be freed while it exists.
"""

import threading

import numpy as np

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc, calloc


cdef extern from "quant.h":
    int64_t ellm_row_bytes(int qtype, int64_t n) nogil
    const char *ellm_status_str(int status) nogil


from _csrc cimport (ellm_add, ellm_add_rmsnorm, ellm_attn_args, ellm_geglu, ellm_linear_multi,
                    ellm_linear_multi_scratch_bytes, ellm_linear_part, ellm_rmsnorm, ellm_rope_attention,
                    ellm_rope_attention_scratch_wanted, ellm_scale, ellm_swiglu)


cdef extern from "threadpool.h":
    int ellm_num_threads() nogil


cdef extern from "lora.h":
    ctypedef struct ellm_lora_proj:
        pass
    ctypedef struct ellm_lora_part:
        const ellm_lora_proj *proj
        float *y
        int64_t ldy
    size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T) nogil
    int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                        const ellm_lora_part *parts, int n_parts, void *scratch,
                        size_t scratch_bytes) nogil
    int ellm_linear_multi_lora(const float *x, int64_t T, int64_t K, const ellm_linear_part *lin, int n_lin,
                               void *lin_scratch, size_t lin_bytes, const int32_t *row_slot,
                               const ellm_lora_part *parts, const int *lin_index, int n_parts,
                               void *scratch, size_t scratch_bytes) nogil


# [lora] one call of the LoRA kernel after a linear: the parts adapted (n = 0: none)
ctypedef struct lora_call:
    ellm_lora_part parts[3]
    int lin[3]          # the linear call's part each one adds to
    int n


# one RMSNorm (or none): rows of n at x (stride ld), written in place
ctypedef struct norm_step:
    const float *w      # NULL: no norm
    float *x
    int64_t ld, rows, n
    float eps


ctypedef struct layer_plan:
    # attention block: q, k, v from hin; optional q/k norms; RoPE + attention; o -> proj
    const float *hin
    ellm_linear_part qkv[3]
    norm_step q_norm, k_norm
    ellm_attn_args attn
    int table              # index of this layer's window among the stack's block tables
    ellm_linear_part o
    const float *attn_x    # (T, nh*hd): o's input
    int64_t attn_width
    # after each block: its norm, its multiplier, then residual += block (+ the next norm)
    norm_step post_attn, post_mlp
    float multiplier
    const float *pre_mlp_w     # NULL: the MLP reads the residual itself
    const float *next_w        # NULL: the next layer reads the residual itself
    # MLP block: gate, up from mlp_in; act; down -> proj
    const float *mlp_in
    ellm_linear_part gate_up[2]
    int gelu
    float *act
    const float *gate
    const float *up
    int64_t F
    ellm_linear_part down
    # [lora] the adapters' products after q/k/v, o, gate/up and down
    lora_call lora[4]


cdef class _Held:
    """A buffer acquired for as long as the stack lives."""
    cdef Py_buffer buf
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.buf)


cdef class LayerStack:
    """Built once per (model, workspace views, row count T, KV cache); see the module doc.

    layers: one dict per layer (models/blocks.Decoder.layer_stack builds them) with the
    Linear weights, the workspace views and the norms of that layer; H the hidden size;
    residual, proj, h: the forward's (T, H) buffers; eps the blocks' RMSNorm epsilon."""
    cdef layer_plan *plans
    cdef int n_layers
    cdef readonly int64_t T, H
    cdef float *residual
    cdef float *proj
    cdef float *h
    cdef list held                # arrays and buffers the plans point into
    cdef list windows             # distinct windows, in table-index order
    cdef void *lin_scratch
    cdef uint8_t *lin_ptr
    cdef size_t lin_bytes
    cdef float *attn_scratch
    cdef int64_t attn_floats
    cdef object lock
    cdef void *lora_scratch        # [lora] 8-byte aligned (malloc)
    cdef size_t lora_bytes
    cdef readonly bint has_lora

    def __cinit__(self):
        self.plans = NULL
        self.lin_scratch = NULL
        self.attn_scratch = NULL
        self.lora_scratch = NULL

    def __dealloc__(self):
        free(self.plans)
        free(self.lin_scratch)
        free(self.attn_scratch)
        free(self.lora_scratch)

    def __init__(self, list layers, int64_t T, int64_t H, residual, proj, h, double eps):
        if T < 1:
            raise ValueError(f"LayerStack: T must be >= 1, got {T}")
        self.T, self.H = T, H
        self.held = []
        self.windows = []
        self.lock = threading.Lock()
        self.residual = self._rows(residual, T, H, "residual")
        self.proj = self._rows(proj, T, H, "proj")
        self.h = self._rows(h, T, H, "h")
        self.n_layers = len(layers)
        self.plans = <layer_plan *>calloc(max(self.n_layers, 1), sizeof(layer_plan))
        if self.plans == NULL:
            raise MemoryError("LayerStack: cannot allocate the layer plans")
        cdef size_t need = 0
        cdef size_t lora_need = 0
        cdef layer_plan *L
        for i, spec in enumerate(layers):
            need = max(need, self._plan(&self.plans[i], spec, <float>eps))
            L = &self.plans[i]
            for c in range(4):
                if L.lora[c].n:
                    self.has_lora = True
                    lora_need = max(lora_need, ellm_lora_scratch_bytes(L.lora[c].parts, L.lora[c].n, T))
        if self.has_lora:
            self.lora_bytes = lora_need
            self.lora_scratch = malloc(lora_need)
            if self.lora_scratch == NULL:
                raise MemoryError(f"LayerStack: cannot allocate {lora_need} bytes of LoRA scratch")
        self.lin_bytes = need
        if need:
            self.lin_scratch = malloc(need + 64)
            if self.lin_scratch == NULL:
                raise MemoryError(f"LayerStack: cannot allocate {need} bytes of scratch")
            self.lin_ptr = <uint8_t *>((<uintptr_t>self.lin_scratch + 63) & ~(<uintptr_t>63))

    # -- building ---------------------------------------------------------------------

    cdef float *_rows(self, object a, int64_t rows, int64_t n, str name) except NULL:
        """The data of a writable float32 (rows, n) array with contiguous rows of stride n
        (the workspace's views), held."""
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise ValueError(f"LayerStack: {name} must be a float32 numpy array")
        a2 = a.reshape(rows, -1) if a.ndim != 2 and a.flags.c_contiguous and a.size == rows * n else a
        if a2.ndim != 2 or a2.shape[0] != rows or a2.shape[1] != n or not a2.flags.c_contiguous or not a2.flags.writeable:
            raise ValueError(f"LayerStack: {name} must be a writable C-contiguous ({rows}, {n}) array, "
                             f"got {a.shape}")
        self.held.append(a2)
        cdef float[:, ::1] mv = a2
        return &mv[0, 0]

    cdef const float *_vector(self, object a, int64_t n, str name) except? NULL:
        """The data of a float32 (n,) array, held; NULL for None."""
        if a is None:
            return NULL
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 1 or a.shape[0] != n \
                or not a.flags.c_contiguous:
            raise ValueError(f"LayerStack: {name} must be a contiguous float32 ({n},) array, got "
                             f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
        self.held.append(a)
        if n == 0:
            return NULL
        cdef const float[::1] mv = a
        return &mv[0]

    cdef int _part(self, ellm_linear_part *p, object lin, int64_t K, float *y, int64_t ldy,
                   str name) except -1:
        """p <- the Linear `lin` (N, K), writing columns [0, N) of y's rows (stride ldy)."""
        cdef _Held hb = _Held()
        if lin.in_features != K:
            raise ValueError(f"LayerStack: {name} takes {lin.in_features} inputs, its input has {K}")
        PyObject_GetBuffer(lin.data, &hb.buf, PyBUF_C_CONTIGUOUS)
        hb.held = True
        self.held.append(hb)
        cdef int64_t N = lin.out_features
        cdef int64_t rb = ellm_row_bytes(int(lin.qtype), K)
        if rb < 0 or <int64_t>hb.buf.len != rb * N or N > ldy:
            raise ValueError(f"LayerStack: {name} holds {hb.buf.len} bytes, not {N} rows of {rb}")
        p.qtype = int(lin.qtype)
        p.w = <const uint8_t *>hb.buf.buf
        p.w_bytes = <size_t>hb.buf.len
        p.N = N
        p.y = y
        p.ldy = ldy
        p.bias = self._vector(lin.bias, N, name + " bias")
        return 0

    cdef int _lora_part(self, lora_call *c, dict tables, str name, float *y, int64_t ldy,
                        int64_t K, int lin) except -1:
        """[lora] Adds projection `name` (writing y, (T, ldy)) to the call c when any
        adapter changes it (tables: name -> _lora.LoraTable)."""
        table = tables.get(name)
        if table is None:
            return 0
        if table.in_features != K or table.out_features != ldy:
            raise ValueError(f"LayerStack: the LoRA table of {name} is ({table.out_features}, "
                             f"{table.in_features}), the projection ({ldy}, {K})")
        self.held.append(table)
        c.parts[c.n].proj = <const ellm_lora_proj *><uintptr_t>table.address
        c.parts[c.n].y = y
        c.parts[c.n].ldy = ldy
        c.lin[c.n] = lin
        c.n += 1
        return 0

    cdef int _norm_on_proj(self, norm_step *n, object w, float eps, str name) except -1:
        n.w = self._vector(w, self.H, name)
        n.x, n.ld, n.rows, n.n, n.eps = self.proj, self.H, self.T, self.H, eps
        return 0

    cdef size_t _plan(self, layer_plan *L, dict s, float eps) except? 0:
        """Fills L from one layer's spec; -> the linear scratch bytes its calls need."""
        cdef int64_t T = self.T, H = self.H
        cdef int64_t nh = s["n_heads"], nkv = s["n_kv_heads"], hd = s["head_dim"]
        cdef int64_t F = s["up"].out_features
        cdef float *q = self._rows(s["q_out"], T, nh * hd, "q")
        cdef float *k = self._rows(s["k_out"], T, nkv * hd, "k")
        cdef float *v = self._rows(s["v_out"], T, nkv * hd, "v")
        cdef float *attn = self._rows(s["attn_out"], T, nh * hd, "attn")
        L.hin = self.h if s["reads_normed"] else self.residual
        self._part(&L.qkv[0], s["q"], H, q, nh * hd, "q_proj")
        self._part(&L.qkv[1], s["k"], H, k, nkv * hd, "k_proj")
        self._part(&L.qkv[2], s["v"], H, v, nkv * hd, "v_proj")
        whole = s["qk_norm_whole"]
        L.q_norm.w = self._vector(s["q_norm"], nh * hd if whole else hd, "q_norm")
        L.k_norm.w = self._vector(s["k_norm"], nkv * hd if whole else hd, "k_norm")
        L.q_norm.x, L.q_norm.eps = q, <float>s["attn_eps"]
        L.k_norm.x, L.k_norm.eps = k, <float>s["attn_eps"]
        if whole:
            L.q_norm.rows, L.q_norm.n, L.k_norm.rows, L.k_norm.n = T, nh * hd, T, nkv * hd
        else:
            L.q_norm.rows, L.q_norm.n, L.k_norm.rows, L.k_norm.n = T * nh, hd, T * nkv, hd
        L.q_norm.ld, L.k_norm.ld = L.q_norm.n, L.k_norm.n

        kc, vc = s["k_cache"], s["v_cache"]
        for name, c in (("k_cache", kc), ("v_cache", vc)):
            if (not isinstance(c, np.ndarray) or c.dtype not in (np.float32, np.float16) or c.ndim != 4
                    or not c.flags.c_contiguous or not c.flags.writeable or c.shape[2] != nkv or c.shape[3] != hd
                    or c.shape[0] < 1 or c.shape[1] < 1 or c.shape != kc.shape or c.dtype != kc.dtype):
                raise ValueError(f"LayerStack: {name} must be a writable C-contiguous float32 or float16 "
                                 f"(num_blocks, block_size, {nkv}, {hd}) array like the other")
        self.held.extend((kc, vc))
        cdef float[:, :, :, ::1] kmv
        cdef float[:, :, :, ::1] vmv
        cdef uint16_t[:, :, :, ::1] kmv16
        cdef uint16_t[:, :, :, ::1] vmv16
        cdef ellm_attn_args *a = &L.attn
        if kc.dtype == np.float16:   # f16 caches: their bits, as uint16
            kmv16, vmv16 = kc.view(np.uint16), vc.view(np.uint16)
            a.k_cache, a.v_cache = NULL, NULL
            a.k_cache16, a.v_cache16 = &kmv16[0, 0, 0, 0], &vmv16[0, 0, 0, 0]
        else:
            kmv, vmv = kc, vc
            a.k_cache, a.v_cache = &kmv[0, 0, 0, 0], &vmv[0, 0, 0, 0]
            a.k_cache16, a.v_cache16 = NULL, NULL
        inv_freq = s["inv_freq"]
        if not isinstance(inv_freq, np.ndarray) or inv_freq.ndim != 1 or inv_freq.shape[0] > hd // 2:
            raise ValueError(f"LayerStack: inv_freq must be a float32 array of at most {hd // 2} elements")
        a.q, a.k, a.v = q, k, v
        a.q_stride, a.k_stride, a.v_stride = nh * hd, nkv * hd, nkv * hd
        a.num_blocks, a.block_size = kc.shape[0], kc.shape[1]
        a.inv_freq = self._vector(inv_freq, inv_freq.shape[0], "inv_freq")
        a.n_rot = <int32_t>inv_freq.shape[0]
        a.out = attn
        a.T = T
        a.nh, a.nkv, a.hd = <int32_t>nh, <int32_t>nkv, <int32_t>hd
        a.interleaved = 1 if s["interleaved"] else 0
        a.window = <int32_t>s["window"]
        a.scale = <float>s["scale"]
        a.softcap = <float>s["softcap"] if s["softcap"] > 0 else 0.0
        a.rope_mscale = <float>s["rope_mscale"]
        if s["window"] not in self.windows:
            self.windows.append(s["window"])
        L.table = self.windows.index(s["window"])
        L.attn_x, L.attn_width = attn, nh * hd
        self._part(&L.o, s["o"], nh * hd, self.proj, H, "o_proj")

        self._norm_on_proj(&L.post_attn, s["post_attn_norm"], eps, "post_attn_norm")
        self._norm_on_proj(&L.post_mlp, s["post_mlp_norm"], eps, "post_mlp_norm")
        L.multiplier = <float>s["residual_multiplier"]
        L.pre_mlp_w = self._vector(s["pre_mlp_norm"], H, "pre_mlp_norm")
        L.next_w = self._vector(s["next_norm"], H, "next norm")

        L.mlp_in = self.residual if L.pre_mlp_w == NULL else self.h
        L.gate = self._rows(s["gate_out"], T, F, "gate")
        L.up = self._rows(s["up_out"], T, F, "up")
        L.act = self._rows(s["act_out"], T, F, "act")
        L.F = F
        L.gelu = 1 if s["act"] == "gelu_tanh" else 0
        self._part(&L.gate_up[0], s["gate"], H, <float *>L.gate, F, "gate_proj")
        self._part(&L.gate_up[1], s["up"], H, <float *>L.up, F, "up_proj")
        self._part(&L.down, s["down"], F, self.proj, H, "down_proj")
        lora = s.get("lora") or {}   # [lora] projection name -> _lora.LoraTable
        self._lora_part(&L.lora[0], lora, "q", q, nh * hd, H, 0)
        self._lora_part(&L.lora[0], lora, "k", k, nkv * hd, H, 1)
        self._lora_part(&L.lora[0], lora, "v", v, nkv * hd, H, 2)
        self._lora_part(&L.lora[1], lora, "o", self.proj, H, nh * hd, 0)
        self._lora_part(&L.lora[2], lora, "gate", <float *>L.gate, F, H, 0)
        self._lora_part(&L.lora[2], lora, "up", <float *>L.up, F, H, 1)
        self._lora_part(&L.lora[3], lora, "down", self.proj, H, F, 0)
        return max(ellm_linear_multi_scratch_bytes(L.qkv, 3, T, H),
                   ellm_linear_multi_scratch_bytes(&L.o, 1, T, nh * hd),
                   ellm_linear_multi_scratch_bytes(L.gate_up, 2, T, H),
                   ellm_linear_multi_scratch_bytes(&L.down, 1, T, F), 1)

    # -- running ----------------------------------------------------------------------

    def run(self, positions, seq_ids, dict block_tables, key_limit=None, adapter_slots=None) -> None:
        """Every layer for this step's tokens: the residual and h buffers end as the per-op
        path leaves them. adapter_slots: [lora] (T,) int32 each row's LoRA adapter (-1:
        none), or None (a batch of the base alone; a stack built without adapters takes
        only None). Two threads may not run one stack (its buffers are one forward's): the
        second gets a RuntimeError."""
        cdef const int32_t[::1] pv = positions
        cdef const int32_t[::1] sv = seq_ids
        cdef const int32_t[::1] lv
        cdef const int32_t[::1] av
        cdef const int32_t *slots = NULL
        cdef const int32_t *limits = NULL
        if adapter_slots is not None:
            if not self.has_lora:
                raise ValueError("LayerStack.run: adapter slots for a stack without LoRA adapters")
            av = adapter_slots
            if av.shape[0] != self.T:
                raise ValueError(f"LayerStack.run: {av.shape[0]} adapter slots for {self.T} rows")
            slots = &av[0]
        if pv.shape[0] != self.T or sv.shape[0] != self.T:
            raise ValueError(f"LayerStack.run: {pv.shape[0]} positions and {sv.shape[0]} sequence ids "
                             f"for a stack of {self.T} rows")
        if key_limit is not None:
            lv = key_limit
            if lv.shape[0] != self.T:
                raise ValueError(f"LayerStack.run: key_limit has {lv.shape[0]} elements, not {self.T}")
            limits = &lv[0]
        cdef int nt = len(self.windows)
        cdef const int32_t *tables[8]
        cdef int64_t tb[8]
        cdef int64_t tm[8]
        cdef const int32_t[:, ::1] bt
        if nt > 8:
            raise ValueError("LayerStack.run: more than 8 attention windows")
        for i in range(nt):
            bt = block_tables[self.windows[i]]
            if bt.shape[0] == 0 or bt.shape[1] == 0:
                raise ValueError("LayerStack.run: empty block table")
            tables[i], tb[i], tm[i] = &bt[0, 0], bt.shape[0], bt.shape[1]
        if not self.lock.acquire(False):
            raise RuntimeError("LayerStack.run: this stack (one workspace's forward) is already running "
                               "on another thread")
        cdef char err[512]
        cdef int st = 0, rc = 0, li
        cdef int threads = ellm_num_threads()
        cdef int64_t need
        cdef layer_plan *L
        cdef ellm_attn_args *a
        cdef int64_t T = self.T, H = self.H
        cdef float *grown
        err[0] = 0
        try:
            with nogil:
                for li in range(self.n_layers):
                    L = &self.plans[li]
                    st = _linear(L.hin, T, H, L.qkv, 3, self.lin_ptr, self.lin_bytes, &L.lora[0], slots,
                                 self.lora_scratch, self.lora_bytes)
                    if st != 0:
                        break
                    if L.q_norm.w != NULL:
                        ellm_rmsnorm(L.q_norm.x, L.q_norm.ld, L.q_norm.w, L.q_norm.eps, L.q_norm.x,
                                     L.q_norm.ld, L.q_norm.rows, L.q_norm.n)
                    if L.k_norm.w != NULL:
                        ellm_rmsnorm(L.k_norm.x, L.k_norm.ld, L.k_norm.w, L.k_norm.eps, L.k_norm.x,
                                     L.k_norm.ld, L.k_norm.rows, L.k_norm.n)
                    a = &L.attn
                    a.positions, a.seq_ids = &pv[0], &sv[0]
                    a.key_limit = limits
                    a.block_tables, a.B, a.max_blocks = tables[L.table], tb[L.table], tm[L.table]
                    need = ellm_rope_attention_scratch_wanted(a, threads)
                    if need > self.attn_floats:
                        grown = <float *>malloc(<size_t>need * sizeof(float))
                        if grown == NULL:
                            rc = -2
                            break
                        free(self.attn_scratch)
                        self.attn_scratch, self.attn_floats = grown, need
                    rc = ellm_rope_attention(a, self.attn_scratch, self.attn_floats, err, sizeof(err))
                    if rc != 0:
                        break
                    st = _linear(L.attn_x, T, L.attn_width, &L.o, 1, self.lin_ptr, self.lin_bytes, &L.lora[1],
                                 slots, self.lora_scratch, self.lora_bytes)
                    if st != 0:
                        break
                    _block_out(&L.post_attn, L.multiplier, self.residual, L.pre_mlp_w, self.h)
                    st = _linear(L.mlp_in, T, H, L.gate_up, 2, self.lin_ptr, self.lin_bytes, &L.lora[2], slots,
                                 self.lora_scratch, self.lora_bytes)
                    if st != 0:
                        break
                    if L.gelu:
                        ellm_geglu(L.gate, L.F, L.up, L.F, L.act, L.F, T, L.F)
                    else:
                        ellm_swiglu(L.gate, L.F, L.up, L.F, L.act, L.F, T, L.F)
                    st = _linear(L.act, T, L.F, &L.down, 1, self.lin_ptr, self.lin_bytes, &L.lora[3], slots,
                                 self.lora_scratch, self.lora_bytes)
                    if st != 0:
                        break
                    _block_out(&L.post_mlp, L.multiplier, self.residual, L.next_w, self.h)
        finally:
            self.lock.release()
        if rc == -2:
            raise MemoryError("LayerStack.run: cannot allocate attention scratch")
        if rc != 0:
            raise ValueError(f"rope_attention: {err.decode('utf-8', 'replace')}")
        if st != 0:
            raise (IndexError if st == -5 else ValueError)(f"linear_multi / lora: {ellm_status_str(st).decode()}")


cdef inline int _linear(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts, int n,
                        void *lin_scratch, size_t lin_bytes, lora_call *c, const int32_t *slots,
                        void *scratch, size_t scratch_bytes) noexcept nogil:
    """One linear call, and [lora] its adapters' products in the same pass over the pool
    (ellm_linear_multi_lora: each block of outputs gets them as soon as it is written)."""
    if slots == NULL or c.n == 0:
        return ellm_linear_multi(x, T, K, parts, n, lin_scratch, lin_bytes)
    return ellm_linear_multi_lora(x, T, K, parts, n, lin_scratch, lin_bytes, slots, c.parts, c.lin, c.n,
                                  scratch, scratch_bytes)


cdef inline void _block_out(norm_step *n, float multiplier, float *residual, const float *next_w,
                            float *h) noexcept nogil:
    """A block's output (n.x) through its own norm and the residual multiplier
    (Decoder._block_out), then added to the residual, and the sum through next_w into h
    (NULL: the next block reads the residual itself)."""
    if n.w != NULL:
        ellm_rmsnorm(n.x, n.ld, n.w, n.eps, n.x, n.ld, n.rows, n.n)
    if multiplier != 1.0:
        ellm_scale(n.x, n.ld, multiplier, n.rows, n.n)
    if next_w == NULL:
        ellm_add(residual, n.ld, n.x, n.ld, n.rows, n.n)
    else:
        ellm_add_rmsnorm(residual, n.ld, n.x, n.ld, next_w, n.eps, h, n.ld, n.rows, n.n)
