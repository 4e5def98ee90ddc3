// Shared device helpers for ellm's CUDA kernels (compiled at run time by NVRTC through
// CuPy's RawModule, and by nvcc --ptx in the test suite).
//
// No CUDA headers are included on purpose: NVRTC then needs no include path and the
// kernels compile the same wherever CuPy runs. Half-precision conversions and the
// tensor-core instruction are inline PTX (sm_80+).
//
// Weight rows are GGML rows (formats/ggml_types.py): F32, F16, BF16 or quantized blocks
// of 32 (Q4_0, Q4_1, Q8_0) or 256 elements (Q4_K, Q5_K, Q6_K). Blocks are only 2-byte
// aligned (a Q4_0 block is 18 bytes), so they are read as bytes and 16-bit halves.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;

#define ELLM_NEG_INF (__int_as_float(0xff800000))

// float -> u32 whose unsigned order is the float order (NaN excluded)
__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Greedy choice as a maximum (sample.cu argmax_rows, mmv.cu's greedy head): a logit's key
// is its order key above the complement of its index, so the largest key is the largest
// value at its first index; -inf and NaN become 0, never chosen (a row of nothing else
// gives id 0, as sample_rows does). A maximum of keys is the same in any order.
__device__ __forceinline__ u64 argmax_key(float v, int i) {
    if (!(v > ELLM_NEG_INF)) return 0ull;   // -inf, NaN
    return ((u64)order_key(v) << 32) | (u64)(0xffffffffu - (u32)i);
}

__device__ __forceinline__ int argmax_id(u64 best) {
    return best ? (int)(0xffffffffu - (u32)best) : 0;
}

// Whether this block is the last of `blocks` to get here, counted in *counter: each
// block's writes before the call are visible to the last one after it (which is then the
// one to merge them, and to set *counter back to 0 for the next launch). Every thread of
// the block calls it; *last is a __shared__ int of the caller's.
__device__ __forceinline__ bool last_block_to_finish(int* counter, int blocks, int* last) {
    __threadfence();   // this block's writes visible to the last block
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == blocks - 1;
    __syncthreads();
    if (!*last) return false;
    __threadfence();
    return true;
}

// Programmatic dependent launch (sm_90+, ops/cuda_pdl.py): inside a captured decode step
// the next kernel's blocks may be scheduled while this one still runs. Every kernel calls
// this before it reads or writes global memory (it may prefetch weights into L2 before:
// prefetch_l2): it waits until the kernel before has
// finished and its writes are visible, then lets the next one be scheduled. After a plain
// launch, and before sm_90, it does nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A hint that the 128-byte line holding p is wanted soon: fetched into L2, nothing
// returned, nothing waited for. Only for weights (nothing a step writes), so a kernel may
// issue it before grid_dependency_sync: under a programmatic dependent launch the fetch
// then overlaps the end of the kernel before. Nothing in a host build.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#else
    (void)p;
#endif
}

// The same into L1 (and L2): for what a kernel reads again soon after, such as a decode
// product's activations, whose loads wait for the step before. Nothing in a host build.
__device__ __forceinline__ void prefetch_l1(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L1 [%0];" :: "l"(p));
#else
    (void)p;
#endif
}

#ifdef ELLM_HOST_CUDA   // a host build for checking without a GPU (tests/cuda_host)
__device__ __forceinline__ float f16_to_f32(u16 h) { return cuda_host_f16_to_f32(h); }
__device__ __forceinline__ float bf16_to_f32(u16 h) { return cuda_host_bf16_to_f32(h); }
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)cuda_host_f32_to_bf16(lo) | ((u32)cuda_host_f32_to_bf16(hi) << 16);
}
__device__ __forceinline__ u16 f32_to_bf16(float f) { return cuda_host_f32_to_bf16(f); }
// D = A B + C on the tensor cores, m16n8k16, bf16 inputs, f32 accumulation (the caller's
// line, so the host build can check that a warp's lanes meet at the same mma)
#define mma_bf16_16816(c, a, b) cuda_host_mma_bf16_16816(c, a, b, __LINE__)
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// two f32 -> packed bf16x2 (lo in the low half), round to nearest even
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// f32 -> bf16, round to nearest even (the bf16 KV cache's stores)
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// D = A B + C on the tensor cores, m16n8k16, bf16 inputs, f32 accumulation; the fragment
// layout is the PTX ISA's (lane 4 g + q: A rows g, g + 8; B column g; C rows g, g + 8).
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Two f32 as two bf16 terms each, a = hi + lo to 16 significant bits (packed pairs, a in
// the low halves): the tensor-core operands of mmv.cu and attn_prefill, near f32
__device__ __forceinline__ void split_bf16(float a, float b, u32& hi, u32& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - bf16_to_f32((u16)(hi & 0xffffu)), b - bf16_to_f32((u16)(hi >> 16)));
}

// KV cache elements: f32, or bf16 (u16 bits) rounded on the way in; read back exactly
__device__ __forceinline__ float kv_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void kv_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(u16* p, long long i, float v) { p[i] = f32_to_bf16(v); }

__device__ __forceinline__ float rd_f16(const u8* p) {
    return f16_to_f32(*(const u16*)p);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

// A warp's inclusive running sum of v in lane order (every lane takes part).
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
    int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_sync(0xffffffffu, v, lane >= o ? lane - o : lane);
        if (lane >= o) v += y;
    }
    return v;
}

// A row's norm: blocks of NORM_THREADS threads (elementwise.cu's norms, attention.cu's
// q/k norms: the same sum, in the same order, for a row of the same length).
#define NORM_THREADS 256

// Sum over a block of NORM_THREADS threads, the same order for every row.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (NORM_THREADS / 32) ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// ---------------------------------------------------------------------------------
// Dequantize 8 consecutive elements k0 .. k0+7 (k0 % 8 == 0) of one weight row.
// One function per GGML type; every kernel that reads weights goes through these, so
// a layout is written once (they mirror csrc/quant.c's dq_* block functions).
// ---------------------------------------------------------------------------------

// The float types' 8 elements as vector loads (16 bytes each): rows of K % 8 == 0
// elements start 16-byte aligned, as the kernels that call these require. Element by
// element, ptxas issued 8 loads of 2 or 4 bytes for them.
__device__ __forceinline__ void deq8_f32(const u8* row, int K, int k0, float* v) {
    const float4* p = (const float4*)((const float*)row + k0);
    float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// F16 (BF = false) or BF16 rows: the 8 halves of one 16-byte load
template <bool BF>
__device__ __forceinline__ void deq8_halves(const u8* row, int k0, float* v) {
    uint4 u = *(const uint4*)((const u16*)row + k0);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        u16 h = (u16)(i & 1 ? w[i >> 1] >> 16 : w[i >> 1] & 0xffffu);
        v[i] = BF ? bf16_to_f32(h) : f16_to_f32(h);
    }
}

__device__ __forceinline__ void deq8_f16(const u8* row, int K, int k0, float* v) { deq8_halves<false>(row, k0, v); }

__device__ __forceinline__ void deq8_bf16(const u8* row, int K, int k0, float* v) { deq8_halves<true>(row, k0, v); }

// Q4_0, Q4_1 and Q8_0 as the GPU keeps them (ops/cuda_kernels.py rows_split): a row's values of
// every block first (16 bytes of nibbles a block of 32 for Q4_0 / Q4_1, 32 int8 for Q8_0),
// then its blocks' scales (f16 d; Q4_1: f16 d and f16 m), the row padded to 16 bytes.
// GGML's blocks (18, 20, 34 bytes) leave the values 2-byte aligned; apart, 8 values are one
// load. Rows start 16-byte aligned; the scales at K / 2 (Q4_x) or K (Q8_0), 16-byte aligned.

// Nibble i (0..7) of weights j0 .. j0 + 7 (j0 % 8 == 0) of a step whose 16 bytes of nibbles
// are placed as Q4_0's (below): w0, w1 its bytes j0 % 16 .. + 7.
__device__ __forceinline__ u32 step_nibble(u32 w0, u32 w1, int j0, int i) {
    return ((i < 4 ? w0 : w1) >> (8 * (i & 3) + (j0 >= 16 ? 4 : 0))) & 15u;
}

// A split row's scales of block blk: after the row's values, vb bytes a block; sb bytes a
// block of scales (mmv.cu SplitRows reads the same places).
__device__ __forceinline__ const u8* split_scales(const u8* row, int K, int vb, int sb, int blk) {
    return row + (K >> 5) * vb + sb * blk;
}

// Q4_0: element j < 16 of a block the low nibble of its byte j, j >= 16 the high nibble of
// byte j - 16; value d * (q - 8).
__device__ __forceinline__ void deq8_q4_0(const u8* row, int K, int k0, float* v) {
    int blk = k0 >> 5, j0 = k0 & 31;
    float d = rd_f16(split_scales(row, K, 16, 2, blk));
    uint2 w = *(const uint2*)(row + 16 * blk + (j0 & 15));
    #pragma unroll
    for (int i = 0; i < 8; i++) v[i] = d * (float)((int)step_nibble(w.x, w.y, j0, i) - 8);
}

// Q4_1: nibbles as Q4_0; value d * q + m.
__device__ __forceinline__ void deq8_q4_1(const u8* row, int K, int k0, float* v) {
    int blk = k0 >> 5, j0 = k0 & 31;
    const u8* dm = split_scales(row, K, 16, 4, blk);
    float d = rd_f16(dm), m = rd_f16(dm + 2);
    uint2 w = *(const uint2*)(row + 16 * blk + (j0 & 15));
    #pragma unroll
    for (int i = 0; i < 8; i++) v[i] = d * (float)step_nibble(w.x, w.y, j0, i) + m;
}

// Q8_0: 32 int8 a block; value d * q.
__device__ __forceinline__ void deq8_q8_0(const u8* row, int K, int k0, float* v) {
    float d = rd_f16(split_scales(row, K, 32, 2, k0 >> 5));
    uint2 w = *(const uint2*)(row + k0);
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = d * (float)(i8)((w.x >> (8 * i)) & 0xffu);
        v[4 + i] = d * (float)(i8)((w.y >> (8 * i)) & 0xffu);
    }
}

// Q4_K and Q5_K as the GPU keeps them (ops/cuda_kernels.py rows_split, csrc/quant.c
// ellm_split_rows): a row's steps of 32 weights (a sub-block each) -- Q4_K: 16 bytes of
// nibbles placed as Q4_0's; Q5_K: those, then 4 bytes of fifth bits (byte q: weights
// 4q + i at bit i, 16 + 4q + i at bit 4 + i) -- then the blocks' 16-byte heads: f16 d, f16
// dmin, a word holding sub-block s's top 2 bits of scale and of min at bits 4s and 4s + 2,
// then a byte a sub-block (its scale's low 4 bits, its min's above them); value
// d sc q - dmin mn. (GGML's block keeps a 64-chunk's two sub-blocks in the low and high
// nibbles of the same 32 bytes, so a step's 16 bytes came in 32, Q5_K's fifth bits of
// every sub-block in one 32 bytes, and the scales packed so that a sub-block's took up
// to 3 words of 4.)
template <int STEP_BYTES>
__device__ __forceinline__ const u8* k_head(const u8* row, int K, int blk) {
    return row + (K >> 5) * STEP_BYTES + 16 * blk;   // after every step's bytes
}

// The words of a block head that sub-block s's scale and min need: d, dmin and the top
// bits (dt), and the word holding its low bits (mmv.cu has a row's lanes load them apart
// and pass them round).
struct KHead {
    uint2 dt;
    u32 low;
};

// Sub-block s's scale and min from those words, times the block's d and dmin.
__device__ __forceinline__ void k_head_scale_min(const KHead& h, int s, float* scale, float* mn) {
    u32 low = h.low >> (8 * (s & 3));
    u32 top = h.dt.y >> (4 * s);
    *scale = f16_to_f32((u16)(h.dt.x & 0xffffu)) * (float)((low & 15u) | ((top & 3u) << 4));
    *mn = f16_to_f32((u16)(h.dt.x >> 16)) * (float)(((low >> 4) & 15u) | (((top >> 2) & 3u) << 4));
}

// Sub-block s's scale and min: two loads of the head.
__device__ __forceinline__ void k_scale_min(const u8* head, int s, float* scale, float* mn) {
    KHead h;
    h.dt = *(const uint2*)head;
    h.low = *(const u32*)(head + 8 + 4 * (s >> 2));
    k_head_scale_min(h, s, scale, mn);
}

__device__ __forceinline__ void deq8_q4_k(const u8* row, int K, int k0, float* v) {
    int j0 = k0 & 31;
    float d, m;
    k_scale_min(k_head<16>(row, K, k0 >> 8), (k0 >> 5) & 7, &d, &m);
    uint2 w = *(const uint2*)(row + 16 * (k0 >> 5) + (j0 & 15));   // 8-byte aligned
    #pragma unroll
    for (int i = 0; i < 8; i++) v[i] = d * (float)step_nibble(w.x, w.y, j0, i) - m;
}

__device__ __forceinline__ void deq8_q5_k(const u8* row, int K, int k0, float* v) {
    int j0 = k0 & 31;
    float d, m;
    k_scale_min(k_head<20>(row, K, k0 >> 8), (k0 >> 5) & 7, &d, &m);
    const u8* rec = row + 20 * (k0 >> 5);                  // 4-byte aligned
    u32 w0 = *(const u32*)(rec + (j0 & 15)), w1 = *(const u32*)(rec + (j0 & 15) + 4);
    u32 fifth = (u32)*(const u16*)(rec + 16 + ((j0 & 15) >> 2)) >> (4 * (j0 >> 4));   // bytes (j0 & 15) / 4, + 1
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 bit = (fifth >> (8 * (i >> 2) + (i & 3))) & 1u;
        v[i] = d * (float)(step_nibble(w0, w1, j0, i) | (bit << 4)) - m;
    }
}

// Q6_K as the GPU keeps it (ops/cuda_kernels.py rows_split, csrc/quant.c ellm_split_rows):
// a row's steps of 32 weights as 24-byte records -- 16 bytes of nibbles (weight j < 16 the
// low nibble of byte j, j >= 16 the high nibble of byte j - 16, as Q4_0) and 8 bytes of
// high bit pairs (u16 word w: weights 4w + i at bits 2i, 16 + 4w + i at bits 8 + 2i) --
// then the blocks' 16 int8 scales (one per 16 weights), then their f16 d; value
// d scale (q - 32). GGML's 210-byte blocks leave everything 2-byte aligned.
__device__ __forceinline__ const u8* q6_k_d(const u8* row, int K, int blk) {
    return split_scales(row, K, 24, 2, K >> 5) + 2 * blk;   // after every step's two scales
}

__device__ __forceinline__ void deq8_q6_k(const u8* row, int K, int k0, float* v) {
    int j0 = k0 & 31;
    const u8* rec = row + 24 * (k0 >> 5);
    float d = rd_f16(q6_k_d(row, K, k0 >> 8)) * (float)((const i8*)split_scales(row, K, 24, 2, 0))[k0 >> 4];
    uint2 w = *(const uint2*)(rec + (j0 & 15));               // 8-byte aligned: 24-byte records
    u32 h = *(const u32*)(rec + 16 + ((j0 & 15) >> 1)) >> (8 * (j0 >> 4));   // words (j0 & 15) / 4, + 1
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 pair = (h >> (16 * (i >> 2) + 2 * (i & 3))) & 3u;
        v[i] = d * (float)((int)(step_nibble(w.x, w.y, j0, i) | (pair << 4)) - 32);
    }
}

// ops/cuda.py compiles linear.cu and mmv.cu one weight type at a time, the types side by
// side (each a fraction of the whole file's compile): ELLM_ONLY_TYPE is then the type's
// GGML id, and only its kernels are made. Without it (nvcc's checks), every type's.
#ifdef ELLM_ONLY_TYPE
#define ELLM_TYPE_ON(id) (ELLM_ONLY_TYPE == (id))
#else
#define ELLM_TYPE_ON(id) 1
#endif
#define ELLM_TYPE_OFF(X)
#if ELLM_TYPE_ON(0)
#define ELLM_TYPE_F32(X) X(f32, deq8_f32)
#else
#define ELLM_TYPE_F32 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(1)
#define ELLM_TYPE_F16(X) X(f16, deq8_f16)
#else
#define ELLM_TYPE_F16 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(30)
#define ELLM_TYPE_BF16(X) X(bf16, deq8_bf16)
#else
#define ELLM_TYPE_BF16 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(2)
#define ELLM_TYPE_Q4_0(X) X(q4_0, deq8_q4_0)
#else
#define ELLM_TYPE_Q4_0 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(3)
#define ELLM_TYPE_Q4_1(X) X(q4_1, deq8_q4_1)
#else
#define ELLM_TYPE_Q4_1 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(8)
#define ELLM_TYPE_Q8_0(X) X(q8_0, deq8_q8_0)
#else
#define ELLM_TYPE_Q8_0 ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(12)
#define ELLM_TYPE_Q4_K(X) X(q4_k, deq8_q4_k)
#else
#define ELLM_TYPE_Q4_K ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(13)
#define ELLM_TYPE_Q5_K(X) X(q5_k, deq8_q5_k)
#else
#define ELLM_TYPE_Q5_K ELLM_TYPE_OFF
#endif
#if ELLM_TYPE_ON(14)
#define ELLM_TYPE_Q6_K(X) X(q6_k, deq8_q6_k)
#else
#define ELLM_TYPE_Q6_K ELLM_TYPE_OFF
#endif

// X(name, deq8 function) for every weight type the kernels take (those ELLM_ONLY_TYPE
// keeps); the names are the suffixes ops/cuda.py asks for (GGMLType names, lower case).
#define ELLM_FOR_EACH_WEIGHT_TYPE(X) \
    ELLM_TYPE_F32(X) ELLM_TYPE_F16(X) ELLM_TYPE_BF16(X) ELLM_TYPE_Q4_0(X) ELLM_TYPE_Q4_1(X) \
    ELLM_TYPE_Q8_0(X) ELLM_TYPE_Q4_K(X) ELLM_TYPE_Q5_K(X) ELLM_TYPE_Q6_K(X)

// ---------------------------------------------------------------------------------
// Norm + q/k/v + RoPE + paged KV write (linear.cu qkv_rope_<type>, mmv.cu
// mmv_qkv_rope_<type>): their parameters, their tasks and their stores.
// ---------------------------------------------------------------------------------
#define ELLM_QKV_ROPE_PARAMS                                                              \
        const u8* __restrict__ Wq, const u8* __restrict__ Wk, const u8* __restrict__ Wv,  \
        long long rbq, long long rbk, long long rbv,                                      \
        const float* __restrict__ bq, const float* __restrict__ bk,                       \
        const float* __restrict__ bv,                                                     \
        const float* __restrict__ X, const float* __restrict__ g, float eps,              \
        const int* __restrict__ positions, const int* __restrict__ seq_ids,               \
        const int* __restrict__ block_tables, int max_blocks,                             \
        float* __restrict__ q_out, void* __restrict__ k_cache, void* __restrict__ v_cache, \
        int kv_bf16, const float* __restrict__ inv_freq, int n_rot, int interleaved,      \
        float mscale, int T, int K, int nh, int nkv, int hd, int block_size
#define ELLM_QKV_ROPE_ARGS                                                                \
        Wq, Wk, Wv, rbq, rbk, rbv, bq, bk, bv, X, g, eps, positions, seq_ids, block_tables, \
        max_blocks, q_out, k_cache, v_cache, kv_bf16, inv_freq, n_rot, interleaved, mscale, T, \
        K, nh, nkv, hd, block_size
#define ELLM_QKV_ROPE_STORE_ARGS                                                          \
        bq, bk, bv, positions, seq_ids, block_tables, max_blocks, q_out, k_cache, v_cache,  \
        kv_bf16, inv_freq, mscale, nh, nkv, hd, block_size

// A task is one row (a passed-through dim, a v row) or a rotated pair of rows: per q / k
// head hd - n_rot tasks (pairs j < n_rot: dims (2j, 2j + 1) interleaved, else (j, j +
// n_rot)), per v head hd.
struct QkvTask {
    int which, head, d0, d1, pair;   // which: 0 q, 1 k, 2 v, -1 none
};

__device__ __forceinline__ QkvTask qkv_task(int task, int nh, int nkv, int hd, int n_rot, int interleaved) {
    QkvTask r = {-1, 0, 0, -1, -1};
    int per_head = hd - n_rot, tq = nh * per_head, tk = nkv * per_head;
    if (task < tq + tk) {
        r.which = task < tq ? 0 : 1;
        int i = task < tq ? task : task - tq;
        r.head = i / per_head;
        int j = i - r.head * per_head;
        if (j < n_rot) {
            r.pair = j;
            r.d0 = interleaved ? 2 * j : j;
            r.d1 = interleaved ? 2 * j + 1 : j + n_rot;
        } else {
            r.d0 = n_rot + j;
        }
    } else if (task < tq + tk + nkv * hd) {
        r.which = 2;
        r.head = (task - tq - tk) / hd;
        r.d0 = (task - tq - tk) - r.head * hd;
    }
    return r;
}

// Token t's results of task k (x1: the pair's second row): + bias, RoPE (the angle reduced
// to [-pi, pi] in double, then the fast sine and cosine: no Payne-Hanek path, no stack
// frame, for the large angles of long positions), then q into q_out or k / v into their
// cache slot (f32, or bf16 rounded to nearest even); none for a padding row (block -1).
__device__ __forceinline__ void qkv_rope_store(
        const QkvTask& k, int t, float x0, float x1, const float* __restrict__ bq,
        const float* __restrict__ bk, const float* __restrict__ bv, const int* __restrict__ positions,
        const int* __restrict__ seq_ids, const int* __restrict__ block_tables, int max_blocks,
        float* __restrict__ q_out, void* __restrict__ k_cache, void* __restrict__ v_cache, int kv_bf16,
        const float* __restrict__ inv_freq, float mscale, int nh, int nkv, int hd, int block_size) {
    const float* b = k.which == 0 ? bq : k.which == 1 ? bk : bv;
    if (b) {
        x0 += b[k.head * hd + k.d0];
        if (k.d1 >= 0) x1 += b[k.head * hd + k.d1];
    }
    int pos = positions[t];
    if (k.pair >= 0) {
        float ang = (float)pos * inv_freq[k.pair];
        double turns = rint((double)ang * 0.15915494309189535);
        float red = (float)((double)ang - turns * 6.283185307179586), c, sn;
        __sincosf(red, &sn, &c);
        c *= mscale;
        sn *= mscale;
        float y0 = x0 * c - x1 * sn, y1 = x1 * c + x0 * sn;
        x0 = y0;
        x1 = y1;
    }
    if (k.which == 0) {
        float* qp = q_out + ((long long)t * nh + k.head) * hd;
        qp[k.d0] = x0;
        if (k.d1 >= 0) qp[k.d1] = x1;
        return;
    }
    int blk = block_tables[(long long)seq_ids[t] * max_blocks + pos / block_size];
    if (blk < 0) return;   // a padding row of a captured batch
    long long slot = (((long long)blk * block_size + pos % block_size) * nkv + k.head) * hd;
    void* cache = k.which == 1 ? k_cache : v_cache;
    if (kv_bf16) {
        kv_store((u16*)cache, slot + k.d0, x0);
        if (k.d1 >= 0) kv_store((u16*)cache, slot + k.d1, x1);
    } else {
        kv_store((float*)cache, slot + k.d0, x0);
        if (k.d1 >= 0) kv_store((float*)cache, slot + k.d1, x1);
    }
}
