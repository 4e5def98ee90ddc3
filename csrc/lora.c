/* LoRA adapters over a shared base, every adapter of a batch in one call (lora.h). */
#include "lora.h"

#include <string.h>

#include "quant.h"
#include "threadpool.h"

#define A_ROWS_PER_ITEM 4   /* rank rows of one adapter's A per work item */
#define B_ROWS_PER_ITEM 16  /* output rows per work item of the B products */

/* The one summation order of every dot product here: 8 lanes (i mod 8), a fixed tree over
 * them, then the tail in order. Plain multiplies and adds (no FMA at the baseline ISA), so
 * the compiler's vectorized code gives the same bits at every level. */
static inline float dot_f32(const float *a, const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * x[i + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * x[i];
    return s;
}

typedef struct {
    int32_t part, slot, j0, j1;
} a_item;

static int max_rank(const ellm_lora_proj *p) {
    int32_t r = 0;
    for (int32_t s = 0; s < p->n_slots; s++)
        if (p->slots[s].rank > r) r = p->slots[s].rank;
    return r;
}

static int64_t a_items_bound(const ellm_lora_part *parts, int n_parts) {
    int64_t n = 0;
    for (int i = 0; i < n_parts; i++)
        for (int32_t s = 0; s < parts[i].proj->n_slots; s++)
            n += (parts[i].proj->slots[s].rank + A_ROWS_PER_ITEM - 1) / A_ROWS_PER_ITEM;
    return n;
}

static int check(const ellm_lora_part *parts, int n_parts, int64_t T) {
    if (!parts || n_parts < 1 || n_parts > ELLM_LORA_MAX_PARTS || T < 0) return ELLM_E_SHAPE;
    const int64_t K = parts[0].proj ? parts[0].proj->K : -1;
    for (int i = 0; i < n_parts; i++) {
        const ellm_lora_proj *p = parts[i].proj;
        if (!p || p->K != K || p->K < 1 || p->N < 1 || p->n_slots < 0 || (p->n_slots && !p->slots))
            return ELLM_E_SHAPE;
        if (!parts[i].y || parts[i].ldy < p->N) return ELLM_E_SHAPE;
        for (int32_t s = 0; s < p->n_slots; s++) {
            const ellm_lora_slot *sl = &p->slots[s];
            if (sl->rank < 0 || (sl->rank > 0 && (!sl->a || !sl->b))) return ELLM_E_SHAPE;
        }
    }
    return ELLM_OK;
}

static int32_t slots_of(const ellm_lora_part *parts, int n_parts) {
    int32_t S = 0;
    for (int i = 0; i < n_parts; i++)
        if (parts[i].proj->n_slots > S) S = parts[i].proj->n_slots;
    return S;
}

size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T) {
    if (check(parts, n_parts, T) != ELLM_OK) return 0;
    const int32_t S = slots_of(parts, n_parts);
    size_t bytes = (size_t)(S + 1) * sizeof(int64_t) + (size_t)a_items_bound(parts, n_parts) * sizeof(a_item);
    for (int i = 0; i < n_parts; i++) bytes += (size_t)T * (size_t)max_rank(parts[i].proj) * sizeof(float);
    bytes += (size_t)T * sizeof(int32_t);
    return bytes + 8;
}

typedef struct {
    const float *x;
    int64_t ldx, K;
    const ellm_lora_part *parts;
    int n_parts;
    const int32_t *order;  /* rows grouped by slot */
    const int64_t *start;  /* (S + 1,): slot s's rows are order[start[s] .. start[s + 1]) */
    float *u[ELLM_LORA_MAX_PARTS];    /* (T, ranks[p]): A x of each row, for part p */
    int32_t ranks[ELLM_LORA_MAX_PARTS];
    const a_item *items;
    int64_t b_first[ELLM_LORA_MAX_PARTS + 1]; /* B work items: part p's are [b_first[p], b_first[p+1]) */
} lora_job;

static void task_a(void *ctx, int64_t begin, int64_t end, int tid) {
    const lora_job *J = ctx;
    for (int64_t it = begin; it < end; it++) {
        const a_item w = J->items[it];
        const ellm_lora_slot *sl = &J->parts[w.part].proj->slots[w.slot];
        float *u = J->u[w.part];
        const int32_t R = J->ranks[w.part];
        for (int32_t j = w.j0; j < w.j1; j++) {
            const float *a = sl->a + (int64_t)j * J->K;
            for (int64_t g = J->start[w.slot]; g < J->start[w.slot + 1]; g++) {
                const int32_t t = J->order[g];
                u[(int64_t)t * R + j] = dot_f32(a, J->x + t * J->ldx, J->K);
            }
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
        const int64_t n0 = (it - J->b_first[p]) * B_ROWS_PER_ITEM;
        const int64_t n1 = n0 + B_ROWS_PER_ITEM < proj->N ? n0 + B_ROWS_PER_ITEM : proj->N;
        const int32_t R = J->ranks[p];
        for (int32_t s = 0; s < proj->n_slots; s++) {
            const ellm_lora_slot *sl = &proj->slots[s];
            if (sl->rank == 0 || J->start[s] == J->start[s + 1]) continue;
            for (int64_t n = n0; n < n1; n++) {
                const float *b = sl->b + n * sl->rank;
                for (int64_t g = J->start[s]; g < J->start[s + 1]; g++) {
                    const int32_t t = J->order[g];
                    part->y[t * part->ldy + n] += sl->scale * dot_f32(b, J->u[p] + (int64_t)t * R, sl->rank);
                }
            }
        }
    }
}

int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                    const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes) {
    int st = check(parts, n_parts, T);
    if (st != ELLM_OK) return st;
    const int64_t K = parts[0].proj->K;
    if (T == 0) return ELLM_OK;
    if (!x || !row_slot || ldx < K) return ELLM_E_SHAPE;
    const size_t need = ellm_lora_scratch_bytes(parts, n_parts, T);
    if (!scratch || scratch_bytes < need || ((uintptr_t)scratch & 7)) return ELLM_E_SCRATCH;
    const int32_t S = slots_of(parts, n_parts);
    for (int64_t t = 0; t < T; t++)
        if (row_slot[t] < -1 || row_slot[t] >= S) return ELLM_E_INDEX;
    for (int i = 0; i < n_parts; i++)   /* a row whose adapter lacks a part's slot list */
        if (parts[i].proj->n_slots != S) return ELLM_E_SHAPE;

    /* scratch: start (S + 1) int64 | items | u of each part | order (T) int32 */
    uint8_t *mem = scratch;
    lora_job J;
    memset(&J, 0, sizeof(J));
    int64_t *start = (int64_t *)mem;
    mem += (size_t)(S + 1) * sizeof(int64_t);
    a_item *items = (a_item *)mem;
    mem += (size_t)a_items_bound(parts, n_parts) * sizeof(a_item);
    for (int i = 0; i < n_parts; i++) {
        J.ranks[i] = max_rank(parts[i].proj);
        J.u[i] = (float *)mem;
        mem += (size_t)T * (size_t)J.ranks[i] * sizeof(float);
    }
    int32_t *order = (int32_t *)mem;

    /* counting sort of the rows by slot, stable in row order */
    memset(start, 0, (size_t)(S + 1) * sizeof(int64_t));
    int64_t adapted = 0;
    for (int64_t t = 0; t < T; t++)
        if (row_slot[t] >= 0) start[row_slot[t] + 1]++, adapted++;
    if (adapted == 0) return ELLM_OK;
    for (int32_t s = 0; s < S; s++) start[s + 1] += start[s];
    for (int64_t t = 0, placed = 0; t < T && placed < adapted; t++) {
        const int32_t s = row_slot[t];
        if (s < 0) continue;
        /* start[s] advances while placing, then is restored below */
        order[start[s]++] = (int32_t)t;
        placed++;
    }
    for (int32_t s = S; s > 0; s--) start[s] = start[s - 1];
    start[0] = 0;

    int64_t n_items = 0;
    for (int i = 0; i < n_parts; i++)
        for (int32_t s = 0; s < S; s++) {
            const int32_t r = parts[i].proj->slots[s].rank;
            if (r == 0 || start[s] == start[s + 1]) continue;
            for (int32_t j = 0; j < r; j += A_ROWS_PER_ITEM)
                items[n_items++] = (a_item){i, s, j, j + A_ROWS_PER_ITEM < r ? j + A_ROWS_PER_ITEM : r};
        }
    if (n_items == 0) return ELLM_OK;

    J.x = x;
    J.ldx = ldx;
    J.K = K;
    J.parts = parts;
    J.n_parts = n_parts;
    J.order = order;
    J.start = start;
    J.items = items;
    J.b_first[0] = 0;
    for (int i = 0; i < n_parts; i++)
        J.b_first[i + 1] = J.b_first[i] + (parts[i].proj->N + B_ROWS_PER_ITEM - 1) / B_ROWS_PER_ITEM;
    ellm_parallel_for(n_items, 1, task_a, &J);
    ellm_parallel_for(J.b_first[n_parts], 4, task_b, &J);
    return ELLM_OK;
}
