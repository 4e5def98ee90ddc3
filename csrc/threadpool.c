/* Placeholder pool: runs every chunk on the calling thread. Replaced by the real pool. */
#include "threadpool.h"

static int n_threads = 1;

void ellm_parallel_for(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    for (int64_t b = 0; b < n; b += grain) fn(ctx, b, b + grain < n ? b + grain : n, 0);
}

int ellm_num_threads(void) { return n_threads; }

void ellm_set_num_threads(int n) { n_threads = 1; (void)n; }
