/* AVX-512 inner loops of the attention kernel (see attention.c and attention_avx2.c for
 * the same loops on 8 lanes): q.k scores of a key tile and the p @ V accumulation. */
#include <immintrin.h>

#include "attention.h"

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* fold each to 8 lanes, then the 8-lane horizontal adds */
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

void ellm_attn_qk_avx512(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    const int body = hd & ~15;
    const __mmask16 tm = (__mmask16)((1u << (hd & 15)) - 1u);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kp[j], *k1 = kp[j + 1], *k2 = kp[j + 2], *k3 = kp[j + 3];
        for (int h = 0; h < g; h++) {
            const float *qh = q + (int64_t)h * hd;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int d = 0; d < body; d += 16) {
                __m512 qv = _mm512_loadu_ps(qh + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), a3);
            }
            if (body < hd) {
                __m512 qv = _mm512_maskz_loadu_ps(tm, qh + body);
                a0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, k0 + body), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, k1 + body), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, k2 + body), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, k3 + body), a3);
            }
            _mm_storeu_ps(s + h * ELLM_ATTN_TILE + j, hsum4x16(a0, a1, a2, a3));
        }
    }
    for (; j < n; j++) {
        const float *k = kp[j];
        for (int h = 0; h < g; h++) {
            const float *qh = q + (int64_t)h * hd;
            __m512 a0 = _mm512_setzero_ps();
            for (int d = 0; d < body; d += 16)
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(k + d), a0);
            if (body < hd)
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, qh + body), _mm512_maskz_loadu_ps(tm, k + body), a0);
            s[h * ELLM_ATTN_TILE + j] = _mm512_reduce_add_ps(a0);
        }
    }
}

void ellm_attn_pv_avx512(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    for (int h = 0; h < g; h++) {
        const float *ph = p + h * ELLM_ATTN_TILE;
        float *ah = acc + (int64_t)h * hd;
        int d = 0;
        for (; d + 64 <= hd; d += 64) {
            __m512 a0 = _mm512_loadu_ps(ah + d), a1 = _mm512_loadu_ps(ah + d + 16);
            __m512 a2 = _mm512_loadu_ps(ah + d + 32), a3 = _mm512_loadu_ps(ah + d + 48);
            for (int j = 0; j < n; j++) {
                const __m512 w = _mm512_set1_ps(ph[j]);
                const float *v = vp[j] + d;
                a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
                a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
                a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
                a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
            }
            _mm512_storeu_ps(ah + d, a0);
            _mm512_storeu_ps(ah + d + 16, a1);
            _mm512_storeu_ps(ah + d + 32, a2);
            _mm512_storeu_ps(ah + d + 48, a3);
        }
        for (; d + 16 <= hd; d += 16) {
            __m512 a0 = _mm512_loadu_ps(ah + d);
            for (int j = 0; j < n; j++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(ph[j]), _mm512_loadu_ps(vp[j] + d), a0);
            _mm512_storeu_ps(ah + d, a0);
        }
        if (d < hd) {
            const __mmask16 tm = (__mmask16)((1u << (hd - d)) - 1u);
            __m512 a0 = _mm512_maskz_loadu_ps(tm, ah + d);
            for (int j = 0; j < n; j++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(ph[j]), _mm512_maskz_loadu_ps(tm, vp[j] + d), a0);
            _mm512_mask_storeu_ps(ah + d, tm, a0);
        }
    }
}
