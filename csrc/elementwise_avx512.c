/* AVX-512 row functions for elementwise.c (and the softmax steps of attention).
 * Same math as elementwise_avx2.c (same fitted polynomials); 2^n is applied with
 * vscalefps, which handles overflow and the subnormal range itself, and row tails use
 * mask registers. */
#include <immintrin.h>
#include <math.h>

#include "elementwise.h"
#include "exp_avx512.h"

/* =============================== vector math =============================== */

static inline __mmask16 tail_mask(int64_t rem) { return (__mmask16)((1u << rem) - 1u); }

static inline __m512 tanh16(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.704991985e-03f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.063909173e-02f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.373971537e-02f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.333144158e-01f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.333328068e-01f));
    /* both branches on |x|; tanh is odd, so the sign of x goes back on at the end */
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), ax, ax);
    __m512 e = ellm_exp16(_mm512_add_ps(ax, ax));
    __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                               _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LE_OQ);
    __m512 r = _mm512_mask_blend_ps(is_small, big, small);
    return _mm512_or_ps(r, _mm512_and_ps(x, _mm512_set1_ps(-0.0f)));
}

static inline __m512 swiglu16(__m512 g, __m512 u) {
    __m512 e = ellm_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

static inline __m512 geglu16(__m512 g, __m512 u) {
    __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    __m512 a = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    __m512 e = ellm_exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), a));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* ============================== row functions ============================== */

void ellm_exp_row_avx512(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, ellm_exp16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m, ellm_exp16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

void ellm_tanh_row_avx512(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, tanh16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m, tanh16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

float ellm_max_row_avx512(const float *x, int64_t n) {
    __m512 acc = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
    if (i < n) acc = _mm512_mask_max_ps(acc, tail_mask(n - i), acc, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    return _mm512_reduce_max_ps(acc);
}

float ellm_exp_shift_sum_row_avx512(float *x, float shift, int64_t n) {
    __m512 sh = _mm512_set1_ps(shift), acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = ellm_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 e = ellm_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), sh));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_mask_add_ps(acc, m, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

void ellm_rmsnorm_row_avx512(const float *x, const float *w, float eps, float *out, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        a1 = _mm512_fmadd_ps(v, v, a1);
    }
    float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), inv);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(v, _mm512_loadu_ps(w + i)));
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

void ellm_add_rmsnorm_row_avx512(float *res, const float *x, const float *w, float eps, float *out,
                                 int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(res + i), _mm512_loadu_ps(x + i));
        __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(res + i + 16), _mm512_loadu_ps(x + i + 16));
        _mm512_storeu_ps(res + i, v0);
        _mm512_storeu_ps(res + i + 16, v1);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(res + i), _mm512_loadu_ps(x + i));
        _mm512_storeu_ps(res + i, v);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, res + i), _mm512_maskz_loadu_ps(m, x + i));
        _mm512_mask_storeu_ps(res + i, m, v);
        a1 = _mm512_fmadd_ps(v, v, a1);
    }
    float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(res + i), inv);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(v, _mm512_loadu_ps(w + i)));
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, res + i), inv);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

#define BINARY_ROW(name, OP)                                                                   \
    void name(const float *a, const float *b, float *out, int64_t n) {                         \
        int64_t i = 0;                                                                         \
        for (; i + 16 <= n; i += 16)                                                           \
            _mm512_storeu_ps(out + i, OP(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));     \
        if (i < n) {                                                                           \
            __mmask16 m = tail_mask(n - i);                                                    \
            _mm512_mask_storeu_ps(out + i, m, OP(_mm512_maskz_loadu_ps(m, a + i),              \
                                                 _mm512_maskz_loadu_ps(m, b + i)));            \
        }                                                                                      \
    }

BINARY_ROW(ellm_swiglu_row_avx512, swiglu16)
BINARY_ROW(ellm_geglu_row_avx512, geglu16)

void ellm_add_row_avx512(float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(a + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
    }
}

void ellm_scale_row_avx512(float *x, float s, int64_t n) {
    __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    }
}

void ellm_softcap_row_avx512(float *x, float cap, int64_t n) {
    __m512 vc = _mm512_set1_ps(cap), vi = _mm512_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(vc, tanh16(_mm512_mul_ps(_mm512_loadu_ps(x + i), vi))));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(vc, tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vi))));
    }
}
