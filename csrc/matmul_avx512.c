/* AVX-512 float-weight dot kernels: the matmul_avx2.c scheme at 16 lanes, with masked
 * loads for the tail instead of a scalar loop. */
#include <immintrin.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))

/* 16 weights starting at element i -> f32; lanes outside `m` read nothing and are 0 */
INLINE __m512 wload(int type, const uint8_t *w, int64_t i, __mmask16 m) {
    switch (type) {
    case ELLM_T_F32: return _mm512_maskz_loadu_ps(m, w + 4 * i);
    case ELLM_T_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + 2 * i));
    default: {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + 2 * i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
    }
}

#define ALL 0xFFFF

INLINE void fdot1(int type, int64_t k, const uint8_t *w, const float *x, float *y) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 = _mm512_fmadd_ps(wload(type, w, i, ALL), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(wload(type, w, i + 16, ALL), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(wload(type, w, i + 32, ALL), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(wload(type, w, i + 48, ALL), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i < k; i += 16) {
        __mmask16 m = k - i >= 16 ? (__mmask16)ALL : (__mmask16)((1u << (k - i)) - 1);
        a0 = _mm512_fmadd_ps(wload(type, w, i, m), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    *y = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* The register tile: MR weight rows x NT tokens, 24 accumulators (of 32 registers);
 * per 16 values of k, MR + NT loads feed MR * NT FMAs. */
#define MR 4
#define NT 6

INLINE void micro(int type, int64_t k, const uint8_t *w, size_t ws, const int mr, const float *x,
                  size_t xs, const int nt, float *y, size_t ys) {
    __m512 acc[MR][NT];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) acc[r][t] = _mm512_setzero_ps();
    /* the masked tail is apart from the main loop: with the mask inside it, GCC spills
     * every accumulator on every step */
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 xv[NT];
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) xv[t] = _mm512_loadu_ps(x + t * xs + i);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < mr; r++) {
            __m512 wv = wload(type, w + r * ws, i, ALL);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    if (i < k) {
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 xv[NT];
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) xv[t] = _mm512_maskz_loadu_ps(m, x + t * xs + i);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < mr; r++) {
            __m512 wv = wload(type, w + r * ws, i, m);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* One register tile of mr <= MR rows and nt <= NT tokens, instantiated per shape. */
INLINE void tile(int type, int64_t k, const uint8_t *w, size_t ws, int mr, const float *x,
                 size_t xs, int nt, float *y, size_t ys) {
    switch (mr * 8 + nt) {
        case 9: micro(type, k, w, ws, 1, x, xs, 1, y, ys); break;
        case 10: micro(type, k, w, ws, 1, x, xs, 2, y, ys); break;
        case 11: micro(type, k, w, ws, 1, x, xs, 3, y, ys); break;
        case 12: micro(type, k, w, ws, 1, x, xs, 4, y, ys); break;
        case 13: micro(type, k, w, ws, 1, x, xs, 5, y, ys); break;
        case 14: micro(type, k, w, ws, 1, x, xs, 6, y, ys); break;
        case 17: micro(type, k, w, ws, 2, x, xs, 1, y, ys); break;
        case 18: micro(type, k, w, ws, 2, x, xs, 2, y, ys); break;
        case 19: micro(type, k, w, ws, 2, x, xs, 3, y, ys); break;
        case 20: micro(type, k, w, ws, 2, x, xs, 4, y, ys); break;
        case 21: micro(type, k, w, ws, 2, x, xs, 5, y, ys); break;
        case 22: micro(type, k, w, ws, 2, x, xs, 6, y, ys); break;
        case 25: micro(type, k, w, ws, 3, x, xs, 1, y, ys); break;
        case 26: micro(type, k, w, ws, 3, x, xs, 2, y, ys); break;
        case 27: micro(type, k, w, ws, 3, x, xs, 3, y, ys); break;
        case 28: micro(type, k, w, ws, 3, x, xs, 4, y, ys); break;
        case 29: micro(type, k, w, ws, 3, x, xs, 5, y, ys); break;
        case 30: micro(type, k, w, ws, 3, x, xs, 6, y, ys); break;
        case 33: micro(type, k, w, ws, 4, x, xs, 1, y, ys); break;
        case 34: micro(type, k, w, ws, 4, x, xs, 2, y, ys); break;
        case 35: micro(type, k, w, ws, 4, x, xs, 3, y, ys); break;
        case 36: micro(type, k, w, ws, 4, x, xs, 4, y, ys); break;
        case 37: micro(type, k, w, ws, 4, x, xs, 5, y, ys); break;
        case 38: micro(type, k, w, ws, 4, x, xs, 6, y, ys); break;
        default: break;
    }
}

/* The whole (nr x nt) block: decode runs row by row (fdot1, memory-bound anyway);
 * prefill steps MR rows at a time and, for those rows (in L1), every NT tokens. */
INLINE void fmm(int type, int64_t k, const uint8_t *w, size_t ws, int64_t nr, const float *x,
                size_t xs, int64_t nt, float *y, size_t ys) {
    if (nt == 1) {
        for (int64_t r = 0; r < nr; r++) fdot1(type, k, w + (size_t)r * ws, x, y + r);
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
