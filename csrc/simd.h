/* Run-time choice of SIMD kernels. One level is active process-wide; every kernel
 * with SIMD variants asks ellm_simd_level() which to run. */
#ifndef ELLM_SIMD_H
#define ELLM_SIMD_H

enum ellm_simd {
    ELLM_SIMD_SCALAR = 0,
    ELLM_SIMD_AVX2 = 1,   /* AVX2 + FMA + F16C */
    ELLM_SIMD_AVX512 = 2, /* AVX-512 F/BW/VL/DQ (+ the AVX2 set) */
    ELLM_SIMD_NEON = 3,
    ELLM_SIMD_AMX = 4,    /* the AVX-512 level (with VNNI) plus AMX int8 tiles for many-token
                           * matmuls (matmul_amx.c); above AVX512, though numbered after NEON */
};

/* The AVX-512 kernels serve this level (AVX512 itself, or AMX, which adds tiles only). */
static inline int ellm_simd_is_avx512(int level) {
    return level == ELLM_SIMD_AVX512 || level == ELLM_SIMD_AMX;
}

/* The best level this CPU (and this build) supports. */
int ellm_simd_best(void);
/* The level kernels use now. */
int ellm_simd_level(void);
/* Forces a level; returns 0, or -1 when the CPU or build lacks it. */
int ellm_simd_set(int level);
const char *ellm_simd_name(int level);
/* The NEON level's optional extensions (aarch64), a bit mask: the kernels of the NEON
 * level take the best variant these allow (plain NEON, SDOT, or SDOT + SMMLA). */
enum { ELLM_NEON_DOTPROD = 1, ELLM_NEON_I8MM = 2 };
/* What the CPU (and OS) offer; 0 off aarch64. */
int ellm_neon_features_best(void);
/* What the kernels use now. */
int ellm_neon_features(void);
/* Restricts the kernels to a subset of ellm_neon_features_best() (i8mm needs dotprod);
 * returns 0, or -1 for a mask the CPU lacks. */
int ellm_neon_set_features(int mask);
/* AVX-512 VNNI (vpdpbusd) usable: lets the AVX-512 integer dot kernels use it. */
int ellm_cpu_has_avx512_vnni(void);
/* The CPU family of an AMD CPU (CPUID vendor "AuthenticAMD"; asked once), 0 for any other
 * vendor: picks which decode kernels stream from DRAM, one row at a time or in row tiles
 * (matmul.c: decode_kernel). 25 is Zen 3 and Zen 4, 26 Zen 5. */
int ellm_cpu_amd_family(void);
/* Tests: f >= 0 answers ellm_cpu_amd_family() so from now on (the kernels chosen for that
 * CPU run on this one, with the same bits); f < 0 asks the CPU again. */
void ellm_cpu_set_amd_family(int f);

#endif
