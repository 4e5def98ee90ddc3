/* e^x on 16 floats at AVX-512: one fitted polynomial shared by the elementwise rows and
 * attention's softmax row, so both give the same bits. Include only from files built with
 * the AVX-512 flags. */
#ifndef ELLM_EXP_AVX512_H
#define ELLM_EXP_AVX512_H
#include <immintrin.h>

static inline __m512 ellm_exp16(__m512 x) {
    /* max/min return their second operand when one is NaN: written so NaN passes. */
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
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

#endif
