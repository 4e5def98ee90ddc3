/* Float-format conversions (bf16/f16 <-> f32). Scalar code here, SIMD in convert_avx2.c. */
#include "convert.h"
#include "simd.h"

#if defined(__x86_64__) || defined(__i386__)
void ellm_bf16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n);
void ellm_f16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n);
#define ELLM_HAVE_AVX2_CONVERT 1
#endif

uint16_t ellm_f32_to_f16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t x = v.u;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);            /* NaN */
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           /* overflow -> inf */
    if (absx < 0x38800000u) {                                             /* subnormal or zero */
        /* value * 2^24 rounded to nearest even gives the subnormal mantissa */
        union { uint32_t u; float f; } a;
        a.u = absx;
        float scaled = a.f * 16777216.0f;
        uint32_t m = (uint32_t)scaled;
        float rem = scaled - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t mant = absx & 0x7fffffu;
    uint32_t exp = (absx >> 23) - 112u;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  /* may carry into the exponent: correct */
    return (uint16_t)(sign | h);
}

void ellm_bf16_to_f32_row(const uint16_t *src, float *dst, size_t n) {
#ifdef ELLM_HAVE_AVX2_CONVERT
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) {
        ellm_bf16_to_f32_row_avx2(src, dst, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = ellm_bf16_to_f32(src[i]);
}

void ellm_f16_to_f32_row(const uint16_t *src, float *dst, size_t n) {
#ifdef ELLM_HAVE_AVX2_CONVERT
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) {
        ellm_f16_to_f32_row_avx2(src, dst, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = ellm_f16_to_f32(src[i]);
}

void ellm_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ellm_f32_to_bf16(src[i]);
}

void ellm_f32_to_f16_row(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ellm_f32_to_f16(src[i]);
}
