/* AVX2 + FMA variants of the sampling kernels in sample.c. */
#include <immintrin.h>

#include "sample.h"

void ellm_sample_heap_offer(int32_t *idx, float *val, int64_t k, int32_t i, float v);

#define EXP_FLOOR (-87.3f)
#define CHUNK 64

/* ============================================================================
 * Top-k scan
 * ============================================================================
 * The heap is full; an entry matters only when it beats the root. Compare 32 entries at
 * a time against the root and fall to scalar code only for the lanes that beat it: on
 * real logits a few hundred of 262144 entries do. */

void ellm_topk_scan_avx2(const float *x, int64_t n, int64_t start, int64_t k, int32_t *idx,
                         float *val) {
    int64_t i = start;
    __m256 thr = _mm256_set1_ps(val[0]);
    for (; i + 32 <= n; i += 32) {
        /* _CMP_GT_OQ is false for NaN, so NaNs never enter. */
        __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), thr, _CMP_GT_OQ);
        __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), thr, _CMP_GT_OQ);
        __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), thr, _CMP_GT_OQ);
        __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), thr, _CMP_GT_OQ);
        __m256 any = _mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3));
        if (_mm256_testz_ps(any, any)) continue;
        uint32_t mask = (uint32_t)_mm256_movemask_ps(c0) | ((uint32_t)_mm256_movemask_ps(c1) << 8) |
                        ((uint32_t)_mm256_movemask_ps(c2) << 16) |
                        ((uint32_t)_mm256_movemask_ps(c3) << 24);
        while (mask) {
            int j = __builtin_ctz(mask);
            mask &= mask - 1;
            float v = x[i + j];
            /* Re-test: the root rose since the vector compare. */
            if (v > val[0]) ellm_sample_heap_offer(idx, val, k, (int32_t)(i + j), v);
        }
        thr = _mm256_set1_ps(val[0]);
    }
    for (; i < n; i++)
        if (x[i] > val[0]) ellm_sample_heap_offer(idx, val, k, (int32_t)i, x[i]);
}

/* Gathers every i with x[i] >= tau, in index order, into idx/val (cap,); returns the
 * count, or -1 once more than cap qualify. Most 32-entry blocks hold none. */
int64_t ellm_topk_collect_avx2(const float *x, int64_t n, float tau, int32_t *idx, float *val,
                               int64_t cap) {
    __m256 t = _mm256_set1_ps(tau);
    int64_t c = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_GE_OQ);
        __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), t, _CMP_GE_OQ);
        __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), t, _CMP_GE_OQ);
        __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), t, _CMP_GE_OQ);
        __m256 any = _mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3));
        if (_mm256_testz_ps(any, any)) continue;
        uint32_t mask = (uint32_t)_mm256_movemask_ps(c0) | ((uint32_t)_mm256_movemask_ps(c1) << 8) |
                        ((uint32_t)_mm256_movemask_ps(c2) << 16) |
                        ((uint32_t)_mm256_movemask_ps(c3) << 24);
        while (mask) {
            int j = __builtin_ctz(mask);
            mask &= mask - 1;
            if (c == cap) return -1;
            idx[c] = (int32_t)(i + j);
            val[c] = x[i + j];
            c++;
        }
    }
    for (; i < n; i++) {
        if (!(x[i] >= tau)) continue;
        if (c == cap) return -1;
        idx[c] = (int32_t)i;
        val[c] = x[i];
        c++;
    }
    return c;
}

/* ============================================================================
 * exp and the weights
 * ============================================================================ */

/* exp(t) for t <= 88: t = m*ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor
 * polynomial (truncation error < 1.2e-7 relative, about float rounding), 2^m built in
 * the exponent bits. Lanes with t <= -87.3 come out as garbage and must be masked off by
 * the caller (weights8 does): skipping a lower clamp saves an op per vector. */
static inline __m256 exp8(__m256 t) {
    t = _mm256_min_ps(t, _mm256_set1_ps(88.0f));
    __m256 m = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln2 split in two so m*ln2_hi is exact in float. */
    __m256 r = _mm256_fnmadd_ps(m, _mm256_set1_ps(0.693145751953125f), t);
    r = _mm256_fnmadd_ps(m, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

typedef struct {
    __m256 mx, scale, lo, floor;
} wparams;

/* Weights of x[i .. i+8), lanes at or past n set to 0 (i < n). */
static inline __m256 weights8(const float *x, int64_t i, int64_t n, const wparams *p) {
    __m256 xv;
    __m256 valid;
    if (i + 8 <= n) {
        xv = _mm256_loadu_ps(x + i);
        valid = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    } else {
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), lane);
        xv = _mm256_maskload_ps(x + i, live); /* never touches memory past n */
        valid = _mm256_castsi256_ps(live);
    }
    __m256 t = _mm256_mul_ps(_mm256_sub_ps(xv, p->mx), p->scale);
    __m256 ok = _mm256_and_ps(_mm256_cmp_ps(xv, p->lo, _CMP_GE_OQ), _mm256_cmp_ps(t, p->floor, _CMP_GT_OQ));
    ok = _mm256_and_ps(ok, valid);
    if (_mm256_testz_ps(ok, ok)) return _mm256_setzero_ps(); /* far below the max: skip exp */
    return _mm256_and_ps(exp8(t), ok);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of the weights of x[c .. min(c+CHUNK, n)). expsum and draw both go through here,
 * so their running totals agree chunk by chunk. */
static inline float chunk_sum(const float *x, int64_t c, int64_t n, const wparams *p) {
    int64_t e = c + CHUNK < n ? c + CHUNK : n;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = c; i < e; i += 8) acc = _mm256_add_ps(acc, weights8(x, i, n, p));
    return hsum8(acc);
}

static inline wparams make_params(float mx, float scale, float lo) {
    wparams p = {_mm256_set1_ps(mx), _mm256_set1_ps(scale), _mm256_set1_ps(lo),
                 _mm256_set1_ps(EXP_FLOOR)};
    return p;
}

double ellm_expsum_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo) {
    wparams p = make_params(mx, scale, lo);
    double total = 0.0;
    for (int64_t c = 0; c < n; c += CHUNK) total += (double)chunk_sum(x, c, n, &p);
    return total;
}

/* The last index with a nonzero weight, or -1. Only reached when rounding leaves the
 * total at or below the target, so a backward scan is cheap enough. */
static int64_t last_nonzero(const float *x, int64_t n, const wparams *p) {
    int64_t c = ((n - 1) / CHUNK) * CHUNK;
    for (; c >= 0; c -= CHUNK) {
        if (!(chunk_sum(x, c, n, p) > 0.0f)) continue;
        int64_t e = c + CHUNK < n ? c + CHUNK : n;
        int64_t last = -1;
        for (int64_t i = c; i < e; i += 8) {
            float w[8];
            _mm256_storeu_ps(w, weights8(x, i, n, p));
            for (int j = 0; j < 8 && i + j < e; j++)
                if (w[j] > 0.0f) last = i + j;
        }
        if (last >= 0) return last;
    }
    return -1;
}

int64_t ellm_draw_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                           double target) {
    wparams p = make_params(mx, scale, lo);
    double acc = 0.0;
    for (int64_t c = 0; c < n; c += CHUNK) {
        float s = chunk_sum(x, c, n, &p);
        if (acc + (double)s <= target) {
            acc += (double)s;
            continue;
        }
        /* The target falls in this chunk: walk its entries one by one. */
        int64_t e = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < e; i += 8) {
            float w[8];
            _mm256_storeu_ps(w, weights8(x, i, n, &p));
            for (int j = 0; j < 8 && i + j < e; j++) {
                if (w[j] <= 0.0f) continue;
                acc += (double)w[j];
                if (acc > target) return i + j;
            }
        }
        /* Lane sums fell just short of the chunk sum: carry on with the next chunk. */
    }
    return last_nonzero(x, n, &p);
}

/* ============================================================================
 * Mass histogram and bin collection
 * ============================================================================ */

typedef struct {
    __m256 mx, scale, lo, neg_span, bin_scale, top_bin;
} hparams;

/* Bins of x[i .. i+8) into b[], exponents into *t; returns the mask of counted lanes
 * (0: none, the common case far below the top). Same arithmetic as bin_of() in sample.c. */
static inline int bins8(const float *x, int64_t i, int64_t n, const hparams *p, __m256 *t,
                        int32_t *b) {
    __m256 xv, valid;
    if (i + 8 <= n) {
        xv = _mm256_loadu_ps(x + i);
        valid = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    } else {
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        xv = _mm256_maskload_ps(x + i, live);
        valid = _mm256_castsi256_ps(live);
    }
    __m256 tv = _mm256_mul_ps(_mm256_sub_ps(xv, p->mx), p->scale);
    __m256 ok = _mm256_and_ps(_mm256_cmp_ps(xv, p->lo, _CMP_GE_OQ), _mm256_cmp_ps(tv, p->neg_span, _CMP_GT_OQ));
    int mask = _mm256_movemask_ps(_mm256_and_ps(ok, valid));
    if (!mask) return 0;
    __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), tv), p->bin_scale);
    u = _mm256_min_ps(_mm256_max_ps(u, _mm256_setzero_ps()), p->top_bin);
    _mm256_storeu_si256((__m256i *)b, _mm256_cvttps_epi32(u));
    *t = tv;
    return mask;
}

static inline hparams make_hparams(float mx, float scale, float lo, float span, int64_t nbins,
                                   float bin_scale) {
    hparams p = {_mm256_set1_ps(mx), _mm256_set1_ps(scale), _mm256_set1_ps(lo),
                 _mm256_set1_ps(-span), _mm256_set1_ps(bin_scale), _mm256_set1_ps((float)(nbins - 1))};
    return p;
}

void ellm_mass_hist_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                             float span, int64_t nbins, float bin_scale, double *hist) {
    hparams p = make_hparams(mx, scale, lo, span, nbins, bin_scale);
    float w[8];
    int32_t b[8];
    __m256 t;
    for (int64_t i = 0; i < n; i += 8) {
        int mask = bins8(x, i, n, &p, &t, b);
        if (!mask) continue;
        _mm256_storeu_ps(w, exp8(t));
        while (mask) {
            int j = __builtin_ctz((unsigned)mask);
            mask &= mask - 1;
            hist[b[j]] += (double)w[j];
        }
    }
}

int64_t ellm_bin_collect_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                                  float span, int64_t nbins, float bin_scale, int64_t bin,
                                  int32_t *idx, float *val, float *w, int64_t cap) {
    hparams p = make_hparams(mx, scale, lo, span, nbins, bin_scale);
    __m256i want = _mm256_set1_epi32((int)bin);
    float wl[8];
    int32_t b[8];
    __m256 t;
    int64_t c = 0;
    for (int64_t i = 0; i < n; i += 8) {
        int mask = bins8(x, i, n, &p, &t, b);
        if (!mask) continue;
        mask &= _mm256_movemask_ps(_mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)b), want)));
        if (!mask) continue;
        _mm256_storeu_ps(wl, exp8(t)); /* the same lane values mass_hist added */
        while (mask) {
            int j = __builtin_ctz((unsigned)mask);
            mask &= mask - 1;
            if (c == cap) return -1;
            idx[c] = (int32_t)(i + j);
            val[c] = x[i + j];
            w[c] = wl[j];
            c++;
        }
    }
    return c;
}

/* ============================================================================
 * Grammar mask
 * ============================================================================ */

/* Whole 32-entry words of the mask (see ellm_mask_apply_f32): lane j of each 8-entry
 * group tests bit j of that group's byte. All-ones words (most of a permissive mask) are
 * skipped; all-zero words (most of a strict one) are four plain stores. */
int64_t ellm_mask_words_avx2(float *x, int64_t nfull, const uint32_t *bits) {
    const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t allowed = 0;
    for (int64_t k = 0; k < nfull; k++) {
        uint32_t w = bits[k];
        float *row = x + 32 * k;
        if (w == 0xFFFFFFFFu) {
            allowed += 32;
            continue;
        }
        if (w == 0) {
            for (int g = 0; g < 4; g++) _mm256_storeu_ps(row + 8 * g, neg_inf);
            continue;
        }
        for (int g = 0; g < 4; g++) {
            uint32_t byte = (w >> (8 * g)) & 0xFFu;
            __m256i sel = _mm256_and_si256(_mm256_set1_epi32((int)byte), lane_bit);
            __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, lane_bit));
            __m256 v = _mm256_loadu_ps(row + 8 * g);
            _mm256_storeu_ps(row + 8 * g, _mm256_blendv_ps(neg_inf, v, keep));
            allowed += __builtin_popcount(byte);
        }
    }
    return allowed;
}
