# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin typed shims over csrc/lora.h: the LoRA products of every adapter of a batch.

A LoraTable holds one projection's factors for every adapter (slot s = adapter s; None
where that adapter leaves the projection alone), checked once when it is made; `apply`
adds scale * B (A x) to each row's output for the row's adapter, all in C with the GIL
released.
"""

import mmap
import threading

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc, calloc


cdef extern from "quant.h":
    const char *ellm_status_str(int status) nogil
    enum:
        ELLM_E_INDEX


cdef extern from "lora.h":
    enum:
        ELLM_LORA_MAX_PARTS
        ELLM_LORA_F32
        ELLM_LORA_F16
        ELLM_LORA_BF16
    ctypedef struct ellm_lora_slot:
        int32_t rank
        int32_t dtype
        float scale
        const void *at
        const void *bt
    ctypedef struct ellm_lora_proj:
        int64_t N, K
        int32_t n_slots
        const ellm_lora_slot *slots
    ctypedef struct ellm_lora_part:
        const ellm_lora_proj *proj
        float *y
        int64_t ldy
    size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T) nogil
    int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                        const ellm_lora_part *parts, int n_parts, void *scratch,
                        size_t scratch_bytes) nogil


# the factors' element types the kernel reads: name -> (its code, the numpy dtype of the bits)
DTYPES = {"f32": (ELLM_LORA_F32, np.float32), "f16": (ELLM_LORA_F16, np.float16),
          "bf16": (ELLM_LORA_BF16, np.uint16)}


MAX_PARTS = ELLM_LORA_MAX_PARTS


cdef int _raise_status(int status, str fn) except -1:
    if status == 0:
        return 0
    msg = f"{fn}: {ellm_status_str(status).decode()}"
    if status == ELLM_E_INDEX:
        raise IndexError(msg)
    raise ValueError(msg)


def _blocked(bt):
    """B^T (r, N) as the kernel reads it (lora.h): (ceil(N / 8), r, 8), each block of 8
    outputs' factors together, the last block padded with zeros."""
    r, N = bt.shape
    n8 = (N + 7) // 8 * 8
    padded = np.zeros((r, n8), bt.dtype)
    padded[:, :N] = bt
    return np.ascontiguousarray(padded.reshape(r, n8 // 8, 8).transpose(1, 0, 2))


def _bf16_units(m):
    """A bfloat16 factor matrix as the kernel reads it (csrc/lora_impl.h): in each row
    (a row of A^T, or a block of B^T flattened), every whole unit of 16 from its start
    with its middle two quarters swapped, so that one AVX2 load of a unit widens into its
    first and last 8 factors in place; the factors past the last whole unit as they are."""
    n = m.shape[m.ndim - 1]   # (no negative index: the module is built with wraparound=False)
    order = np.arange(n)
    whole = n & ~15
    head = order[:whole]
    head ^= (((head >> 2) ^ (head >> 3)) & 1) * 12
    return np.ascontiguousarray(m[..., order])


# The factors' buffers are this big (or one factor's size, if larger)
_ARENA_CHUNK = 16 << 20
_HUGE_PAGE = 2 << 20


class FactorArena:
    """The factors of many tables, copied one after the other (each on a 64-byte line) into
    large anonymous mappings asked for on 2 MiB pages (madvise(MADV_HUGEPAGE)): a decode
    step reads an adapter's factors in the order its tables were made (layer by layer, A
    then B of each projection), a run of a few huge pages instead of hundreds of separate
    small arrays over as many 4 KiB pages (and TLB entries)."""

    def __init__(self) -> None:
        self._buf = None
        self._used = 0

    def place(self, m):
        """A copy of the C-contiguous array m in the arena (a view of its buffer)."""
        n = max(int(m.nbytes), 1)
        at = (self._used + 63) & ~63
        if self._buf is None or at + n > self._buf.nbytes:
            # room to start on a 2 MiB boundary (the mapping itself may not be on one)
            size = max(_ARENA_CHUNK, n) + _HUGE_PAGE
            size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            if hasattr(mmap, "MAP_PRIVATE"):   # private: THP's madvise mode covers it (shared: shmem)
                region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            else:
                region = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    region.madvise(mmap.MADV_HUGEPAGE)
                except OSError:   # no transparent huge pages here: 4 KiB pages still work
                    pass
            self._buf = np.frombuffer(region, np.uint8)
            at = -self._buf.ctypes.data % _HUGE_PAGE
        view = self._buf[at:at + m.nbytes].view(m.dtype).reshape(m.shape)
        view[...] = m
        self._used = at + n
        return view


cdef class LoraTable:
    """One projection (out_features N, in_features K) of every adapter.

    slots: a sequence, one entry per adapter: None, or (At, Bt, scale, dtype) with A^T
    (K, r) and B^T (r, N) C-contiguous arrays of `dtype` ("f32": float32, "f16": float16,
    "bf16": uint16 bfloat16 bits), r >= 1. A^T is referenced (bf16: copied in the
    kernel's order, _bf16_units); B^T is held in the kernel's blocked layout (a copy). arena: a FactorArena to copy both into (A^T, then B^T), or
    None."""

    cdef ellm_lora_proj proj
    cdef ellm_lora_slot *c_slots
    cdef tuple _arrays
    cdef readonly int64_t out_features
    cdef readonly int64_t in_features
    cdef readonly int n_slots

    def __cinit__(self, slots, int64_t out_features, int64_t in_features, arena=None):
        self.c_slots = NULL
        entries = tuple(slots)
        cdef int S = len(entries)
        if out_features < 1 or in_features < 1:
            raise ValueError(f"LoraTable: shape ({out_features}, {in_features})")
        self.c_slots = <ellm_lora_slot *>calloc(max(S, 1), sizeof(ellm_lora_slot))
        if self.c_slots == NULL:
            raise MemoryError()
        held = []
        for s, e in enumerate(entries):
            if e is None:
                continue
            at, bt, scale, dtype = e
            if dtype not in DTYPES:
                raise ValueError(f"LoraTable: slot {s}'s dtype {dtype!r} is not one of {', '.join(DTYPES)}")
            code, np_dtype = DTYPES[dtype]
            for name, m in (("A^T", at), ("B^T", bt)):
                if not isinstance(m, np.ndarray) or m.dtype != np_dtype or m.ndim != 2 or not m.flags.c_contiguous:
                    raise ValueError(f"LoraTable: slot {s}'s {name} must be a C-contiguous {np.dtype(np_dtype).name} "
                                     f"matrix ({dtype})")
            r = at.shape[1]
            if r < 1 or at.shape[0] != in_features or bt.shape[0] != r or bt.shape[1] != out_features:
                raise ValueError(f"LoraTable: slot {s} has A^T {at.shape} and B^T {bt.shape}; expected "
                                 f"({in_features}, r) and (r, {out_features}) with r >= 1")
            bt = _blocked(bt)
            if dtype == "bf16":
                at, bt = _bf16_units(at), _bf16_units(bt.reshape(bt.shape[0], -1)).reshape(bt.shape)
            if arena is not None:
                at, bt = arena.place(at), arena.place(bt)
            self.c_slots[s].rank = <int32_t>r
            self.c_slots[s].dtype = <int32_t>code
            self.c_slots[s].scale = <float>scale
            self.c_slots[s].at = <const void *><uintptr_t>at.ctypes.data
            self.c_slots[s].bt = <const void *><uintptr_t>bt.ctypes.data
            held.extend((at, bt))
        self._arrays = tuple(held)
        self.proj.N, self.proj.K, self.proj.n_slots, self.proj.slots = out_features, in_features, S, self.c_slots
        self.out_features, self.in_features, self.n_slots = out_features, in_features, S

    def __dealloc__(self):
        free(self.c_slots)

    @property
    def address(self) -> int:
        """The C struct's address (for the layer stack, which holds this object)."""
        return <uintptr_t>&self.proj


SCRATCH_USE = "LoRA"
include "scratch.pxi"


def apply(const float[:, ::1] x not None, const int32_t[::1] row_slots not None, parts) -> None:
    """For each (table, y) of parts: y[t, :N] += scale_s * B_s (A_s x[t]) for every row t
    whose slot s = row_slots[t] >= 0 adapts that table (-1: left alone). x (T, K) float32;
    each y a writable float32 (T, >= N) array with contiguous rows."""
    cdef int64_t T = x.shape[0], K = x.shape[1]
    cdef int n = len(parts)
    if n < 1 or n > ELLM_LORA_MAX_PARTS:
        raise ValueError(f"lora apply: {n} parts; 1 to {ELLM_LORA_MAX_PARTS} allowed")
    if row_slots.shape[0] != T:
        raise ValueError(f"lora apply: {row_slots.shape[0]} row slots for {T} rows")
    cdef ellm_lora_part c_parts[8]
    cdef LoraTable table
    cdef float[:, :] yv
    held = []
    for i, (tab, y) in enumerate(parts):
        table = <LoraTable?>tab
        if table.in_features != K:
            raise ValueError(f"lora apply: part {i} takes {table.in_features} inputs, x has {K}")
        if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.ndim != 2 or y.shape[0] != T \
                or y.shape[1] < table.out_features or y.strides[1] != 4 or not y.flags.writeable:
            raise ValueError(f"lora apply: part {i}'s output must be a writable float32 ({T}, "
                             f">= {table.out_features}) array with contiguous rows")
        yv = y
        held.append(y)
        c_parts[i].proj = &table.proj
        c_parts[i].y = &yv[0, 0] if T else NULL
        c_parts[i].ldy = y.strides[0] // 4 if T > 1 else table.out_features
    if T == 0:
        return
    cdef size_t need = ellm_lora_scratch_bytes(c_parts, n, T)
    if need == 0:
        raise ValueError("lora apply: the tables disagree in shape")
    cdef _Scratch sc = _scratch()
    sc.reserve(need)
    cdef int st
    with nogil:
        st = ellm_lora_apply(&x[0, 0], K, T, &row_slots[0], c_parts, n, sc.ptr, sc.cap)
    _raise_status(st, "lora apply")
