/* AVX-512 inner loops of the attention kernel (see attention.c and attention_avx2.c for
 * the same loops on 8 lanes): q.k scores of a key tile and the p @ V accumulation.
 * As there, each score has one fixed horizontal-sum order (fold 16 -> 8 lanes, then the
 * 8-lane order), for keys in groups of sixteen or four and in the tail alike. */
#include <immintrin.h>
#include <math.h>

#include "attention.h"
#include "elementwise.h"
#include "exp_avx512.h"

static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

/* sum(a) in the order of one lane of hsum4x16 */
static inline float hsum16(__m512 a) {
    __m256 h = fold16(a);
    h = _mm256_hadd_ps(h, h);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* fold each to 8 lanes, then the 8-lane horizontal adds */
    __m256 a8 = fold16(a), b8 = fold16(b), c8 = fold16(c), d8 = fold16(d);
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* ================================ q.k scores ================================ */

/* Scores of four keys for 1..4 rows at once: each key chunk loaded once for all rows
 * and each q chunk once for four keys. Every (row, key) is the same FMA chain over
 * head_dim and the same hsum as anywhere else. The accumulators are named variables
 * (ROWS lists the rows): as an array, GCC keeps them on the stack. */
#define QK_DECL(r)                                                                            \
    __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = _mm512_setzero_ps();                      \
    __m512 a##r##2 = _mm512_setzero_ps(), a##r##3 = _mm512_setzero_ps();
#define QK_FMA(r, LOAD, off)                                                                  \
    {                                                                                         \
        const __m512 qv = LOAD(q + (r) * (int64_t)hd + (off));                                \
        a##r##0 = _mm512_fmadd_ps(qv, k0, a##r##0);                                           \
        a##r##1 = _mm512_fmadd_ps(qv, k1, a##r##1);                                           \
        a##r##2 = _mm512_fmadd_ps(qv, k2, a##r##2);                                           \
        a##r##3 = _mm512_fmadd_ps(qv, k3, a##r##3);                                           \
    }
#define QK_BODY(r) QK_FMA(r, _mm512_loadu_ps, d)
#define QK_TAIL(r) QK_FMA(r, MASKED, body)
#define QK_STORE(r) _mm_storeu_ps(out + (r) * ELLM_ATTN_TILE, hsum4x16(a##r##0, a##r##1, a##r##2, a##r##3));
#define MASKED(ptr) _mm512_maskz_loadu_ps(tm, ptr)
/* One q.k kernel body for up to 4 query rows x 4 keys; STORE says what it leaves in out:
 * four scores a row (QK_STORE, into the score tile) or the 16-key fold's partial sums
 * (QR_STORE, below). */
#define QK_KERNEL(name, ROWS, OUT_T, STORE)                                                   \
    static void name(const float *q, int hd, int body, __mmask16 tm, const float *const *k, OUT_T out) { \
        ROWS(QK_DECL)                                                                         \
        for (int d = 0; d < body; d += 16) {                                                  \
            const __m512 k0 = _mm512_loadu_ps(k[0] + d), k1 = _mm512_loadu_ps(k[1] + d);      \
            const __m512 k2 = _mm512_loadu_ps(k[2] + d), k3 = _mm512_loadu_ps(k[3] + d);      \
            ROWS(QK_BODY)                                                                     \
        }                                                                                     \
        if (body < hd) {                                                                      \
            const __m512 k0 = MASKED(k[0] + body), k1 = MASKED(k[1] + body);                  \
            const __m512 k2 = MASKED(k[2] + body), k3 = MASKED(k[3] + body);                  \
            ROWS(QK_TAIL)                                                                     \
        }                                                                                     \
        ROWS(STORE)                                                                           \
    }
#define QK_BLOCK(name, ROWS) QK_KERNEL(name, ROWS, float *, QK_STORE)
#define ROWS4(X) X(0) X(1) X(2) X(3)
#define ROWS3(X) X(0) X(1) X(2)
#define ROWS2(X) X(0) X(1)
#define ROWS1(X) X(0)
QK_BLOCK(qk_4keys_4, ROWS4)
QK_BLOCK(qk_4keys_3, ROWS3)
QK_BLOCK(qk_4keys_2, ROWS2)
QK_BLOCK(qk_4keys_1, ROWS1)

/* ---- 16 keys at a time: the same sums, folded across keys ----
 * hsum4x16 spends ~19 instructions on four scores. For a group of 16 keys the same
 * additions -- A_i = a_i + a_{i+8}, then adjacent pairs three times, each score
 * ((A0+A1)+(A2+A3)) + ((A4+A5)+(A6+A7)) -- are done with two keys' lanes per
 * shuffle-and-add, ~3 instructions per score, and give the same bits. */
static inline __m512 fold8(__m512 a, __m512 b) { /* [a_i + a_{i+8} | b_i + b_{i+8}] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 pairs(__m512 x, __m512 y) { /* per 128 bits: x0+x1, x2+x3, y0+y1, y2+y3 */
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
#define QR_STORE(r) out[r] = pairs(fold8(a##r##0, a##r##1), fold8(a##r##2, a##r##3));
#define QR_BLOCK(name, ROWS) QK_KERNEL(name, ROWS, __m512 *, QR_STORE)
QR_BLOCK(qr_4keys_4, ROWS4)
QR_BLOCK(qr_4keys_3, ROWS3)
QR_BLOCK(qr_4keys_2, ROWS2)
QR_BLOCK(qr_4keys_1, ROWS1)

/* Scores of rows [h, h + rb) (rb <= 4) for the 16 keys k[0..16) into s[r * TILE]. */
static void qk_16keys(const float *q, int rb, int hd, int body, __mmask16 tm, const float *const *k, float *s) {
    /* the folds leave the keys in lanes as 0 2 4 6 1 3 5 7 8 10 12 14 9 11 13 15: key j is
     * in lane src[j] */
    const __m512i src = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    __m512 f[4][4]; /* [4-key quarter][row]: (4 keys x 4 partials) */
    for (int qq = 0; qq < 4; qq++) {
        switch (rb) {
        case 4: qr_4keys_4(q, hd, body, tm, k + 4 * qq, f[qq]); break;
        case 3: qr_4keys_3(q, hd, body, tm, k + 4 * qq, f[qq]); break;
        case 2: qr_4keys_2(q, hd, body, tm, k + 4 * qq, f[qq]); break;
        default: qr_4keys_1(q, hd, body, tm, k + 4 * qq, f[qq]); break;
        }
    }
    for (int r = 0; r < rb; r++) {
        const __m512 lo = pairs(f[0][r], f[1][r]), hi = pairs(f[2][r], f[3][r]); /* 8 keys x (C0, C1) */
        const __m512 sc = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
        _mm512_storeu_ps(s + r * ELLM_ATTN_TILE, _mm512_permutexvar_ps(src, sc));
    }
}

void ellm_attn_qk_avx512(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    const int body = hd & ~15;
    const __mmask16 tm = (__mmask16)((1u << (hd & 15)) - 1u);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int h = 0; h < g; h += 4)
            qk_16keys(q + (int64_t)h * hd, g - h < 4 ? g - h : 4, hd, body, tm, kp + j, s + h * ELLM_ATTN_TILE + j);
    for (; j + 4 <= n; j += 4) {
        int h = 0;
        for (; h + 4 <= g; h += 4)
            qk_4keys_4(q + (int64_t)h * hd, hd, body, tm, kp + j, s + h * ELLM_ATTN_TILE + j);
        const float *qh = q + (int64_t)h * hd;
        float *sh = s + h * ELLM_ATTN_TILE + j;
        switch (g - h) {
        case 3: qk_4keys_3(qh, hd, body, tm, kp + j, sh); break;
        case 2: qk_4keys_2(qh, hd, body, tm, kp + j, sh); break;
        case 1: qk_4keys_1(qh, hd, body, tm, kp + j, sh); break;
        default: break;
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
            s[h * ELLM_ATTN_TILE + j] = hsum16(a0);
        }
    }
}

/* ================================ p @ V ================================ */

/* acc row += p row @ V for columns [d0, hd) of one row: 64, then 16 columns in registers
 * across all keys, then the masked tail. */
static inline void pv_row(const float *ph, float *ah, const float *const *vp, int n, int hd, int d0) {
    int d = d0;
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

/* 1..4 rows over 64 columns: each value chunk loaded once for all rows (up to 16
 * accumulators, named variables as in the q.k block); each element still adds its keys
 * in order j = 0, 1, ... */
#define PV_LOAD(r)                                                                            \
    __m512 a##r##0 = _mm512_loadu_ps(acc + (r) * (int64_t)hd + d);                            \
    __m512 a##r##1 = _mm512_loadu_ps(acc + (r) * (int64_t)hd + d + 16);                       \
    __m512 a##r##2 = _mm512_loadu_ps(acc + (r) * (int64_t)hd + d + 32);                       \
    __m512 a##r##3 = _mm512_loadu_ps(acc + (r) * (int64_t)hd + d + 48);
#define PV_FMA(r)                                                                             \
    {                                                                                         \
        const __m512 w = _mm512_set1_ps(p[(r) * ELLM_ATTN_TILE + j]);                         \
        a##r##0 = _mm512_fmadd_ps(w, v0, a##r##0);                                            \
        a##r##1 = _mm512_fmadd_ps(w, v1, a##r##1);                                            \
        a##r##2 = _mm512_fmadd_ps(w, v2, a##r##2);                                            \
        a##r##3 = _mm512_fmadd_ps(w, v3, a##r##3);                                            \
    }
#define PV_STORE(r)                                                                           \
    _mm512_storeu_ps(acc + (r) * (int64_t)hd + d, a##r##0);                                   \
    _mm512_storeu_ps(acc + (r) * (int64_t)hd + d + 16, a##r##1);                              \
    _mm512_storeu_ps(acc + (r) * (int64_t)hd + d + 32, a##r##2);                              \
    _mm512_storeu_ps(acc + (r) * (int64_t)hd + d + 48, a##r##3);
#define PV_BLOCK(name, ROWS)                                                                  \
    static void name(const float *p, float *acc, int hd, const float *const *vp, int n, int d) { \
        ROWS(PV_LOAD)                                                                         \
        for (int j = 0; j < n; j++) {                                                         \
            const float *v = vp[j] + d;                                                       \
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);               \
            const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);          \
            ROWS(PV_FMA)                                                                      \
        }                                                                                     \
        ROWS(PV_STORE)                                                                        \
    }
PV_BLOCK(pv_rows_64_4, ROWS4)
PV_BLOCK(pv_rows_64_3, ROWS3)
PV_BLOCK(pv_rows_64_2, ROWS2)

/* rows [h, h + rb) (rb <= 4) */
static inline void pv_rows(const float *p, int h, int rb, int hd, const float *const *vp, int n, float *acc) {
    const int body = rb > 1 ? hd & ~63 : 0;
    for (int d = 0; d < body; d += 64) {
        const float *ph = p + h * ELLM_ATTN_TILE;
        float *ah = acc + (int64_t)h * hd;
        if (rb == 4) pv_rows_64_4(ph, ah, hd, vp, n, d);
        else if (rb == 3) pv_rows_64_3(ph, ah, hd, vp, n, d);
        else pv_rows_64_2(ph, ah, hd, vp, n, d);
    }
    if (body < hd)
        for (int r = h; r < h + rb; r++) pv_row(p + r * ELLM_ATTN_TILE, acc + (int64_t)r * hd, vp, n, hd, body);
}

void ellm_attn_pv_avx512(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    for (int h = 0; h < g; h += 4) pv_rows(p, h, g - h < 4 ? g - h : 4, hd, vp, n, acc);
}

/* ================================ softmax row ================================ */

float ellm_attn_softmax_row_avx512(float *x, int n, float scale, float cap, float m_old, float *m_new) {
    enum { V = ELLM_ATTN_TILE / 16 };
    const int full = n / 16, rem = n % 16;
    const __mmask16 tm = (__mmask16)((1u << rem) - 1u);
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 v[V];
    for (int i = 0; i < full; i++) v[i] = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * i), vs);
    if (rem) v[full] = _mm512_mul_ps(_mm512_maskz_loadu_ps(tm, x + 16 * full), vs);
    if (cap > 0.0f) { /* rare (Gemma 2): the row function on the scaled row */
        for (int i = 0; i < full; i++) _mm512_storeu_ps(x + 16 * i, v[i]);
        if (rem) _mm512_mask_storeu_ps(x + 16 * full, tm, v[full]);
        ellm_softcap_row_avx512(x, cap, n);
        for (int i = 0; i < full; i++) v[i] = _mm512_loadu_ps(x + 16 * i);
        if (rem) v[full] = _mm512_maskz_loadu_ps(tm, x + 16 * full);
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < full; i++) mx = _mm512_max_ps(mx, v[i]);
    if (rem) mx = _mm512_mask_max_ps(mx, tm, mx, v[full]);
    const float tile_max = _mm512_reduce_max_ps(mx);
    const float mn = tile_max > m_old ? tile_max : m_old;
    const __m512 sh = _mm512_set1_ps(mn);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < full; i++) {
        const __m512 e = ellm_exp16(_mm512_sub_ps(v[i], sh));
        _mm512_storeu_ps(x + 16 * i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (rem) {
        const __m512 e = ellm_exp16(_mm512_sub_ps(v[full], sh));
        _mm512_mask_storeu_ps(x + 16 * full, tm, e);
        acc = _mm512_mask_add_ps(acc, tm, acc, e);
    }
    *m_new = mn;
    return _mm512_reduce_add_ps(acc);
}

/* ================================ f16 rows -> f32 ================================ */

void ellm_attn_widen_avx512(const uint16_t *const *src, int n, int hd, float *dst) {
    for (int j = 0; j < n; j++) {
        const uint16_t *s = src[j];
        float *o = dst + (int64_t)j * hd;
        int d = 0;
        for (; d + 16 <= hd; d += 16)
            _mm512_storeu_ps(o + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + d))));
        if (d < hd) {
            const __mmask16 tm = (__mmask16)((1u << (hd - d)) - 1u);
            _mm512_mask_storeu_ps(o + d, tm, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tm, s + d)));
        }
    }
}
