/* Detects the CPU's SIMD features once and holds the process-wide kernel level. */
#include "simd.h"

#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#define ELLM_X86 1
#endif
#if defined(__aarch64__)
#define ELLM_ARM64 1
#endif

#ifdef ELLM_X86
#ifdef _MSC_VER
#include <intrin.h> /* MSVC and clang-cl: __cpuidex, _xgetbv */
#else
#include <cpuid.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* CPUID and XGETBV read directly (not __builtin_cpu_supports, which needs a runtime
 * symbol, __cpu_model, that Apple's and Microsoft's toolchains lack): a feature counts
 * only if the OS also saves the register state it needs. */
static uint64_t xgetbv0(void) {
#ifdef _MSC_VER
    return (uint64_t)_xgetbv(0);
#else
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
#endif
}

/* CPUID leaf, subleaf -> a b c d; 0 when the CPU does not have that leaf. */
static int cpuid(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
#ifdef _MSC_VER
    int r[4];
    __cpuid(r, (int)(leaf & 0x80000000u));
    if ((unsigned)r[0] < leaf) return 0;
    __cpuidex(r, (int)leaf, (int)sub);
    *a = (unsigned)r[0], *b = (unsigned)r[1], *c = (unsigned)r[2], *d = (unsigned)r[3];
    return 1;
#else
    return __get_cpuid_count(leaf, sub, a, b, c, d);
#endif
}

typedef struct {
    int avx2, avx512, vnni, amx; /* amx: AMX-TILE + AMX-INT8 in CPUID, tile state in XCR0 */
    int amx_bf16; /* [bf16] amx and AMX-BF16 (CPUID.7.0:EDX[22]) */
} x86_feature_set;

static x86_feature_set x86_features(void) {
    unsigned a, b, c, d;
    if (!cpuid(1, 0, &a, &b, &c, &d)) return (x86_feature_set){0, 0, 0, 0, 0};
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return (x86_feature_set){0, 0, 0, 0, 0};
    uint64_t xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 0x6) == 0x6;            /* SSE + AVX state */
    int zmm_ok = ymm_ok && (xcr0 & 0xe0) == 0xe0; /* opmask + ZMM state */
    if (!cpuid(7, 0, &a, &b, &c, &d)) return (x86_feature_set){0, 0, 0, 0, 0};
    int avx2 = ymm_ok && ((b >> 5) & 1) && fma && f16c;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    int avx512 = avx2 && zmm_ok && f && dq && bw && vl;
    int vnni = avx512 && ((c >> 11) & 1);
    /* XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves tile state */
    int amx = vnni && ((d >> 24) & 1) && ((d >> 25) & 1) && (xcr0 & 0x60000) == 0x60000;
    int amx_bf16 = amx && ((d >> 22) & 1); /* [bf16] */
    return (x86_feature_set){avx2, avx512, vnni, amx, amx_bf16};
}

/* Linux hands out the tile data state (8 KiB per thread) only on request, once per
 * process (it then holds for every thread). 0 where refused or not Linux: the AMX level
 * is then simply not offered. */
static int amx_permitted(void) {
#ifdef __linux__
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return 0;
#endif
}
#endif

#ifdef ELLM_ARM64
#if defined(__linux__)
#include <sys/auxv.h>
#define ELLM_HWCAP_ASIMDDP (1ul << 20) /* <asm/hwcap.h>: AT_HWCAP */
#define ELLM_HWCAP2_I8MM (1ul << 13)   /* AT_HWCAP2 */
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#elif defined(_WIN32)
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#endif

#ifdef __APPLE__
static int sysctl_flag(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v != 0;
}
#endif

/* The optional extensions of the NEON level: SDOT/UDOT (Armv8.2 dotprod) and the int8
 * matrix multiply (Armv8.6 i8mm), as the OS reports them. */
static int arm_detect(void) {
    int f = 0;
#if defined(__linux__)
    if (getauxval(AT_HWCAP) & ELLM_HWCAP_ASIMDDP) f |= ELLM_NEON_DOTPROD;
    if (getauxval(AT_HWCAP2) & ELLM_HWCAP2_I8MM) f |= ELLM_NEON_I8MM;
#elif defined(__APPLE__)
    if (sysctl_flag("hw.optional.arm.FEAT_DotProd")) f |= ELLM_NEON_DOTPROD;
    if (sysctl_flag("hw.optional.arm.FEAT_I8MM")) f |= ELLM_NEON_I8MM;
#elif defined(_WIN32)
    if (IsProcessorFeaturePresent(43 /* PF_ARM_V82_DP_INSTRUCTIONS_AVAILABLE */)) f |= ELLM_NEON_DOTPROD;
#endif
    /* every CPU with i8mm has dotprod; the i8mm kernels use both */
    if (!(f & ELLM_NEON_DOTPROD)) f = 0;
    return f;
}
#endif

static atomic_int neon_best = -1;
static atomic_int neon_active = -1;

int ellm_neon_features_best(void) {
    int f = atomic_load(&neon_best);
    if (f < 0) {
#ifdef ELLM_ARM64
        f = arm_detect();
#else
        f = 0;
#endif
        atomic_store(&neon_best, f);
    }
    return f;
}

int ellm_neon_features(void) {
    int f = atomic_load_explicit(&neon_active, memory_order_relaxed);
    if (f < 0) {
        f = ellm_neon_features_best();
        atomic_store(&neon_active, f);
    }
    return f;
}

int ellm_neon_set_features(int mask) {
    int best = ellm_neon_features_best();
    if (mask < 0 || (mask & ~best) || ((mask & ELLM_NEON_I8MM) && !(mask & ELLM_NEON_DOTPROD))) return -1;
    atomic_store(&neon_active, mask);
    return 0;
}

static int detect(void) {
#ifdef ELLM_X86
    x86_feature_set f = x86_features();
    if (f.amx && amx_permitted()) return ELLM_SIMD_AMX;
    if (f.avx512) return ELLM_SIMD_AVX512;
    if (f.avx2) return ELLM_SIMD_AVX2;
    return ELLM_SIMD_SCALAR;
#elif defined(ELLM_ARM64)
    return ELLM_SIMD_NEON;  /* NEON is part of the aarch64 baseline */
#else
    return ELLM_SIMD_SCALAR;
#endif
}

int ellm_cpu_has_avx512_vnni(void) {
#ifdef ELLM_X86
    return x86_features().vnni;
#else
    return 0;
#endif
}

/* [bf16] the bf16 tile kernels (matmul_bf16_amx.c) run at the AMX level where this holds;
 * asked on every linear call, so CPUID (a trap to the hypervisor in a VM) runs once */
static atomic_int has_amx_bf16 = -1;
int ellm_cpu_has_amx_bf16(void) {
    int h = atomic_load_explicit(&has_amx_bf16, memory_order_relaxed);
    if (h < 0) {
#ifdef ELLM_X86
        h = x86_features().amx_bf16;
#else
        h = 0;
#endif
        atomic_store(&has_amx_bf16, h);
    }
    return h;
}

static atomic_int amd_family = -1;
void ellm_cpu_set_amd_family(int f) { atomic_store(&amd_family, f < 0 ? -1 : f); }
int ellm_cpu_amd_family(void) {
    int v = atomic_load_explicit(&amd_family, memory_order_relaxed);
    if (v < 0) {
        v = 0;
#ifdef ELLM_X86
        unsigned a, b, c, d;
        /* the vendor string is EBX, EDX, ECX: "Auth" "enti" "cAMD"; the family is leaf 1's
         * EAX bits 8-11, plus bits 20-27 when those read 0xF (every AMD CPU since 2011) */
        if (cpuid(0, 0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u &&
            cpuid(1, 0, &a, &b, &c, &d)) {
            const int base = (int)((a >> 8) & 0xF);
            v = base == 0xF ? base + (int)((a >> 20) & 0xFF) : base;
        }
#endif
        atomic_store(&amd_family, v);
    }
    return v;
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
    case ELLM_SIMD_AMX: return "amx";
    default: return "unknown";
    }
}
