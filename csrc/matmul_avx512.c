/* AVX-512 float-weight dot kernels: the matmul_avx2.c scheme at 16 lanes, with masked
 * loads for the tail (as one more step of k) instead of a scalar loop. */
#include <immintrin.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))

/* 16 weights starting at element i -> f32; lanes outside `m` read nothing and are 0 */
INLINE __m512 wload(int type, const uint8_t *w, int64_t i, __mmask16 m) {
    switch (type) {
    case ELLM_T_F32: {
        __m512 v = _mm512_maskz_loadu_ps(m, w + 4 * i);
        /* keep it in a register: GCC otherwise folds the load into each token's FMA,
         * and the repeated loads cost ~15% of prefill speed */
        __asm__("" : "+v"(v));
        return v;
    }
    case ELLM_T_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + 2 * i));
    default: {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + 2 * i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
    }
}

#define ALL 0xFFFF

/* The register tile: MR weight rows x NT tokens x 2 chains = 24 accumulators (of 32
 * registers). Each output is summed by two 16-lane FMA chains, the even 16-steps of k
 * (the last one masked when k % 16 != 0) into one and the odd into the other, and
 * reduced as _mm512_reduce_add_ps(chain0 + chain1): the same for every tile shape and
 * token count, so results do not depend on the batch (quant_impl.h). */
#define MR 4
#define NT 3

/* one 16-step of k at i into chain `acc` (m: the lanes of k left) */
#define STEP16(acc, i, m)                                                                    \
    do {                                                                                     \
        __m512 xv[NT];                                                                       \
        _Pragma("GCC unroll 8")                                                              \
        for (int t = 0; t < nt; t++) xv[t] = _mm512_maskz_loadu_ps((m), x + t * xs + (i));   \
        _Pragma("GCC unroll 8")                                                              \
        for (int r = 0; r < mr; r++) {                                                       \
            __m512 wv = wload(type, w + r * ws, (i), (m));                                   \
            _Pragma("GCC unroll 8")                                                          \
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);  \
        }                                                                                    \
    } while (0)

INLINE void micro(int type, int64_t k, const uint8_t *w, size_t ws, const int mr, const float *x,
                  size_t xs, const int nt, float *y, size_t ys) {
    __m512 a0[MR][NT], a1[MR][NT];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
    /* the masked tail is apart from the main loop: with the mask inside it, GCC spills
     * every accumulator on every step */
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        STEP16(a0, i, ALL);
        STEP16(a1, i + 16, ALL);
    }
    if (i + 16 <= k) {
        STEP16(a0, i, ALL);
        i += 16;
        if (i < k) STEP16(a1, i, (__mmask16)((1u << (k - i)) - 1));
    } else if (i < k) {
        STEP16(a0, i, (__mmask16)((1u << (k - i)) - 1));
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++)
            y[t * ys + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

/* One register tile of mr <= MR rows and nt <= NT tokens, instantiated per shape. */
INLINE void tile(int type, int64_t k, const uint8_t *w, size_t ws, int mr, const float *x,
                 size_t xs, int nt, float *y, size_t ys) {
    switch (mr * 8 + nt) {
    case 9: micro(type, k, w, ws, 1, x, xs, 1, y, ys); break;
    case 10: micro(type, k, w, ws, 1, x, xs, 2, y, ys); break;
    case 11: micro(type, k, w, ws, 1, x, xs, 3, y, ys); break;
    case 17: micro(type, k, w, ws, 2, x, xs, 1, y, ys); break;
    case 18: micro(type, k, w, ws, 2, x, xs, 2, y, ys); break;
    case 19: micro(type, k, w, ws, 2, x, xs, 3, y, ys); break;
    case 25: micro(type, k, w, ws, 3, x, xs, 1, y, ys); break;
    case 26: micro(type, k, w, ws, 3, x, xs, 2, y, ys); break;
    case 27: micro(type, k, w, ws, 3, x, xs, 3, y, ys); break;
    case 33: micro(type, k, w, ws, 4, x, xs, 1, y, ys); break;
    case 34: micro(type, k, w, ws, 4, x, xs, 2, y, ys); break;
    case 35: micro(type, k, w, ws, 4, x, xs, 3, y, ys); break;
    default: break;
    }
}

/* The whole (nr x nt) block: MR rows at a time and, for those rows (in L1), NT tokens
 * at a time. One token (decode) takes one row at a time -- a single sequential stream
 * through the weights, which the hardware prefetcher follows best (several rows side
 * by side read DRAM at half the speed here) -- its two chains hiding the FMA latency. */
INLINE void fmm(int type, int64_t k, const uint8_t *w, size_t ws, int64_t nr, const float *x,
                size_t xs, int64_t nt, float *y, size_t ys) {
    if (nt == 1) {
        for (int64_t r = 0; r < nr; r++)
            micro(type, k, w + (size_t)r * ws, ws, 1, x, xs, 1, y + r, ys);
        return;
    }
    for (int64_t r = 0; r < nr; r += MR) {
        int mr = (int)(nr - r < MR ? nr - r : MR);
        for (int64_t t = 0; t < nt; t += NT) {
            int n = (int)(nt - t < NT ? nt - t : NT);
            tile(type, k, w + (size_t)r * ws, ws, mr, x + (size_t)t * xs, xs, n,
                 y + (size_t)t * ys + r, ys);
        }
    }
}

#define DEFINE_FMM(name, TYPE)                                                               \
    static void name(int64_t k, const uint8_t *w, size_t ws, int64_t nr, const float *x,      \
                     size_t xs, int64_t nt, float *y, size_t ys) {                            \
        fmm(TYPE, k, w, ws, nr, x, xs, nt, y, ys);                                           \
    }

DEFINE_FMM(fmm_f32, ELLM_T_F32)
DEFINE_FMM(fmm_f16, ELLM_T_F16)
DEFINE_FMM(fmm_bf16, ELLM_T_BF16)

ellm_fmm_fn ellm_fmm_avx512(int qtype) {
    switch (qtype) {
    case ELLM_T_F32: return fmm_f32;
    case ELLM_T_F16: return fmm_f16;
    case ELLM_T_BF16: return fmm_bf16;
    default: return NULL;
    }
}
