/* The LoRA inner loops at the AVX2 level (lora_impl.h; same bits as the baseline): the
 * shrink as the compiler vectorizes it, the expand in intrinsics -- 8 outputs a register,
 * a multiply then an add (never fused: -ffp-contract=off), each output's terms in the
 * baseline's order; the shrink of a whole chunk in intrinsics too, asking for A a few
 * rows ahead. The compiler's own vectorization of the expand ran at a fifth of
 * this (SmolLM2 decode, one thread: 8% of a step against 2%). BF16 factors come 16 to a
 * load, each unit laid out so that two unpacks widen it in order (lora_impl.h), in place
 * of two loads, two widenings and two shifts: one rank-16 576 x 576 projection from
 * cache, shrink 0.64 -> 0.55 us, expand 0.76 -> 0.55 us (Zen 2, one thread). */
#include <immintrin.h>
#include <stdint.h>

#include "lora.h"

static void expand_avx2_x(const void *bt, int32_t dtype, int64_t N, int32_t r, int64_t n0, int64_t nc,
                          const float *u, float scale, float *y);
static void expand4_avx2_x(const void *bt, int32_t dtype, int32_t r, int64_t n0, int64_t nc,
                           const float *const u[4], float scale, float *const y[4], int rows);
static void shrink_avx2_x(const void *at, int32_t dtype, int64_t K, int32_t r, int32_t j0, int32_t jn,
                          const float *x0, const float *x1, float *u0, float *u1);
#define LORA_SHRINK shrink_avx2_x
#define LORA_EXPAND expand_avx2_x
#define LORA_EXPAND4 expand4_avx2_x
#define LORA_SUFFIX avx2
#include "lora_impl.h"

/* 8 factors of one group (one j) widened exactly to float32 */
static inline __attribute__((always_inline)) __m256 load8(const void *p, int32_t dtype, int64_t i) {
    if (dtype == ELLM_LORA_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == ELLM_LORA_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* [bf16] 16 factors of a whole unit (lora_impl.h: its middle quarters swapped) widened
 * exactly to float32: the first 8 into lo, the last 8 into hi, one unpack each (two
 * shifted loads of 8 before) */
static inline __attribute__((always_inline)) void load16_bf16(const void *p, int64_t i, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

/* sums of groups [g0, g0 + 4) (4 chains in flight) into acc + g0 * 8; [bf16] factors j
 * and j + 1 of a group widened from one load (the units of a block, lora_impl.h) */
static inline __attribute__((always_inline)) void groups4(const void *bt, int32_t dtype, int64_t R8, int64_t gq, int32_t r, const float *u,
                           float *acc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int32_t j = 0;
    if (dtype == ELLM_LORA_BF16)
        for (; j + 2 <= r; j += 2) {
            const __m256 uj = _mm256_set1_ps(u[j]), uk = _mm256_set1_ps(u[j + 1]);
            const int64_t i = gq * R8 + (int64_t)j * 8;
            __m256 l0, h0, l1, h1, l2, h2, l3, h3;
            load16_bf16(bt, i, &l0, &h0);
            load16_bf16(bt, i + R8, &l1, &h1);
            load16_bf16(bt, i + 2 * R8, &l2, &h2);
            load16_bf16(bt, i + 3 * R8, &l3, &h3);
            a0 = _mm256_add_ps(_mm256_add_ps(a0, _mm256_mul_ps(uj, l0)), _mm256_mul_ps(uk, h0));
            a1 = _mm256_add_ps(_mm256_add_ps(a1, _mm256_mul_ps(uj, l1)), _mm256_mul_ps(uk, h1));
            a2 = _mm256_add_ps(_mm256_add_ps(a2, _mm256_mul_ps(uj, l2)), _mm256_mul_ps(uk, h2));
            a3 = _mm256_add_ps(_mm256_add_ps(a3, _mm256_mul_ps(uj, l3)), _mm256_mul_ps(uk, h3));
        }
    for (; j < r; j++) {   /* [bf16] an odd rank's last factor: after the last whole unit, in order */
        const __m256 uj = _mm256_set1_ps(u[j]);
        const int64_t i = gq * R8 + (int64_t)j * 8;
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(uj, load8(bt, dtype, i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(uj, load8(bt, dtype, i + R8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(uj, load8(bt, dtype, i + 2 * R8)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(uj, load8(bt, dtype, i + 3 * R8)));
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
}

/* Each kernel's body is inlined once per factor type (dtype a constant there), so that no
 * test of the type is left in its loops. */
#define BY_DTYPE(body, dtype, ...)                                                            \
    do {                                                                                      \
        if ((dtype) == ELLM_LORA_BF16) body(ELLM_LORA_BF16, __VA_ARGS__);                     \
        else if ((dtype) == ELLM_LORA_F16) body(ELLM_LORA_F16, __VA_ARGS__);                  \
        else body(ELLM_LORA_F32, __VA_ARGS__);                                                \
    } while (0)

static inline __attribute__((always_inline)) void expand_body(const int32_t dtype, const void *bt, int32_t r, int64_t n0,
                                                              int64_t nc, const float *u, float scale, float *y) {
    const int64_t R8 = (int64_t)r * 8, o = n0 & 7, G = (nc + o + 7) / 8, gb = n0 >> 3;
    float acc[(EXPAND_BLOCK / 8 + 4) * 8];
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) groups4(bt, dtype, R8, gb + g, r, u, acc + g * 8);
    for (; g < G; g++) {   /* the last one to three groups */
        __m256 a = _mm256_setzero_ps();
        int32_t j = 0;
        if (dtype == ELLM_LORA_BF16)
            for (; j + 2 <= r; j += 2) {
                __m256 lo, hi;
                load16_bf16(bt, (gb + g) * R8 + (int64_t)j * 8, &lo, &hi);
                a = _mm256_add_ps(_mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(u[j]), lo)),
                                  _mm256_mul_ps(_mm256_set1_ps(u[j + 1]), hi));
            }
        for (; j < r; j++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(u[j]), load8(bt, dtype, (gb + g) * R8 + (int64_t)j * 8)));
        _mm256_storeu_ps(acc + g * 8, a);
    }
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t c = 0;
    for (; c + 8 <= nc; c += 8)
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_mul_ps(sc, _mm256_loadu_ps(acc + o + c))));
    for (; c < nc; c++) y[c] += scale * acc[o + c];
}

static void expand_avx2_x(const void *bt, int32_t dtype, int64_t N, int32_t r, int64_t n0, int64_t nc,
                          const float *u, float scale, float *y) {
    (void)N;
    BY_DTYPE(expand_body, dtype, bt, r, n0, nc, u, scale, y);
}

static inline __attribute__((always_inline)) void expand4_body(const int32_t dtype, const void *bt, int32_t r, int64_t n0,
                                                               int64_t nc, const float *const u[4], float scale,
                                                               float *const y[4], int rows) {
    const int64_t R8 = (int64_t)r * 8, o = n0 & 7, span = nc + o, ng = (span + 7) / 8, gb = n0 >> 3;
    for (int64_t g0 = 0; g0 < ng; g0 += 2) {
        const int two = g0 + 1 < ng;
        __m256 a[4][2];
        for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        int32_t j = 0;
        if (dtype == ELLM_LORA_BF16)   /* factors j and j + 1 of each group from one load */
            for (; j + 2 <= r; j += 2) {
                const int64_t idx = (gb + g0) * R8 + (int64_t)j * 8;
                __m256 l0, h0, l1 = _mm256_setzero_ps(), h1 = l1;
                load16_bf16(bt, idx, &l0, &h0);
                if (two) load16_bf16(bt, idx + R8, &l1, &h1);
                for (int i = 0; i < 4; i++) {
                    const __m256 uj = _mm256_set1_ps(u[i][j]), uk = _mm256_set1_ps(u[i][j + 1]);
                    a[i][0] = _mm256_add_ps(_mm256_add_ps(a[i][0], _mm256_mul_ps(uj, l0)), _mm256_mul_ps(uk, h0));
                    a[i][1] = _mm256_add_ps(_mm256_add_ps(a[i][1], _mm256_mul_ps(uj, l1)), _mm256_mul_ps(uk, h1));
                }
            }
        for (; j < r; j++) {
            const int64_t idx = (gb + g0) * R8 + (int64_t)j * 8;
            const __m256 b0 = load8(bt, dtype, idx), b1 = two ? load8(bt, dtype, idx + R8) : _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                const __m256 uj = _mm256_set1_ps(u[i][j]);
                a[i][0] = _mm256_add_ps(a[i][0], _mm256_mul_ps(uj, b0));
                a[i][1] = _mm256_add_ps(a[i][1], _mm256_mul_ps(uj, b1));
            }
        }
        const int64_t c0 = g0 * 8, lo = c0 < o ? o : c0, hi = c0 + 16 < span ? c0 + 16 : span;
        const __m256 sc = _mm256_set1_ps(scale);
        for (int i = 0; i < rows; i++) {
            if (lo == c0 && hi == c0 + 16) {   /* a whole pair of groups: y += scale * sum, 8 at a time */
                float *yi = y[i] + (c0 - o);
                _mm256_storeu_ps(yi, _mm256_add_ps(_mm256_loadu_ps(yi), _mm256_mul_ps(sc, a[i][0])));
                _mm256_storeu_ps(yi + 8, _mm256_add_ps(_mm256_loadu_ps(yi + 8), _mm256_mul_ps(sc, a[i][1])));
                continue;
            }
            float t[16];
            _mm256_storeu_ps(t, a[i][0]);
            _mm256_storeu_ps(t + 8, a[i][1]);
            for (int64_t c = lo; c < hi; c++) y[i][c - o] += scale * t[c - c0];
        }
    }
}

static void expand4_avx2_x(const void *bt, int32_t dtype, int32_t r, int64_t n0, int64_t nc,
                           const float *const u[4], float scale, float *const y[4], int rows) {
    BY_DTYPE(expand4_body, dtype, bt, r, n0, nc, u, scale, y, rows);
}

/* A's rows (one k each) asked for this many bytes ahead of the one summed */
#define SHRINK_PREFETCH_BYTES 1024

/* shrink (lora_impl.h) of a whole chunk of 16 ranks: the even and the odd k in their own
 * sums, added at the end, as the baseline; rows of A prefetched ahead (the decode step's
 * shrink runs on one thread, A from memory). Other chunks: the baseline's loops. */
static inline __attribute__((always_inline)) void shrink_body(const int32_t dtype, const void *at, int64_t K, int32_t r,
                                                              int32_t j0, const float *x0, const float *x1, float *u0,
                                                              float *u1) {
    const int64_t K2 = K & ~(int64_t)1, elt = dtype == ELLM_LORA_F32 ? 4 : 2, ahead = SHRINK_PREFETCH_BYTES / elt;
    const char *bytes = (const char *)at;
    __m256 e0a = _mm256_setzero_ps(), e0b = e0a, o0a = e0a, o0b = e0a;
    __m256 e1a = e0a, e1b = e0a, o1a = e0a, o1b = e0a;
    for (int64_t k = 0; k < K2; k += 2) {
        const int64_t i = k * r + j0;
        __builtin_prefetch(bytes + (i + ahead) * elt, 0, 3);
        __builtin_prefetch(bytes + (i + r + ahead) * elt, 0, 3);
        __m256 a, b, a2, b2;
        if (dtype == ELLM_LORA_BF16) {   /* a whole unit of 16 (lora_impl.h) a load */
            load16_bf16(at, i, &a, &b);
            load16_bf16(at, i + r, &a2, &b2);
        } else {
            a = load8(at, dtype, i), b = load8(at, dtype, i + 8);
            a2 = load8(at, dtype, i + r), b2 = load8(at, dtype, i + r + 8);
        }
        const __m256 xa = _mm256_set1_ps(x0[k]), xa2 = _mm256_set1_ps(x0[k + 1]);
        e0a = _mm256_add_ps(e0a, _mm256_mul_ps(a, xa));
        e0b = _mm256_add_ps(e0b, _mm256_mul_ps(b, xa));
        o0a = _mm256_add_ps(o0a, _mm256_mul_ps(a2, xa2));
        o0b = _mm256_add_ps(o0b, _mm256_mul_ps(b2, xa2));
        if (x1) {
            const __m256 xb = _mm256_set1_ps(x1[k]), xb2 = _mm256_set1_ps(x1[k + 1]);
            e1a = _mm256_add_ps(e1a, _mm256_mul_ps(a, xb));
            e1b = _mm256_add_ps(e1b, _mm256_mul_ps(b, xb));
            o1a = _mm256_add_ps(o1a, _mm256_mul_ps(a2, xb2));
            o1b = _mm256_add_ps(o1b, _mm256_mul_ps(b2, xb2));
        }
    }
    if (K2 < K) { /* an odd K: the last k joins the even sums */
        const int64_t i = K2 * r + j0;
        __m256 a, b;
        if (dtype == ELLM_LORA_BF16) load16_bf16(at, i, &a, &b);
        else a = load8(at, dtype, i), b = load8(at, dtype, i + 8);
        const __m256 xa = _mm256_set1_ps(x0[K2]);
        e0a = _mm256_add_ps(e0a, _mm256_mul_ps(a, xa));
        e0b = _mm256_add_ps(e0b, _mm256_mul_ps(b, xa));
        if (x1) {
            const __m256 xb = _mm256_set1_ps(x1[K2]);
            e1a = _mm256_add_ps(e1a, _mm256_mul_ps(a, xb));
            e1b = _mm256_add_ps(e1b, _mm256_mul_ps(b, xb));
        }
    }
    _mm256_storeu_ps(u0, _mm256_add_ps(e0a, o0a));
    _mm256_storeu_ps(u0 + 8, _mm256_add_ps(e0b, o0b));
    if (x1) {
        _mm256_storeu_ps(u1, _mm256_add_ps(e1a, o1a));
        _mm256_storeu_ps(u1 + 8, _mm256_add_ps(e1b, o1b));
    }
}

/* shrink of a chunk of 8 ranks (rank 8, PEFT's default, or the last 8 of 24, 40 ...),
 * the same sums as the baseline's loops: even and odd k apart, added at the end. Such a
 * chunk lies past the row's last whole unit of 16, so its BF16 factors are in order. */
static inline __attribute__((always_inline)) void shrink8_body(const int32_t dtype, const void *at, int64_t K, int32_t r,
                                                               int32_t j0, const float *x0, const float *x1, float *u0,
                                                               float *u1) {
    const int64_t K2 = K & ~(int64_t)1, elt = dtype == ELLM_LORA_F32 ? 4 : 2, ahead = SHRINK_PREFETCH_BYTES / elt;
    const char *bytes = (const char *)at;
    __m256 e0 = _mm256_setzero_ps(), o0 = e0, e1 = e0, o1 = e0;
    for (int64_t k = 0; k < K2; k += 2) {
        const int64_t i = k * r + j0;
        __builtin_prefetch(bytes + (i + ahead) * elt, 0, 3);
        const __m256 a = load8(at, dtype, i), a2 = load8(at, dtype, i + r);
        e0 = _mm256_add_ps(e0, _mm256_mul_ps(a, _mm256_set1_ps(x0[k])));
        o0 = _mm256_add_ps(o0, _mm256_mul_ps(a2, _mm256_set1_ps(x0[k + 1])));
        if (x1) {
            e1 = _mm256_add_ps(e1, _mm256_mul_ps(a, _mm256_set1_ps(x1[k])));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(a2, _mm256_set1_ps(x1[k + 1])));
        }
    }
    if (K2 < K) { /* an odd K: the last k joins the even sums */
        const __m256 a = load8(at, dtype, K2 * r + j0);
        e0 = _mm256_add_ps(e0, _mm256_mul_ps(a, _mm256_set1_ps(x0[K2])));
        if (x1) e1 = _mm256_add_ps(e1, _mm256_mul_ps(a, _mm256_set1_ps(x1[K2])));
    }
    _mm256_storeu_ps(u0, _mm256_add_ps(e0, o0));
    if (x1) _mm256_storeu_ps(u1, _mm256_add_ps(e1, o1));
}

static void shrink_avx2_x(const void *at, int32_t dtype, int64_t K, int32_t r, int32_t j0, int32_t jn,
                          const float *x0, const float *x1, float *u0, float *u1) {
    if (jn == 8) {
        BY_DTYPE(shrink8_body, dtype, at, K, r, j0, x0, x1, u0, u1);
        return;
    }
    if (jn != SHRINK_CHUNK) {
        shrink_avx2(at, dtype, K, r, j0, jn, x0, x1, u0, u1);
        return;
    }
    BY_DTYPE(shrink_body, dtype, at, K, r, j0, x0, x1, u0, u1);
}
