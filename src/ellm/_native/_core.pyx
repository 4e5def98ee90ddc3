# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin typed shims over csrc/: file maps, float conversions and the SIMD level."""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t, uint16_t, uint64_t
from libc.string cimport strerror


cdef extern from "mapfile.h":
    ctypedef struct ellm_map:
        const uint8_t *data
        size_t size
    int ellm_map_open(const char *path, ellm_map *out)
    void ellm_map_close(ellm_map *m)
    void ellm_map_advise_willneed(const ellm_map *m, size_t offset, size_t len)
    size_t ellm_map_move_to_huge_pages(ellm_map *m, const int *stop) nogil
    void ellm_map_request_stop(int *stop)


cdef extern from "convert.h":
    void ellm_bf16_to_f32_row(const uint16_t *src, float *dst, size_t n) nogil
    void ellm_f16_to_f32_row(const uint16_t *src, float *dst, size_t n) nogil
    void ellm_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n) nogil
    void ellm_f32_to_f16_row(const float *src, uint16_t *dst, size_t n) nogil


cdef extern from "simd.h":
    int ellm_simd_best()
    int ellm_simd_level()
    int ellm_simd_set(int level)
    const char *ellm_simd_name(int level)
    int ellm_neon_features()


cdef class MappedFile:
    """A read-only memory map of a whole file, exposed through the buffer protocol.

    numpy views made with np.frombuffer keep this object (and so the map) alive.
    """
    cdef ellm_map m
    cdef readonly str path
    cdef int exports
    cdef int stop_moving_flag   # written and read only atomically (csrc/mapfile.c)

    def __cinit__(self, path):
        self.path = str(path)
        cdef bytes bpath = self.path.encode()
        cdef int err = ellm_map_open(bpath, &self.m)
        if err != 0:
            raise OSError(err, f"cannot map {self.path}: {strerror(err).decode()}")

    def __dealloc__(self):
        ellm_map_close(&self.m)

    @property
    def size(self):
        return self.m.size

    def __len__(self):
        return self.m.size

    def advise_willneed(self, size_t offset, size_t length):
        ellm_map_advise_willneed(&self.m, offset, length)

    def move_to_huge_pages(self) -> int:
        """Moves the map's whole 2 MiB pieces onto anonymous huge pages in place (same
        addresses, same bytes; csrc/mapfile.h), without the GIL; the bytes moved (0 where
        the platform has no such pages). Views keep reading correct bytes meanwhile."""
        cdef size_t moved
        with nogil:
            moved = ellm_map_move_to_huge_pages(&self.m, &self.stop_moving_flag)
        return moved

    def stop_moving(self) -> None:
        """Makes a move_to_huge_pages running on another thread return after its piece."""
        ellm_map_request_stop(&self.stop_moving_flag)

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError(f"{self.path} is mapped read-only")
        # An empty file has no mapping; hand out a valid zero-length buffer.
        cdef const uint8_t *p = self.m.data if self.m.data != NULL else <const uint8_t *>b""
        PyBuffer_FillInfo(buffer, self, <void *>p, self.m.size, 1, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1


def gguf_strings(const uint8_t[::1] buf, size_t pos, size_t count, uint64_t max_bytes):
    """GGUF string-array elements from byte `pos` of `buf` on (a little-endian u64 length,
    then that many UTF-8 bytes; invalid bytes kept as surrogate escapes): (strings, the
    position after them). It stops before the first element whose length is cut short,
    or claims more than max_bytes or than the bytes left, so fewer than `count` strings
    come back and the caller names that element. (formats/gguf.py: a 262k-token vocabulary
    is 0.03 s here against 0.25 s in a Python loop.)"""
    cdef size_t end = <size_t>buf.shape[0], i
    cdef const uint8_t *p = &buf[0] if end else NULL
    cdef uint64_t n
    cdef int b
    cdef list out = []
    if pos > end:
        return out, pos
    for i in range(count):
        if end - pos < 8:
            break
        n = 0
        for b in range(8):
            n |= (<uint64_t>p[pos + b]) << (8 * b)
        if n > max_bytes or n > end - pos - 8:
            break
        out.append(PyUnicode_DecodeUTF8(<const char *>(p + pos + 8), <Py_ssize_t>n, "surrogateescape"))
        pos += 8 + <size_t>n
    return out, pos


def bf16_to_f32(const uint16_t[::1] src, float[::1] dst):
    """(n,) bf16 bits -> (n,) float32."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("bf16_to_f32: length mismatch")
    with nogil:
        ellm_bf16_to_f32_row(&src[0] if src.shape[0] else NULL, &dst[0] if dst.shape[0] else NULL, src.shape[0])


def f16_to_f32(const uint16_t[::1] src, float[::1] dst):
    """(n,) f16 bits -> (n,) float32."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("f16_to_f32: length mismatch")
    with nogil:
        ellm_f16_to_f32_row(&src[0] if src.shape[0] else NULL, &dst[0] if dst.shape[0] else NULL, src.shape[0])


def f32_to_bf16(const float[::1] src, uint16_t[::1] dst):
    """(n,) float32 -> (n,) bf16 bits, round to nearest even."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("f32_to_bf16: length mismatch")
    with nogil:
        ellm_f32_to_bf16_row(&src[0] if src.shape[0] else NULL, &dst[0] if dst.shape[0] else NULL, src.shape[0])


def f32_to_f16(const float[::1] src, uint16_t[::1] dst):
    """(n,) float32 -> (n,) f16 bits, round to nearest even."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("f32_to_f16: length mismatch")
    with nogil:
        ellm_f32_to_f16_row(&src[0] if src.shape[0] else NULL, &dst[0] if dst.shape[0] else NULL, src.shape[0])


SIMD_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2, "neon": 3, "amx": 4}


def simd_best() -> str:
    return ellm_simd_name(ellm_simd_best()).decode()


def simd_level() -> str:
    return ellm_simd_name(ellm_simd_level()).decode()


def set_simd_level(name: str) -> None:
    """Forces the kernel level ("scalar", "avx2", "avx512", "amx", "neon") for the whole process."""
    if name not in SIMD_LEVELS:
        raise ValueError(f"unknown SIMD level {name!r}; expected one of {sorted(SIMD_LEVELS)}")
    if ellm_simd_set(SIMD_LEVELS[name]) != 0:
        raise ValueError(f"SIMD level {name!r} is not supported on this CPU (best: {simd_best()})")


def simd_extensions() -> list:
    """The optional extensions the active level's kernels use: at the NEON level (aarch64)
    "dotprod" (SDOT) and "i8mm" where the CPU has them; empty elsewhere."""
    if ellm_simd_level() != SIMD_LEVELS["neon"]:
        return []
    cdef int f = ellm_neon_features()
    return [name for name, bit in (("dotprod", 1), ("i8mm", 2)) if f & bit]


def supported_simd_levels() -> list:
    """Every level this CPU can run, lowest first."""
    best = ellm_simd_best()
    if best == 3:
        return ["scalar", "neon"]
    if best == 4:  # AMX: the AVX-512 level plus tiles, numbered after NEON
        return ["scalar", "avx2", "avx512", "amx"]
    return [ellm_simd_name(i).decode() for i in range(best + 1)]
