/* AVX-512 row functions of vision.c. exp comes from elementwise_avx512.c's row (on a
 * stack chunk), so GELU here and GeGLU there round alike. */
#include <immintrin.h>
#include <math.h>

#include "elementwise.h"
#include "vision.h"

enum { CHUNK = 256 };

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

float ellm_dot_row_avx512(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = hsum16(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void ellm_scale_axpy_row_avx512(float *y, float s, float a, const float *x, int64_t n) {
    __m512 vs = _mm512_set1_ps(s), va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_mul_ps(_mm512_loadu_ps(y + i), vs)));
    for (; i < n; i++) y[i] = y[i] * s + a * x[i];
}

void ellm_layernorm_row_avx512(const float *x, const float *w, const float *b, float eps, float *out,
                             int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
    float sum = hsum16(acc);
    for (; i < n; i++) sum += x[i];
    float mean = sum / (float)n;
    __m512 vm = _mm512_set1_ps(mean);
    acc = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), vm);
        acc = _mm512_fmadd_ps(d, d, acc);
    }
    float ss = hsum16(acc);
    for (; i < n; i++) ss += (x[i] - mean) * (x[i] - mean);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    __m512 vi = _mm512_set1_ps(inv);
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vi);
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(d, _mm512_loadu_ps(w + i), _mm512_loadu_ps(b + i)));
    }
    for (; i < n; i++) out[i] = (x[i] - mean) * inv * w[i] + b[i];
}

void ellm_gelu_tanh_row_avx512(const float *x, float *out, int64_t n) {
    float e[CHUNK];
    const __m512 c = _mm512_set1_ps(0.7978845608f), k = _mm512_set1_ps(0.044715f);
    const __m512 m2 = _mm512_set1_ps(-2.0f), one = _mm512_set1_ps(1.0f);
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK, i = 0;
        const float *xs = x + i0;
        for (; i + 16 <= m; i += 16) {   /* e = -2 a, a = c (v + k v^3) */
            __m512 v = _mm512_loadu_ps(xs + i);
            __m512 a = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(k, v), _mm512_mul_ps(v, v), v));
            _mm512_storeu_ps(e + i, _mm512_mul_ps(m2, a));
        }
        for (; i < m; i++) {
            float v = xs[i];
            e[i] = -2.0f * (0.7978845608f * (v + 0.044715f * v * v * v));
        }
        ellm_exp_row_avx512(e, e, m);
        for (i = 0; i + 16 <= m; i += 16)
            _mm512_storeu_ps(out + i0 + i, _mm512_div_ps(_mm512_loadu_ps(xs + i),
                                                         _mm512_add_ps(one, _mm512_loadu_ps(e + i))));
        for (; i < m; i++) out[i0 + i] = xs[i] / (1.0f + e[i]);
    }
}
