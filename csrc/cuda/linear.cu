// Matrix products Y (T, N) = X (T, K) @ W^T (+ bias) for every weight type, and the
// embedding gather. W is (N, row_bytes) GGML rows (common.cuh), dequantized in the kernel.
//
//   gemv_<type>   few tokens (decode; gemv3_<type>: up to three matrices at once): one warp per output row, the row read once for up
//                 to GEMV_TOKENS tokens; f32 accumulation in a fixed order per output
//                 element, so a token's result does not depend on its batch (the batch
//                 invariance contract, DESIGN.md).
//   gemm_<type>   many tokens (prefill): 64x64 tiles on the tensor cores (mma.sync
//                 m16n8k16, bf16 inputs, f32 accumulation); X and the dequantized W are
//                 rounded to bf16 in shared memory. Not bit-equal to gemv: ops/cuda.py uses
//                 gemm only above a fixed token count, whatever the sequences.
//   embed_<type>  out (T, K) = rows ids (T,) of W, dequantized.
#include "common.cuh"

#define GEMV_TOKENS 8      // tokens sharing one read of a weight row
#define GEMV_WARPS 4       // output rows per block

// One warp: row n of W (row_bytes per row) against tokens t0 .. t0+GEMV_TOKENS-1 of X;
// Y[t][n] (row stride ldy) = the sum (+ bias[n]). The order of the sum is fixed per
// output element, so gemv and gemv3 give the same bits.
#define ELLM_GEMV_ROW(name, deq)                                                          \
__device__ __forceinline__ void gemv_row_##name(                                          \
        const u8* __restrict__ row, const float* __restrict__ X,                          \
        const float* __restrict__ bias, float* __restrict__ Y,                            \
        int T, int K, int n, int ldy, int t0, int lane) {                                 \
    int nt = min(GEMV_TOKENS, T - t0);                                                    \
    float acc[GEMV_TOKENS];                                                               \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = 0.0f;                \
    for (int c = lane; c < (K >> 3); c += 32) {                                           \
        float w[8];                                                                       \
        deq(row, c << 3, w);                                                              \
        _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                         \
            if (t < nt) {                                                                 \
                const float4* xp = (const float4*)(X + (long long)(t0 + t) * K + (c << 3)); \
                float4 a = xp[0], b = xp[1];                                              \
                acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w               \
                        + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;              \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                             \
        if (t < nt) {                                                                     \
            float s = warp_sum(acc[t]);                                                   \
            if (lane == 0) Y[(long long)(t0 + t) * ldy + n] = bias ? s + bias[n] : s;     \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMV_ROW)

// grid (ceil(N / GEMV_WARPS), ceil(T / GEMV_TOKENS)), block 32 * GEMV_WARPS. K % 8 == 0.
#define ELLM_GEMV(name, deq)                                                              \
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_##name(               \
        const u8* __restrict__ W,        /* (N, row_bytes) */                             \
        long long row_bytes,                                                              \
        const float* __restrict__ X,     /* (T, K) */                                     \
        const float* __restrict__ bias,  /* (N,) or null */                               \
        float* __restrict__ Y,           /* (T, N) */                                     \
        int T, int K, int N) {                                                            \
    int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);                                 \
    if (n >= N) return;                                                                   \
    gemv_row_##name(W + (long long)n * row_bytes, X, bias, Y, T, K, n, N,                 \
                    blockIdx.y * GEMV_TOKENS, threadIdx.x & 31);                          \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMV)

// Three matrices of one type against the same X in one launch (q/k/v, gate/up: fewer
// launches per decode step); N2 = 0 for two. grid (ceil((N0+N1+N2) / GEMV_WARPS), ...).
#define ELLM_GEMV3(name, deq)                                                             \
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv3_##name(              \
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,  \
        long long rb0, long long rb1, long long rb2,                                      \
        const float* __restrict__ b0, const float* __restrict__ b1,                       \
        const float* __restrict__ b2,                                                     \
        float* __restrict__ Y0, float* __restrict__ Y1, float* __restrict__ Y2,           \
        const float* __restrict__ X, int T, int K, int N0, int N1, int N2) {              \
    int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);                                 \
    int t0 = blockIdx.y * GEMV_TOKENS, lane = threadIdx.x & 31;                           \
    if (n < N0) {                                                                         \
        gemv_row_##name(W0 + (long long)n * rb0, X, b0, Y0, T, K, n, N0, t0, lane);       \
    } else if (n < N0 + N1) {                                                             \
        n -= N0;                                                                          \
        gemv_row_##name(W1 + (long long)n * rb1, X, b1, Y1, T, K, n, N1, t0, lane);       \
    } else if (n < N0 + N1 + N2) {                                                        \
        n -= N0 + N1;                                                                     \
        gemv_row_##name(W2 + (long long)n * rb2, X, b2, Y2, T, K, n, N2, t0, lane);       \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMV3)

// ---------------------------------------------------------------------------------
// Tensor-core GEMM. Block tile 64 tokens x 64 outputs, k-step 32; 4 warps, each a
// 32 x 32 quarter = 2 (m16) x 4 (n8) mma tiles. Requires K % 32 == 0.
// ---------------------------------------------------------------------------------
#define GM 64
#define GN 64
#define GK 32
#define GPAD 8   // keeps 32-bit fragment reads aligned and spreads banks

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// grid (ceil(N / GN), ceil(T / GM)), block 128.
#define ELLM_GEMM(name, deq)                                                              \
extern "C" __global__ void __launch_bounds__(128, 4) gemm_##name(                           \
        const u8* __restrict__ W, long long row_bytes,                                    \
        const float* __restrict__ X,     /* (T, K) */                                     \
        const float* __restrict__ bias,  /* (N,) or null */                               \
        float* __restrict__ Y,           /* (T, N) */                                     \
        int T, int K, int N) {                                                            \
    __shared__ __align__(16) u16 As[GM][GK + GPAD];   /* tokens x k, bf16 */              \
    __shared__ __align__(16) u16 Bs[GN][GK + GPAD];   /* outputs x k, bf16 */             \
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;                              \
    int g = lane >> 2, q = lane & 3;                                                      \
    int m0 = blockIdx.y * GM, n0 = blockIdx.x * GN;                                       \
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;                                      \
    float acc[2][4][4];                                                                   \
    _Pragma("unroll") for (int i = 0; i < 2; i++)                                                           \
        _Pragma("unroll") for (int j = 0; j < 4; j++)                                                       \
            _Pragma("unroll") for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;                              \
    for (int k0 = 0; k0 < K; k0 += GK) {                                                  \
        /* X tile: 64 x 32 floats, 8 consecutive per thread, two passes */                \
        _Pragma("unroll") for (int p = 0; p < 2; p++) {                                 \
            int idx = tid + p * 128, r = idx >> 2, c = (idx & 3) * 8;                     \
            u32* dst = (u32*)&As[r][c];                                                   \
            if (m0 + r < T) {                                                             \
                const float4* xp = (const float4*)(X + (long long)(m0 + r) * K + k0 + c); \
                float4 a = xp[0], b = xp[1];                                              \
                dst[0] = pack_bf16x2(a.x, a.y); dst[1] = pack_bf16x2(a.z, a.w);           \
                dst[2] = pack_bf16x2(b.x, b.y); dst[3] = pack_bf16x2(b.z, b.w);           \
            } else {                                                                      \
                dst[0] = dst[1] = dst[2] = dst[3] = 0u;                                   \
            }                                                                             \
        }                                                                                 \
        /* W tile: 64 rows x 32, dequantized 8 at a time */                               \
        _Pragma("unroll") for (int p = 0; p < 2; p++) {                                 \
            int idx = tid + p * 128, r = idx >> 2, c = (idx & 3) * 8;                     \
            u32* dst = (u32*)&Bs[r][c];                                                   \
            if (n0 + r < N) {                                                             \
                float w[8];                                                               \
                deq(W + (long long)(n0 + r) * row_bytes, k0 + c, w);                      \
                dst[0] = pack_bf16x2(w[0], w[1]); dst[1] = pack_bf16x2(w[2], w[3]);       \
                dst[2] = pack_bf16x2(w[4], w[5]); dst[3] = pack_bf16x2(w[6], w[7]);       \
            } else {                                                                      \
                dst[0] = dst[1] = dst[2] = dst[3] = 0u;                                   \
            }                                                                             \
        }                                                                                 \
        __syncthreads();                                                                  \
        _Pragma("unroll") for (int kk = 0; kk < GK; kk += 16) {                                             \
            u32 a[2][4], b[4][2];                                                         \
            _Pragma("unroll") for (int i = 0; i < 2; i++) {                                                 \
                int r = wm + i * 16 + g;                                                  \
                a[i][0] = *(const u32*)&As[r][kk + 2 * q];                                \
                a[i][1] = *(const u32*)&As[r + 8][kk + 2 * q];                            \
                a[i][2] = *(const u32*)&As[r][kk + 2 * q + 8];                            \
                a[i][3] = *(const u32*)&As[r + 8][kk + 2 * q + 8];                        \
            }                                                                             \
            _Pragma("unroll") for (int j = 0; j < 4; j++) {                                                 \
                int r = wn + j * 8 + g;                                                   \
                b[j][0] = *(const u32*)&Bs[r][kk + 2 * q];                                \
                b[j][1] = *(const u32*)&Bs[r][kk + 2 * q + 8];                            \
            }                                                                             \
            _Pragma("unroll") for (int i = 0; i < 2; i++)                                                   \
                _Pragma("unroll") for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);        \
        }                                                                                 \
        __syncthreads();                                                                  \
    }                                                                                     \
    _Pragma("unroll") for (int i = 0; i < 2; i++) {                                                         \
        _Pragma("unroll") for (int j = 0; j < 4; j++) {                                                     \
            int col = n0 + wn + j * 8 + 2 * q;                                            \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                                                 \
                int row = m0 + wm + i * 16 + g + 8 * h;                                   \
                if (row >= T) continue;                                                   \
                _Pragma("unroll") for (int e = 0; e < 2; e++) {                                             \
                    if (col + e < N) {                                                    \
                        float s = acc[i][j][2 * h + e];                                   \
                        Y[(long long)row * N + col + e] = bias ? s + bias[col + e] : s;   \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMM)

// grid T, block 128. ids are checked on the host; an id outside [0, n_rows) gives NaN
// rows rather than a read outside W.
#define ELLM_EMBED(name, deq)                                                             \
extern "C" __global__ void embed_##name(                                                  \
        const u8* __restrict__ W, long long row_bytes, int n_rows,                        \
        const int* __restrict__ ids,     /* (T,) */                                       \
        float* __restrict__ out,         /* (T, K) */                                     \
        int K) {                                                                          \
    int t = blockIdx.x, id = ids[t];                                                      \
    float* o = out + (long long)t * K;                                                    \
    for (int c = threadIdx.x; c < (K >> 3); c += blockDim.x) {                            \
        float w[8];                                                                       \
        if (id >= 0 && id < n_rows) {                                                     \
            deq(W + (long long)id * row_bytes, c << 3, w);                                \
        } else {                                                                          \
            for (int i = 0; i < 8; i++) w[i] = __int_as_float(0x7fc00000);                \
        }                                                                                 \
        for (int i = 0; i < 8; i++) o[(c << 3) + i] = w[i];                               \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_EMBED)
