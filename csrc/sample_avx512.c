/* AVX-512 variant of the grammar mask in sample.c: the mask bits are AVX-512 write
 * masks as they stand, so a word is two masked stores. */
#include <immintrin.h>

#include "sample.h"

int64_t ellm_mask_words_avx512(float *x, int64_t nfull, const uint32_t *bits) {
    const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
    int64_t allowed = 0;
    for (int64_t k = 0; k < nfull; k++) {
        uint32_t w = bits[k];
        if (w == 0xFFFFFFFFu) {
            allowed += 32;
            continue;
        }
        float *row = x + 32 * k;
        /* Store -inf where the bit is 0: the complement is the write mask. */
        _mm512_mask_storeu_ps(row, (__mmask16)~(w & 0xFFFFu), neg_inf);
        _mm512_mask_storeu_ps(row + 16, (__mmask16)~(w >> 16), neg_inf);
        allowed += __builtin_popcount(w);
    }
    return allowed;
}
