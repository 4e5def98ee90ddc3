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

/* Moves the map's whole 2 MiB pieces, one after the other, onto anonymous memory that asks
 * for 2 MiB pages (Linux transparent huge pages): each piece is copied and then put in
 * place of the file's pages at the same addresses (mremap), so readers -- a decode running
 * meanwhile included -- see the same bytes throughout, and resident memory stays one copy.
 * A decode step reads every weight from DRAM; on 4 KiB file pages a core takes a TLB miss
 * and a hardware prefetcher restart every 4 KiB (csrc/mapfile.c has the figures).
 * Stops early, leaving the rest on the file's pages, when *stop becomes nonzero (read
 * between pieces), or when a piece cannot be had. Returns the bytes now on such memory;
 * 0 where the platform has none (anything but Linux) or the map is not 2 MiB aligned. */
size_t ellm_map_move_to_huge_pages(ellm_map *m, const int *stop);

/* Sets *stop for a move running on another thread (an atomic store; the move reads it
 * atomically between pieces). */
void ellm_map_request_stop(int *stop);

#endif
