/* Fused RoPE + paged attention: validation, the parallel phases, the online softmax,
 * the fold of key chunks, and the scalar inner loops. The vector inner loops (q.k
 * scores of a key tile, p @ V into the accumulators) are in attention_avx2.c and
 * attention_avx512.c.
 *
 * Numerics follow reference.rope_attention: rope angles are (f32 position * f32 inv_freq)
 * rounded to f32, their cos/sin taken in double and rounded, then times rope_mscale in
 * f32; only the first n_rot pairs rotate (partial rotary), the other dims are copied;
 * scores are (q.k) * scale, then softcapped; the softmax is exact up to rounding.
 *
 * Batch invariance (see attention.h) rests on one fixed recipe per (token, query head):
 *   - its keys [lo, p] are cut at absolute positions multiple of CHUNK into chunks, and
 *     each chunk at multiples of TILE into tiles;
 *   - a chunk's partial (m, l, acc) starts empty and takes its tiles in order (online
 *     softmax: acc rescaled by exp(m_old - m_new) when the max grows);
 *   - the first chunk's partial becomes the state, each later one is folded in by
 *     merge_row in order, and the state is divided by its sum at the end.
 * Two schedules run this recipe: attend_run (phase 2a: a run of query tokens of one
 * sequence per item, sharing each K/V tile; chunks kept in a per-thread buffer) and
 * the split schedule for small batches (phase 2b: one chunk of one token per item,
 * partials in scratch, phase 3 folds them). The shared steps (attend_tile, merge_row,
 * finish_row) are single noinline functions so both compile to the same instructions. */
#include "attention.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "convert.h"
#include "elementwise.h"
#include "simd.h"
#include "threadpool.h"

enum {
    TILE = ELLM_ATTN_TILE,         /* keys per tile: the unit of the online softmax */
    CHUNK = ELLM_ATTN_CHUNK,       /* keys per chunk: the unit spread over threads */
    MAX_ROWS = ELLM_ATTN_MAX_ROWS, /* query rows (token, head) per pass over a tile */
    ROPE_CHUNK = 64,               /* rotation pairs whose cos/sin are held at once */
    SPLIT_PAIRS = 4,               /* split keys when (token, kv head) pairs < this * threads */
    /* below this, one thread: waking a worker costs more than the work. Low, because in
     * a model a decode's keys come from memory (the weights streamed through the caches
     * since the layer last ran), so even a short call waits on misses that two threads
     * overlap: SmolLM2 decode at 64-192 keys, attention 1.15-1.33 -> 0.92-0.96 ms a
     * token with 1 << 18 -> 0 here (AMD EPYC, 2 threads) */
    SMALL_CALL_MUL_ADDS = 1 << 15,
};
/* The split schedule's partials may take at most this many floats (else: no split). */
#define MAX_PARTIAL_FLOATS ((int64_t)1 << 22)

_Static_assert(CHUNK % TILE == 0, "chunks are whole tiles");

/* =============================== scalar inner loops =============================== */

void ellm_attn_qk_scalar(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    for (int j = 0; j < n; j++) {
        const float *k = kp[j];
        for (int h = 0; h < g; h++) {
            const float *qh = q + (int64_t)h * hd;
            float acc[4] = {0, 0, 0, 0};
            int d = 0;
            for (; d + 4 <= hd; d += 4)
                for (int u = 0; u < 4; u++) acc[u] += qh[d + u] * k[d + u];
            for (; d < hd; d++) acc[0] += qh[d] * k[d];
            s[h * TILE + j] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
    }
}

void ellm_attn_pv_scalar(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    for (int h = 0; h < g; h++) {
        float *a = acc + (int64_t)h * hd;
        for (int j = 0; j < n; j++) {
            const float w = p[h * TILE + j];
            const float *v = vp[j];
            for (int d = 0; d < hd; d++) a[d] += w * v[d];
        }
    }
}

void ellm_attn_widen_scalar(const uint16_t *const *src, int n, int hd, float *dst) {
    for (int j = 0; j < n; j++)
        for (int d = 0; d < hd; d++) dst[(int64_t)j * hd + d] = ellm_f16_to_f32(src[j][d]);
}

/* ================================== dispatch ================================== */

typedef struct {
    void (*qk)(const float *, int, int, const float *const *, int, float *);
    void (*pv)(const float *, int, int, const float *const *, int, float *);
    void (*scale)(float *, float, int64_t);
    void (*softcap)(float *, float, int64_t);
    float (*max)(const float *, int64_t);
    float (*exp_shift_sum)(float *, float, int64_t);
    /* the four steps above on one row of a tile in one pass (attention.h), or NULL */
    float (*softmax_row)(float *, int, float, float, float, float *);
    void (*widen)(const uint16_t *const *, int, int, float *);
} attn_funcs;

#define ATTN_TABLE(sfx, softmax_row)                                                          \
    {ellm_attn_qk_##sfx, ellm_attn_pv_##sfx, ellm_scale_row_##sfx, ellm_softcap_row_##sfx,     \
     ellm_max_row_##sfx, ellm_exp_shift_sum_row_##sfx, softmax_row, ellm_attn_widen_##sfx}

static const attn_funcs funcs_scalar = ATTN_TABLE(scalar, NULL);
#ifdef ELLM_HAVE_X86_ATTN
static const attn_funcs funcs_avx2 = ATTN_TABLE(avx2, NULL);
static const attn_funcs funcs_avx512 = ATTN_TABLE(avx512, ellm_attn_softmax_row_avx512);
#endif

static const attn_funcs *funcs_now(void) {
#ifdef ELLM_HAVE_X86_ATTN
    int level = ellm_simd_level();
    if (ellm_simd_is_avx512(level)) return &funcs_avx512;
    if (level == ELLM_SIMD_AVX2) return &funcs_avx2;
#endif
    return &funcs_scalar;
}

/* ================================== validation ================================== */

static int fail(char *err, size_t len, const char *msg) {
    if (err && len) snprintf(err, len, "%s", msg);
    return -1;
}

int ellm_rope_attention_check(const ellm_attn_args *a, char *err, size_t len) {
    char msg[256];
    if (a->T < 0) return fail(err, len, "T must be >= 0");
    if (a->nh < 1 || a->nkv < 1 || a->nh % a->nkv != 0) {
        snprintf(msg, sizeof msg, "nh (%d) must be a positive multiple of nkv (%d)", a->nh, a->nkv);
        return fail(err, len, msg);
    }
    if (a->hd < 2 || a->hd % 2 != 0) {
        snprintf(msg, sizeof msg, "head_dim must be even and >= 2, got %d", a->hd);
        return fail(err, len, msg);
    }
    if (a->block_size < 1 || a->num_blocks < 1 || a->max_blocks < 1 || a->B < 1) {
        snprintf(msg, sizeof msg,
                 "empty cache or block table (block_size %d, num_blocks %lld, B %lld, max_blocks %lld)",
                 a->block_size, (long long)a->num_blocks, (long long)a->B, (long long)a->max_blocks);
        return fail(err, len, msg);
    }
    if (a->window < 0) return fail(err, len, "window must be >= 0");
    if (a->n_rot < 0 || a->n_rot > a->hd / 2) {
        snprintf(msg, sizeof msg, "rotated pairs n_rot (%d) must be in [0, head_dim/2 = %d]", a->n_rot,
                 a->hd / 2);
        return fail(err, len, msg);
    }
    if (!(a->rope_mscale == a->rope_mscale) || isinf(a->rope_mscale))
        return fail(err, len, "rope_mscale must be finite");
    const int f32_caches = a->k_cache != NULL && a->v_cache != NULL && !a->k_cache16 && !a->v_cache16;
    const int f16_caches = a->k_cache16 != NULL && a->v_cache16 != NULL && !a->k_cache && !a->v_cache;
    if (!f32_caches && !f16_caches) return fail(err, len, "give both K and V caches, of one type (f32 or f16)");
    if (f16_caches && (a->hd > ELLM_ATTN_F16_MAX_HD || (int64_t)a->nkv * a->hd > ELLM_ATTN_F16_MAX_ROW)) {
        snprintf(msg, sizeof msg, "an f16 cache takes head_dim <= %d and kv_heads * head_dim <= %d, got %d and %lld",
                 ELLM_ATTN_F16_MAX_HD, ELLM_ATTN_F16_MAX_ROW, a->hd, (long long)a->nkv * a->hd);
        return fail(err, len, msg);
    }
    if (a->q_stride < (int64_t)a->nh * a->hd || a->k_stride < (int64_t)a->nkv * a->hd ||
        a->v_stride < (int64_t)a->nkv * a->hd)
        return fail(err, len, "q/k/v token strides are smaller than one token's row");
    const int64_t bs = a->block_size;
    const int64_t max_pos = a->max_blocks * bs;
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t s = a->seq_ids[t], p = a->positions[t];
        if (s < 0 || s >= a->B) {
            snprintf(msg, sizeof msg, "seq_ids[%lld] = %lld is outside [0, %lld)", (long long)t,
                     (long long)s, (long long)a->B);
            return fail(err, len, msg);
        }
        if (p < 0 || p >= max_pos) {
            snprintf(msg, sizeof msg,
                     "positions[%lld] = %lld is outside [0, %lld) (max_blocks %lld * block_size %lld)",
                     (long long)t, (long long)p, (long long)max_pos, (long long)a->max_blocks, (long long)bs);
            return fail(err, len, msg);
        }
        int64_t e = p;
        if (a->key_limit) {
            e = a->key_limit[t];
            if (e < p || e >= max_pos) {
                snprintf(msg, sizeof msg,
                         "key_limit[%lld] = %lld must be in [positions[%lld] = %lld, %lld) (max_blocks %lld * "
                         "block_size %lld)",
                         (long long)t, (long long)e, (long long)t, (long long)p, (long long)max_pos,
                         (long long)a->max_blocks, (long long)bs);
                return fail(err, len, msg);
            }
        }
        const int64_t lo = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
        const int32_t *row = a->block_tables + s * a->max_blocks;
        for (int64_t b = lo / bs; b <= e / bs; b++) {
            if (row[b] < 0 || row[b] >= a->num_blocks) {
                snprintf(msg, sizeof msg,
                         "block_tables[%lld, %lld] = %d is outside [0, %lld) (token %lld at position %lld "
                         "reads positions %lld..%lld)",
                         (long long)s, (long long)b, row[b], (long long)a->num_blocks, (long long)t,
                         (long long)p, (long long)lo, (long long)e);
                return fail(err, len, msg);
            }
        }
    }
    return 0;
}

/* ================================== planning ================================== */

/* First key position a token at p sees. */
static inline int64_t first_key(int64_t p, int32_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* Last key position token t sees: its key_limit, or its own position (causal). */
static inline int64_t last_key(const ellm_attn_args *a, int64_t t) {
    return a->key_limit ? a->key_limit[t] : a->positions[t];
}

/* Chunks a token at p whose last key is e reads: [first_key / CHUNK, e / CHUNK]. */
static inline int64_t chunk_count(int64_t p, int64_t e, int32_t window) {
    return e / CHUNK - first_key(p, window) / CHUNK + 1;
}

/* Query rows per pass: a run of tokens of one sequence, all heads of the group, when the
 * group fits; else one token and MAX_ROWS heads at a time. */
static inline int run_tokens(int g) { return g <= MAX_ROWS ? MAX_ROWS / g : 1; }
static inline int head_slices(int g) { return (g + MAX_ROWS - 1) / MAX_ROWS; }

static inline int64_t thread_floats(int32_t hd) { return (int64_t)MAX_ROWS * hd; }

/* Floats of the split schedule's partials for this batch on `threads` threads, 0 when it
 * would not split; *max_chunks gets the most chunks of any token. Safe on unchecked
 * input: out-of-range positions are skipped. */
static int64_t split_plan(const ellm_attn_args *a, int threads, int64_t *max_chunks) {
    *max_chunks = 1;
    if (threads <= 1 || a->T <= 0 || a->nh < 1 || a->nkv < 1 || a->hd < 1 || a->nh % a->nkv) return 0;
    const int64_t g = a->nh / a->nkv;
    const int64_t pairs = a->T * a->nkv * head_slices((int)g);
    if (pairs >= SPLIT_PAIRS * (int64_t)threads) return 0;
    const int64_t max_pos = a->max_blocks * a->block_size;
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t p = a->positions[t], e = last_key(a, t);
        if (p < 0 || p >= max_pos || e < p || e >= max_pos) continue;
        const int64_t n = chunk_count(p, e, a->window);
        if (n > *max_chunks) *max_chunks = n;
    }
    if (*max_chunks <= 1) return 0;
    const int64_t floats = a->T * a->nkv * *max_chunks * (2 * g + g * a->hd);
    return floats <= MAX_PARTIAL_FLOATS ? floats : 0;
}

/* Multiply-adds of phase 2 (q.k and p @ V over every token's visible keys). */
static int64_t mul_adds(const ellm_attn_args *a) {
    int64_t keys = 0;
    for (int64_t t = 0; t < a->T; t++) keys += last_key(a, t) - first_key(a->positions[t], a->window) + 1;
    return 2 * keys * a->nh * a->hd;
}

/* ============================ phase 1: rope + cache write ============================ */

typedef struct {
    const ellm_attn_args *a;
    const attn_funcs *f;
    float *qrot;       /* (nkv, T, g, hd) scratch: rotated q, a group's rows of consecutive
                          tokens contiguous */
    float *thread_buf; /* (threads, MAX_ROWS, hd) scratch: the chunk accumulator (phase 2a) */
    float *partial;    /* (T, nkv, max_chunks, 2g + g*hd) scratch: chunk partials (phase 2b) */
    int64_t max_chunks;
} attn_ctx;

/* A key tile's K/V rows: f32 pointers, or with f16 caches f16 ones. */
typedef struct {
    const float *k[TILE], *v[TILE];
    const uint16_t *k16[TILE], *v16[TILE];
} tile_rows;

/* Rotates n_heads rows of hd from src (stride hd) into dst, pairs [i0, i0 + cnt) of the
 * n_rot rotated pairs. */
static void rotate_heads(const float *src, float *dst, int n_heads, int hd, int n_rot, int interleaved,
                         int i0, int cnt, const float *cs, const float *sn) {
    const int half = n_rot; /* rotate-half pairs (i, i + n_rot) within the rotated dims */
    for (int h = 0; h < n_heads; h++) {
        const float *x = src + (int64_t)h * hd;
        float *y = dst + (int64_t)h * hd;
        if (interleaved) {
            for (int i = 0; i < cnt; i++) {
                float x0 = x[2 * (i0 + i)], x1 = x[2 * (i0 + i) + 1];
                y[2 * (i0 + i)] = x0 * cs[i] - x1 * sn[i];
                y[2 * (i0 + i) + 1] = x1 * cs[i] + x0 * sn[i];
            }
        } else {
            for (int i = 0; i < cnt; i++) {
                float x0 = x[i0 + i], x1 = x[i0 + i + half];
                y[i0 + i] = x0 * cs[i] - x1 * sn[i];
                y[i0 + i + half] = x1 * cs[i] + x0 * sn[i];
            }
        }
    }
}

/* Copies dims [d0, hd) of n_heads rows of hd from src into dst: the dims partial rotary
 * leaves as they are. */
static void pass_heads(const float *src, float *dst, int n_heads, int hd, int d0) {
    if (d0 >= hd) return;
    for (int h = 0; h < n_heads; h++)
        memcpy(dst + (int64_t)h * hd + d0, src + (int64_t)h * hd + d0, sizeof(float) * (size_t)(hd - d0));
}

static void phase1(void *p, int64_t t0, int64_t t1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, n_rot = a->n_rot, nkv = a->nkv, g = a->nh / a->nkv;
    const float mscale = a->rope_mscale;
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    /* f16 caches: the rotated k row, in f32 (nkv * hd <= ELLM_ATTN_F16_MAX_ROW, validated) */
    float f16_row[a->k_cache16 ? (int64_t)nkv * hd : 1];
    for (int64_t t = t0; t < t1; t++) {
        const int64_t pos = a->positions[t];
        const int64_t blk = a->block_tables[(int64_t)a->seq_ids[t] * a->max_blocks + pos / a->block_size];
        const int64_t slot = (blk * a->block_size + pos % a->block_size) * nkv * hd;
        /* f16 caches: the rotated k row is made in f32 here, then rounded into its slot */
        float *krow = a->k_cache16 ? f16_row : a->k_cache + slot;
        const float fpos = (float)pos;
        for (int i0 = 0; i0 < n_rot; i0 += ROPE_CHUNK) {
            const int cnt = n_rot - i0 < ROPE_CHUNK ? n_rot - i0 : ROPE_CHUNK;
            for (int i = 0; i < cnt; i++) {
                const float ang = fpos * a->inv_freq[i0 + i]; /* rounded to f32, like the reference */
                /* cos, sin rounded to f32, then scaled in f32 (exact when mscale is 1) */
                cs[i] = (float)cos((double)ang) * mscale;
                sn[i] = (float)sin((double)ang) * mscale;
            }
            for (int kvh = 0; kvh < nkv; kvh++)
                rotate_heads(a->q + t * a->q_stride + (int64_t)kvh * g * hd,
                             c->qrot + ((int64_t)kvh * a->T + t) * g * hd, g, hd, n_rot, a->interleaved, i0,
                             cnt, cs, sn);
            rotate_heads(a->k + t * a->k_stride, krow, nkv, hd, n_rot, a->interleaved, i0, cnt, cs, sn);
        }
        for (int kvh = 0; kvh < nkv; kvh++)
            pass_heads(a->q + t * a->q_stride + (int64_t)kvh * g * hd, c->qrot + ((int64_t)kvh * a->T + t) * g * hd,
                       g, hd, 2 * n_rot);
        pass_heads(a->k + t * a->k_stride, krow, nkv, hd, 2 * n_rot);
        if (a->k_cache16) {
            ellm_f32_to_f16_row(krow, a->k_cache16 + slot, (size_t)nkv * hd);
            ellm_f32_to_f16_row(a->v + t * a->v_stride, a->v_cache16 + slot, (size_t)nkv * hd);
        } else {
            memcpy(a->v_cache + slot, a->v + t * a->v_stride, sizeof(float) * (size_t)nkv * hd);
        }
    }
}

/* ============================ the shared recipe steps ============================ */

/* The first half of a key tile for `rows` query rows that all see its n keys: scores
 * into s (rows, TILE), then the online-softmax update of m, l (rows,) and acc (rows, hd);
 * s is left holding the probabilities for p @ V. */
__attribute__((noinline)) static void tile_softmax(const attn_funcs *f, const float *q, int rows, int hd,
                                                   const float *const *kp, int n, float scale, float cap,
                                                   float *m, float *l, float *acc, float *s) {
    f->qk(q, rows, hd, kp, n, s);
    for (int h = 0; h < rows; h++) {
        float *sh = s + h * TILE;
        float m_new, sum;
        if (f->softmax_row) {
            sum = f->softmax_row(sh, n, scale, cap, m[h], &m_new);
        } else {
            f->scale(sh, scale, n);
            if (cap > 0.0f) f->softcap(sh, cap, n);
            const float tile_max = f->max(sh, n);
            m_new = tile_max > m[h] ? tile_max : m[h];
            sum = f->exp_shift_sum(sh, m_new, n);
        }
        if (m[h] == -INFINITY) {
            l[h] = sum; /* first tile: acc is still zero */
        } else {
            const float corr = expf(m[h] - m_new);
            l[h] = l[h] * corr + sum;
            if (corr != 1.0f) f->scale(acc + (int64_t)h * hd, corr, hd);
        }
        m[h] = m_new;
    }
}

/* One key tile: tile_softmax, then p @ V. */
__attribute__((noinline)) static void attend_tile(const attn_funcs *f, const float *q, int rows, int hd,
                                                  const float *const *kp, const float *const *vp, int n,
                                                  float scale, float cap, float *m, float *l, float *acc) {
    float s[MAX_ROWS * TILE]; /* (rows, TILE) scores, then probabilities */
    tile_softmax(f, q, rows, hd, kp, n, scale, cap, m, l, acc, s);
    f->pv(s, rows, hd, vp, n, acc);
}

/* attend_tile on f16 rows: the K rows, then the V rows, converted (exactly) to f32 in one
 * staging buffer, so every sum is the f32 path's on the stored values. */
__attribute__((noinline)) static void attend_tile16(const attn_funcs *f, const float *q, int rows, int hd,
                                                    const uint16_t *const *kp, const uint16_t *const *vp,
                                                    int n, float scale, float cap, float *m, float *l,
                                                    float *acc) {
    float s[MAX_ROWS * TILE];
    float stage[n * hd]; /* n <= TILE, hd <= ELLM_ATTN_F16_MAX_HD (validated) */
    const float *rows_f32[TILE];
    for (int j = 0; j < n; j++) rows_f32[j] = stage + (int64_t)j * hd;
    f->widen(kp, n, hd, stage);
    tile_softmax(f, q, rows, hd, rows_f32, n, scale, cap, m, l, acc, s);
    f->widen(vp, n, hd, stage);
    f->pv(s, rows, hd, rows_f32, n, acc);
}

/* attend_tile over rows [off, off + n) of a filled tile, f32 or f16. */
static inline void attend_rows(const attn_ctx *c, const float *q, int rows, const tile_rows *tr, int64_t off,
                               int n, float *m, float *l, float *acc) {
    const ellm_attn_args *a = c->a;
    if (a->k_cache16)
        attend_tile16(c->f, q, rows, a->hd, tr->k16 + off, tr->v16 + off, n, a->scale, a->softcap, m, l, acc);
    else
        attend_tile(c->f, q, rows, a->hd, tr->k + off, tr->v + off, n, a->scale, a->softcap, m, l, acc);
}

/* Folds a later chunk's partial (m, l, part (hd,)) into the state (*M, *L, o (hd,)). */
__attribute__((noinline)) static void merge_row(float *M, float *L, float *o, float m, float l,
                                                const float *part, int hd) {
    const float mn = m > *M ? m : *M;
    const float wa = expf(*M - mn), wb = expf(m - mn);
    *L = *L * wa + l * wb;
    for (int d = 0; d < hd; d++) o[d] = o[d] * wa + part[d] * wb;
    *M = mn;
}

/* The state's normalization: o /= L. */
__attribute__((noinline)) static void finish_row(const attn_funcs *f, float *o, float L, int hd) {
    f->scale(o, 1.0f / L, hd);
}

/* Points tr's rows [0, j1 - j0) at the K/V rows of positions [j0, j1) (within one tile)
 * of kv head kvh, through the block-table row. A position in an unallocated block (-1)
 * gets NULL: a run of tokens far apart may span keys that none of them reads, whose blocks
 * a sliding-window cache has released (validation only vouches for the keys read). */
static void fill_tile(const ellm_attn_args *a, const int32_t *row, int kvh, int64_t j0, int64_t j1,
                      tile_rows *tr) {
    const int64_t bs = a->block_size, nkv = a->nkv, hd = a->hd;
    int64_t b = j0 / bs, off = j0 % bs;
    for (int64_t j = 0; j < j1 - j0; j++) {
        const int64_t elem = row[b] >= 0 ? (((int64_t)row[b] * bs + off) * nkv + kvh) * hd : -1;
        if (a->k_cache16) {
            tr->k16[j] = elem >= 0 ? a->k_cache16 + elem : NULL;
            tr->v16[j] = elem >= 0 ? a->v_cache16 + elem : NULL;
        } else {
            tr->k[j] = elem >= 0 ? a->k_cache + elem : NULL;
            tr->v[j] = elem >= 0 ? a->v_cache + elem : NULL;
        }
        if (++off == bs) {
            off = 0;
            b++;
        }
    }
}

/* Asks for the K and V rows of positions [j0, j1) of kv head kvh, a tile before they are
 * used: a decode streams its keys from memory once, through a block table the hardware
 * prefetcher cannot follow. Touches nothing (unallocated blocks are skipped). */
static void prefetch_keys(const ellm_attn_args *a, const int32_t *row, int kvh, int64_t j0, int64_t j1) {
    const int64_t bs = a->block_size, max_pos = a->max_blocks * bs;
    const int64_t elem_bytes = a->k_cache16 ? 2 : 4, bytes = (int64_t)a->hd * elem_bytes;
    const char *k_base = a->k_cache16 ? (const char *)a->k_cache16 : (const char *)a->k_cache;
    const char *v_base = a->k_cache16 ? (const char *)a->v_cache16 : (const char *)a->v_cache;
    if (j1 > max_pos) j1 = max_pos;
    for (int64_t j = j0; j < j1; j++) {
        const int32_t b = row[j / bs];
        if (b < 0 || b >= a->num_blocks) continue;
        const int64_t elem = (((int64_t)b * bs + j % bs) * a->nkv + kvh) * a->hd;
        const char *kr = k_base + elem * elem_bytes, *vr = v_base + elem * elem_bytes;
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(kr + o);
            __builtin_prefetch(vr + o);
        }
    }
}

/* Prefetch when a pass has at most this many rows (the call streams its keys: decode) and
 * the kv heads interleave (nkv > 1: one head's rows are strided, which the hardware
 * prefetcher follows poorly; with nkv 1 they are contiguous within a block, and
 * prefetching measured no gain). */
enum { PREFETCH_ROWS = 8 };
static inline int wants_prefetch(const ellm_attn_args *a, int rows) { return rows <= PREFETCH_ROWS && a->nkv > 1; }

/* The partial (m, l, acc) of `rows` query rows of one token over chunk keys [k0, k1),
 * tile by tile (tiles cut at absolute multiples of TILE). */
static void chunk_partial(const attn_ctx *c, const float *q, int rows, const int32_t *row, int kvh,
                          int64_t k0, int64_t k1, float *m, float *l, float *acc) {
    const ellm_attn_args *a = c->a;
    tile_rows tr;
    for (int h = 0; h < rows; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * a->hd);
    for (int64_t j0 = k0; j0 < k1;) {
        const int64_t te = (j0 / TILE + 1) * TILE, j1 = te < k1 ? te : k1;
        if (wants_prefetch(a, rows) && j1 < k1) prefetch_keys(a, row, kvh, j1, te + TILE < k1 ? te + TILE : k1);
        fill_tile(a, row, kvh, j0, j1, &tr);
        attend_rows(c, q, rows, &tr, 0, (int)(j1 - j0), m, l, acc);
        j0 = j1;
    }
}

/* ======================= phase 2a: runs of query tokens per K/V tile ======================= */

/* Query tokens [t0, t1) of one sequence (t1 - t0 <= run_tokens(g)), kv head kvh, query
 * heads [h0, h0 + gs) of the group (gs < g only for a single token): each K/V tile is
 * read once for all of them. Tiles that every token sees in full go through the kernels
 * as one block of rows; at the edges each token takes its own part of the tile. */
static void attend_run(const attn_ctx *c, int64_t t0, int64_t t1, int kvh, int h0, int gs, float *part) {
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, g = a->nh / a->nkv, nq = (int)(t1 - t0), rows = nq * gs;
    const float *q = c->qrot + (((int64_t)kvh * a->T + t0) * g + h0) * hd; /* (rows, hd) */
    const int32_t *row = a->block_tables + (int64_t)a->seq_ids[t0] * a->max_blocks;
    int64_t lo[MAX_ROWS], hi[MAX_ROWS], klo = INT64_MAX, khi = 0;
    for (int i = 0; i < nq; i++) {
        const int64_t p = a->positions[t0 + i];
        lo[i] = first_key(p, a->window);
        hi[i] = last_key(a, t0 + i) + 1;
        if (lo[i] < klo) klo = lo[i];
        if (hi[i] > khi) khi = hi[i];
    }
    float m[MAX_ROWS], l[MAX_ROWS], M[MAX_ROWS], L[MAX_ROWS]; /* (rows,) chunk and state */
    tile_rows tr;
    for (int64_t c0 = klo / CHUNK * CHUNK; c0 < khi; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK;
        int active = 0;
        for (int i = 0; i < nq; i++) active |= hi[i] > c0 && lo[i] < c1;
        if (!active) continue; /* a gap between tokens far apart */
        for (int r = 0; r < rows; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        memset(part, 0, sizeof(float) * (size_t)rows * hd);
        for (int64_t ts = c0 > klo / TILE * TILE ? c0 : klo / TILE * TILE; ts < c1 && ts < khi; ts += TILE) {
            /* the keys of this tile that some token reads: [u0, u1) */
            int64_t u0 = INT64_MAX, u1 = 0;
            int full = 1;
            for (int i = 0; i < nq; i++) {
                const int64_t j0 = lo[i] > ts ? lo[i] : ts, j1 = hi[i] < ts + TILE ? hi[i] : ts + TILE;
                if (j0 < j1) {
                    u0 = j0 < u0 ? j0 : u0;
                    u1 = j1 > u1 ? j1 : u1;
                }
            }
            if (u0 >= u1) continue;
            if (wants_prefetch(a, rows) && ts + TILE < khi)
                prefetch_keys(a, row, kvh, ts + TILE, ts + 2 * TILE < khi ? ts + 2 * TILE : khi);
            for (int i = 0; i < nq; i++) full &= lo[i] <= u0 && hi[i] >= u1;
            fill_tile(a, row, kvh, u0, u1, &tr);
            if (full) {
                attend_rows(c, q, rows, &tr, 0, (int)(u1 - u0), m, l, part);
                continue;
            }
            for (int i = 0; i < nq; i++) {
                const int64_t j0 = lo[i] > u0 ? lo[i] : u0, j1 = hi[i] < u1 ? hi[i] : u1;
                if (j0 >= j1) continue;
                attend_rows(c, q + (int64_t)i * gs * hd, gs, &tr, j0 - u0, (int)(j1 - j0), m + i * gs,
                            l + i * gs, part + (int64_t)i * gs * hd);
            }
        }
        /* fold this chunk into each token that sees it */
        for (int i = 0; i < nq; i++) {
            if (hi[i] <= c0 || lo[i] >= c1) continue;
            const int first = lo[i] >= c0;
            for (int h = 0; h < gs; h++) {
                const int r = i * gs + h;
                float *o = a->out + ((t0 + i) * a->nh + (int64_t)kvh * g + h0 + h) * hd;
                if (first) {
                    M[r] = m[r];
                    L[r] = l[r];
                    memcpy(o, part + (int64_t)r * hd, sizeof(float) * (size_t)hd);
                } else {
                    merge_row(&M[r], &L[r], o, m[r], l[r], part + (int64_t)r * hd, hd);
                }
            }
        }
    }
    for (int i = 0; i < nq; i++)
        for (int h = 0; h < gs; h++)
            finish_row(c->f, a->out + ((t0 + i) * a->nh + (int64_t)kvh * g + h0 + h) * hd, L[i * gs + h], hd);
}

/* Item = (token, from the last; kv head; head slice); only tokens that start a run do
 * work. A run is the tokens from there up to the next multiple of run_tokens(g) or the
 * next token of another sequence, so runs never depend on the scheduling. */
static void phase2a(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int g = a->nh / a->nkv, S = head_slices(g), R = run_tokens(g);
    const int64_t T = a->T;
    float *part = c->thread_buf + (int64_t)tid * thread_floats(a->hd);
    for (int64_t item = i0; item < i1; item++) {
        /* the latest tokens first: a causal prefill's longest runs are claimed early
         * and the short ones fill in at the end (threads claim items in order) */
        const int64_t t0 = T - 1 - item / ((int64_t)a->nkv * S);
        const int kvh = (int)(item % ((int64_t)a->nkv * S) / S), sl = (int)(item % S);
        if (t0 % R != 0 && a->seq_ids[t0] == a->seq_ids[t0 - 1]) continue; /* inside a run */
        int64_t t1 = t0 + 1;
        while (t1 < T && t1 % R != 0 && a->seq_ids[t1] == a->seq_ids[t0]) t1++;
        const int h0 = sl * MAX_ROWS, gs = g - h0 < MAX_ROWS ? g - h0 : MAX_ROWS;
        attend_run(c, t0, t1, kvh, h0, gs, part);
    }
}

/* ================== phase 2b + 3: one token's chunks spread over threads ================== */

/* Item = (token, kv head, chunk index): that chunk's partial for all g heads, at
 * partial[item] = [m (g), l (g), acc (g, hd)]. */
static void phase2b(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, nkv = a->nkv, g = a->nh / a->nkv;
    const int64_t NC = c->max_chunks, stride = 2 * (int64_t)g + (int64_t)g * hd;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t t = item / (nkv * NC), ci = item % NC;
        const int kvh = (int)(item / NC % nkv);
        const int64_t pos = a->positions[t], lo = first_key(pos, a->window), end = last_key(a, t);
        const int64_t c0 = (lo / CHUNK + ci) * CHUNK;
        if (c0 > end) continue; /* this token has fewer chunks */
        const int64_t k0 = lo > c0 ? lo : c0, k1 = c0 + CHUNK < end + 1 ? c0 + CHUNK : end + 1;
        const int32_t *row = a->block_tables + (int64_t)a->seq_ids[t] * a->max_blocks;
        float *slot = c->partial + item * stride;
        for (int h0 = 0; h0 < g; h0 += MAX_ROWS) {
            const int gs = g - h0 < MAX_ROWS ? g - h0 : MAX_ROWS;
            chunk_partial(c, c->qrot + (((int64_t)kvh * a->T + t) * g + h0) * hd, gs, row, kvh, k0, k1,
                          slot + h0, slot + g + h0, slot + 2 * g + (int64_t)h0 * hd);
        }
    }
}

/* Item = (token, kv head): folds its chunks' partials in order into the output rows. */
static void phase3(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, nkv = a->nkv, g = a->nh / a->nkv;
    const int64_t NC = c->max_chunks, stride = 2 * (int64_t)g + (int64_t)g * hd;
    for (int64_t pair = i0; pair < i1; pair++) {
        const int64_t t = pair / nkv, n = chunk_count(a->positions[t], last_key(a, t), a->window);
        const int kvh = (int)(pair % nkv);
        const float *base = c->partial + pair * NC * stride;
        for (int h = 0; h < g; h++) {
            float *o = a->out + (t * a->nh + (int64_t)kvh * g + h) * hd;
            float M = base[h], L = base[g + h];
            memcpy(o, base + 2 * g + (int64_t)h * hd, sizeof(float) * (size_t)hd);
            for (int64_t ci = 1; ci < n; ci++) {
                const float *ps = base + ci * stride;
                merge_row(&M, &L, o, ps[h], ps[g + h], ps + 2 * g + (int64_t)h * hd, hd);
            }
            finish_row(c->f, o, L, hd);
        }
    }
}

/* ================================== entry points ================================== */

int64_t ellm_rope_attention_scratch_floats(int64_t T, int32_t nh, int32_t nkv, int32_t hd, int threads) {
    if (T <= 0 || nh <= 0 || nkv <= 0 || hd <= 0) return 0;
    return T * nh * hd + (threads > 1 ? threads : 1) * thread_floats(hd);
}

int64_t ellm_rope_attention_scratch_wanted(const ellm_attn_args *a, int threads) {
    const int64_t base = ellm_rope_attention_scratch_floats(a->T, a->nh, a->nkv, a->hd, threads);
    if (base == 0) return 0;
    int64_t max_chunks;
    const int64_t split = split_plan(a, threads, &max_chunks);
    const int64_t with_split = a->T * a->nh * a->hd + split;
    return with_split > base ? with_split : base;
}

int ellm_rope_attention(const ellm_attn_args *a, float *scratch, int64_t scratch_floats, char *err,
                        size_t err_len) {
    if (ellm_rope_attention_check(a, err, err_len) != 0) return -1;
    if (a->T == 0) return 0;
    const int64_t q_floats = a->T * a->nh * a->hd, room = scratch_floats - q_floats;
    if (scratch == NULL || room < thread_floats(a->hd)) return fail(err, err_len, "attention scratch too small");

    attn_ctx c = {.a = a, .f = funcs_now(), .qrot = scratch, .thread_buf = scratch + q_floats,
                  .partial = scratch + q_floats, .max_chunks = 1};
    int threads = ellm_num_threads();
    /* a small call (decode at a short context) runs on this thread alone: waking a worker
     * costs more than the work */
    if (mul_adds(a) < SMALL_CALL_MUL_ADDS) threads = 1;
    ellm_parallel_for_threads(a->T, 8, threads, phase1, &c);

    const int64_t split = split_plan(a, threads, &c.max_chunks);
    if (split > 0 && split <= room) {
        const int64_t pairs = a->T * a->nkv;
        ellm_parallel_for_threads(pairs * c.max_chunks, 1, threads, phase2b, &c);
        ellm_parallel_for_threads(pairs, 1, threads, phase3, &c);
        return 0;
    }
    if (room / thread_floats(a->hd) < threads) threads = (int)(room / thread_floats(a->hd));
    const int g = a->nh / a->nkv;
    /* A batched decode step (every token its own sequence, enough of them for the threads)
     * hands out a token's kv heads together: they read the same K/V blocks, whose rows
     * hold all the kv heads side by side, so one thread streams them whole (SmolLM2, 16
     * sequences: attention 5.1-8.8 -> 5.2-5.8 ms a step, 7 alternating runs). */
    const int64_t per_token = a->nkv * (int64_t)head_slices(g);
    int whole_tokens = a->T >= 2 * (int64_t)threads;
    for (int64_t t = 1; whole_tokens && t < a->T; t++) whole_tokens = a->seq_ids[t] != a->seq_ids[t - 1];
    ellm_parallel_for_threads(per_token * a->T, whole_tokens ? per_token : 1, threads, phase2a, &c);
    return 0;
}
