/* AVX-512 inner loops of the attention kernel (see attention.c and attention_avx2.c for
 * the same loops on 8 lanes): q.k scores of a key tile and the p @ V accumulation.
 * As there, each score has one fixed horizontal-sum order (fold 16 -> 8 lanes, then the
 * 8-lane order), for keys in a group of four and in the tail alike. */
#include <immintrin.h>
#include <math.h>

#include "attention.h"
#include "elementwise.h"

_Static_assert(ELLM_ATTN_TILE == 64, "the fused tile holds a row's scores in four vectors");

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
#define QK_STORE(r) _mm_storeu_ps(s + (r) * ELLM_ATTN_TILE, hsum4x16(a##r##0, a##r##1, a##r##2, a##r##3));
#define MASKED(ptr) _mm512_maskz_loadu_ps(tm, ptr)
#define QK_BLOCK(name, ROWS)                                                                  \
    static void name(const float *q, int hd, int body, __mmask16 tm, const float *const *k, float *s) { \
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
        ROWS(QK_STORE)                                                                        \
    }
#define ROWS4(X) X(0) X(1) X(2) X(3)
#define ROWS3(X) X(0) X(1) X(2)
#define ROWS2(X) X(0) X(1)
#define ROWS1(X) X(0)
QK_BLOCK(qk_4keys_4, ROWS4)
QK_BLOCK(qk_4keys_3, ROWS3)
QK_BLOCK(qk_4keys_2, ROWS2)
QK_BLOCK(qk_4keys_1, ROWS1)

void ellm_attn_qk_avx512(const float *q, int g, int hd, const float *const *kp, int n, float *s) {
    const int body = hd & ~15;
    const __mmask16 tm = (__mmask16)((1u << (hd & 15)) - 1u);
    int j = 0;
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
static inline void pv_row(const float *ph, int ks, float *ah, const float *const *vp, int n, int hd, int d0) {
    int d = d0;
    for (; d + 64 <= hd; d += 64) {
        __m512 a0 = _mm512_loadu_ps(ah + d), a1 = _mm512_loadu_ps(ah + d + 16);
        __m512 a2 = _mm512_loadu_ps(ah + d + 32), a3 = _mm512_loadu_ps(ah + d + 48);
        for (int j = 0; j < n; j++) {
            const __m512 w = _mm512_set1_ps(ph[j * ks]);
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
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(ph[j * ks]), _mm512_loadu_ps(vp[j] + d), a0);
        _mm512_storeu_ps(ah + d, a0);
    }
    if (d < hd) {
        const __mmask16 tm = (__mmask16)((1u << (hd - d)) - 1u);
        __m512 a0 = _mm512_maskz_loadu_ps(tm, ah + d);
        for (int j = 0; j < n; j++)
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(ph[j * ks]), _mm512_maskz_loadu_ps(tm, vp[j] + d), a0);
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
        const __m512 w = _mm512_set1_ps(p[(r) * rs + j * ks]);                                \
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
    static void name(const float *p, int rs, int ks, float *acc, int hd, const float *const *vp, int n,  \
                     int d) {                                                                 \
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

/* rows [h, h + rb) (rb <= 4); p[r * rs + j * ks] is row r's weight of key j */
static inline void pv_rows(const float *p, int rs, int ks, int h, int rb, int hd, const float *const *vp, int n,
                           float *acc) {
    const int body = rb > 1 ? hd & ~63 : 0;
    const float *ph = p + h * rs;
    float *ah = acc + (int64_t)h * hd;
    for (int d = 0; d < body; d += 64) {
        if (rb == 4) pv_rows_64_4(ph, rs, ks, ah, hd, vp, n, d);
        else if (rb == 3) pv_rows_64_3(ph, rs, ks, ah, hd, vp, n, d);
        else pv_rows_64_2(ph, rs, ks, ah, hd, vp, n, d);
    }
    if (body < hd)
        for (int r = 0; r < rb; r++) pv_row(ph + r * rs, ks, ah + (int64_t)r * hd, vp, n, hd, body);
}

static void pv_strided(const float *p, int rs, int ks, int g, int hd, const float *const *vp, int n, float *acc) {
    for (int h = 0; h < g; h += 4) pv_rows(p, rs, ks, h, g - h < 4 ? g - h : 4, hd, vp, n, acc);
}

void ellm_attn_pv_avx512(const float *p, int g, int hd, const float *const *vp, int n, float *acc) {
    pv_strided(p, ELLM_ATTN_TILE, 1, g, hd, vp, n, acc);
}

/* ============================ the fused tile ============================
 * One pass over a key tile for up to MAX_ROWS query rows (a run of tokens of one
 * sequence and all heads of its GQA group, or one token's heads in decode): the q.k
 * scores above, then per row scale, soft-cap, mask, max, exp and sum in registers, the
 * online-softmax update, and p @ V -- instead of four passes over each row's scores.
 *
 * A score sits at the lane of its key in the tile (position - tile start) whoever
 * computes it; the keys a row does not see are -inf before the max and exactly 0 after
 * the exp, so they add nothing to its sum or to its p @ V (acc + 0 * v == acc). So the
 * rows of tokens whose keys end (or start) at different lanes of one tile -- the tile on
 * the diagonal of a causal prefill -- share one call, and a row's result is the same as
 * when it is alone (decode). */

/* ---- the score of one (row, key) ----
 * 16 partial FMA chains, chain l over dims l, l + 16, l + 32, ... in order (from 0),
 * folded by one tree: r1_l = p_l + p_{l+8}, r2_l = r1_l + r1_{l+4},
 * r3_l = r2_l + r2_{l+2}, score = r3_0 + r3_1. Two layouts compute exactly that:
 * dims in the lanes (few rows: decode), and rows in the lanes (many rows: prefill). */

/* -- dims in the lanes: lane l of a (row, key) accumulator is chain l; the tree runs
 * across the keys of a 16-key group (each shuffle-and-add level serves two keys' lanes) */
static inline __m512 fold1(__m512 a, __m512 b) { /* [a 8 | b 8]: lanes l + l+8 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 fold2(__m512 a, __m512 b) { /* 4 keys x 4: lanes l + l+4 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 fold3(__m512 a, __m512 b) { /* 8 keys x 2: lanes l + l+2 */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
static inline __m512 fold4(__m512 a, __m512 b) { /* 16 keys x 1: lanes l + l+1 */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
/* accumulator i of a group holds key 4 (i % 4) + i / 4: the folds then leave key L at
 * lane L */
static const int KEY_ORDER[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* 1..4 rows x 4 keys (the old q.k block's loads and FMAs), each row's four accumulators
 * folded twice into f[r] = (4 keys x 4 partials r2). */
#define QF_STORE(r) f[r] = fold2(fold1(a##r##0, a##r##1), fold1(a##r##2, a##r##3));
#define QF_BLOCK(name, ROWS)                                                                  \
    static void name(const float *q, int hd, int body, __mmask16 tm, const float *const *k, __m512 *f) { \
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
        ROWS(QF_STORE)                                                                        \
    }
QF_BLOCK(qf_4, ROWS4)
QF_BLOCK(qf_3, ROWS3)
QF_BLOCK(qf_2, ROWS2)
QF_BLOCK(qf_1, ROWS1)

/* Scores of `rows` rows (q row-major) for the 16 keys kk[0..16) into s[r * TILE]. */
static void qk_dims_in_lanes(const float *q, int rows, int hd, const float *const *kk, float *s) {
    const int body = hd & ~15;
    const __mmask16 tm = (__mmask16)((1u << (hd & 15)) - 1u);
    const float *ko[16];
    for (int i = 0; i < 16; i++) ko[i] = kk[KEY_ORDER[i]];
    for (int r = 0; r < rows; r += 4) {
        const int rb = rows - r < 4 ? rows - r : 4;
        const float *qr = q + (int64_t)r * hd;
        __m512 f[4][4]; /* [quarter][row] */
        for (int qq = 0; qq < 4; qq++) {
            switch (rb) {
            case 4: qf_4(qr, hd, body, tm, ko + 4 * qq, f[qq]); break;
            case 3: qf_3(qr, hd, body, tm, ko + 4 * qq, f[qq]); break;
            case 2: qf_2(qr, hd, body, tm, ko + 4 * qq, f[qq]); break;
            default: qf_1(qr, hd, body, tm, ko + 4 * qq, f[qq]); break;
            }
        }
        for (int i = 0; i < rb; i++)
            _mm512_storeu_ps(s + (r + i) * ELLM_ATTN_TILE,
                             fold4(fold3(f[0][i], f[1][i]), fold3(f[2][i], f[3][i])));
    }
}

/* -- rows in the lanes: q transposed (qt[d * QT + r]), each key element broadcast; the
 * chains of one key and row vector are separate accumulators, the tree vertical adds.
 * chains_8 gives r1_l (l < 8) of 8 combos: 4 keys x 2 row vectors (combo 4 v + j) or 8
 * keys x 1 (combo j), chain l and l + 8 side by side. */
enum { QT = ELLM_ATTN_QT };

#define CH_STEP(v, j, D, A)                                                                    \
    A##v##j = _mm512_fmadd_ps(q##v, _mm512_set1_ps(k[j][D]), A##v##j);
#define CH_DECL(v, j) __m512 a##v##j = _mm512_setzero_ps(), b##v##j = _mm512_setzero_ps();
#define CH_OUT(v, j) r1[(v) * NK + (j)] = _mm512_add_ps(a##v##j, b##v##j);

#define COMBOS_42(X, ...) X(0, 0 __VA_ARGS__) X(0, 1 __VA_ARGS__) X(0, 2 __VA_ARGS__) X(0, 3 __VA_ARGS__) \
    X(1, 0 __VA_ARGS__) X(1, 1 __VA_ARGS__) X(1, 2 __VA_ARGS__) X(1, 3 __VA_ARGS__)
#define COMBOS_81(X, ...) X(0, 0 __VA_ARGS__) X(0, 1 __VA_ARGS__) X(0, 2 __VA_ARGS__) X(0, 3 __VA_ARGS__) \
    X(0, 4 __VA_ARGS__) X(0, 5 __VA_ARGS__) X(0, 6 __VA_ARGS__) X(0, 7 __VA_ARGS__)

#define CHAINS(name, COMBOS, NKV, NVV)                                                        \
    static inline void name(const float *qt, const float *const *k, int hd, int l, float *r1p) { \
        enum { NK = NKV };                                                                    \
        __m512 *r1 = (__m512 *)0;                                                             \
        (void)r1;                                                                             \
        COMBOS(CH_DECL)                                                                       \
        int d = l;                                                                            \
        for (; d + 8 < hd; d += 16) {                                                         \
            {                                                                                 \
                const __m512 q0 = _mm512_loadu_ps(qt + (int64_t)d * QT);                      \
                const __m512 q1 = NVV > 1 ? _mm512_loadu_ps(qt + (int64_t)d * QT + 16) : q0;  \
                (void)q1;                                                                     \
                COMBOS(CH_STEP, , d, a)                                                       \
            }                                                                                 \
            {                                                                                 \
                const __m512 q0 = _mm512_loadu_ps(qt + (int64_t)(d + 8) * QT);                \
                const __m512 q1 = NVV > 1 ? _mm512_loadu_ps(qt + (int64_t)(d + 8) * QT + 16) : q0; \
                (void)q1;                                                                     \
                COMBOS(CH_STEP, , d + 8, b)                                                   \
            }                                                                                 \
        }                                                                                     \
        if (d < hd) {                                                                         \
            const __m512 q0 = _mm512_loadu_ps(qt + (int64_t)d * QT);                          \
            const __m512 q1 = NVV > 1 ? _mm512_loadu_ps(qt + (int64_t)d * QT + 16) : q0;      \
            (void)q1;                                                                         \
            COMBOS(CH_STEP, , d, a)                                                           \
        }                                                                                     \
        COMBOS(CH_STORE)                                                                      \
    }
#define CH_STORE(v, j) _mm512_storeu_ps(r1p + 16 * ((v) * NK + (j)), _mm512_add_ps(a##v##j, b##v##j));
CHAINS(chains_42, COMBOS_42, 4, 2)
CHAINS(chains_81, COMBOS_81, 8, 1)

/* Scores of 8 combos into s[j * QT + 16 v]: r1_l for l < 8 kept in R (8 x 8 vectors),
 * then the r2, r3 and final levels. */
#define ROWS_IN_LANES(name, CH, NK, NV)                                                       \
    __attribute__((noinline)) static void name(const float *qt, const float *const *k, int hd, float *s) { \
        float R[8][8 * 16];                                                                   \
        for (int l = 0; l < 8; l++) CH(qt, k, hd, l, R[l]);                                   \
        for (int v = 0; v < NV; v++)                                                          \
            for (int j = 0; j < NK; j++) {                                                    \
                const int o = 16 * (v * NK + j);                                              \
                __m512 r2[4];                                                                 \
                for (int i = 0; i < 4; i++)                                                   \
                    r2[i] = _mm512_add_ps(_mm512_loadu_ps(R[i] + o), _mm512_loadu_ps(R[i + 4] + o)); \
                const __m512 r30 = _mm512_add_ps(r2[0], r2[2]), r31 = _mm512_add_ps(r2[1], r2[3]); \
                _mm512_storeu_ps(s + j * QT + 16 * v, _mm512_add_ps(r30, r31));               \
            }                                                                                 \
    }
ROWS_IN_LANES(qk_keys4_rows32, chains_42, 4, 2)
ROWS_IN_LANES(qk_keys8_rows16, chains_81, 8, 1)

/* e^x for x <= 0 (the shifted scores): the polynomial of elementwise's exp16. */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.381461741e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.368710056e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166838899e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666652113e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999404e-01f));
    __m512 e = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    e = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}

/* lanes [lo, hi) of the 16 starting at lane 16 c */
static inline __mmask16 lane_mask(int c, int lo, int hi) {
    const int a = lo - 16 * c < 0 ? 0 : lo - 16 * c, b = hi - 16 * c > 16 ? 16 : hi - 16 * c;
    if (a >= b) return 0;
    return (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

/* sum(e0..e3 lanes) as (e0 + e1) + (e2 + e3), then lanes 8, 4, 2, 1 apart */
static inline float sum_lanes(__m512 e0, __m512 e1, __m512 e2, __m512 e3) {
    const __m512 p = _mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3));
    const __m256 q = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
    const __m128 t = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* The online-softmax step of one row over its scores sr[0..TILE) (row-major; lanes
 * outside [u0, u1) unread): lanes [lo, hi) seen. */
static void softmax_row(float *sr, int u0, int u1, int lo, int hi, float scale, float cap, float *m, float *l,
                        float *corr) {
    *corr = 1.0f;
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    __mmask16 mk[4];
    __m512 x[4];
    for (int c = 0; c < 4; c++) { /* only the lanes [u0, u1) hold scores */
        const __mmask16 in = lane_mask(c, u0, u1);
        mk[c] = lane_mask(c, lo, hi);
        x[c] = in ? _mm512_mul_ps(_mm512_maskz_loadu_ps(in, sr + 16 * c), vscale) : ninf;
    }
    if (lo >= hi) { /* sees nothing here: p = 0, state untouched */
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(sr + 16 * c, _mm512_setzero_ps());
        return;
    }
    if (cap > 0.0f) {
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(sr + 16 * c, x[c]);
        ellm_softcap_row_avx512(sr, cap, ELLM_ATTN_TILE);
        for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_ps(sr + 16 * c);
    }
    for (int c = 0; c < 4; c++) x[c] = _mm512_mask_mov_ps(ninf, mk[c], x[c]);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    const float m_old = *m, m_new = mx > m_old ? mx : m_old;
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 e[4];
    for (int c = 0; c < 4; c++) {
        e[c] = _mm512_maskz_mov_ps(mk[c], exp_neg16(_mm512_sub_ps(x[c], vm)));
        _mm512_storeu_ps(sr + 16 * c, e[c]);
    }
    const float sum = sum_lanes(e[0], e[1], e[2], e[3]);
    if (m_old == -INFINITY) {
        *l = sum;
    } else {
        const float c = _mm512_cvtss_f32(exp_neg16(_mm512_set1_ps(m_old - m_new)));
        *l = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(*l), _mm_set_ss(c), _mm_set_ss(sum)));
        *corr = c;
    }
    *m = m_new;
}

/* The online-softmax step of 16 rows (lanes; `valid` of them real) over the scores
 * s[j * QT] of lanes [u0, u1): mask, max, exp (written back as p), sum, and the update
 * of m, l; *corr gets each row's rescale of acc (1 where nothing changes). */
static void softmax16(float *s, int u0, int u1, const int *lo, const int *hi, __mmask16 valid, float scale,
                      float cap, float *m, float *l, float *corr) {
    const __m512i vlo = _mm512_maskz_loadu_epi32(valid, lo), vhi = _mm512_maskz_loadu_epi32(valid, hi);
    const __mmask16 active = _mm512_mask_cmplt_epi32_mask(valid, vlo, vhi);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    const __m512 m_old = _mm512_mask_loadu_ps(ninf, valid, m);
    __m512 mx = ninf;
    for (int j = u0; j < u1; j++) {
        const __m512i vj = _mm512_set1_epi32(j);
        const __mmask16 sees = _mm512_mask_cmple_epi32_mask(_mm512_cmplt_epi32_mask(vj, vhi), vlo, vj);
        float *sj = s + j * QT;
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sj), vscale);
        if (cap > 0.0f) {
            _mm512_storeu_ps(sj, x);
            ellm_softcap_row_avx512(sj, cap, 16);
            x = _mm512_loadu_ps(sj);
        }
        x = _mm512_mask_mov_ps(ninf, sees, x);
        _mm512_storeu_ps(sj, x);
        mx = _mm512_max_ps(mx, x);
    }
    const __m512 m_new = _mm512_mask_max_ps(m_old, active, m_old, mx);
    __m512 e[ELLM_ATTN_TILE]; /* p of each lane, 0 outside [u0, u1) */
    for (int j = 0; j < ELLM_ATTN_TILE; j++) {
        if (j < u0 || j >= u1) {
            e[j] = _mm512_setzero_ps();
            continue;
        }
        float *sj = s + j * QT;
        const __m512 x = _mm512_loadu_ps(sj);
        const __mmask16 sees = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        e[j] = _mm512_maskz_mov_ps(sees, exp_neg16(_mm512_sub_ps(x, m_new)));
        _mm512_storeu_ps(sj, e[j]);
    }
    /* the sum in the order of sum_lanes (the few-rows path): lanes 16 apart first */
    __m512 pl[16];
    for (int j = 0; j < 16; j++) pl[j] = _mm512_add_ps(_mm512_add_ps(e[j], e[j + 16]), _mm512_add_ps(e[j + 32], e[j + 48]));
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) pl[j] = _mm512_add_ps(pl[j], pl[j + w]);
    const __m512 sum = pl[0];
    /* rows that had keys before: acc and l scaled by e^(m_old - m_new); the first: 0 */
    const __mmask16 had = _mm512_mask_cmp_ps_mask(active, m_old, ninf, _CMP_NEQ_OQ);
    const __m512 c = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), had, exp_neg16(_mm512_sub_ps(m_old, m_new)));
    const __m512 l_old = _mm512_maskz_loadu_ps(valid, l);
    const __m512 l_new = _mm512_mask_blend_ps(had, sum, _mm512_fmadd_ps(l_old, c, sum));
    _mm512_mask_storeu_ps(l, active, l_new);
    _mm512_mask_storeu_ps(m, active, m_new);
    _mm512_mask_storeu_ps(corr, valid, c);
}

void ellm_attn_tile_avx512(const float *q, const float *qt, int rows, int hd, const float *const *kp,
                           const float *const *vp, int u0, int u1, const int *lo, const int *hi, float scale,
                           float cap, float *m, float *l, float *acc) {
    float s[ELLM_ATTN_MAX_ROWS * ELLM_ATTN_TILE]; /* scores, then p */
    float corr[ELLM_ATTN_MAX_ROWS];
    const float *kk[ELLM_ATTN_TILE];
    const int c0 = u0 / 16, c1 = (u1 + 15) / 16;
    for (int j = 16 * c0; j < 16 * c1; j++) kk[j] = j >= u0 && j < u1 ? kp[j] : kp[u0]; /* masked later */
    if (rows <= ELLM_ATTN_FEW_ROWS) { /* s[r * TILE + j] */
        for (int c = c0; c < c1; c++) qk_dims_in_lanes(q, rows, hd, kk + 16 * c, s + 16 * c);
        for (int r = 0; r < rows; r++)
            softmax_row(s + r * ELLM_ATTN_TILE, u0, u1, lo[r], hi[r], scale, cap, m + r, l + r, corr + r);
    } else { /* s[j * QT + r] */
        const int step = rows > 16 ? 4 : 8;
        for (int b = u0 / step * step; b < u1; b += step) {
            if (rows > 16) qk_keys4_rows32(qt, kk + b, hd, s + b * QT);
            else qk_keys8_rows16(qt, kk + b, hd, s + b * QT);
        }
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const int nr = rows - r0 < 16 ? rows - r0 : 16;
            softmax16(s + r0, u0, u1, lo + r0, hi + r0, (__mmask16)((1u << nr) - 1u), scale, cap, m + r0, l + r0,
                      corr + r0);
        }
    }
    for (int r = 0; r < rows; r++)
        if (corr[r] != 1.0f) ellm_scale_row_avx512(acc + (int64_t)r * hd, corr[r], hd);
    if (rows <= ELLM_ATTN_FEW_ROWS) pv_strided(s + u0, ELLM_ATTN_TILE, 1, rows, hd, vp + u0, u1 - u0, acc);
    else pv_strided(s + u0 * QT, 1, QT, rows, hd, vp + u0, u1 - u0, acc);
}
