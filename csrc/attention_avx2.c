/* AVX2 + FMA inner loops of the attention kernel (see attention.c): the q.k scores of a
 * key tile and the p @ V accumulation. These are the hot loops of long-context decode.
 *
 * Batch invariance: every score is one FMA chain over head_dim in 8 lanes, then the same
 * horizontal sum ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), whether its key is in a group of
 * four or in the tail; so a score never depends on where its key sits in a tile. */
#include <immintrin.h>

#include "attention.h"

/* lanes [0, rem) set: 8 words starting at mask_src + 8 - rem */
static const int32_t mask_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* [sum(a), sum(b), sum(c), sum(d)], each as ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)) */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b);
    __m256 cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* sum(v) in the order of one lane of hsum4x8 */
static inline float hsum8(__m256 v) {
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* ================================ q.k scores ================================ */

/* Scores of four keys for 1 or 2 rows: each key chunk loaded once for both rows, each q
 * chunk once for four keys (8 accumulators + 4 keys + q: 13 of the 16 registers). Every
 * (row, key) is the same FMA chain and hsum as anywhere else. ROWS lists the rows; the
 * accumulators are named variables so that they stay in registers. */
#define QK_DECL(r)                                                                            \
    __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();                      \
    __m256 a##r##2 = _mm256_setzero_ps(), a##r##3 = _mm256_setzero_ps();
#define QK_FMA(r, LOAD, off)                                                                  \
    {                                                                                         \
        const __m256 qv = LOAD(q + (r) * (int64_t)hd + (off));                                \
        a##r##0 = _mm256_fmadd_ps(qv, k0, a##r##0);                                           \
        a##r##1 = _mm256_fmadd_ps(qv, k1, a##r##1);                                           \
        a##r##2 = _mm256_fmadd_ps(qv, k2, a##r##2);                                           \
        a##r##3 = _mm256_fmadd_ps(qv, k3, a##r##3);                                           \
    }
#define MASKED(ptr) _mm256_maskload_ps(ptr, tm)
#define QK_BODY(r) QK_FMA(r, _mm256_loadu_ps, d)
#define QK_TAIL(r) QK_FMA(r, MASKED, body)
#define QK_STORE(r) _mm_storeu_ps(s + (r) * ELLM_ATTN_TILE, hsum4x8(a##r##0, a##r##1, a##r##2, a##r##3));
#define QK_BLOCK(name, ROWS)                                                                  \
    static void name(const float *q, int hd, int body, __m256i tm, const float *const *k, float *s) { \
        ROWS(QK_DECL)                                                                         \
        for (int d = 0; d < body; d += 8) {                                                   \
            const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d);      \
            const __m256 k2 = _mm256_loadu_ps(k[2] + d), k3 = _mm256_loadu_ps(k[3] + d);      \
            ROWS(QK_BODY)                                                                     \
        }                                                                                     \
        if (body < hd) {                                                                      \
            const __m256 k0 = MASKED(k[0] + body), k1 = MASKED(k[1] + body);                  \
            const __m256 k2 = MASKED(k[2] + body), k3 = MASKED(k[3] + body);                  \
            ROWS(QK_TAIL)                                                                     \
        }                                                                                     \
        ROWS(QK_STORE)                                                                        \
    }
#define ROWS2(X) X(0) X(1)
#define ROWS1(X) X(0)
QK_BLOCK(qk_4keys_2, ROWS2)
QK_BLOCK(qk_4keys_1, ROWS1)

void ellm_attn_qk_avx2(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    const int body = hd & ~7;
    const __m256i tm = _mm256_loadu_si256((const __m256i *)(mask_src + 8 - (hd & 7)));
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        int h = 0;
        for (; h + 2 <= g; h += 2)
            qk_4keys_2(q + (int64_t)h * hd, hd, body, tm, kp + j, s + h * ELLM_ATTN_TILE + j);
        if (h < g) qk_4keys_1(q + (int64_t)h * hd, hd, body, tm, kp + j, s + h * ELLM_ATTN_TILE + j);
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

/* ================================ p @ V ================================ */

/* acc row += p row @ V for columns [d0, hd) of one row: 32, then 8 columns in registers
 * across all keys, then the masked tail. */
static inline void pv_row(const float *ph, float *ah, const float *const *vp, int n, int hd, int d0) {
    int d = d0;
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

/* Two rows over 32 columns: each value chunk loaded once for both rows (8 accumulators,
 * 4 values, 1 weight); each element still adds its keys in order j = 0, 1, ... */
static void pv_2rows_32(const float *p, float *acc, int hd, const float *const *vp, int n, int d) {
    float *r0 = acc + d, *r1 = acc + hd + d;
    __m256 a00 = _mm256_loadu_ps(r0), a01 = _mm256_loadu_ps(r0 + 8);
    __m256 a02 = _mm256_loadu_ps(r0 + 16), a03 = _mm256_loadu_ps(r0 + 24);
    __m256 a10 = _mm256_loadu_ps(r1), a11 = _mm256_loadu_ps(r1 + 8);
    __m256 a12 = _mm256_loadu_ps(r1 + 16), a13 = _mm256_loadu_ps(r1 + 24);
    for (int j = 0; j < n; j++) {
        const float *v = vp[j] + d;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        const __m256 w0 = _mm256_broadcast_ss(p + j);
        a00 = _mm256_fmadd_ps(w0, v0, a00);
        a01 = _mm256_fmadd_ps(w0, v1, a01);
        a02 = _mm256_fmadd_ps(w0, v2, a02);
        a03 = _mm256_fmadd_ps(w0, v3, a03);
        const __m256 w1 = _mm256_broadcast_ss(p + ELLM_ATTN_TILE + j);
        a10 = _mm256_fmadd_ps(w1, v0, a10);
        a11 = _mm256_fmadd_ps(w1, v1, a11);
        a12 = _mm256_fmadd_ps(w1, v2, a12);
        a13 = _mm256_fmadd_ps(w1, v3, a13);
    }
    _mm256_storeu_ps(r0, a00);
    _mm256_storeu_ps(r0 + 8, a01);
    _mm256_storeu_ps(r0 + 16, a02);
    _mm256_storeu_ps(r0 + 24, a03);
    _mm256_storeu_ps(r1, a10);
    _mm256_storeu_ps(r1 + 8, a11);
    _mm256_storeu_ps(r1 + 16, a12);
    _mm256_storeu_ps(r1 + 24, a13);
}

void ellm_attn_pv_avx2(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    const int body = hd & ~31;
    int h = 0;
    for (; h + 2 <= g; h += 2) {
        const float *ph = p + h * ELLM_ATTN_TILE;
        float *ah = acc + (int64_t)h * hd;
        for (int d = 0; d < body; d += 32) pv_2rows_32(ph, ah, hd, vp, n, d);
        if (body < hd) {
            pv_row(ph, ah, vp, n, hd, body);
            pv_row(ph + ELLM_ATTN_TILE, ah + hd, vp, n, hd, body);
        }
    }
    if (h < g) pv_row(p + h * ELLM_ATTN_TILE, acc + (int64_t)h * hd, vp, n, hd, 0);
}

/* ================================ f16 rows -> f32 ================================ */

void ellm_attn_widen_avx2(const uint16_t *const *src, int n, int hd, float *dst) {
    for (int j = 0; j < n; j++) {
        const uint16_t *s = src[j];
        float *o = dst + (int64_t)j * hd;
        int d = 0;
        for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + d))));
        for (; d < hd; d++) o[d] = _cvtsh_ss(s[d]);
    }
}
