/* Element conversions between float formats. No Python here. */
#ifndef ELLM_CONVERT_H
#define ELLM_CONVERT_H
#include <stddef.h>
#include <stdint.h>

static inline float ellm_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* IEEE half -> float, exact for every input (subnormals, inf, nan). */
static inline float ellm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        if (man == 0) {
            v.u = sign;
        } else {  /* subnormal: value = man * 2^-24 */
            v.f = (float)man * 5.9604644775390625e-08f;
            v.u |= sign;
        }
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return v.f;
}

/* float -> bf16, round to nearest even; NaN stays NaN. */
static inline uint16_t ellm_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* float -> IEEE half, round to nearest even. */
uint16_t ellm_f32_to_f16(float f);

/* (n,) -> (n,) conversions; SIMD chosen at run time. */
void ellm_bf16_to_f32_row(const uint16_t *src, float *dst, size_t n);
void ellm_f16_to_f32_row(const uint16_t *src, float *dst, size_t n);
void ellm_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n);
void ellm_f32_to_f16_row(const float *src, uint16_t *dst, size_t n);

#endif
