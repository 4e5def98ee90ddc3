/* Float-format conversions (bf16/f16 <-> f32). Scalar code here, SIMD in convert_avx2.c
 * and, for aarch64's NEON level (baseline NEON, no extension needed), below: every
 * output bit for bit the scalar one's (NaNs included). */
#include "convert.h"
#include "simd.h"

#if defined(__x86_64__) || defined(__i386__)
void ellm_bf16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n);
void ellm_f16_to_f32_row_avx2(const uint16_t *src, float *dst, size_t n);
#define ELLM_HAVE_AVX2_CONVERT 1
#endif

#if defined(__aarch64__)
#include <arm_neon.h>
#define ELLM_HAVE_NEON_CONVERT 1

static int neon_level(void) { return ellm_simd_level() == ELLM_SIMD_NEON; }

/* 8 at a time; returns how many it did (the caller does the tail). */
static size_t bf16_to_f32_neon(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t h = vld1q_u16(src + i);
        vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)));
        vst1q_f32(dst + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)));
    }
    return i;
}

/* FCVTL is exact for every half, NaNs aside: it quiets a signalling one, the scalar
 * code keeps its bits; so those lanes take the scalar formula's bits */
static size_t f16_to_f32_neon(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const uint16x4_t h = vld1_u16(src + i);
        uint32x4_t f = vreinterpretq_u32_f32(vcvt_f32_f16(vreinterpret_f16_u16(h)));
        const uint32x4_t w = vmovl_u16(h);
        const uint32x4_t nan = vcgtq_u32(vandq_u32(w, vdupq_n_u32(0x7fffu)), vdupq_n_u32(0x7c00u));
        const uint32x4_t exact = vorrq_u32(vshlq_n_u32(vandq_u32(w, vdupq_n_u32(0x8000u)), 16),
                                           vorrq_u32(vdupq_n_u32(0x7f800000u), vshlq_n_u32(vandq_u32(w, vdupq_n_u32(0x3ffu)), 13)));
        f = vbslq_u32(nan, exact, f);
        vst1q_f32(dst + i, vreinterpretq_f32_u32(f));
    }
    return i;
}

/* the scalar ellm_f32_to_bf16 in lanes: NaN -> its top half | 0x40, else round to
 * nearest even */
static size_t f32_to_bf16_neon(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const uint32x4_t u = vreinterpretq_u32_f32(vld1q_f32(src + i));
        const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
        const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
        const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fffu), odd)), 16);
        const uint32x4_t q = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40u));
        vst1_u16(dst + i, vmovn_u32(vbslq_u32(nan, q, r)));
    }
    return i;
}

/* FCVTN rounds to nearest even (the default FPCR) like the scalar code, overflow to inf
 * and subnormals included; NaN lanes get the scalar result, sign | 0x7e00 */
static size_t f32_to_f16_neon(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t f = vld1q_f32(src + i);
        const uint32x4_t u = vreinterpretq_u32_f32(f);
        const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(f));
        const uint16x4_t nan = vmovn_u32(vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u)));
        const uint16x4_t q = vorr_u16(vmovn_u32(vshrq_n_u32(vandq_u32(u, vdupq_n_u32(0x80000000u)), 16)), vdup_n_u16(0x7e00u));
        vst1_u16(dst + i, vbsl_u16(nan, q, h));
    }
    return i;
}
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
    size_t i = 0;
#ifdef ELLM_HAVE_NEON_CONVERT
    if (neon_level()) i = bf16_to_f32_neon(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ellm_bf16_to_f32(src[i]);
}

void ellm_f16_to_f32_row(const uint16_t *src, float *dst, size_t n) {
#ifdef ELLM_HAVE_AVX2_CONVERT
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) {
        ellm_f16_to_f32_row_avx2(src, dst, n);
        return;
    }
#endif
    size_t i = 0;
#ifdef ELLM_HAVE_NEON_CONVERT
    if (neon_level()) i = f16_to_f32_neon(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ellm_f16_to_f32(src[i]);
}

void ellm_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
#ifdef ELLM_HAVE_NEON_CONVERT
    if (neon_level()) i = f32_to_bf16_neon(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ellm_f32_to_bf16(src[i]);
}

void ellm_f32_to_f16_row(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
#ifdef ELLM_HAVE_NEON_CONVERT
    if (neon_level()) i = f32_to_f16_neon(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ellm_f32_to_f16(src[i]);
}
