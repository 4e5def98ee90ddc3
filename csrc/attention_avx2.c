/* AVX2 + FMA inner loops of the attention kernel (see attention.c): the q.k scores of a
 * key tile and the p @ V accumulation. These are the hot loops of long-context decode. */
#include <immintrin.h>

#include "attention.h"

/* lanes [0, rem) set: 8 words starting at mask_src + 8 - rem */
static const int32_t mask_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b);
    __m256 cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void ellm_attn_qk_avx2(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    const int body = hd & ~7;
    const __m256i tm = _mm256_loadu_si256((const __m256i *)(mask_src + 8 - (hd & 7)));
    int j = 0;
    /* four keys at a time: each q chunk is loaded once for four FMAs */
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kp[j], *k1 = kp[j + 1], *k2 = kp[j + 2], *k3 = kp[j + 3];
        for (int h = 0; h < g; h++) {
            const float *qh = q + (int64_t)h * hd;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int d = 0; d < body; d += 8) {
                __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            if (body < hd) {
                __m256 qv = _mm256_maskload_ps(qh + body, tm);
                a0 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k0 + body, tm), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k1 + body, tm), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k2 + body, tm), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k3 + body, tm), a3);
            }
            _mm_storeu_ps(s + h * ELLM_ATTN_TILE + j, hsum4x8(a0, a1, a2, a3));
        }
    }
    for (; j < n; j++) {
        const float *k = kp[j];
        for (int h = 0; h < g; h++) {
            const float *qh = q + (int64_t)h * hd;
            __m256 a0 = _mm256_setzero_ps();
            for (int d = 0; d < body; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), a0);
            if (body < hd)
                a0 = _mm256_fmadd_ps(_mm256_maskload_ps(qh + body, tm), _mm256_maskload_ps(k + body, tm), a0);
            s[h * ELLM_ATTN_TILE + j] = hsum8(a0);
        }
    }
}

void ellm_attn_pv_avx2(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    for (int h = 0; h < g; h++) {
        const float *ph = p + h * ELLM_ATTN_TILE;
        float *ah = acc + (int64_t)h * hd;
        int d = 0;
        /* 32 columns in four registers across all keys of the tile */
        for (; d + 32 <= hd; d += 32) {
            __m256 a0 = _mm256_loadu_ps(ah + d), a1 = _mm256_loadu_ps(ah + d + 8);
            __m256 a2 = _mm256_loadu_ps(ah + d + 16), a3 = _mm256_loadu_ps(ah + d + 24);
            for (int j = 0; j < n; j++) {
                const __m256 w = _mm256_broadcast_ss(ph + j);
                const float *v = vp[j] + d;
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(ah + d, a0);
            _mm256_storeu_ps(ah + d + 8, a1);
            _mm256_storeu_ps(ah + d + 16, a2);
            _mm256_storeu_ps(ah + d + 24, a3);
        }
        for (; d + 8 <= hd; d += 8) {
            __m256 a0 = _mm256_loadu_ps(ah + d);
            for (int j = 0; j < n; j++)
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + j), _mm256_loadu_ps(vp[j] + d), a0);
            _mm256_storeu_ps(ah + d, a0);
        }
        if (d < hd) {
            const __m256i tm = _mm256_loadu_si256((const __m256i *)(mask_src + 8 - (hd - d)));
            __m256 a0 = _mm256_maskload_ps(ah + d, tm);
            for (int j = 0; j < n; j++)
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + j), _mm256_maskload_ps(vp[j] + d, tm), a0);
            _mm256_maskstore_ps(ah + d, tm, a0);
        }
    }
}
