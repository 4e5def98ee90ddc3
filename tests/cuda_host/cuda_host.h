// The CUDA built-ins ellm's kernels use, for a host build of csrc/cuda/*.cu (g++ -include
// this file): the kernels' own text runs on the CPU, so their indexing, fragment layouts,
// reductions and batch invariance can be checked without a GPU (tests/cuda_host/cupy).
//
// A block runs as blockDim fibers on one OS thread, switched cooperatively at every
// __syncthreads, warp shuffle and mma (each a barrier of its block or warp); blocks run one
// after another, so `__shared__` (made `static`) is the block's shared memory (filled with
// 0xff bytes as each block starts: poison_shared). The threads
// of a block meeting at a __syncthreads must all have come to the same one (its line of
// the source), as CUDA requires, and so must a warp's lanes at a shuffle or mma: a GPU may
// hang or go on with the barriers paired wrongly where they do not, so that is an error
// here, not a hang or wrong results. What this cannot show: speed, data races between
// threads or blocks other than those running them in reverse order exposes (the fibers
// never run at the same time; reverse_order below), and the hardware's own rounding
// inside mma.sync (emulated here as f32 sums of exact products of the bf16 inputs).
#pragma once
#if !defined(__x86_64__)
#error "the host CUDA runtime switches fibers with x86-64 code"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ffi.h>
#include <sys/mman.h>
#include <xmmintrin.h>
#if defined(__SANITIZE_ADDRESS__)   // ELLM_CUDA_HOST_ASAN=1: a reused fiber stack starts clean
#include <sanitizer/asan_interface.h>
#define CUDA_HOST_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define CUDA_HOST_UNPOISON(p, n) ((void)0)
#endif

#define ELLM_HOST_CUDA 1
#define __global__ __attribute__((visibility("default")))
#define __device__
#define __forceinline__ inline
// Every __shared__ variable of the module goes in one section, whose bounds the linker
// gives as __start_ / __stop_ symbols: each block starts with it filled with 0xff bytes
// (NaN floats, -1 integers), as a GPU's shared memory holds whatever was there before, so
// a kernel that reads shared memory it has not written computes garbage here too.
// Not under AddressSanitizer (ELLM_CUDA_HOST_ASAN=1), which gives variables of a section
// of their own no redzones, so an index past a shared array would go unseen.
#if defined(__SANITIZE_ADDRESS__)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("cuda_host_shared")))
#endif
extern "C" __attribute__((weak)) char __start_cuda_host_shared[], __stop_cuda_host_shared[];
#define __align__(n) __attribute__((aligned(n)))
#ifdef CUDA_HOST_SCAN_BOUNDS   // tests/cuda_host/cupy reads each kernel's bound from the preprocessed text
#define __launch_bounds__(...) cuda_host_launch_bounds(__VA_ARGS__)
#else
#define __launch_bounds__(...)
#endif

struct dim3 { unsigned x = 1, y = 1, z = 1; };
// CUDA's vector types with CUDA's alignment: a GPU faults on a vector load or store at an
// address that is not a multiple of its size (the cuda_host_misaligned handler below)
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };

namespace cuda_host {

// -- fibers ---------------------------------------------------------------------------------
struct Group {            // a barrier: a block's threads, or a warp's
    int live = 0, arrived = 0;
    unsigned long long generation = 0;
    int site = 0;         // the source line of the __syncthreads the arrived threads wait at
};

struct Fiber {
    void* sp = nullptr;
    unsigned char* stack = nullptr;
    unsigned tid = 0;
    unsigned exchanges = 0;  // warp exchanges made (selects the exchange buffer)
    bool done = true;
    const Group* waits_on = nullptr;   // resumed only once this group's generation moves on
    unsigned long long waits_for = 0;
    dim3 idx;
};

constexpr size_t kStack = 256 * 1024;
constexpr int kSlotWords = 10;   // one lane's part of an exchange: mma's a[4], b[2], c[4]

struct Launch {
    ffi_cif cif;
    void (*fn)(void) = nullptr;
    void** values = nullptr;
    Fiber* fibers = nullptr;
    unsigned n_fibers = 0, cap = 0;
    Group block;
    Group* warps = nullptr;
    uint32_t (*slots)[32][kSlotWords] = nullptr;   // [warp * 2 + buffer][lane][word]
    unsigned long long progress = 0;
    Fiber* current = nullptr;
    void* scheduler_sp = nullptr;
    bool failed = false;  // a thread found the launch wrong (error says why): stop it
    char error[256] = {0};
};

inline Launch& launch() { static Launch L; return L; }

}  // namespace cuda_host

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

extern "C" void cuda_host_switch(void** save_sp, void* next_sp);
__asm__(
    ".text\n"
    ".globl cuda_host_switch\n"
    ".hidden cuda_host_switch\n"
    ".type cuda_host_switch,@function\n"
    "cuda_host_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size cuda_host_switch, .-cuda_host_switch\n");

namespace cuda_host {

inline void yield() {
    Launch& L = launch();
    cuda_host_switch(&L.current->sp, L.scheduler_sp);
}

inline void release(Group& g) {
    g.arrived = 0;
    g.generation++;
    launch().progress++;
}

// Wait until every live member of g has arrived (an exited thread no longer counts).
// site: the source line of a block barrier or of a warp's shuffle or mma, which every
// live thread of the group must reach together; 0: __syncwarp, which lanes may meet from
// any line.
inline void arrive(Group& g, int site = 0) {
    Launch& L = launch();
    if (g.arrived == 0) {
        g.site = site;
    } else if (site != g.site) {
        if (&g == &L.block)
            std::snprintf(L.error, sizeof L.error,
                          "threads of block (%u, %u, %u) wait at different __syncthreads: lines %d and %d of the "
                          "source (thread %u at the second)", blockIdx.x, blockIdx.y, blockIdx.z, g.site, site,
                          L.current->tid);
        else
            std::snprintf(L.error, sizeof L.error,
                          "lanes of warp %u of block (%u, %u, %u) meet at different warp exchanges: lines %d and "
                          "%d of the source (thread %u at the second; line 0: __syncwarp)", L.current->tid >> 5,
                          blockIdx.x, blockIdx.y, blockIdx.z, g.site, site, L.current->tid);
        L.failed = true;
        for (;;) yield();   // never resumed: the launch ends here
    }
    L.progress++;
    unsigned long long gen = g.generation;
    if (++g.arrived == g.live) {
        release(g);
        return;
    }
    Fiber* f = L.current;
    f->waits_on = &g;
    f->waits_for = gen;
    while (g.generation == gen) yield();
    f->waits_on = nullptr;
}

inline Group& my_warp() {
    Launch& L = launch();
    return L.warps[L.current->tid >> 5];
}

// Every lane of the warp deposits `words` 32-bit words at the same source line `site`;
// returns the warp's deposits ([lane][word]) once all have, valid until this lane's next
// exchange but one.
inline uint32_t (*exchange(const uint32_t* mine, int words, int site))[kSlotWords] {
    Launch& L = launch();
    Fiber* f = L.current;
    unsigned warp = f->tid >> 5, lane = f->tid & 31, buffer = f->exchanges++ & 1;
    uint32_t (*slots)[kSlotWords] = L.slots[warp * 2 + buffer];
    std::memcpy(slots[lane], mine, sizeof(uint32_t) * words);
    arrive(L.warps[warp], site);
    return slots;
}

extern "C" inline void fiber_main() {
    Launch& L = launch();
    Fiber* f = L.current;
    ffi_arg ignored;
    ffi_call(&L.cif, L.fn, &ignored, L.values);
    f->done = true;
    L.progress++;
    Group& w = L.warps[f->tid >> 5];
    for (Group* g : {&L.block, &w}) {
        g->live--;
        if (g->live > 0 && g->arrived == g->live) release(*g);
    }
    cuda_host_switch(&f->sp, L.scheduler_sp);
    std::abort();   // a finished fiber is never resumed
}

inline void start_fiber(Fiber& f) {
    if (!f.stack) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) std::abort();
        f.stack = (unsigned char*)p;
    }
    CUDA_HOST_UNPOISON(f.stack, kStack);
    // cuda_host_switch pops: control words (8 bytes), r15 r14 r13 r12 rbx rbp, then returns
    // into fiber_main with the stack as after a call (rsp % 16 == 8).
    uint64_t* top = (uint64_t*)(f.stack + kStack);
    *--top = 0;                                  // fiber_main's return address (never used)
    *--top = (uint64_t)(uintptr_t)&fiber_main;
    for (int i = 0; i < 6; i++) *--top = 0;
    uint32_t control[2];
    __asm__ volatile("stmxcsr %0\n fnstcw %1" : "=m"(control[0]), "=m"(control[1]));
    *--top = (uint64_t)control[0] | ((uint64_t)(control[1] & 0xffff) << 32);
    f.sp = top;
    f.done = false;
    f.exchanges = 0;
    f.waits_on = nullptr;
}

}  // namespace cuda_host

// Runs fn(args) over the grid. types: one letter per argument (p pointer, i int32, q int64,
// f float, d double); values: one 8-byte slot each. Returns 0, or -1 with cuda_host_error().
extern "C" __attribute__((visibility("default"))) const char* cuda_host_error() {
    return cuda_host::launch().error;
}

// A block's shared memory as it starts on a GPU: not cleared (without the section, under
// AddressSanitizer, nothing: both bounds are null)
inline void poison_shared() {
    volatile char* p = __start_cuda_host_shared;
    for (; p != nullptr && p < (volatile char*)__stop_cuda_host_shared; p++) *p = (char)0xff;
}

// ELLM_CUDA_HOST_ORDER=reverse: a grid's blocks from the last to the first, and a block's
// threads likewise. A kernel correct on a GPU gives the same results in either order; one
// that reads what another thread writes without a barrier between them gives others in
// one of the two (forward order hides a value thread 0 writes for the rest, reverse order
// a value overwritten by a lower thread before the rest have read it).
inline bool reverse_order() {
    static const bool reverse = [] {
        const char* e = std::getenv("ELLM_CUDA_HOST_ORDER");
        return e != nullptr && std::strcmp(e, "reverse") == 0;
    }();
    return reverse;
}

extern "C" __attribute__((visibility("default"))) int cuda_host_launch(
        void (*fn)(void), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
        int nargs, const char* types, uint64_t* values) {
    using namespace cuda_host;
    Launch& L = launch();
    L.error[0] = 0;
    L.failed = false;
    unsigned n = bx * by * bz;
    if (n == 0 || n > 1024 || bz > 64 || nargs > 64) {
        std::snprintf(L.error, sizeof L.error, "block of %u threads (%u, %u, %u) or %d arguments", n, bx, by, bz,
                      nargs);
        return -1;
    }
    // a GPU refuses these launches ("invalid argument"): grid y and z at most 65,535
    if (gx == 0 || gy == 0 || gz == 0 || gx > 0x7fffffffu || gy > 65535 || gz > 65535) {
        std::snprintf(L.error, sizeof L.error, "grid (%u, %u, %u): a GPU takes x up to 2^31 - 1, y and z up to "
                      "65,535, none 0", gx, gy, gz);
        return -1;
    }
    ffi_type* arg_types[64];
    void* arg_values[64];
    for (int i = 0; i < nargs; i++) {
        switch (types[i]) {
            case 'p': arg_types[i] = &ffi_type_pointer; break;
            case 'i': arg_types[i] = &ffi_type_sint32; break;
            case 'q': arg_types[i] = &ffi_type_sint64; break;
            case 'f': arg_types[i] = &ffi_type_float; break;
            case 'd': arg_types[i] = &ffi_type_double; break;
            default:
                std::snprintf(L.error, sizeof L.error, "argument %d of unknown type %c", i, types[i]);
                return -1;
        }
        arg_values[i] = &values[i];
    }
    if (ffi_prep_cif(&L.cif, FFI_DEFAULT_ABI, nargs, &ffi_type_void, arg_types) != FFI_OK) {
        std::snprintf(L.error, sizeof L.error, "ffi_prep_cif failed");
        return -1;
    }
    L.fn = fn;
    L.values = arg_values;
    if (n > L.cap) {
        L.fibers = (Fiber*)std::realloc((void*)L.fibers, sizeof(Fiber) * n);
        for (unsigned i = L.cap; i < n; i++) new (&L.fibers[i]) Fiber();
        L.cap = n;
    }
    unsigned n_warps = (n + 31) / 32;
    Group warps[32];
    static uint32_t slots[64][32][kSlotWords];
    L.warps = warps;
    L.slots = slots;
    blockDim = dim3{bx, by, bz};
    gridDim = dim3{gx, gy, gz};
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);   // flush denormals to zero, as NVRTC's -ftz=true (CuPy's default)
    int rc = 0;
    const bool reverse = reverse_order();
    const unsigned long long n_blocks = (unsigned long long)gx * gy * gz;
    for (unsigned long long i = 0; i < n_blocks && !rc; i++) {
        const unsigned long long b = reverse ? n_blocks - 1 - i : i;
        const unsigned x = (unsigned)(b % gx), y = (unsigned)(b / gx % gy), z = (unsigned)(b / gx / gy);
        blockIdx = dim3{x, y, z};
        poison_shared();
        L.block = Group{(int)n, 0, 0};
        for (unsigned w = 0; w < n_warps; w++) warps[w] = Group{(int)std::min(32u, n - 32 * w), 0, 0};
        for (unsigned t = 0; t < n; t++) {
            Fiber& f = L.fibers[t];
            start_fiber(f);
            f.tid = t;
            f.idx = dim3{t % bx, (t / bx) % by, t / (bx * by)};
        }
        unsigned left = n;
        while (left) {
            unsigned long long before = L.progress;
            left = 0;
            for (unsigned k = 0; k < n; k++) {
                Fiber& f = L.fibers[reverse ? n - 1 - k : k];
                if (f.done) continue;
                if (f.waits_on && f.waits_on->generation == f.waits_for) {
                    left++;
                    continue;
                }
                L.current = &f;
                threadIdx = f.idx;
                cuda_host_switch(&L.scheduler_sp, f.sp);
                if (L.failed) break;
                left += !f.done;
            }
            if (L.failed) {
                rc = -1;
                break;
            }
            if (left && L.progress == before) {
                std::snprintf(L.error, sizeof L.error,
                              "deadlock in block (%u, %u, %u): %u threads wait at barriers the others "
                              "never reach", x, y, z, left);
                rc = -1;
                break;
            }
        }
    }
    _mm_setcsr(csr);
    L.current = nullptr;
    return rc;
}

// -- misaligned loads and stores --------------------------------------------------------------
// The kernels are built with -fsanitize=alignment: every load or store through a typed
// pointer checks that its address is a multiple of the type's alignment (u16 2, u32 and
// float 4, uint2 8, float4 and uint4 16), and where it is not the compiler calls the
// handlers below. A GPU stops a kernel there ("misaligned address", which also ends the
// CUDA context, so every later call of the process fails); here the launch fails, naming
// the source line, the type and the thread. The handlers' arguments are the sanitizer's
// (GCC and Clang alike since GCC 8): a source location, the type's descriptor, log2 of the
// alignment and the kind of access.
namespace cuda_host {
struct SanitizerLocation { const char* file; uint32_t line, column; };
struct SanitizerType { uint16_t kind, info; char name[1]; };
struct SanitizerMismatch {
    SanitizerLocation where;
    const SanitizerType* type;
    unsigned char log_alignment, access;
};

inline void misaligned(void* data, void* address) {
    const SanitizerMismatch& m = *(const SanitizerMismatch*)data;
    uintptr_t at = (uintptr_t)address, alignment = (uintptr_t)1 << m.log_alignment;
    if (at % alignment == 0) return;   // the sanitizer also calls for checks this build does not ask for
    Launch& L = launch();
    const char* access = m.access == 0 ? "a load of" : m.access == 1 ? "a store to" : "an access to";
    if (L.current == nullptr) {   // host code outside any launch: not a kernel's fault
        std::fprintf(stderr, "cuda_host: misaligned address: %s %s at line %u\n", access, m.type->name, m.where.line);
        std::abort();
    }
    std::snprintf(L.error, sizeof L.error,
                  "misaligned address: %s %s (%u-byte aligned on a GPU) at %p, %u bytes past a multiple, "
                  "line %u of the source, thread %u of block (%u, %u, %u)", access, m.type->name,
                  (unsigned)alignment, address, (unsigned)(at % alignment), m.where.line, L.current->tid,
                  blockIdx.x, blockIdx.y, blockIdx.z);
    L.failed = true;
    for (;;) yield();   // never resumed: the launch ends here
}
}  // namespace cuda_host

extern "C" void __ubsan_handle_type_mismatch_v1(void* data, void* address) { cuda_host::misaligned(data, address); }
extern "C" void __ubsan_handle_type_mismatch_v1_abort(void* data, void* address) {
    cuda_host::misaligned(data, address);
}

// -- the built-ins ----------------------------------------------------------------------------
template <class T> inline float __int_as_float(T v) {
    int32_t i = (int32_t)(uint32_t)v; float f; std::memcpy(&f, &i, 4); return f;
}
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }

template <class A, class B> inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C; return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B> inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C; return (C)a < (C)b ? (C)b : (C)a;
}

inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }

inline void cuda_host_syncthreads(int line) { cuda_host::arrive(cuda_host::launch().block, line); }
#define __syncthreads() cuda_host_syncthreads(__LINE__)
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_host::arrive(cuda_host::my_warp()); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// lane src_lane's v (of the whole warp: every live lane must call it at the same line, as
// CUDA asks of a full mask: the same intrinsic on every lane, else undefined)
template <class T> inline T cuda_host_shfl_sync(unsigned mask, T v, int src_lane, int line) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    if (mask != 0xffffffffu) std::abort();   // the kernels shuffle whole warps only
    uint32_t mine[2] = {0, 0};
    std::memcpy(mine, &v, sizeof(T));
    auto slots = cuda_host::exchange(mine, 2, line);
    T r;
    std::memcpy(&r, slots[src_lane & 31], sizeof(T));
    return r;
}

template <class T> inline T cuda_host_shfl_xor_sync(unsigned mask, T v, int lane_mask, int line) {
    return cuda_host_shfl_sync(mask, v, (int)((cuda_host::launch().current->tid & 31) ^ (unsigned)lane_mask), line);
}
// the lanes of the warp whose v equals this lane's (a whole warp, every lane live: the
// kernels call it so)
inline unsigned cuda_host_match_any_sync(unsigned mask, int v, int line) {
    cuda_host::Launch& L = cuda_host::launch();
    if (mask != 0xffffffffu || L.warps[L.current->tid >> 5].live != 32) std::abort();
    uint32_t mine[1] = {(uint32_t)v};
    auto slots = cuda_host::exchange(mine, 1, line);
    unsigned peers = 0;
    for (int lane = 0; lane < 32; lane++) peers |= (unsigned)(slots[lane][0] == (uint32_t)v) << lane;
    return peers;
}
#define __match_any_sync(mask, v) cuda_host_match_any_sync(mask, v, __LINE__)
inline int __popc(unsigned x) { return __builtin_popcount(x); }
#define __shfl_sync(mask, v, src_lane) cuda_host_shfl_sync(mask, v, src_lane, __LINE__)
#define __shfl_xor_sync(mask, v, lane_mask) cuda_host_shfl_xor_sync(mask, v, lane_mask, __LINE__)

template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }

// -- what common.cuh writes as inline PTX ------------------------------------------------------
inline float cuda_host_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {   // subnormal half: value man * 2^-24, exact in f32
            float f = std::ldexp((float)man, -24);
            return sign ? -f : f;
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline uint16_t cuda_host_f32_to_bf16(float f) {   // round to nearest even; NaN stays NaN
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

inline float cuda_host_bf16_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 over the warp: lane l = 4 g + q holds
// A rows g, g + 8 at k 2q, 2q + 1 (a0, a1) and 2q + 8, 2q + 9 (a2, a3), B column g at k 2q,
// 2q + 1 (b0) and 2q + 8, 2q + 9 (b1), and C rows g, g + 8 at columns 2q, 2q + 1 (PTX ISA).
inline void cuda_host_mma_bf16_16816(float* c, const uint32_t* a, const uint32_t* b, int line) {
    uint32_t mine[10];
    std::memcpy(mine, a, 16);
    std::memcpy(mine + 4, b, 8);
    std::memcpy(mine + 6, c, 16);
    auto s = cuda_host::exchange(mine, 10, line);
    auto A = [&](int r, int k) {   // element (r, k) of A
        int lane = (r & 7) * 4 + ((k & 7) >> 1), reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return cuda_host_bf16_to_f32((s[lane][reg] >> (16 * (k & 1))) & 0xffffu);
    };
    auto B = [&](int k, int n) {   // element (k, n) of B
        int lane = n * 4 + ((k & 7) >> 1), reg = 4 + (k >= 8 ? 1 : 0);
        return cuda_host_bf16_to_f32((s[lane][reg] >> (16 * (k & 1))) & 0xffffu);
    };
    unsigned lane = cuda_host::launch().current->tid & 31;
    int g = lane >> 2, q = lane & 3;
    float out[4];
    for (int i = 0; i < 4; i++) {
        int r = g + 8 * (i >> 1), n = 2 * q + (i & 1);
        float acc = __uint_as_float(s[lane][6 + i]);
        for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, n);
        out[i] = acc;
    }
    std::memcpy(c, out, 16);
}
