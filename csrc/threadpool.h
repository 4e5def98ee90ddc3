/* The process-wide worker pool every multithreaded kernel runs on. */
#ifndef ELLM_THREADPOOL_H
#define ELLM_THREADPOOL_H
#include <stdint.h>

/* Work on items [begin, end); thread_id is in [0, ellm_num_threads()). */
typedef void (*ellm_task_fn)(void *ctx, int64_t begin, int64_t end, int thread_id);

/* Runs fn over [0, n) in chunks of `grain` items that threads claim one at a time
 * (so a descheduled thread delays only its own chunk), and returns when all are done.
 * The calling thread works too. Safe to call with the GIL released. */
void ellm_parallel_for(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx);

/* Threads the pool uses (the caller included). */
int ellm_num_threads(void);
/* Sets the thread count (>= 1); n <= 0 means "the CPUs this process may use". */
void ellm_set_num_threads(int n);

#endif
