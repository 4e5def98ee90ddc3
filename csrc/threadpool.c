/* The worker pool behind ellm_parallel_for: persistent threads, dynamic chunk claiming.
 *
 * Why dynamic claiming: on a small shared machine another process can take a core at
 * any moment. A static split followed by a barrier (OpenMP / llama.cpp style) then waits
 * for the descheduled thread's whole share; here every chunk is claimed from one atomic
 * counter, so a descheduled thread delays only the chunk it holds and the others (the
 * caller included) take the rest.
 *
 * Protocol, for one job:
 *   caller : publish job fields, set `ticket` = (job id << 32 | 0), bump `gen`, wake
 *            sleepers; claim chunks like a worker; wait until `done` == n_chunks.
 *   worker : wait for `gen` to change (spin for spin_us, then sleep on a futex); claim
 *            chunk indices by CAS on `ticket` until they run out; count each in `done`.
 * The ticket carries the job id so that a worker still holding a stale view of an
 * earlier job can never claim a chunk of the next one: the job fields are written under
 * a seqlock (the ticket's chunk index is CLOSED while they change), and a claim is only
 * valid if the CAS sees exactly the ticket value the fields were read under.
 *
 * One job runs at a time (pool_lock); a second concurrent caller, a nested call from
 * inside a task, and any call with a single chunk run serially on the calling thread.
 * After fork() the child has no workers; the atfork handler resets the pool so the
 * first call in the child starts fresh ones.
 *
 * Platforms: POSIX threads, sleeping on a futex on Linux and on one condition variable
 * elsewhere (macOS; or anywhere with -DELLM_THREADPOOL_CONDVAR, which the cross tests
 * build so that path stays tested); Win32 threads, an SRW lock and WaitOnAddress on
 * Windows.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "threadpool.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>

#ifdef _WIN32
#define ELLM_WIN32_THREADS 1
#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0602 /* Windows 8: WaitOnAddress */
#endif
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#endif

#if defined(__linux__) && !defined(ELLM_THREADPOOL_CONDVAR)
#include <linux/futex.h>
#include <sys/syscall.h>
#define ELLM_HAVE_FUTEX 1
#endif

#if defined(_WIN32)
#define cpu_relax() YieldProcessor()
#elif defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

enum { MAX_THREADS = 256 };
#define MAX_CHUNKS ((int64_t)1 << 30)
#define CLOSED 0xffffffffu /* ticket chunk index while the job fields are being written */

/* ============================== sleeping and waking ============================== */

#ifdef ELLM_HAVE_FUTEX
/* Sleeps while *w == expected (spurious returns are fine: callers loop). */
static void word_wait(atomic_uint *w, unsigned expected) {
    syscall(SYS_futex, (unsigned *)w, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}
static void word_wake(atomic_uint *w, int count) {
    syscall(SYS_futex, (unsigned *)w, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}
#elif defined(ELLM_WIN32_THREADS)
/* WaitOnAddress: the futex's counterpart (Windows 8+, Synchronization.lib). */
static void word_wait(atomic_uint *w, unsigned expected) {
    WaitOnAddress((volatile VOID *)w, &expected, sizeof expected, INFINITE);
}
static void word_wake(atomic_uint *w, int count) {
    if (count == 1)
        WakeByAddressSingle((PVOID)w);
    else
        WakeByAddressAll((PVOID)w);
}
#else
/* Portable fallback: one mutex + condvar for every word; wakes everyone. */
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static void word_wait(atomic_uint *w, unsigned expected) {
    pthread_mutex_lock(&sleep_mu);
    while (atomic_load(w) == expected) pthread_cond_wait(&sleep_cv, &sleep_mu);
    pthread_mutex_unlock(&sleep_mu);
}
static void word_wake(atomic_uint *w, int count) {
    (void)w;
    (void)count;
    pthread_mutex_lock(&sleep_mu);
    pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mu);
}
#endif

static uint64_t now_ns(void) {
#ifdef ELLM_WIN32_THREADS
    static LARGE_INTEGER freq; /* racing first calls store the same value */
    LARGE_INTEGER c;
    if (freq.QuadPart == 0) QueryPerformanceFrequency(&freq);
    QueryPerformanceCounter(&c);
    return (uint64_t)(c.QuadPart / freq.QuadPart) * 1000000000u +
           (uint64_t)(c.QuadPart % freq.QuadPart) * 1000000000u / (uint64_t)freq.QuadPart;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
#endif
}

/* The pool lock and the worker threads: SRW lock and Win32 threads, or pthreads. */
#ifdef ELLM_WIN32_THREADS
typedef SRWLOCK pool_mutex;
#define POOL_MUTEX_INIT SRWLOCK_INIT
static int pool_trylock(pool_mutex *m) { return TryAcquireSRWLockExclusive(m) ? 0 : 1; }
static void pool_unlock(pool_mutex *m) { ReleaseSRWLockExclusive(m); }
typedef HANDLE pool_thread;
#else
typedef pthread_mutex_t pool_mutex;
#define POOL_MUTEX_INIT PTHREAD_MUTEX_INITIALIZER
static int pool_trylock(pool_mutex *m) { return pthread_mutex_trylock(m); }
static void pool_unlock(pool_mutex *m) { pthread_mutex_unlock(m); }
typedef pthread_t pool_thread;
#endif

/* ================================== pool state ================================== */

/* Hot words on their own cache lines: the ticket and done counter are hit by every
 * claim, gen is polled by every spinning worker. */
static struct {
    _Alignas(64) _Atomic uint64_t ticket; /* (job id << 32) | next chunk index */
    _Alignas(64) atomic_uint done;        /* chunks finished in the current job */
    atomic_int caller_sleeping;
    _Alignas(64) atomic_uint gen;         /* bumped once per job; workers sleep on it */
    atomic_int n_sleeping;
    atomic_int stop;
    _Alignas(64) _Atomic(ellm_task_fn) fn; /* job fields: written under the seqlock */
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int64_t grain;
    atomic_uint n_chunks;
    atomic_int max_tid;                   /* workers with id >= this sit the job out */
} P = {.ticket = CLOSED};

static pool_mutex pool_lock = POOL_MUTEX_INIT;
static pool_thread workers[MAX_THREADS];
static unsigned worker_start_gen[MAX_THREADS];
static int n_workers;      /* started workers (ids 1..n_workers); under pool_lock */
static uint32_t job_id;    /* under pool_lock */
static atomic_int want_threads; /* 0 = not decided yet (use the CPU count) */
static atomic_int spin_us = 200;
#ifndef ELLM_WIN32_THREADS
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static int fork_locked;
#endif

static _Thread_local int tls_in_task;

/* ================================== workers ================================== */

/* Claims and runs chunks of the current job until none are left. */
static void run_chunks(int tid) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
        uint32_t idx = (uint32_t)t;
        if (idx == CLOSED) return;
        ellm_task_fn fn = atomic_load_explicit(&P.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_relaxed);
        int64_t n = atomic_load_explicit(&P.n, memory_order_relaxed);
        int64_t grain = atomic_load_explicit(&P.grain, memory_order_relaxed);
        uint32_t n_chunks = atomic_load_explicit(&P.n_chunks, memory_order_relaxed);
        int max_tid = atomic_load_explicit(&P.max_tid, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (idx >= n_chunks || tid >= max_tid) return;
        /* Succeeds only if no new job was published since `t` was read, so the fields
         * above belong to this ticket's job. */
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        int64_t begin = (int64_t)idx * grain;
        int64_t end = n - begin > grain ? begin + grain : n;
        fn(ctx, begin, end, tid);
        unsigned d = atomic_fetch_add(&P.done, 1u) + 1u;
        if (d == n_chunks && atomic_load(&P.caller_sleeping)) word_wake(&P.done, 1);
    }
}

static int64_t spin_budget_ns(void) {
    return (int64_t)atomic_load_explicit(&spin_us, memory_order_relaxed) * 1000;
}

/* Returns once gen differs from *seen (and stores the new value). */
static void wait_for_job(unsigned *seen) {
    unsigned s = *seen, g;
    int64_t budget = spin_budget_ns();
    if (budget > 0) {
        uint64_t start = now_ns();
        for (unsigned i = 1;; i++) {
            g = atomic_load_explicit(&P.gen, memory_order_acquire);
            if (g != s) {
                *seen = g;
                return;
            }
            cpu_relax();
            if ((i & 63u) == 0 && (int64_t)(now_ns() - start) > budget) break;
        }
    }
    for (;;) {
        /* Announce the sleep before the last check: the caller bumps gen and then reads
         * n_sleeping (both seq_cst), so one of us sees the other. */
        atomic_fetch_add(&P.n_sleeping, 1);
        if (atomic_load(&P.gen) == s) word_wait(&P.gen, s);
        atomic_fetch_sub(&P.n_sleeping, 1);
        g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g != s) {
            *seen = g;
            return;
        }
    }
}

static void *worker_main(void *arg) {
    int tid = (int)(intptr_t)arg;
    unsigned seen = worker_start_gen[tid];
    tls_in_task = 1; /* anything a worker runs is inside a task */
    for (;;) {
        wait_for_job(&seen);
        if (atomic_load_explicit(&P.stop, memory_order_acquire)) break;
        run_chunks(tid);
    }
    return NULL;
}

#ifdef ELLM_WIN32_THREADS
static DWORD WINAPI worker_thunk(LPVOID arg) {
    worker_main(arg);
    return 0;
}
#endif

/* ============================ starting and stopping ============================ */

#ifndef ELLM_WIN32_THREADS /* no fork() on Windows */
static void atfork_prepare(void) {
    /* Let a running job finish so the child does not inherit a half-written one. A fork
     * from inside a task would deadlock here, so it skips the lock. */
    fork_locked = !tls_in_task;
    if (fork_locked) pthread_mutex_lock(&pool_lock);
}

static void atfork_parent(void) {
    if (fork_locked) pthread_mutex_unlock(&pool_lock);
}

static void atfork_child(void) {
    /* The workers do not exist in the child: forget them and reset every shared word. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pool_lock = fresh;
#ifndef ELLM_HAVE_FUTEX
    pthread_mutex_t fresh_sleep = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    sleep_mu = fresh_sleep;
    sleep_cv = fresh_cv;
#endif
    n_workers = 0;
    atomic_store(&P.ticket, ((uint64_t)job_id << 32) | CLOSED);
    atomic_store(&P.done, 0u);
    atomic_store(&P.caller_sleeping, 0);
    atomic_store(&P.n_sleeping, 0);
    atomic_store(&P.stop, 0);
}

static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }
#endif

/* Under pool_lock. */
static void stop_workers(void) {
    if (n_workers == 0) return;
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.gen, 1u);
    word_wake(&P.gen, INT_MAX);
    for (int i = 1; i <= n_workers; i++) {
#ifdef ELLM_WIN32_THREADS
        WaitForSingleObject(workers[i], INFINITE);
        CloseHandle(workers[i]);
#else
        pthread_join(workers[i], NULL);
#endif
    }
    n_workers = 0;
    atomic_store(&P.stop, 0);
}

/* Under pool_lock: brings the worker count to `want` (fewer if threads cannot start). */
static void ensure_workers(int want) {
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    if (n_workers > want) stop_workers();
    if (n_workers == want) return;
    unsigned g = atomic_load(&P.gen);
#ifdef ELLM_WIN32_THREADS
    while (n_workers < want) {
        int id = n_workers + 1;
        worker_start_gen[id] = g;
        workers[id] = CreateThread(NULL, 0, worker_thunk, (LPVOID)(intptr_t)id, 0, NULL);
        if (workers[id] == NULL) break;
        n_workers = id;
    }
#else
    pthread_once(&atfork_once, register_atfork);
    /* Workers never take signals: Python's handlers belong to the main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (n_workers < want) {
        int id = n_workers + 1;
        worker_start_gen[id] = g;
        if (pthread_create(&workers[id], NULL, worker_main, (void *)(intptr_t)id) != 0) break;
        n_workers = id;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
#endif
}

/* ================================= public API ================================= */

int ellm_cpu_count(void) {
#ifdef ELLM_WIN32_THREADS
    /* the CPUs of this process's affinity mask (its processor group) */
    DWORD_PTR proc_mask, sys_mask;
    if (GetProcessAffinityMask(GetCurrentProcess(), &proc_mask, &sys_mask) && proc_mask) {
        int c = 0;
        for (; proc_mask; proc_mask &= proc_mask - 1) c++;
        return c;
    }
    DWORD n = GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
    return n > 0 ? (int)n : 1;
#else
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int c = CPU_COUNT(&set);
        if (c > 0) return c;
    }
#endif
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)c : 1;
#endif
}

int ellm_num_threads(void) {
    int n = atomic_load_explicit(&want_threads, memory_order_relaxed);
    if (n <= 0) {
        int c = ellm_cpu_count();
        if (c > MAX_THREADS) c = MAX_THREADS;
        int expected = 0;
        atomic_compare_exchange_strong(&want_threads, &expected, c);
        n = atomic_load(&want_threads);
    }
    return n;
}

void ellm_set_num_threads(int n) {
    if (n <= 0) n = ellm_cpu_count();
    if (n > MAX_THREADS) n = MAX_THREADS;
    /* Takes effect at the next parallel_for, which starts or stops workers under the
     * pool lock; so this is safe from anywhere, a task included. */
    atomic_store(&want_threads, n);
}

int ellm_set_spin_us(int us) {
    if (us < 0) us = 0;
    return atomic_exchange(&spin_us, us);
}

int ellm_in_parallel_region(void) { return tls_in_task; }

static void run_serial(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx, int tid) {
    int outer = tls_in_task;
    tls_in_task = 1;
    for (int64_t begin = 0; begin < n;) {
        int64_t end = n - begin > grain ? begin + grain : n;
        fn(ctx, begin, end, tid);
        begin = end;
    }
    tls_in_task = outer;
}

void ellm_parallel_for(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx) {
    ellm_parallel_for_threads(n, grain, 0, fn, ctx);
}

void ellm_parallel_for_threads(int64_t n, int64_t grain, int max_threads, ellm_task_fn fn, void *ctx) {
    if (n <= 0 || fn == NULL) return;
    if (grain < 1) grain = 1;
    int64_t n_chunks = n / grain + (n % grain != 0);
    if (n_chunks > MAX_CHUNKS) {
        grain = n / MAX_CHUNKS + 1;
        n_chunks = n / grain + (n % grain != 0);
    }
    /* A serial run is one thread, so its id is 0 (ids are unique within a call only). */
    if (n_chunks == 1 || tls_in_task) {
        run_serial(n, grain, fn, ctx, 0);
        return;
    }
    int threads = ellm_num_threads();
    if (max_threads > 0 && max_threads < threads) threads = max_threads;
    if (threads <= 1 || pool_trylock(&pool_lock) != 0) {
        /* Single-threaded, or another thread's job holds the pool: run it here. */
        run_serial(n, grain, fn, ctx, 0);
        return;
    }
    /* The pool keeps ellm_num_threads() - 1 workers; this job may use fewer. */
    ensure_workers(ellm_num_threads() - 1);
    if (n_workers == 0) {
        pool_unlock(&pool_lock);
        run_serial(n, grain, fn, ctx, 0);
        return;
    }

    /* Publish (seqlock writer): close the ticket under the new job id, write the fields,
     * then open chunk 0. */
    uint32_t id = ++job_id;
    atomic_store_explicit(&P.ticket, ((uint64_t)id << 32) | CLOSED, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.n, n, memory_order_relaxed);
    atomic_store_explicit(&P.grain, grain, memory_order_relaxed);
    atomic_store_explicit(&P.n_chunks, (uint32_t)n_chunks, memory_order_relaxed);
    atomic_store_explicit(&P.max_tid, threads, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0u, memory_order_relaxed);
    atomic_store_explicit(&P.ticket, (uint64_t)id << 32, memory_order_release);
    atomic_fetch_add(&P.gen, 1u);
    if (atomic_load(&P.n_sleeping) > 0) {
        /* Wake as many as can help; if this job excludes some workers, wake them all, as
         * the futex does not choose which sleepers it wakes. */
        int64_t helpers = n_chunks - 1 < n_workers ? n_chunks - 1 : n_workers;
        if (threads - 1 < n_workers) helpers = n_workers;
        word_wake(&P.gen, (int)helpers);
    }

    tls_in_task = 1;
    run_chunks(0);
    tls_in_task = 0;

    /* Wait for chunks other threads still hold: spin, then sleep on `done`. */
    uint32_t target = (uint32_t)n_chunks;
    if (atomic_load_explicit(&P.done, memory_order_acquire) != target) {
        int64_t budget = spin_budget_ns();
        uint64_t start = now_ns();
        for (unsigned i = 1; atomic_load_explicit(&P.done, memory_order_acquire) != target; i++) {
            cpu_relax();
            if ((i & 63u) == 0 && (int64_t)(now_ns() - start) > budget) {
                for (;;) {
                    atomic_store(&P.caller_sleeping, 1);
                    unsigned d = atomic_load(&P.done);
                    if (d == target) break;
                    word_wait(&P.done, d);
                }
                atomic_store(&P.caller_sleeping, 0);
                break;
            }
        }
    }
    pool_unlock(&pool_lock);
}

/* ================================== regions ================================== */

typedef struct {
    _Alignas(64) _Atomic uint64_t left; /* (first << 32) | end: chunks [first, end) unclaimed */
} region;

typedef struct {
    ellm_task_fn fn;
    void *ctx;
    int64_t n, grain;
    int n_regions;
    region r[ELLM_MAX_REGIONS];
} regions_job;

/* Claims the first (owner) or last (another thread) unclaimed chunk of r. Relaxed: the
 * pool's completion count orders the work. */
static int claim_chunk(region *r, int from_back, uint32_t *chunk) {
    uint64_t v = atomic_load_explicit(&r->left, memory_order_relaxed);
    for (;;) {
        const uint32_t first = (uint32_t)(v >> 32), end = (uint32_t)v;
        if (first >= end) return 0;
        const uint64_t nv = from_back ? (v & ~(uint64_t)0xffffffffu) | (end - 1) : ((uint64_t)(first + 1) << 32) | end;
        if (atomic_compare_exchange_weak_explicit(&r->left, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            *chunk = from_back ? end - 1 : first;
            return 1;
        }
    }
}

static void run_region_chunk(const regions_job *J, uint32_t chunk, int tid) {
    const int64_t begin = (int64_t)chunk * J->grain, end = begin + J->grain < J->n ? begin + J->grain : J->n;
    J->fn(J->ctx, begin, end, tid);
}

static void task_regions(void *p, int64_t b, int64_t e, int tid) {
    regions_job *J = p;
    const int own = tid < J->n_regions ? tid : 0;
    uint32_t chunk;
    while (claim_chunk(&J->r[own], 0, &chunk)) run_region_chunk(J, chunk, tid);
    for (int k = 1; k < J->n_regions; k++)
        while (claim_chunk(&J->r[(own + k) % J->n_regions], 1, &chunk)) run_region_chunk(J, chunk, tid);
}

/* Chunks [cuts[k], cuts[k + 1]) are region k; the caller has checked the cuts. */
static void run_regions(int64_t n, int64_t grain, const int64_t *cuts, int n_regions, ellm_task_fn fn, void *ctx) {
    regions_job J = {.fn = fn, .ctx = ctx, .n = n, .grain = grain, .n_regions = n_regions};
    for (int k = 0; k < n_regions; k++)
        atomic_init(&J.r[k].left, ((uint64_t)cuts[k] << 32) | (uint64_t)cuts[k + 1]);
    ellm_parallel_for_threads(n_regions, 1, n_regions, task_regions, &J);
}

void ellm_parallel_for_regions(int64_t n, int64_t grain, ellm_task_fn fn, void *ctx) {
    if (n <= 0 || fn == NULL) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = n / grain + (n % grain != 0);
    int threads = ellm_num_threads();
    if (threads > ELLM_MAX_REGIONS) threads = ELLM_MAX_REGIONS;
    if (threads <= 1 || chunks < 2 || chunks > (int64_t)UINT32_MAX || tls_in_task) {
        ellm_parallel_for(n, grain, fn, ctx);
        return;
    }
    int64_t cuts[ELLM_MAX_REGIONS + 1];
    for (int k = 0; k <= threads; k++) cuts[k] = chunks * k / threads;
    run_regions(n, grain, cuts, threads, fn, ctx);
}

void ellm_parallel_for_cut(int64_t n, const int64_t *cuts, int n_regions, ellm_task_fn fn, void *ctx) {
    if (n <= 0 || fn == NULL) return;
    int ok = n_regions >= 1 && n_regions <= ELLM_MAX_REGIONS && n <= (int64_t)UINT32_MAX && cuts[0] == 0 &&
             cuts[n_regions] == n && !tls_in_task;
    for (int k = 0; ok && k < n_regions; k++) ok = cuts[k] <= cuts[k + 1];
    if (!ok || n_regions == 1) {
        ellm_parallel_for(n, 1, fn, ctx);
        return;
    }
    run_regions(n, 1, cuts, n_regions, fn, ctx);
}
