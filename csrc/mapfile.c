/* Read-only memory maps of model files: weights stay in the page cache, never copied. */
#define _GNU_SOURCE
#include "mapfile.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
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
