/* Read-only memory maps of model files: weights stay in the page cache, or on Linux may be
 * moved, 2 MiB at a time, onto anonymous huge pages (ellm_map_move_to_huge_pages).
 * POSIX mmap, or on Windows a file mapping object (CreateFileMapping + MapViewOfFile). */
#define _GNU_SOURCE
#include "mapfile.h"

#include <errno.h>
#include <stdlib.h>

#ifdef _WIN32
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0602 /* Windows 8: PrefetchVirtualMemory */
#endif
#include <windows.h>

/* errno values for the Windows errors a map can meet (the caller prints strerror). */
static int win_errno(DWORD e) {
    switch (e) {
    case ERROR_FILE_NOT_FOUND:
    case ERROR_PATH_NOT_FOUND:
    case ERROR_INVALID_DRIVE: return ENOENT;
    case ERROR_ACCESS_DENIED:
    case ERROR_SHARING_VIOLATION:
    case ERROR_LOCK_VIOLATION: return EACCES;
    case ERROR_NOT_ENOUGH_MEMORY:
    case ERROR_OUTOFMEMORY:
    case ERROR_COMMITMENT_LIMIT: return ENOMEM;
    case ERROR_FILENAME_EXCED_RANGE: return ENAMETOOLONG;
    default: return EIO;
    }
}

int ellm_map_open(const char *path, ellm_map *out) {
    out->data = NULL;
    out->size = 0;
    /* path is UTF-8 (Python's os.fsencode on Windows): the wide API takes any name */
    int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, NULL, 0);
    if (n <= 0) return EINVAL;
    WCHAR *wpath = (WCHAR *)malloc((size_t)n * sizeof(WCHAR));
    if (!wpath) return ENOMEM;
    MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, wpath, n);
    /* FILE_SHARE_DELETE too: like POSIX, the file may be renamed or unlinked while mapped */
    HANDLE f = CreateFileW(wpath, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                           NULL, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, NULL);
    free(wpath);
    if (f == INVALID_HANDLE_VALUE) return win_errno(GetLastError());
    LARGE_INTEGER size;
    /* a directory, pipe or device is refused as not a regular file (EINVAL, as on POSIX) */
    if (GetFileType(f) != FILE_TYPE_DISK || !GetFileSizeEx(f, &size)) {
        CloseHandle(f);
        return EINVAL;
    }
    if (size.QuadPart == 0) { /* a mapping of length 0 is an error; an empty map is not */
        CloseHandle(f);
        return 0;
    }
    if ((unsigned long long)size.QuadPart > (unsigned long long)SIZE_MAX) {
        CloseHandle(f);
        return EFBIG;
    }
    HANDLE m = CreateFileMappingW(f, NULL, PAGE_READONLY, 0, 0, NULL);
    DWORD e = GetLastError();
    CloseHandle(f); /* the mapping object keeps the file open */
    if (!m) return win_errno(e);
    void *p = MapViewOfFile(m, FILE_MAP_READ, 0, 0, 0);
    e = GetLastError();
    CloseHandle(m); /* the view keeps the mapping object alive */
    if (!p) return win_errno(e);
    out->data = (const uint8_t *)p;
    out->size = (size_t)size.QuadPart;
    return 0;
}

void ellm_map_close(ellm_map *m) {
    if (m->data) UnmapViewOfFile((LPCVOID)m->data);
    m->data = NULL;
    m->size = 0;
}

void ellm_map_advise_willneed(const ellm_map *m, size_t offset, size_t len) {
    if (!m->data || offset >= m->size) return;
    if (len > m->size - offset) len = m->size - offset;
    WIN32_MEMORY_RANGE_ENTRY range = {(PVOID)(m->data + offset), len};
    PrefetchVirtualMemory(GetCurrentProcess(), 1, &range, 0); /* a hint: failure is fine */
}

size_t ellm_map_move_to_huge_pages(ellm_map *m, const int *stop) {
    (void)m;
    (void)stop;
    return 0;
}

void ellm_map_request_stop(int *stop) { *stop = 1; } /* nothing reads it on Windows */

#else /* POSIX */

void ellm_map_request_stop(int *stop) { __atomic_store_n(stop, 1, __ATOMIC_RELAXED); }
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MREMAP_FIXED)
#define ELLM_HUGE_MOVE 1
#define HUGE_PAGE ((size_t)2 << 20)
#endif

/* The file mapped read-only; on Linux at a 2 MiB-aligned address, so that its 2 MiB pieces
 * can be moved onto huge pages (ellm_map_move_to_huge_pages). MAP_FAILED (errno) on failure. */
static void *map_file(int fd, size_t size) {
#ifdef ELLM_HUGE_MOVE
    if (size <= SIZE_MAX - 2 * HUGE_PAGE) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE), span = size + HUGE_PAGE;
        /* reserve room, place the file at its first 2 MiB boundary, give back the rest */
        uint8_t *r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (r != MAP_FAILED) {
            uint8_t *a = (uint8_t *)(((uintptr_t)r + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
            void *p = mmap(a, size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
            if (p == MAP_FAILED) {
                const int e = errno;
                munmap(r, span);
                errno = e;
                return MAP_FAILED;
            }
            uint8_t *end = a + (size + page - 1) / page * page;
            if (a > r) munmap(r, (size_t)(a - r));
            if (r + span > end) munmap(end, (size_t)(r + span - end));
            return p;
        }
    }
#endif
    return mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
}

int ellm_map_open(const char *path, ellm_map *out) {
    out->data = NULL;
    out->size = 0;
    /* O_NONBLOCK: opening a FIFO (or a device) for reading would otherwise wait forever
     * for a writer; it is refused below as not a regular file. On a regular file the
     * flag changes nothing (reads and mmap never block on it). */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return e;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return EINVAL;
    }
    if (st.st_size == 0) {  /* mmap of length 0 is an error; an empty map is not */
        close(fd);
        return 0;
    }
    void *p = map_file(fd, (size_t)st.st_size);
    int e = errno;
    close(fd);  /* the mapping keeps the file alive */
    if (p == MAP_FAILED) return e;
    out->data = (const uint8_t *)p;
    out->size = (size_t)st.st_size;
    return 0;
}

void ellm_map_close(ellm_map *m) {
    if (m->data) munmap((void *)m->data, m->size);
    m->data = NULL;
    m->size = 0;
}

void ellm_map_advise_willneed(const ellm_map *m, size_t offset, size_t len) {
    if (!m->data || offset >= m->size) return;
    if (len > m->size - offset) len = m->size - offset;
    long page = sysconf(_SC_PAGESIZE);
    size_t start = offset - offset % (size_t)page;
    madvise((void *)(m->data + start), len + (offset - start), MADV_WILLNEED);
}

#ifdef ELLM_HUGE_MOVE
#include <string.h>

/* One core, AMD EPYC Zen 3, Llama-3.2-1B-shape Q4_K_M (584 MB of layers, 215 MB Q6_K
 * head), one decode token's matmuls by thread CPU time, medians of alternated calls (load
 * ~9 from other work), file pages -> an anonymous copy on 2 MiB pages: the layers 41.4 ->
 * 38.4 ms, the head 13.5 -> 12.4 ms; a plain read loop over the head's bytes 14.4 -> 15.6
 * GB/s. */
size_t ellm_map_move_to_huge_pages(ellm_map *m, const int *stop) {
    if (!m->data || ((uintptr_t)m->data & (HUGE_PAGE - 1))) return 0;
    size_t moved = 0;
    for (size_t at = 0; at + HUGE_PAGE <= m->size && !__atomic_load_n(stop, __ATOMIC_RELAXED); at += HUGE_PAGE) {
        /* a 2 MiB-aligned anonymous piece: 4 MiB reserved, the slack on each side returned
         * at once (so nothing else can be mapped into a hole of this range meanwhile) */
        uint8_t *r = mmap(NULL, 2 * HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r == MAP_FAILED) break;
        uint8_t *a = (uint8_t *)(((uintptr_t)r + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (a > r) munmap(r, (size_t)(a - r));
        if (r + 2 * HUGE_PAGE > a + HUGE_PAGE) munmap(a + HUGE_PAGE, (size_t)(r + HUGE_PAGE - a));
        if (madvise(a, HUGE_PAGE, MADV_HUGEPAGE) != 0) {
            munmap(a, HUGE_PAGE);
            break;
        }
        memcpy(a, m->data + at, HUGE_PAGE);
        mprotect(a, HUGE_PAGE, PROT_READ); /* the weights are never written */
        /* in place of the file's pages: one step under the process's map lock, so a reader
         * faulting meanwhile waits and then finds the copy (the same bytes) */
        if (mremap(a, HUGE_PAGE, HUGE_PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)(m->data + at)) == MAP_FAILED) {
            munmap(a, HUGE_PAGE);
            break;
        }
        moved += HUGE_PAGE;
    }
    return moved;
}
#else
size_t ellm_map_move_to_huge_pages(ellm_map *m, const int *stop) {
    (void)m;
    (void)stop;
    return 0;
}
#endif
#endif
