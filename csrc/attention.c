/* Fused RoPE + paged attention: validation, the two (three) parallel phases, the online
 * softmax, and the scalar inner loops. The vector inner loops (q.k scores of a key tile,
 * p @ V into the accumulators) are in attention_avx2.c and attention_avx512.c.
 *
 * Numerics follow reference.rope_attention: rope angles are (f32 position * f32 inv_freq)
 * rounded to f32, their cos/sin taken in double and rounded; scores are (q.k) * scale,
 * then softcapped; the softmax is exact up to rounding (online: running max m and sum l
 * per head, the accumulator rescaled by exp(m_old - m_new) once per key tile). */
#include "attention.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "elementwise.h"
#include "simd.h"
#include "threadpool.h"

enum {
    TILE = ELLM_ATTN_TILE,
    MAX_GROUP = ELLM_ATTN_MAX_GROUP, /* query heads per pass over the keys */
    ROPE_CHUNK = 64,                 /* rotation pairs whose cos/sin are held at once */
    MAX_SPLITS = 32,                 /* key splits per (token, kv head) in small batches */
    MIN_SPLIT_KEYS = 128,            /* do not split below this many keys per split */
};

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

/* ================================== dispatch ================================== */

typedef struct {
    void (*qk)(const float *, int, int, const float *const *, int, float *);
    void (*pv)(const float *, int, int, const float *const *, int, float *);
    void (*scale)(float *, float, int64_t);
    void (*softcap)(float *, float, int64_t);
    float (*max)(const float *, int64_t);
    float (*exp_shift_sum)(float *, float, int64_t);
} attn_funcs;

#define ATTN_TABLE(sfx)                                                                       \
    {ellm_attn_qk_##sfx, ellm_attn_pv_##sfx, ellm_scale_row_##sfx, ellm_softcap_row_##sfx,     \
     ellm_max_row_##sfx, ellm_exp_shift_sum_row_##sfx}

static const attn_funcs funcs_scalar = ATTN_TABLE(scalar);
#ifdef ELLM_HAVE_X86_ATTN
static const attn_funcs funcs_avx2 = ATTN_TABLE(avx2);
static const attn_funcs funcs_avx512 = ATTN_TABLE(avx512);
#endif

static const attn_funcs *funcs_now(void) {
#ifdef ELLM_HAVE_X86_ATTN
    int level = ellm_simd_level();
    if (level == ELLM_SIMD_AVX512) return &funcs_avx512;
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
        const int64_t lo = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
        const int32_t *row = a->block_tables + s * a->max_blocks;
        for (int64_t b = lo / bs; b <= p / bs; b++) {
            if (row[b] < 0 || row[b] >= a->num_blocks) {
                snprintf(msg, sizeof msg,
                         "block_tables[%lld, %lld] = %d is outside [0, %lld) (token %lld at position %lld "
                         "reads positions %lld..%lld)",
                         (long long)s, (long long)b, row[b], (long long)a->num_blocks, (long long)t,
                         (long long)p, (long long)lo, (long long)p);
                return fail(err, len, msg);
            }
        }
    }
    return 0;
}

/* ============================ phase 1: rope + cache write ============================ */

typedef struct {
    const ellm_attn_args *a;
    const attn_funcs *f;
    float *qrot;     /* (T, nh, hd) scratch */
    float *partial;  /* (T * nkv * splits, 2 * g + g * hd) scratch, when splits > 1 */
    int splits;
} attn_ctx;

/* Rotates n_heads rows of hd from src (stride hd) into dst, pairs [i0, i0 + cnt). */
static void rotate_heads(const float *src, float *dst, int n_heads, int hd, int interleaved, int i0,
                         int cnt, const float *cs, const float *sn) {
    const int half = hd / 2;
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

static void phase1(void *p, int64_t t0, int64_t t1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, half = hd / 2, nkv = a->nkv;
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    for (int64_t t = t0; t < t1; t++) {
        const int64_t pos = a->positions[t];
        const int64_t blk = a->block_tables[(int64_t)a->seq_ids[t] * a->max_blocks + pos / a->block_size];
        const int64_t slot = (blk * a->block_size + pos % a->block_size) * nkv * hd;
        const float fpos = (float)pos;
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            const int cnt = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            for (int i = 0; i < cnt; i++) {
                const float ang = fpos * a->inv_freq[i0 + i]; /* rounded to f32, like the reference */
                cs[i] = (float)cos((double)ang);
                sn[i] = (float)sin((double)ang);
            }
            rotate_heads(a->q + t * a->q_stride, c->qrot + t * a->nh * hd, a->nh, hd, a->interleaved, i0,
                         cnt, cs, sn);
            rotate_heads(a->k + t * a->k_stride, a->k_cache + slot, nkv, hd, a->interleaved, i0, cnt, cs, sn);
        }
        memcpy(a->v_cache + slot, a->v + t * a->v_stride, sizeof(float) * (size_t)nkv * hd);
    }
}

/* ============================ phase 2: attention ============================ */

/* One key tile for g heads: scores, online-softmax update of m, l and acc, then p @ V. */
static void attend_tile(const attn_funcs *f, const float *q, int g, int hd, const float *const *kp,
                        const float *const *vp, int n, float scale, float cap, float *m, float *l,
                        float *acc) {
    float s[MAX_GROUP * TILE]; /* (g, TILE) scores, then probabilities */
    f->qk(q, g, hd, kp, n, s);
    for (int h = 0; h < g; h++) {
        float *sh = s + h * TILE;
        f->scale(sh, scale, n);
        if (cap > 0.0f) f->softcap(sh, cap, n);
        const float tile_max = f->max(sh, n);
        const float m_new = tile_max > m[h] ? tile_max : m[h];
        const float sum = f->exp_shift_sum(sh, m_new, n);
        if (m[h] == -INFINITY) {
            l[h] = sum; /* first tile: acc is still zero */
        } else {
            const float corr = expf(m[h] - m_new);
            l[h] = l[h] * corr + sum;
            if (corr != 1.0f) f->scale(acc + (int64_t)h * hd, corr, hd);
        }
        m[h] = m_new;
    }
    f->pv(s, g, hd, vp, n, acc);
}

/* Points kp/vp (n,) at the K/V rows of positions [j0, min(j0 + TILE, k1)) of kv head
 * kvh, through the block-table row; returns n (0 when j0 >= k1). */
static int fill_tile(const ellm_attn_args *a, const int32_t *row, int kvh, int64_t j0, int64_t k1,
                     const float **kp, const float **vp) {
    if (j0 >= k1) return 0;
    const int n = k1 - j0 < TILE ? (int)(k1 - j0) : TILE;
    const int64_t bs = a->block_size, nkv = a->nkv, hd = a->hd;
    int64_t b = j0 / bs, off = j0 % bs;
    for (int j = 0; j < n; j++) {
        const int64_t elem = (((int64_t)row[b] * bs + off) * nkv + kvh) * hd;
        kp[j] = a->k_cache + elem;
        vp[j] = a->v_cache + elem;
        if (++off == bs) {
            off = 0;
            b++;
        }
    }
    return n;
}

/* Item = (token, kv head, split). Without splits, writes the normalized output rows;
 * with splits, writes (m, l, unnormalized acc) partials for phase 3. */
static void phase2(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const attn_funcs *f = c->f;
    const int hd = a->hd, nkv = a->nkv, g = a->nh / a->nkv, S = c->splits;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t t = item / ((int64_t)nkv * S);
        const int kvh = (int)(item / S % nkv), sp = (int)(item % S);
        const int64_t pos = a->positions[t];
        const int64_t lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        int64_t k0 = lo, k1 = pos + 1;
        if (S > 1) {
            const int64_t per = (k1 - lo + S - 1) / S;
            k0 = lo + sp * per;
            k1 = k0 + per < pos + 1 ? k0 + per : pos + 1;
        }
        const int32_t *row = a->block_tables + (int64_t)a->seq_ids[t] * a->max_blocks;
        float *part = S > 1 ? c->partial + item * (2 * g + (int64_t)g * hd) : NULL;
        for (int h0 = 0; h0 < g; h0 += MAX_GROUP) {
            const int gs = g - h0 < MAX_GROUP ? g - h0 : MAX_GROUP;
            const int64_t head = t * a->nh + (int64_t)kvh * g + h0; /* first query head row */
            const float *q = c->qrot + head * hd;
            float *acc = part ? part + 2 * g + (int64_t)h0 * hd : a->out + head * hd; /* (gs, hd) */
            float m[MAX_GROUP], l[MAX_GROUP];
            for (int h = 0; h < gs; h++) {
                m[h] = -INFINITY;
                l[h] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)gs * hd);
            /* (Software prefetch of the next tile's rows was tried: no gain measured.) */
            const float *kp[TILE], *vp[TILE];
            for (int64_t j0 = k0; j0 < k1; j0 += TILE) {
                const int n = fill_tile(a, row, kvh, j0, k1, kp, vp);
                attend_tile(f, q, gs, hd, kp, vp, n, a->scale, a->softcap, m, l, acc);
            }
            if (part) {
                for (int h = 0; h < gs; h++) {
                    part[h0 + h] = m[h];
                    part[g + h0 + h] = l[h];
                }
            } else {
                for (int h = 0; h < gs; h++) f->scale(acc + (int64_t)h * hd, 1.0f / l[h], hd);
            }
        }
    }
}

/* Phase 3 (splits only): item = (token, kv head); combines the splits' partials. */
static void phase3(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    const ellm_attn_args *a = c->a;
    const int hd = a->hd, g = a->nh / a->nkv, S = c->splits;
    const int64_t stride = 2 * g + (int64_t)g * hd;
    for (int64_t pair = i0; pair < i1; pair++) {
        const float *base = c->partial + pair * S * stride;
        const int64_t t = pair / a->nkv;
        const int kvh = (int)(pair % a->nkv);
        for (int h = 0; h < g; h++) {
            float m_max = -INFINITY;
            for (int sp = 0; sp < S; sp++) {
                const float *ps = base + sp * stride;
                if (ps[g + h] > 0.0f && ps[h] > m_max) m_max = ps[h];
            }
            float *o = a->out + (t * a->nh + (int64_t)kvh * g + h) * hd;
            float total = 0.0f;
            memset(o, 0, sizeof(float) * (size_t)hd);
            for (int sp = 0; sp < S; sp++) {
                const float *ps = base + sp * stride;
                if (!(ps[g + h] > 0.0f)) continue; /* empty split */
                const float w = expf(ps[h] - m_max);
                const float *acc = ps + 2 * g + (int64_t)h * hd;
                total += w * ps[g + h];
                for (int d = 0; d < hd; d++) o[d] += w * acc[d];
            }
            c->f->scale(o, 1.0f / total, hd);
        }
    }
}

/* ================================== entry points ================================== */

static int64_t splits_wanted(int64_t pairs, int threads) {
    if (threads <= 1 || pairs >= 2 * (int64_t)threads) return 1;
    int64_t s = (4 * (int64_t)threads + pairs - 1) / pairs;
    return s < MAX_SPLITS ? s : MAX_SPLITS;
}

int64_t ellm_rope_attention_scratch_floats(int64_t T, int32_t nh, int32_t nkv, int32_t hd, int threads) {
    if (T <= 0 || nh <= 0 || nkv <= 0 || hd <= 0) return 0;
    const int64_t g = nh / nkv, pairs = T * nkv;
    const int64_t s = splits_wanted(pairs, threads);
    const int64_t partial = s > 1 ? pairs * s * (2 * g + g * hd) : 0;
    return T * nh * hd + partial;
}

int ellm_rope_attention(const ellm_attn_args *a, float *scratch, int64_t scratch_floats, char *err,
                        size_t err_len) {
    if (ellm_rope_attention_check(a, err, err_len) != 0) return -1;
    if (a->T == 0) return 0;
    const int64_t q_floats = a->T * a->nh * a->hd;
    if (scratch == NULL || scratch_floats < q_floats) return fail(err, err_len, "attention scratch too small");

    attn_ctx c = {.a = a, .f = funcs_now(), .qrot = scratch, .partial = scratch + q_floats, .splits = 1};
    const int g = a->nh / a->nkv;
    const int64_t pairs = a->T * a->nkv, item_floats = 2 * g + (int64_t)g * a->hd;
    int64_t s = splits_wanted(pairs, ellm_num_threads());
    if (s > 1) {
        int64_t longest = 0;
        for (int64_t t = 0; t < a->T; t++) {
            const int64_t p = a->positions[t];
            const int64_t lo = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
            if (p - lo + 1 > longest) longest = p - lo + 1;
        }
        if (s > longest / MIN_SPLIT_KEYS) s = longest / MIN_SPLIT_KEYS;
        const int64_t room = (scratch_floats - q_floats) / (pairs * item_floats);
        if (s > room) s = room;
        if (s < 1) s = 1;
    }
    c.splits = (int)s;

    ellm_parallel_for(a->T, 8, phase1, &c);
    ellm_parallel_for(pairs * c.splits, 1, phase2, &c);
    if (c.splits > 1) ellm_parallel_for(pairs, 1, phase3, &c);
    return 0;
}
