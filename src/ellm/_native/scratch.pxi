# Scratch for the kernels' temporaries: one 64-byte-aligned buffer per Python thread,
# grown only when a call needs more (two threads may run kernels at once with the GIL
# released). Included by the modules that need one (each keeps its own per-thread buffer);
# they cimport malloc/free, uint8_t and uintptr_t and import threading.

cdef class _Scratch:
    cdef void *raw
    cdef uint8_t *ptr   # 64-byte aligned inside raw
    cdef size_t cap

    cdef int reserve(self, size_t nbytes) except -1:
        if nbytes <= self.cap:
            return 0
        cdef size_t cap = max(nbytes, 2 * self.cap)
        cdef void *p = malloc(cap + 64)
        if p == NULL:
            raise MemoryError(f"cannot allocate {cap} bytes of {SCRATCH_USE} scratch")
        free(self.raw)
        self.raw = p
        self.ptr = <uint8_t *>((<uintptr_t>p + 63) & ~(<uintptr_t>63))
        self.cap = cap
        return 0

    def __dealloc__(self):
        free(self.raw)


_tls = threading.local()


cdef _Scratch _scratch():
    s = getattr(_tls, "scratch", None)
    if s is None:
        s = _Scratch()
        _tls.scratch = s
    return <_Scratch>s
