/* Read-only memory maps of model files. No Python here. */
#ifndef ELLM_MAPFILE_H
#define ELLM_MAPFILE_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const uint8_t *data;  /* (size,) bytes, read-only; NULL for an empty file */
    size_t size;
} ellm_map;

/* Maps the whole file at `path`. Returns 0, or an errno value (nothing mapped). */
int ellm_map_open(const char *path, ellm_map *out);
void ellm_map_close(ellm_map *m);
/* Hints the kernel that [offset, offset+len) will be read sequentially soon. */
void ellm_map_advise_willneed(const ellm_map *m, size_t offset, size_t len);

#endif
