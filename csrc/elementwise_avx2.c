/* AVX2 + FMA row functions for elementwise.c (and the softmax steps of attention).
 *
 * exp: x = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial fitted here for
 * minimax relative error (~3e-9 before f32 rounding), 2^n applied as two factors 2^(n/2)
 * so that results down in the subnormals and up to overflow come out right.
 * tanh: odd polynomial (degree 9, fitted likewise) for |x| <= 0.625, else
 * sign(x) * (1 - 2 / (exp(2|x|) + 1)). Both stay within a few ulp of the true value. */
#include <immintrin.h>
#include <math.h>

#include "elementwise.h"

/* =============================== vector math =============================== */

/* lanes [0, rem) set: load 8 words starting at mask_src + 8 - rem */
static const int32_t mask_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m256i tail_mask(int64_t rem) {
    return _mm256_loadu_si256((const __m256i *)(mask_src + 8 - rem));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp8(__m256 x) {
    /* max/min return their second operand when one is NaN: written so NaN passes. */
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n*ln2, with ln2 split so n*hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.381461741e-03f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.368710056e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166838899e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666652113e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.999999404e-01f));
    __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    e = _mm256_add_ps(e, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n);  /* n in [-150, 128] */
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(e, s1), s2);
}

static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(sign, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.704991985e-03f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.063909173e-02f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.373971537e-02f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.333144158e-01f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.333328068e-01f));
    /* both branches on |x|; tanh is odd, so the sign of x goes back on at the end */
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
    __m256 e = exp8(_mm256_add_ps(ax, ax));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LE_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(x, sign));
}

/* silu(g) * u, as reference.silu: g / (1 + exp(-g)) */
static inline __m256 swiglu8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* gelu_tanh(g) * u; 0.5 * (1 + tanh(a)) == 1 / (1 + exp(-2a)) */
static inline __m256 geglu8(__m256 g, __m256 u) {
    __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    __m256 a = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* ============================== row functions ============================== */

void ellm_exp_row_avx2(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(out + i, m, exp8(_mm256_maskload_ps(x + i, m)));
    }
}

void ellm_tanh_row_avx2(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, tanh8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(out + i, m, tanh8(_mm256_maskload_ps(x + i, m)));
    }
}

float ellm_max_row_avx2(const float *x, int64_t n) {
    __m256 acc = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + i, m),
                                    _mm256_castsi256_ps(m));
        acc = _mm256_max_ps(acc, v);
    }
    return hmax8(acc);
}

float ellm_exp_shift_sum_row_avx2(float *x, float shift, int64_t n) {
    __m256 sh = _mm256_set1_ps(shift), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (i < n) {
        __m256i m = tail_mask(n - i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), sh));
        _mm256_maskstore_ps(x + i, m, e);
        acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
    }
    return hsum8(acc);
}

void ellm_rmsnorm_row_avx2(const float *x, const float *w, float eps, float *out, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        __m256 v = _mm256_maskload_ps(x + i, tail_mask(n - i));
        a1 = _mm256_fmadd_ps(v, v, a1);
    }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
    }
    if (i < n) {
        __m256i m = tail_mask(n - i);
        __m256 v = _mm256_mul_ps(_mm256_maskload_ps(x + i, m), inv);
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(v, _mm256_maskload_ps(w + i, m)));
    }
}

void ellm_add_rmsnorm_row_avx2(float *res, const float *x, const float *w, float eps, float *out,
                               int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_add_ps(_mm256_loadu_ps(res + i), _mm256_loadu_ps(x + i));
        __m256 v1 = _mm256_add_ps(_mm256_loadu_ps(res + i + 8), _mm256_loadu_ps(x + i + 8));
        _mm256_storeu_ps(res + i, v0);
        _mm256_storeu_ps(res + i + 8, v1);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(res + i), _mm256_loadu_ps(x + i));
        _mm256_storeu_ps(res + i, v);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        __m256i m = tail_mask(n - i);
        __m256 v = _mm256_add_ps(_mm256_maskload_ps(res + i, m), _mm256_maskload_ps(x + i, m));
        _mm256_maskstore_ps(res + i, m, v);
        a1 = _mm256_fmadd_ps(v, v, a1);
    }
    float ss = hsum8(_mm256_add_ps(a0, a1));
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(res + i), inv);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
    }
    if (i < n) {
        __m256i m = tail_mask(n - i);
        __m256 v = _mm256_mul_ps(_mm256_maskload_ps(res + i, m), inv);
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(v, _mm256_maskload_ps(w + i, m)));
    }
}

/* out[i] = OP(a[i], b[i]) over a row, tail masked */
#define BINARY_ROW(name, OP)                                                                   \
    void name(const float *a, const float *b, float *out, int64_t n) {                         \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8)                                                             \
            _mm256_storeu_ps(out + i, OP(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));     \
        if (i < n) {                                                                           \
            __m256i m = tail_mask(n - i);                                                      \
            _mm256_maskstore_ps(out + i, m, OP(_mm256_maskload_ps(a + i, m),                   \
                                               _mm256_maskload_ps(b + i, m)));                 \
        }                                                                                      \
    }

BINARY_ROW(ellm_swiglu_row_avx2, swiglu8)
BINARY_ROW(ellm_geglu_row_avx2, geglu8)

void ellm_add_row_avx2(float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(a + i, m, _mm256_add_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m)));
    }
}

void ellm_scale_row_avx2(float *x, float s, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(_mm256_maskload_ps(x + i, m), vs));
    }
}

void ellm_softcap_row_avx2(float *x, float cap, int64_t n) {
    __m256 vc = _mm256_set1_ps(cap), vi = _mm256_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi))));
    if (i < n) {
        __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), vi))));
    }
}
