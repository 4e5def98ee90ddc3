/* AVX-512 row functions of vision.c. exp comes from elementwise_avx512.c's row (on a
 * stack chunk), so GELU here and GeGLU there round alike. */
#include <immintrin.h>
#include <math.h>

#include "elementwise.h"
#include "vision.h"

enum { CHUNK = 256 };

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

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


void ellm_pv4_row_avx512(float *const y[4], const float *const p[4], const float *v, int64_t ldv,
                         int64_t nb, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 a0 = _mm512_loadu_ps(y[0] + i), a1 = _mm512_loadu_ps(y[1] + i), a2 = _mm512_loadu_ps(y[2] + i),
               a3 = _mm512_loadu_ps(y[3] + i);
        for (int64_t j = 0; j < nb; j++) {
            __m512 x = _mm512_loadu_ps(v + j * ldv + i);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[0][j]), x, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[1][j]), x, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[2][j]), x, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[3][j]), x, a3);
        }
        _mm512_storeu_ps(y[0] + i, a0), _mm512_storeu_ps(y[1] + i, a1), _mm512_storeu_ps(y[2] + i, a2),
            _mm512_storeu_ps(y[3] + i, a3);
    }
    for (; i < n; i++)
        for (int r = 0; r < 4; r++)
            for (int64_t j = 0; j < nb; j++) y[r][i] += p[r][j] * v[j * ldv + i];
}

void ellm_scores64_row_avx512(const float *q, const float *kt, int64_t hd, float out[64]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < hd; d++) {
        __m512 qd = _mm512_set1_ps(q[d]);
        const float *k = kt + d * 64;
        a0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k), a0);
        a1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + 16), a1);
        a2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + 32), a2);
        a3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + 48), a3);
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2);
    _mm512_storeu_ps(out + 48, a3);
}
