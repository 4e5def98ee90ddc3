/* The process-wide worker pool every multithreaded kernel runs on. */
#ifndef ELLM_THREADPOOL_H
#define ELLM_THREADPOOL_H
#include <stdint.h>

/* Work on items [begin, end); thread_id is in [0, ellm_num_threads()) and is unique among
 * the threads running one ellm_parallel_for call (not across concurrent calls from
 * different caller threads: per-call scratch belongs in ctx, not in a global array). */
typedef void (*ellm_task_fn)(void *ctx, int64_t begin, int64_t end, int thread_id);

/* Runs fn over [0, n) in chunks of `grain` items that threads claim one at a time
 * (so a descheduled thread delays only its own chunk), and returns when all are done.
 * The calling thread works too. Safe to call with the GIL released, from several
 * threads at once (a second concurrent caller runs its chunks itself, serially), after
 * fork(), and from inside a task (the nested call runs serially on that thread). */
void ellm_parallel_for(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx);

/* The same on at most max_threads threads (<= 0: all), with every thread_id <
 * max_threads guaranteed -- size per-thread scratch by the value you pass here, never
 * by an earlier ellm_num_threads() (another thread may change the count in between). */
void ellm_parallel_for_threads(int64_t n, int64_t grain, int max_threads, ellm_task_fn fn, void *ctx);

/* ellm_parallel_for with the chunks cut into one contiguous region per thread: thread k
 * runs its region's chunks front to back, then takes what is left of the others from
 * their backs (a descheduled thread still delays only the chunk it holds). Calls over the
 * same n give thread k the same items, stolen ones aside, so an op that reads what the op
 * before wrote finds it in its own core's cache: the token-wise ops of a prefill
 * (matmul.c, elementwise.c) all cut their tokens this way. */
void ellm_parallel_for_regions(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx);

/* The same over items [0, n) one at a time (grain 1), with the regions given: region k is
 * items [cuts[k], cuts[k + 1]) (cuts[0] == 0, cuts[n_regions] == n, non-decreasing,
 * n_regions <= ELLM_MAX_REGIONS; anything else runs as ellm_parallel_for). */
#define ELLM_MAX_REGIONS 64
void ellm_parallel_for_cut(int64_t n, const int64_t *cuts, int n_regions, ellm_task_fn fn, void *ctx);

/* Threads the pool uses (the caller included). */
int ellm_num_threads(void);
/* Sets the thread count (>= 1); n <= 0 means "the CPUs this process may use". */
void ellm_set_num_threads(int n);

/* CPUs this process may run on (sched_getaffinity where there is one). */
int ellm_cpu_count(void);
/* How long an idle worker (and a caller waiting for the last chunk) spins before it
 * sleeps, in microseconds; 0 sleeps at once. Default 200. Returns the previous value. */
int ellm_set_spin_us(int us);
/* 1 inside a task run by ellm_parallel_for (on a worker or on the calling thread). */
int ellm_in_parallel_region(void);

#endif
