/* AVX2 + F16C variants of the row conversions in convert.c. */
#include <immintrin.h>

#include "convert.h"

void ellm_bf16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
    }
    for (; i < n; i++) dst[i] = ellm_bf16_to_f32(src[i]);
}

void ellm_f16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        /* VCVTPH2PS quiets a signalling NaN; the scalar conversion (the reference) keeps
         * every NaN's bits, so NaN lanes take its formula: sign | 0x7f800000 | man << 13 */
        const __m256i w = _mm256_cvtepu16_epi32(h);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
        const __m256i exact = _mm256_or_si256(
            _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
            _mm256_or_si256(_mm256_set1_epi32(0x7f800000), _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13)));
        const __m256 f = _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(exact), _mm256_castsi256_ps(nan));
        _mm256_storeu_ps(dst + i, f);
    }
    for (; i < n; i++) dst[i] = ellm_f16_to_f32(src[i]);
}
