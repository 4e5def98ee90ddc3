/* AVX2 (+FMA, F16C) float-weight kernels: weight rows of f32, f16 or bf16 (converted in
 * registers, never to memory) times f32 activation rows.
 *
 * Prefill computes MR x NT register tiles so each loaded and converted weight vector
 * serves NT tokens and each activation vector MR rows; decode (one token) walks one row
 * at a time. Each output is summed the same way in both (see micro), so results do not
 * depend on the batch (quant_impl.h). */
#include <immintrin.h>
#include <math.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 weights starting at element i -> f32 */
INLINE __m256 wload(int type, const uint8_t *w, int64_t i) {
    switch (type) {
    case ELLM_T_F32: {
        __m256 v = _mm256_loadu_ps((const float *)(const void *)(w + 4 * i));
        /* keep it in a register: GCC otherwise folds the load into each token's FMA,
         * and the repeated loads cost ~15% of prefill speed */
        __asm__("" : "+x"(v));
        return v;
    }
    case ELLM_T_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
    default: {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
    }
}

INLINE float wscalar(int type, const uint8_t *w, int64_t i) {
    switch (type) {
    case ELLM_T_F32: {
        float f;
        memcpy(&f, w + 4 * i, 4);
        return f;
    }
    case ELLM_T_F16: return _cvtsh_ss(ellm_rd_u16(w + 2 * i));
    default: return ellm_bf16_to_f32(ellm_rd_u16(w + 2 * i));
    }
}

/* The register tile: MR weight rows x NT tokens x 2 chains = 12 accumulators (of 16
 * registers). Each output is summed by two 8-lane FMA chains, the even 8-steps of k into
 * one and the odd into the other, reduced as hsum8(chain0 + chain1), then the k % 8
 * tail by scalar FMAs in k order: the same for every tile shape and token count, so
 * results do not depend on the batch (quant_impl.h). Per two 8-steps, 2 (MR + NT) loads
 * feed 2 MR NT FMAs. */
#define MR 3
#define NT 2

/* one 8-step of k at i into chain `acc` */
#define STEP8(acc, i)                                                                        \
    do {                                                                                     \
        __m256 xv[NT];                                                                       \
        _Pragma("GCC unroll 8")                                                              \
        for (int t = 0; t < nt; t++) xv[t] = _mm256_loadu_ps(x + t * xs + (i));             \
        _Pragma("GCC unroll 8")                                                              \
        for (int r = 0; r < mr; r++) {                                                       \
            __m256 wv = wload(type, w + r * ws, (i));                                        \
            _Pragma("GCC unroll 8")                                                          \
            for (int t = 0; t < nt; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);  \
        }                                                                                    \
    } while (0)

INLINE void micro(int type, int64_t k, const uint8_t *w, size_t ws, const int mr, const float *x,
                  size_t xs, const int nt, float *y, size_t ys) {
    __m256 a0[MR][NT], a1[MR][NT];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) a0[r][t] = a1[r][t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        STEP8(a0, i);
        STEP8(a1, i + 8);
    }
    if (i + 8 <= k) {
        STEP8(a0, i);
        i += 8;
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) {
            float a = hsum8(_mm256_add_ps(a0[r][t], a1[r][t]));
            for (int64_t j = i; j < k; j++)
                a = fmaf(wscalar(type, w + r * ws, j), x[t * xs + j], a);
            y[t * ys + r] = a;
        }
}

/* One register tile of mr <= MR rows and nt <= NT tokens, instantiated per shape. */
INLINE void tile(int type, int64_t k, const uint8_t *w, size_t ws, int mr, const float *x,
                 size_t xs, int nt, float *y, size_t ys) {
    switch (mr * 8 + nt) {
    case 9: micro(type, k, w, ws, 1, x, xs, 1, y, ys); break;
    case 10: micro(type, k, w, ws, 1, x, xs, 2, y, ys); break;
    case 17: micro(type, k, w, ws, 2, x, xs, 1, y, ys); break;
    case 18: micro(type, k, w, ws, 2, x, xs, 2, y, ys); break;
    case 25: micro(type, k, w, ws, 3, x, xs, 1, y, ys); break;
    case 26: micro(type, k, w, ws, 3, x, xs, 2, y, ys); break;
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

ellm_fmm_fn ellm_fmm_avx2(int qtype) {
    switch (qtype) {
    case ELLM_T_F32: return fmm_f32;
    case ELLM_T_F16: return fmm_f16;
    case ELLM_T_BF16: return fmm_bf16;
    default: return NULL;
    }
}
