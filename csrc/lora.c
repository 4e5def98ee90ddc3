/* LoRA adapters over a shared base, every adapter of a batch in one call (lora.h). The
 * baseline variant of the inner loops is here; lora_avx2.c holds the AVX2 one. */
#define LORA_SUFFIX scalar
#include "lora_impl.h"

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

int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                    const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes) {
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

    int64_t n_items = 0;
    for (int i = 0; i < n_parts; i++)
        for (int32_t s = 0; s < S; s++) {
            const int32_t r = parts[i].proj->slots[s].rank;
            if (r == 0 || start[s] == start[s + 1]) continue;
            for (int32_t j = 0; j < r; j += SHRINK_CHUNK)
                items[n_items++] = (a_item){i, s, j, r - j < SHRINK_CHUNK ? r - j : SHRINK_CHUNK};
        }
    if (n_items == 0) return ELLM_OK;

    J.f = lora_funcs();
    J.x = x;
    J.ldx = ldx;
    J.K = K;
    J.parts = parts;
    J.order = order;
    J.start = start;
    J.items = items;
    for (int i = 0; i < n_parts; i++)
        J.b_first[i + 1] = J.b_first[i] + (parts[i].proj->N + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
    ellm_parallel_for(n_items, 1, task_a, &J);
    ellm_parallel_for(J.b_first[n_parts], 1, task_b, &J);
    return ELLM_OK;
}
