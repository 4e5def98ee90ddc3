// The experts' products of a mixture-of-experts layer on the tensor cores (ops/cuda.py
// CudaOps.moe), mmv.cu's products with the expert chosen on the device.
//
// elementwise.cu's moe_route has laid the step's (token, expert) entries out by expert:
// slot s of blockIdx.y holds expert slots[s] (-1: no expert, the block returns), whose
// entries are starts[s] .. starts[s + 1] - 1, and rows[p] is entry p's token (its row of
// the step's activations, which gate/up read in place). A block of slot s reads its
// expert's rows once for up to 64 of that expert's tokens (blockIdx.z: which 64; a decode
// step has no more), as mmv.cu's kernels read a matrix once for every token, and writes
// the entries' rows of the result. Experts nobody chose are never read.
//
// Each token's sums are those of mmv.cu with that token alone (its column only; the order
// fixed by K), so a token's result does not depend on the batch. One tile a block: an
// expert has a few tokens of a step (T k / E on average), where more tiles gain nothing.
// An expert's matrix is found as a projection's base address (a kernel parameter) plus the
// expert's offset from it in bytes (a table of E, each matrix of one type and row stride):
// an address loaded whole from a table would be a generic one to the compiler, whose loads
// are neither global (LDG) nor issued ahead of their use.
#define ELLM_MMV_DEVICE_ONLY
#include "mmv.cu"

// The slot's expert and the entries [p0, p0 + n) this block takes: its blockIdx.z-th 64 of
// the slot's (a prefill may give an expert more than a step's 64), or -1 where there are
// none. Reads what moe_route wrote: after the wait for the kernel before.
__device__ __forceinline__ int moe_slot(const int* __restrict__ slots, const int* __restrict__ starts, int& p0,
                                        int& n) {
    grid_dependency_sync();
    int s = (int)blockIdx.y, first = (int)blockIdx.z * MMV_TOKENS;
    p0 = starts[s] + first;
    n = min(starts[s + 1] - p0, MMV_TOKENS);
    return n > 0 ? slots[s] : -1;
}

// The tokens of a block's entries (moe_glu: its entry t reads row moe_entry_rows[t] of the
// step's activations), loaded by the block once it knows its entries.
__shared__ int moe_entry_rows[MMV_TOKENS];
struct EntryRows {
    __device__ __forceinline__ int operator()(int t) const { return moe_entry_rows[t]; }
};

// Y (T, N) = X @ W^T for one matrix: mmv3_t's sums (the same bits) without its biases, adds,
// second and third matrices and greedy head, whose bookkeeping would push the quantized
// types past 128 registers here.
template <class WT>
__device__ __forceinline__ void mmv_one_t(const u8* __restrict__ W, long long rb, const float* __restrict__ X,
                                          float* __restrict__ Y, int T, int K, int N) {
    MMV_SHARED
    int lane = threadIdx.x & 31, gi = lane >> 2;
    auto point = [&](int grp, const u8* (&a)[1], const u8* (&b)[1]) {
        int n = grp * 16 + gi;
        a[0] = n < N ? W + (long long)n * rb : nullptr;
        b[0] = n + 8 < N ? W + (long long)(n + 8) * rb : nullptr;
    };
    mmv_groups<WT, 1>((N + 15) / 16, point, X, nullptr, T, K, part, sq, [&](int grp, int r) {
        int n0 = grp * 16;
        for (int it = threadIdx.x; it < 16 * T; it += blockDim.x) {
            int s = it & 15, t = it >> 4;
            if (n0 + s < N) Y[(long long)t * N + n0 + s] = tile_sum(part, s, t);
        }
    });
}

// gate/up and SiLU of each entry: out (T k, F) in entry order, mmv_glu's meaning (no bias;
// the RMSNorm of weight g folded in, each entry's 1/rms from its own row, or none where g is
// null) on X (T, K), the tokens' rows (entry p reads row rows[p]: no gathered copy).
// grid (groups, slots, ceil(T / 64)), block 32 * MMV_WARPS; K % 32 == 0.
// down of each entry: y (T k, N), mmv3's meaning with one matrix (mmv_one_t). Likewise.
#define ELLM_MOE_KERNELS(name, WT)                                                        \
extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS, 2) moe_glu_##name(           \
        const u8* __restrict__ gate, const u8* __restrict__ up,                           \
        const long long* __restrict__ gate_at, const long long* __restrict__ up_at, long long rb, \
        const int* __restrict__ slots, const int* __restrict__ starts,                    \
        const int* __restrict__ rows, const float* __restrict__ X,                        \
        const float* __restrict__ g, float eps, float* __restrict__ out, int K, int F) {  \
    int p0, n, e = moe_slot(slots, starts, p0, n);                                        \
    if (e < 0) return;                                                                    \
    for (int i = threadIdx.x; i < n; i += blockDim.x) moe_entry_rows[i] = rows[p0 + i];   \
    __syncthreads();                                                                      \
    mmv_glu_t<WT, 1>(gate + gate_at[e], up + up_at[e], rb, rb, nullptr, nullptr,          \
                     X, g, eps, out + (long long)p0 * F, n, K, F, 0, EntryRows());        \
}                                                                                         \
extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS, 2) moe_down_##name(          \
        const u8* __restrict__ down, const long long* __restrict__ down_at, long long rb, \
        const int* __restrict__ slots, const int* __restrict__ starts,                    \
        const float* __restrict__ X, float* __restrict__ y, int K, int N) {               \
    int p0, n, e = moe_slot(slots, starts, p0, n);                                        \
    if (e < 0) return;                                                                    \
    mmv_one_t<WT>(down + down_at[e], rb, X + (long long)p0 * K, y + (long long)p0 * N, n, K, N); \
}

// A type loading U steps ahead with one tile instead of its own count. moe.cu's kernels hold
// the expert's addresses, its entries' first row and their count in registers where mmv.cu's
// read them from the kernel's parameters: within two blocks an SM (128 registers), Q4_0's 16
// steps ahead and Q4_K's 8 would spill (Q4_0 20-136 bytes, Q4_K 16-48 with the folded norm),
// so they take 8 and 4 here.
template <class WT, int U>
struct Ahead : WT {
    static constexpr int unroll = U;
};

// by GGML type id, as mmv.cu (one type a compile: common.cuh ELLM_ONLY_TYPE)
#if ELLM_TYPE_ON(1)
ELLM_MOE_KERNELS(f16, WF16)
#endif
#if ELLM_TYPE_ON(30)
ELLM_MOE_KERNELS(bf16, WBf16)
#endif
#if ELLM_TYPE_ON(2)
using WQ4_0_8 = Ahead<WQ4_0, 8>;
ELLM_MOE_KERNELS(q4_0, WQ4_0_8)
#endif
#if ELLM_TYPE_ON(3)
ELLM_MOE_KERNELS(q4_1, WQ4_1)
#endif
#if ELLM_TYPE_ON(8)
ELLM_MOE_KERNELS(q8_0, WQ8_0)
#endif
#if ELLM_TYPE_ON(12)
using WQ4_K_4 = Ahead<WQ4_K, 4>;
ELLM_MOE_KERNELS(q4_k, WQ4_K_4)
#endif
#if ELLM_TYPE_ON(13)
ELLM_MOE_KERNELS(q5_k, WQ5_K)
#endif
#if ELLM_TYPE_ON(14)
ELLM_MOE_KERNELS(q6_k, WQ6_K)
#endif
