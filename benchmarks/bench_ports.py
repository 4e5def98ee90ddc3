"""How many of the int8 prefill kernels' vector instructions one core retires a cycle.

A quantized matmul at many tokens (prefill) is bound by the core's vector pipes, not by
memory. At the AVX2 level its exact integer dot products are built from `vpmaddubsw`
(32 u8 x s8 products summed in pairs) and `vpmaddwd` (pairs widened to int32); with
AVX-512 VNNI, `vpdpbusd` does both in one instruction. This times long runs of
independent instructions (twelve chains, so no chain's latency decides) and prints
cycles per instruction, with the clock estimated from a chain of dependent scalar adds
(one a cycle on every x86 core since the Pentium Pro):

    python benchmarks/bench_ports.py            # ~5 s

What the figures decide: if `maddubs` and `madd` each take a cycle and the mix of the
two takes two, both use one and the same multiply pipe, and an exact int8 dot product
(two multiplies per 32 products) cannot go past 16 products a cycle per core, however
the kernel is written. docs/benchmarks.md compares that ceiling with the kernels' own
GFLOP/s (benchmarks/bench_kernels.py).
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from bench_stream import build_c, cpu_line

# Each t_ function runs `n` iterations of 12 independent instructions (or of the mix
# named) and returns the seconds taken; the empty asm statements use every chain's value
# each iteration, so none is dropped.
C_SOURCE = r"""
#include <immintrin.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define KEEP6(v, o) __asm__ volatile("" :: "x"(v[o]), "x"(v[o + 1]), "x"(v[o + 2]), \
                                          "x"(v[o + 3]), "x"(v[o + 4]), "x"(v[o + 5]))
#define KEEP12(v) do { KEEP6(v, 0); KEEP6(v, 6); } while (0)

double scalar_adds(long n) {  /* 4 dependent adds an iteration: the clock */
    long x = 0;
    double t0 = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return now() - t0;
}

/* One function per mix, each with only the registers it needs (12 of the 16) */
#define INT_TEST(name, BODY)                                                            \
    double name(long n) {                                                               \
        __m256i a[12];                                                                  \
        const __m256i b = _mm256_set1_epi8(3);                                          \
        for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi8((char)i);                  \
        double t0 = now();                                                              \
        for (long it = 0; it < n; it++) { BODY; KEEP12(a); }                          \
        return now() - t0;                                                              \
    }
INT_TEST(t_maddubs, for (int i = 0; i < 12; i++) a[i] = _mm256_maddubs_epi16(a[i], b))
INT_TEST(t_madd, for (int i = 0; i < 12; i++) a[i] = _mm256_madd_epi16(a[i], b))
INT_TEST(t_maddubs_madd, for (int i = 0; i < 6; i++) { a[i] = _mm256_maddubs_epi16(a[i], b);
                                                       a[i + 6] = _mm256_madd_epi16(a[i + 6], b); })
INT_TEST(t_sign, for (int i = 0; i < 12; i++) a[i] = _mm256_sign_epi8(a[i], b))
INT_TEST(t_maddubs_sign, for (int i = 0; i < 6; i++) { a[i] = _mm256_maddubs_epi16(a[i], b);
                                                       a[i + 6] = _mm256_sign_epi8(a[i + 6], b); })
INT_TEST(t_add, for (int i = 0; i < 12; i++) a[i] = _mm256_add_epi32(a[i], b))

double t_fma(long n) {
    __m256 f[12];
    const __m256 fb = _mm256_set1_ps(1.0001f), fc = _mm256_set1_ps(0.9999f);
    for (int i = 0; i < 12; i++) f[i] = _mm256_set1_ps((float)i);
    double t0 = now();
    for (long it = 0; it < n; it++) {
        for (int i = 0; i < 12; i++) f[i] = _mm256_fmadd_ps(f[i], fb, fc);
        KEEP12(f);
    }
    return now() - t0;
}

double t_maddubs_fma(long n) {
    __m256i a[6];
    __m256 f[6];
    const __m256i b = _mm256_set1_epi8(3);
    const __m256 fb = _mm256_set1_ps(1.0001f), fc = _mm256_set1_ps(0.9999f);
    for (int i = 0; i < 6; i++) { a[i] = _mm256_set1_epi8((char)i); f[i] = _mm256_set1_ps((float)i); }
    double t0 = now();
    for (long it = 0; it < n; it++) {
        for (int i = 0; i < 6; i++) { a[i] = _mm256_maddubs_epi16(a[i], b); f[i] = _mm256_fmadd_ps(f[i], fb, fc); }
        KEEP6(a, 0); KEEP6(f, 0);
    }
    return now() - t0;
}
"""

TESTS = [
    ("t_maddubs", "vpmaddubsw"),
    ("t_madd", "vpmaddwd"),
    ("t_maddubs_madd", "vpmaddubsw + vpmaddwd, half each"),
    ("t_sign", "vpsignb"),
    ("t_maddubs_sign", "vpmaddubsw + vpsignb, half each"),
    ("t_add", "vpaddd"),
    ("t_fma", "vfmadd231ps"),
    ("t_maddubs_fma", "vpmaddubsw + vfmadd231ps, half each"),
]


def build() -> ctypes.CDLL:
    dll = build_c(C_SOURCE, "ports", ["-O3", "-mavx2", "-mfma"])
    for fn in ["scalar_adds"] + [name for name, _ in TESTS]:
        getattr(dll, fn).restype = ctypes.c_double
        getattr(dll, fn).argtypes = [ctypes.c_long]
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20_000_000, help="loop iterations per figure")
    ap.add_argument("--rounds", type=int, default=3, help="the best of this many runs is kept")
    args = ap.parse_args()
    print(f"# {cpu_line()}")
    print(f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}")
    dll = build()
    n = args.iterations
    clock = 4 * n / min(dll.scalar_adds(n) for _ in range(args.rounds))
    print(f"clock (dependent scalar adds): {clock / 1e9:.2f} GHz")
    print(f"{'instructions':<40} {'cycles each':>12} {'per cycle':>10}")
    for fn, name in TESTS:
        seconds = min(getattr(dll, fn)(n) for _ in range(args.rounds))
        cycles = seconds * clock / (12 * n)
        print(f"{name:<40} {cycles:>12.2f} {1 / cycles:>10.2f}")


if __name__ == "__main__":
    main()
