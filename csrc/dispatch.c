/* Detects the CPU's SIMD features once and holds the process-wide kernel level. */
#include "simd.h"

#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#define ELLM_X86 1
#endif
#if defined(__aarch64__)
#define ELLM_ARM64 1
#endif

static int detect(void) {
#ifdef ELLM_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512) return ELLM_SIMD_AVX512;
    if (avx2) return ELLM_SIMD_AVX2;
    return ELLM_SIMD_SCALAR;
#elif defined(ELLM_ARM64)
    return ELLM_SIMD_NEON;  /* NEON is part of the aarch64 baseline */
#else
    return ELLM_SIMD_SCALAR;
#endif
}

static atomic_int best_level = -1;
static atomic_int active_level = -1;

int ellm_simd_best(void) {
    int b = atomic_load(&best_level);
    if (b < 0) {
        b = detect();
        atomic_store(&best_level, b);
    }
    return b;
}

int ellm_simd_level(void) {
    int l = atomic_load_explicit(&active_level, memory_order_relaxed);
    if (l < 0) {
        l = ellm_simd_best();
        atomic_store(&active_level, l);
    }
    return l;
}

int ellm_simd_set(int level) {
    int best = ellm_simd_best();
    if (level == ELLM_SIMD_SCALAR) {
        atomic_store(&active_level, level);
        return 0;
    }
    if (level == ELLM_SIMD_NEON) {
        if (best != ELLM_SIMD_NEON) return -1;
    } else if (best == ELLM_SIMD_NEON || level > best || level < 0) {
        return -1;
    }
    atomic_store(&active_level, level);
    return 0;
}

const char *ellm_simd_name(int level) {
    switch (level) {
    case ELLM_SIMD_SCALAR: return "scalar";
    case ELLM_SIMD_AVX2: return "avx2";
    case ELLM_SIMD_AVX512: return "avx512";
    case ELLM_SIMD_NEON: return "neon";
    default: return "unknown";
    }
}
