/* LoRA adapters over a shared base, every adapter of a batch in one call (lora.h). The
 * baseline variant of the inner loops is here; lora_avx2.c holds the AVX2 one. */
#define LORA_SUFFIX scalar
#include "lora_impl.h"

#include <stdatomic.h>

#include "matmul.h"
#include "quant.h"
#include "simd.h"
#include "threadpool.h"

static const ellm_lora_funcs *lora_funcs(void) {
#if defined(__x86_64__) || defined(__i386__)
    const int level = ellm_simd_level();
    if (level == ELLM_SIMD_AVX2 || ellm_simd_is_avx512(level)) return ellm_lora_funcs_avx2();
#endif
    return ellm_lora_funcs_scalar();
}

typedef struct {
    int32_t part, slot, j0, jn;
} a_item;

static int32_t max_rank(const ellm_lora_proj *p) {
    int32_t r = 0;
    for (int32_t s = 0; s < p->n_slots; s++)
        if (p->slots[s].rank > r) r = p->slots[s].rank;
    return r;
}

static int64_t a_items_bound(const ellm_lora_part *parts, int n_parts) {
    int64_t n = 0;
    for (int i = 0; i < n_parts; i++)
        for (int32_t s = 0; s < parts[i].proj->n_slots; s++)
            n += (parts[i].proj->slots[s].rank + SHRINK_CHUNK - 1) / SHRINK_CHUNK;
    return n;
}

static int check(const ellm_lora_part *parts, int n_parts, int64_t T) {
    if (!parts || n_parts < 1 || n_parts > ELLM_LORA_MAX_PARTS || T < 0 || !parts[0].proj) return ELLM_E_SHAPE;
    const int64_t K = parts[0].proj->K;
    const int32_t S = parts[0].proj->n_slots;
    for (int i = 0; i < n_parts; i++) {
        const ellm_lora_proj *p = parts[i].proj;
        if (!p || p->K != K || p->K < 1 || p->N < 1 || p->n_slots != S || S < 0 || (S && !p->slots))
            return ELLM_E_SHAPE;
        if (!parts[i].y || parts[i].ldy < p->N) return ELLM_E_SHAPE;
        for (int32_t s = 0; s < S; s++) {
            const ellm_lora_slot *sl = &p->slots[s];
            if (sl->rank < 0 || (sl->rank > 0 && (!sl->at || !sl->bt))) return ELLM_E_SHAPE;
            if (sl->dtype != ELLM_LORA_F32 && sl->dtype != ELLM_LORA_F16 && sl->dtype != ELLM_LORA_BF16)
                return ELLM_E_TYPE;
        }
    }
    return ELLM_OK;
}

size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T) {
    if (check(parts, n_parts, T) != ELLM_OK) return 0;
    const int32_t S = parts[0].proj->n_slots;
    size_t bytes = (size_t)(S + 1) * sizeof(int64_t) + (size_t)a_items_bound(parts, n_parts) * sizeof(a_item);
    for (int i = 0; i < n_parts; i++) bytes += (size_t)T * (size_t)max_rank(parts[i].proj) * sizeof(float);
    bytes += (size_t)T * sizeof(int32_t);
    return bytes + 8;
}

typedef struct {
    const ellm_lora_funcs *f;
    const float *x;
    int64_t ldx, K;
    const ellm_lora_part *parts;
    int n_parts, active;
    int64_t deferred;      /* > 0: the shrink's items, left to the base's pass (help_shrink) */
    const int32_t *row_slot;
    const int32_t *order;  /* rows grouped by slot */
    const int64_t *start;  /* (S + 1,): slot s's rows are order[start[s] .. start[s + 1]) */
    float *u[ELLM_LORA_MAX_PARTS];    /* (T, ranks[p]): A x of each row, for part p */
    int32_t ranks[ELLM_LORA_MAX_PARTS];
    const a_item *items;
    int64_t b_first[ELLM_LORA_MAX_PARTS + 1]; /* B items: part p's are [b_first[p], b_first[p + 1]) */
} lora_job;

static void task_a(void *ctx, int64_t begin, int64_t end, int tid) {
    const lora_job *J = ctx;
    for (int64_t it = begin; it < end; it++) {
        const a_item w = J->items[it];
        const ellm_lora_slot *sl = &J->parts[w.part].proj->slots[w.slot];
        float *u = J->u[w.part];
        const int32_t R = J->ranks[w.part];
        for (int64_t g = J->start[w.slot]; g < J->start[w.slot + 1]; g += 2) {   /* rows in pairs */
            const int32_t t0 = J->order[g];
            const int pair = g + 1 < J->start[w.slot + 1];
            const int32_t t1 = pair ? J->order[g + 1] : t0;
            J->f->shrink(sl->at, sl->dtype, J->K, sl->rank, w.j0, w.jn, J->x + t0 * J->ldx,
                         pair ? J->x + t1 * J->ldx : NULL, u + (int64_t)t0 * R + w.j0,
                         u + (int64_t)t1 * R + w.j0);
        }
    }
}

static void task_b(void *ctx, int64_t begin, int64_t end, int tid) {
    const lora_job *J = ctx;
    for (int64_t it = begin; it < end; it++) {
        int p = 0;
        while (it >= J->b_first[p + 1]) p++;
        const ellm_lora_part *part = &J->parts[p];
        const ellm_lora_proj *proj = part->proj;
        const int64_t n0 = (it - J->b_first[p]) * EXPAND_BLOCK;
        const int64_t nc = n0 + EXPAND_BLOCK < proj->N ? EXPAND_BLOCK : proj->N - n0;
        const int32_t R = J->ranks[p];
        for (int32_t s = 0; s < proj->n_slots; s++) {
            const ellm_lora_slot *sl = &proj->slots[s];
            if (sl->rank == 0) continue;
            for (int64_t g = J->start[s]; g < J->start[s + 1]; g++) {
                const int32_t t = J->order[g];
                J->f->expand(sl->bt, sl->dtype, proj->N, sl->rank, n0, nc, J->u[p] + (int64_t)t * R, sl->scale,
                             part->y + t * part->ldy + n0);
            }
        }
    }
}

/* Checks, groups the rows by slot and sums u = A x of every adapted row into the scratch
 * (J set up for the expand); J->active is 0 when no row is adapted. A small shrink (a decode
 * step's few rows) runs on the calling thread: it is a few microseconds, less than waking
 * the pool for it. */
#define LORA_SERIAL_SHRINK_MACS ((int64_t)1 << 16)

static int lora_prepare(lora_job *J, const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                        const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes,
                        int may_defer) {
    memset(J, 0, sizeof(*J));
    int st = check(parts, n_parts, T);
    if (st != ELLM_OK) return st;
    const int64_t K = parts[0].proj->K;
    if (T == 0) return ELLM_OK;
    if (!x || !row_slot || ldx < K) return ELLM_E_SHAPE;
    const size_t need = ellm_lora_scratch_bytes(parts, n_parts, T);
    if (!scratch || scratch_bytes < need || ((uintptr_t)scratch & 7)) return ELLM_E_SCRATCH;
    const int32_t S = parts[0].proj->n_slots;
    for (int64_t t = 0; t < T; t++)
        if (row_slot[t] < -1 || row_slot[t] >= S) return ELLM_E_INDEX;

    /* scratch: start (S + 1) int64 | A items | u of each part | order (T) int32 */
    uint8_t *mem = scratch;
    int64_t *start = (int64_t *)mem;
    mem += (size_t)(S + 1) * sizeof(int64_t);
    a_item *items = (a_item *)mem;
    mem += (size_t)a_items_bound(parts, n_parts) * sizeof(a_item);
    for (int i = 0; i < n_parts; i++) {
        J->ranks[i] = max_rank(parts[i].proj);
        J->u[i] = (float *)mem;
        mem += (size_t)T * (size_t)J->ranks[i] * sizeof(float);
    }
    int32_t *order = (int32_t *)mem;

    /* counting sort of the adapted rows by slot, stable in row order */
    memset(start, 0, (size_t)(S + 1) * sizeof(int64_t));
    int64_t adapted = 0;
    for (int64_t t = 0; t < T; t++)
        if (row_slot[t] >= 0) start[row_slot[t] + 1]++, adapted++;
    if (adapted == 0) return ELLM_OK;
    for (int32_t s = 0; s < S; s++) start[s + 1] += start[s];
    for (int64_t t = 0; t < T; t++)   /* start[s] runs to slot s's end while placing */
        if (row_slot[t] >= 0) order[start[row_slot[t]]++] = (int32_t)t;
    for (int32_t s = S; s > 0; s--) start[s] = start[s - 1];
    start[0] = 0;

    int64_t n_items = 0, macs = 0;
    for (int i = 0; i < n_parts; i++)
        for (int32_t s = 0; s < S; s++) {
            const int32_t r = parts[i].proj->slots[s].rank;
            if (r == 0 || start[s] == start[s + 1]) continue;
            macs += (start[s + 1] - start[s]) * K * r;
            for (int32_t j = 0; j < r; j += SHRINK_CHUNK)
                items[n_items++] = (a_item){i, s, j, r - j < SHRINK_CHUNK ? r - j : SHRINK_CHUNK};
        }
    if (n_items == 0) return ELLM_OK;

    J->f = lora_funcs();
    J->x = x;
    J->ldx = ldx;
    J->K = K;
    J->parts = parts;
    J->n_parts = n_parts;
    J->order = order;
    J->start = start;
    J->items = items;
    J->row_slot = row_slot;
    for (int i = 0; i < n_parts; i++)
        J->b_first[i + 1] = J->b_first[i] + (parts[i].proj->N + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
    J->active = 1;
    if (macs <= LORA_SERIAL_SHRINK_MACS || ellm_num_threads() < 2) {
        if (may_defer) J->deferred = n_items;   /* the base's pass runs it, as its blocks start */
        else task_a(J, 0, n_items, 0);
    } else {
        ellm_parallel_for(n_items, 1, task_a, J);
    }
    return ELLM_OK;
}

int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                    const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes) {
    lora_job J;
    const int st = lora_prepare(&J, x, ldx, T, row_slot, parts, n_parts, scratch, scratch_bytes, 0);
    if (st != ELLM_OK || !J.active) return st;
    ellm_parallel_for(J.b_first[n_parts], 1, task_b, &J);
    return ELLM_OK;
}

/* The expand of lora part lp for outputs [n0, n1) of rows [t0, t1): each adapted row's
 * outputs in that block, right after the base product wrote them. The rows of one adapter
 * go four at a time (each load of B serves four); the same sums as task_b either way, so
 * the same bits. */
static void expand_block(const lora_job *J, int lp, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
    const ellm_lora_part *part = &J->parts[lp];
    const ellm_lora_proj *proj = part->proj;
    const int32_t R = J->ranks[lp];
    const int four = t1 - t0 > 1;
    for (int32_t s = 0; s < proj->n_slots; s++) {
        const ellm_lora_slot *sl = &proj->slots[s];
        if (sl->rank == 0 || J->start[s] == J->start[s + 1]) continue;
        const float *u[4];
        float *y[4];
        int rows = 0;
        for (int64_t g = J->start[s]; g <= J->start[s + 1]; g++) {   /* this slot's rows, in order */
            const int32_t t = g < J->start[s + 1] ? J->order[g] : -1;
            if (t >= 0 && (t < t0 || t >= t1)) continue;
            if (t >= 0 && four) {
                u[rows] = J->u[lp] + t * R;
                y[rows++] = part->y + t * part->ldy + n0;
            } else if (t >= 0) {
                for (int64_t c0 = n0; c0 < n1; c0 += EXPAND_BLOCK) {
                    const int64_t nc = c0 + EXPAND_BLOCK < n1 ? EXPAND_BLOCK : n1 - c0;
                    J->f->expand(sl->bt, sl->dtype, proj->N, sl->rank, c0, nc, J->u[lp] + t * R, sl->scale,
                                 part->y + t * part->ldy + c0);
                }
            }
            if (rows == 4 || (rows > 0 && t < 0)) {
                if (rows == 1) {   /* one row: the single-row kernel's wider blocks */
                    for (int64_t c0 = n0; c0 < n1; c0 += EXPAND_BLOCK) {
                        const int64_t nc = c0 + EXPAND_BLOCK < n1 ? EXPAND_BLOCK : n1 - c0;
                        J->f->expand(sl->bt, sl->dtype, proj->N, sl->rank, c0, nc, u[0], sl->scale, y[0] + (c0 - n0));
                    }
                } else {
                    for (int i = rows; i < 4; i++) u[i] = u[0], y[i] = y[0];
                    J->f->expand4(sl->bt, sl->dtype, sl->rank, n0, n1 - n0, u, sl->scale, y, rows);
                }
                rows = 0;
            }
        }
    }
}

/* A block of outputs whose expand waits for the shrink: the thread that completes the
 * shrink runs it (ready: its fields are written). */
typedef struct {
    int part;
    int64_t n0, n1, t0, t1;
    _Atomic int ready;
} waiting_block;

#define LORA_WAITING_MAX 32
#define SHRINK_COMPLETE ((uint64_t)1 << 63)

typedef struct {
    const lora_job *J;
    int lora_of[ELLM_LINEAR_MAX_PARTS]; /* linear part -> its lora part, or -1 */
    /* [deferred shrink] its J->deferred items: the next one to claim, and how many are done */
    _Atomic int64_t shrink_next, shrink_done;
    /* SHRINK_COMPLETE once every item is done; below it, how many of `waiting` are taken */
    _Atomic uint64_t state;
    waiting_block waiting[LORA_WAITING_MAX];
} lora_epilogue;

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A small shrink (a decode step's) runs inside the base product's pass: each thread that
 * starts a block while some of its items (a chunk of 16 ranks of one adapter's A for one
 * projection: q, k and v are three) are unclaimed sums them one by one there and then, the
 * others start on their base blocks. A block whose base product is done before the
 * shrink does not wait for it: its expand is left in `waiting`, and the thread that
 * completes the shrink runs it (then and there, inside the same pass), so no thread
 * spins while another sums A. Each item and each expand is the same sums whichever thread
 * runs it, so the bits do not depend on the sharing. Serial before the pass, the shrink
 * left the other threads idle for its length; on one thread inside it, with the expands
 * waiting for it, they spun for it (SmolLM2 decode, 2 threads: ~2% of the samples). */
static void help_shrink(lora_epilogue *E) {
    const int64_t n = E->J->deferred;
    while (atomic_load_explicit(&E->shrink_next, memory_order_relaxed) < n) {
        const int64_t it = atomic_fetch_add_explicit(&E->shrink_next, 1, memory_order_relaxed);
        if (it >= n) break;
        task_a((void *)E->J, it, it + 1, 0);
        if (atomic_fetch_add_explicit(&E->shrink_done, 1, memory_order_acq_rel) + 1 == n) {
            /* the last item: every u is summed; the blocks left waiting are this thread's */
            const uint64_t taken = atomic_fetch_or_explicit(&E->state, SHRINK_COMPLETE, memory_order_acq_rel);
            for (uint64_t i = 0; i < taken; i++) {
                waiting_block *w = &E->waiting[i];
                while (!atomic_load_explicit(&w->ready, memory_order_acquire)) spin_pause();   /* being written */
                expand_block(E->J, E->lora_of[w->part], w->n0, w->n1, w->t0, w->t1);
            }
        }
    }
}

static void lora_epilogue_fn(void *ctx, int part, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
    lora_epilogue *E = ctx;
    if (part < 0 || part >= ELLM_LINEAR_MAX_PARTS || E->lora_of[part] < 0) return;
    help_shrink(E);
    uint64_t s = atomic_load_explicit(&E->state, memory_order_acquire);
    while (!(s & SHRINK_COMPLETE)) {
        if (s >= LORA_WAITING_MAX) {   /* no room left: wait for the shrink (a thread is summing it) */
            while (!(atomic_load_explicit(&E->state, memory_order_acquire) & SHRINK_COMPLETE)) spin_pause();
            break;
        }
        if (atomic_compare_exchange_weak_explicit(&E->state, &s, s + 1, memory_order_acq_rel, memory_order_acquire)) {
            waiting_block *w = &E->waiting[s];
            w->part = part, w->n0 = n0, w->n1 = n1, w->t0 = t0, w->t1 = t1;
            atomic_store_explicit(&w->ready, 1, memory_order_release);
            return;   /* the thread completing the shrink expands it */
        }
    }
    expand_block(E->J, E->lora_of[part], n0, n1, t0, t1);
}

/* Asks for the B factors expand_block will read for this block (each adapter of its rows
 * once), so that they come from memory while the base product is summed: read when the
 * base is done, they stalled the expand (SmolLM2 decode: 8% of a step, 1 thread). */
static void lora_prefetch_fn(void *ctx, int part, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
    lora_epilogue *E = ctx;
    help_shrink(E);   /* unclaimed shrink items first: every expand needs them */
    if (part < 0 || part >= ELLM_LINEAR_MAX_PARTS || E->lora_of[part] < 0) return;
    const lora_job *J = E->J;
    const ellm_lora_proj *proj = J->parts[E->lora_of[part]].proj;
    int32_t last = -1;
    for (int64_t t = t0; t < t1; t++) {
        const int32_t s = J->row_slot[t];
        if (s < 0 || s == last) continue;
        last = s;
        const ellm_lora_slot *sl = &proj->slots[s];
        if (sl->rank == 0) continue;
        const size_t elt = sl->dtype == ELLM_LORA_F32 ? 4 : 2, group = (size_t)sl->rank * 8 * elt;
        const char *b = (const char *)sl->bt + (size_t)(n0 >> 3) * group;
        const size_t bytes = (size_t)(((n1 - 1) >> 3) - (n0 >> 3) + 1) * group;
        for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(b + off, 0, 3);
    }
}

int ellm_linear_multi_lora(const float *x, int64_t T, int64_t K, const ellm_linear_part *lin, int n_lin,
                           void *lin_scratch, size_t lin_bytes, const int32_t *row_slot,
                           const ellm_lora_part *parts, const int *lin_index, int n_parts, void *scratch,
                           size_t scratch_bytes) {
    if (row_slot == NULL || n_parts == 0) return ellm_linear_multi(x, T, K, lin, n_lin, lin_scratch, lin_bytes);
    if (!lin || n_lin < 1 || n_lin > ELLM_LINEAR_MAX_PARTS || !lin_index || n_parts < 0 ||
        n_parts > ELLM_LORA_MAX_PARTS)
        return ELLM_E_SHAPE;
    lora_epilogue E;
    for (int i = 0; i < ELLM_LINEAR_MAX_PARTS; i++) E.lora_of[i] = -1;
    atomic_init(&E.shrink_next, 0);
    atomic_init(&E.shrink_done, 0);
    atomic_init(&E.state, 0);
    for (int i = 0; i < LORA_WAITING_MAX; i++) atomic_init(&E.waiting[i].ready, 0);
    for (int i = 0; i < n_parts; i++) {   /* each lora part adds to its own linear part's y */
        const int li = lin_index[i];
        if (li < 0 || li >= n_lin || E.lora_of[li] >= 0 || !parts[i].proj) return ELLM_E_SHAPE;
        if (parts[i].y != lin[li].y || parts[i].ldy != lin[li].ldy || parts[i].proj->N != lin[li].N ||
            parts[i].proj->K != K)
            return ELLM_E_SHAPE;
        E.lora_of[li] = i;
    }
    lora_job J;
    const int st = lora_prepare(&J, x, K, T, row_slot, parts, n_parts, scratch, scratch_bytes, 1);
    if (st != ELLM_OK) return st;
    if (!J.active) return ellm_linear_multi(x, T, K, lin, n_lin, lin_scratch, lin_bytes);
    E.J = &J;
    if (J.deferred == 0) atomic_init(&E.state, SHRINK_COMPLETE);   /* the shrink ran before the pass */
    const ellm_linear_epilogue epi = {lora_epilogue_fn, &E, lora_prefetch_fn};
    return ellm_linear_multi_epi(x, T, K, lin, n_lin, lin_scratch, lin_bytes, &epi);
}
