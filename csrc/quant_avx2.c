/* AVX2 (+FMA, F16C) activation quantizers and integer dot kernels (the kernel bodies
 * are in quant_x86.h, shared with the AVX512-VNNI build). Same integer sums as the
 * scalar code in quant_dot.c; only the float summation order differs. */
#include <float.h>
#include <immintrin.h>
#include <math.h>

/* u8 x s8 products summed in fours: maddubs (pairs -> s16, no saturation for our
 * ranges) then madd with ones (pairs of s16 -> s32) */
#define DOT_US8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define DOT2_S16(p0, s0, p1, s1) \
    _mm256_add_epi32(_mm256_madd_epi16((p0), (s0)), _mm256_madd_epi16((p1), (s1)))
#define KINLINE static inline __attribute__((always_inline))
#define KFUNC static
#define QX_VNNI 0
#define QX_ROWS 2

#include "quant_x86.h"

/* ====================================================================================
 * Activation quantization
 * ==================================================================================== */

/* 32 f32 -> 32 int8 (rounded to nearest), returns their sum. */
INLINE int quant32(const float *x, __m256 vid, int8_t *out) {
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), vid));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vid));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vid));
    int sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    /* packs interleave 128-bit lanes; the permute puts the 8 dwords back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, p);
    return sum;
}

/* Largest |x[j]| over n (a multiple of 8), or NAN when some x[j] is NaN or infinite
 * (as block_amax in quant_dot.c). */
INLINE float amax_n(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
        m = _mm256_max_ps(m, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* NaN or > FLT_MAX */
    }
    return _mm256_movemask_ps(bad) ? NAN : hmax8(m);
}

void ellm_act32_avx2(const float *x, int64_t k, void *out) {
    ellm_act32 *a = (ellm_act32 *)out;
    for (int64_t i = 0; i < k / QK32; i++, x += QK32) {
        float amax = amax_n(x, QK32);
        if (isnan(amax)) {
            memset(a[i].qs, 0, sizeof a[i].qs);
            a[i].d = a[i].s = NAN;
            continue;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 127.0f / amax : 0.0f;
        int sum = quant32(x, _mm256_set1_ps(id), a[i].qs);
        a[i].d = d;
        a[i].s = d * (float)sum;
    }
}

void ellm_act256_avx2(const float *x, int64_t k, void *out) {
    ellm_act256 *a = (ellm_act256 *)out;
    for (int64_t i = 0; i < k / QK256; i++, x += QK256) {
        float amax = amax_n(x, QK256);
        if (isnan(amax)) {
            memset(a[i].qs, 0, sizeof a[i].qs);
            memset(a[i].bsums, 0, sizeof a[i].bsums);
            a[i].d = NAN;
            continue;
        }
        a[i].d = amax / 127.0f;
        /* d == 0 (amax 0 or tiny): all values 0, and no overflow of 127 / amax */
        __m256 vid = _mm256_set1_ps(a[i].d != 0.0f ? 127.0f / amax : 0.0f);
        for (int j = 0; j < QK256; j += 32) {
            quant32(x + j, vid, a[i].qs + j);
            /* the two 16-sums of this 32: widen to 16 bits, pairs to 32 bits, add up */
            __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a[i].qs + j)));
            __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a[i].qs + j + 16)));
            a[i].bsums[j / 16] = (int16_t)hsum8_epi32(_mm256_madd_epi16(w0, _mm256_set1_epi16(1)));
            a[i].bsums[j / 16 + 1] =
                (int16_t)hsum8_epi32(_mm256_madd_epi16(w1, _mm256_set1_epi16(1)));
        }
    }
}

ellm_qdot_fn ellm_qdot_avx2(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return qdot_q4_0;
    case ELLM_T_Q4_1: return qdot_q4_1;
    case ELLM_T_Q5_0: return qdot_q5_0;
    case ELLM_T_Q5_1: return qdot_q5_1;
    case ELLM_T_Q8_0: return qdot_q8_0;
    case ELLM_T_Q2_K: return qdot_q2_k;
    case ELLM_T_Q3_K: return qdot_q3_k;
    case ELLM_T_Q4_K: return qdot_q4_k;
    case ELLM_T_Q5_K: return qdot_q5_k;
    case ELLM_T_Q6_K: return qdot_q6_k;
    default: return NULL;
    }
}

ellm_qgemm_fn ellm_qgemm_avx2(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return qgemm_q4_0;
    case ELLM_T_Q4_1: return qgemm_q4_1;
    case ELLM_T_Q5_0: return qgemm_q5_0;
    case ELLM_T_Q5_1: return qgemm_q5_1;
    case ELLM_T_Q8_0: return qgemm_q8_0;
    case ELLM_T_Q2_K: return qgemm_q2_k;
    case ELLM_T_Q3_K: return qgemm_q3_k;
    case ELLM_T_Q4_K: return qgemm_q4_k;
    case ELLM_T_Q5_K: return qgemm_q5_k;
    case ELLM_T_Q6_K: return qgemm_q6_k;
    default: return NULL;
    }
}

ellm_qdot_fn ellm_qdot_stream_avx2(int qtype) {
    /* Q8_0's one-token kernel (4 rows at a time, qdot_q8_rows4) streams faster */
    return qtype == ELLM_T_Q8_0 ? NULL : qdot_stream_kernel(qtype);
}
