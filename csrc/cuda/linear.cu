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
        deq(row, K, c << 3, w);                                                           \
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
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 1) gemv_##name(             \
        const u8* __restrict__ W,        /* (N, row_bytes) */                             \
        long long row_bytes,                                                              \
        const float* __restrict__ X,     /* (T, K) */                                     \
        const float* __restrict__ bias,  /* (N,) or null */                               \
        float* __restrict__ Y,           /* (T, N) */                                     \
        int T, int K, int N) {                                                            \
    grid_dependency_sync();                                                               \
    int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);                                 \
    if (n >= N) return;                                                                   \
    gemv_row_##name(W + (long long)n * row_bytes, X, bias, Y, T, K, n, N,                 \
                    blockIdx.y * GEMV_TOKENS, threadIdx.x & 31);                          \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMV)

// Three matrices of one type against the same X in one launch (q/k/v, gate/up: fewer
// launches per decode step); N2 = 0 for two. grid (ceil((N0+N1+N2) / GEMV_WARPS), ...).
#define ELLM_GEMV3(name, deq)                                                             \
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 1) gemv3_##name(            \
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,  \
        long long rb0, long long rb1, long long rb2,                                      \
        const float* __restrict__ b0, const float* __restrict__ b1,                       \
        const float* __restrict__ b2,                                                     \
        float* __restrict__ Y0, float* __restrict__ Y1, float* __restrict__ Y2,           \
        const float* __restrict__ X, int T, int K, int N0, int N1, int N2) {              \
    grid_dependency_sync();                                                               \
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

// grid (ceil(N / GN), ceil(T / GM)), block 128.
#define ELLM_GEMM(name, deq)                                                              \
extern "C" __global__ void __launch_bounds__(128, 4) gemm_##name(                         \
        const u8* __restrict__ W, long long row_bytes,                                    \
        const float* __restrict__ X,     /* (T, K) */                                     \
        const float* __restrict__ bias,  /* (N,) or null */                               \
        float* __restrict__ Y,           /* (T, N) */                                     \
        int T, int K, int N) {                                                            \
    grid_dependency_sync();                                                               \
    __shared__ __align__(16) u16 As[GM][GK + GPAD];   /* tokens x k, bf16 */              \
    __shared__ __align__(16) u16 Bs[GN][GK + GPAD];   /* outputs x k, bf16 */             \
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;                              \
    int g = lane >> 2, q = lane & 3;                                                      \
    int m0 = blockIdx.y * GM, n0 = blockIdx.x * GN;                                       \
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;                                      \
    float acc[2][4][4];                                                                   \
    _Pragma("unroll") for (int i = 0; i < 2; i++)                                         \
        _Pragma("unroll") for (int j = 0; j < 4; j++)                                     \
            _Pragma("unroll") for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;            \
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
                deq(W + (long long)(n0 + r) * row_bytes, K, k0 + c, w);                   \
                dst[0] = pack_bf16x2(w[0], w[1]); dst[1] = pack_bf16x2(w[2], w[3]);       \
                dst[2] = pack_bf16x2(w[4], w[5]); dst[3] = pack_bf16x2(w[6], w[7]);       \
            } else {                                                                      \
                dst[0] = dst[1] = dst[2] = dst[3] = 0u;                                   \
            }                                                                             \
        }                                                                                 \
        __syncthreads();                                                                  \
        _Pragma("unroll") for (int kk = 0; kk < GK; kk += 16) {                           \
            u32 a[2][4], b[4][2];                                                         \
            _Pragma("unroll") for (int i = 0; i < 2; i++) {                               \
                int r = wm + i * 16 + g;                                                  \
                a[i][0] = *(const u32*)&As[r][kk + 2 * q];                                \
                a[i][1] = *(const u32*)&As[r + 8][kk + 2 * q];                            \
                a[i][2] = *(const u32*)&As[r][kk + 2 * q + 8];                            \
                a[i][3] = *(const u32*)&As[r + 8][kk + 2 * q + 8];                        \
            }                                                                             \
            _Pragma("unroll") for (int j = 0; j < 4; j++) {                               \
                int r = wn + j * 8 + g;                                                   \
                b[j][0] = *(const u32*)&Bs[r][kk + 2 * q];                                \
                b[j][1] = *(const u32*)&Bs[r][kk + 2 * q + 8];                            \
            }                                                                             \
            _Pragma("unroll") for (int i = 0; i < 2; i++)                                 \
                _Pragma("unroll") for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j]); \
        }                                                                                 \
        __syncthreads();                                                                  \
    }                                                                                     \
    _Pragma("unroll") for (int i = 0; i < 2; i++) {                                       \
        _Pragma("unroll") for (int j = 0; j < 4; j++) {                                   \
            int col = n0 + wn + j * 8 + 2 * q;                                            \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                               \
                int row = m0 + wm + i * 16 + g + 8 * h;                                   \
                if (row >= T) continue;                                                   \
                _Pragma("unroll") for (int e = 0; e < 2; e++) {                           \
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
    grid_dependency_sync();                                                               \
    int t = blockIdx.x, id = ids[t];                                                      \
    float* o = out + (long long)t * K;                                                    \
    for (int c = threadIdx.x; c < (K >> 3); c += blockDim.x) {                            \
        float w[8];                                                                       \
        if (id >= 0 && id < n_rows) {                                                     \
            deq(W + (long long)id * row_bytes, K, c << 3, w);                             \
        } else {                                                                          \
            for (int i = 0; i < 8; i++) w[i] = __int_as_float(0x7fc00000);                \
        }                                                                                 \
        for (int i = 0; i < 8; i++) o[(c << 3) + i] = w[i];                               \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_EMBED)

// out (N, K) bf16 = W dequantized and rounded to nearest even: the input cuBLAS takes for
// a prefill product (ops/cuda.py), the same rounding gemm_<type> does in shared memory.
// grid ceil(N * K / 8 / 256), block 256.
#define ELLM_DEQUANT_BF16(name, deq)                                                      \
extern "C" __global__ void dequant_bf16_##name(                                           \
        const u8* __restrict__ W, long long row_bytes, u16* __restrict__ out, int N, int K) { \
    grid_dependency_sync();                                                               \
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x, per_row = K >> 3;     \
    if (c >= (long long)N * per_row) return;                                              \
    long long n = c / per_row;                                                            \
    int k0 = (int)(c - n * per_row) << 3;                                                 \
    float w[8];                                                                           \
    deq(W + n * row_bytes, K, k0, w);                                                     \
    u32* o = (u32*)(out + n * K + k0);                                                    \
    _Pragma("unroll") for (int i = 0; i < 4; i++) o[i] = pack_bf16x2(w[2 * i], w[2 * i + 1]); \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_DEQUANT_BF16)

// ---------------------------------------------------------------------------------
// Fused decode kernels (up to GEMM_MIN_TOKENS tokens; ops/reference.py says what each
// means: norm_linear_multi, norm_linear_glu, linear_add, norm_qkv_rope_write). One warp
// per output row (or pair of rows), FUSED_WARPS rows a block, GEMV_TOKENS tokens sharing
// one read of a row, f32 accumulation in an order fixed per output element.
//
// The RMSNorm of the input is folded in: each warp sums the squares of its tokens' rows
// from the loads its products make (a fixed order per token: lane-strided chunks of 8,
// then the warp's butterfly), the products run on x * norm_weight, and the dot is scaled
// by 1 / sqrt(mean(x^2) + eps) at the end: no pass over the input of its own, no barrier.
// With a null norm weight the input is taken as it is.
// ---------------------------------------------------------------------------------
#define FUSED_WARPS 4   // rows (or rotated pairs) a block: more blocks for batch 1

// 1 / sqrt(mean(x^2) + eps) from a lane's share of a token's sum of squares (the same
// bits in every lane), or 1 without a norm.
__device__ __forceinline__ float warp_inv_rms(float ss, bool norm, int K, float eps) {
    if (!norm) return 1.0f;   // uniform across the warp
    return 1.0f / sqrtf(warp_sum(ss) / (float)K + eps);
}

// acc0[t] (+ acc1[t] when row1) += this lane's share of row . (x[t0 + t] * g) for t < nt;
// with a norm weight, ss[t] += its share of x[t0 + t]'s sum of squares.
#define ELLM_DOT2(name, deq)                                                              \
__device__ __forceinline__ void dot2_##name(                                              \
        const u8* __restrict__ row0, const u8* __restrict__ row1,                         \
        const float* __restrict__ X, const float* __restrict__ g,                         \
        int K, int t0, int nt, int lane, float* acc0, float* acc1, float* ss) {           \
    for (int c = lane; c < (K >> 3); c += 32) {                                           \
        float w0[8], w1[8], gs[8];                                                        \
        deq(row0, K, c << 3, w0);                                                         \
        if (row1) deq(row1, K, c << 3, w1);                                               \
        if (g) {                                                                          \
            const float4* gp = (const float4*)(g + (c << 3));                             \
            float4 a = gp[0], b = gp[1];                                                  \
            gs[0] = a.x; gs[1] = a.y; gs[2] = a.z; gs[3] = a.w;                           \
            gs[4] = b.x; gs[5] = b.y; gs[6] = b.z; gs[7] = b.w;                           \
        }                                                                                 \
        _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                         \
            if (t < nt) {                                                                 \
                const float4* xp = (const float4*)(X + (long long)(t0 + t) * K + (c << 3)); \
                float4 a = xp[0], b = xp[1];                                              \
                float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};                    \
                if (g) {                                                                  \
                    float sq = 0.0f;                                                      \
                    _Pragma("unroll") for (int i = 0; i < 8; i++) sq = fmaf(x[i], x[i], sq); \
                    ss[t] += sq;                                                          \
                    _Pragma("unroll") for (int i = 0; i < 8; i++) x[i] *= gs[i];          \
                }                                                                         \
                acc0[t] += w0[0] * x[0] + w0[1] * x[1] + w0[2] * x[2] + w0[3] * x[3]      \
                         + w0[4] * x[4] + w0[5] * x[5] + w0[6] * x[6] + w0[7] * x[7];     \
                if (row1)                                                                 \
                    acc1[t] += w1[0] * x[0] + w1[1] * x[1] + w1[2] * x[2] + w1[3] * x[3]  \
                             + w1[4] * x[4] + w1[5] * x[5] + w1[6] * x[6] + w1[7] * x[7]; \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_DOT2)

// One warp: Y[t][n] = (row . (x[t] * g)) / rms(x[t]) (+ bias[n]).
#define ELLM_NMV_ROW(name, deq)                                                           \
__device__ __forceinline__ void nmv_row_##name(                                           \
        const u8* __restrict__ row, const float* __restrict__ X, const float* __restrict__ g, \
        float eps, const float* __restrict__ bias, float* __restrict__ Y,                 \
        int K, int n, int ldy, int t0, int nt, int lane) {                                \
    float acc[GEMV_TOKENS], unused[GEMV_TOKENS], ss[GEMV_TOKENS];                         \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = unused[t] = ss[t] = 0.0f; \
    dot2_##name(row, nullptr, X, g, K, t0, nt, lane, acc, unused, ss);                    \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                             \
        if (t < nt) {                                                                     \
            float s = warp_sum(acc[t]) * warp_inv_rms(ss[t], g, K, eps);                  \
            if (lane == 0) Y[(long long)(t0 + t) * ldy + n] = bias ? s + bias[n] : s;     \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_NMV_ROW)

// Norm + up to three products (q/k/v without RoPE, or any parts of one type): Yi (T, Ni)
// = rmsnorm(X) @ Wi^T (+ bi). grid (ceil((N0+N1+N2) / FUSED_WARPS), ceil(T / GEMV_TOKENS)),
// block 32 * FUSED_WARPS. K % 8 == 0.
#define ELLM_NMV3(name, deq)                                                              \
extern "C" __global__ void __launch_bounds__(32 * FUSED_WARPS, 1) nmv3_##name(            \
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,  \
        long long rb0, long long rb1, long long rb2,                                      \
        const float* __restrict__ b0, const float* __restrict__ b1,                       \
        const float* __restrict__ b2,                                                     \
        float* __restrict__ Y0, float* __restrict__ Y1, float* __restrict__ Y2,           \
        const float* __restrict__ X, const float* __restrict__ g, float eps,              \
        int T, int K, int N0, int N1, int N2) {                                           \
    grid_dependency_sync();                                                               \
    int t0 = blockIdx.y * GEMV_TOKENS, nt = min(GEMV_TOKENS, T - t0), lane = threadIdx.x & 31; \
    int n = blockIdx.x * FUSED_WARPS + (threadIdx.x >> 5);                                \
    if (n < N0) {                                                                         \
        nmv_row_##name(W0 + (long long)n * rb0, X, g, eps, b0, Y0, K, n, N0, t0, nt, lane); \
    } else if (n < N0 + N1) {                                                             \
        n -= N0;                                                                          \
        nmv_row_##name(W1 + (long long)n * rb1, X, g, eps, b1, Y1, K, n, N1, t0, nt, lane); \
    } else if (n < N0 + N1 + N2) {                                                        \
        n -= N0 + N1;                                                                     \
        nmv_row_##name(W2 + (long long)n * rb2, X, g, eps, b2, Y2, K, n, N2, t0, nt, lane); \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_NMV3)

// Norm + gate/up + activation: out (T, F) = act(h @ Wg^T + bg) * (h @ Wu^T + bu), h =
// rmsnorm(X); act 0 = silu, 1 = gelu_tanh (elementwise.cu's formulas). grid
// (ceil(F / FUSED_WARPS), ceil(T / GEMV_TOKENS)), block 32 * FUSED_WARPS.
#define ELLM_GLU(name, deq)                                                               \
extern "C" __global__ void __launch_bounds__(32 * FUSED_WARPS, 1) glu_##name(             \
        const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long rbg, long long rbu, \
        const float* __restrict__ bg, const float* __restrict__ bu,                       \
        const float* __restrict__ X, const float* __restrict__ g, float eps,              \
        float* __restrict__ out, int T, int K, int F, int act) {                          \
    grid_dependency_sync();                                                               \
    int t0 = blockIdx.y * GEMV_TOKENS, nt = min(GEMV_TOKENS, T - t0), lane = threadIdx.x & 31; \
    int n = blockIdx.x * FUSED_WARPS + (threadIdx.x >> 5);                                \
    if (n >= F) return;                                                                   \
    float ag[GEMV_TOKENS], au[GEMV_TOKENS], ss[GEMV_TOKENS];                              \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) ag[t] = au[t] = ss[t] = 0.0f; \
    dot2_##name(Wg + (long long)n * rbg, Wu + (long long)n * rbu, X, g, K, t0, nt, lane, ag, au, ss); \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                             \
        if (t < nt) {                                                                     \
            float inv = warp_inv_rms(ss[t], g, K, eps);                                   \
            float a = warp_sum(ag[t]) * inv, u = warp_sum(au[t]) * inv;                   \
            if (bg) a += bg[n];                                                           \
            if (bu) u += bu[n];                                                           \
            float y;                                                                      \
            if (act == 0) {                                                               \
                y = a / (1.0f + expf(-a)) * u;                                            \
            } else {                                                                      \
                const float c = 0.7978845608028654f;   /* sqrt(2 / pi) */                 \
                y = 0.5f * a * (1.0f + tanhf(c * (a + 0.044715f * a * a * a))) * u;      \
            }                                                                             \
            if (lane == 0) out[(long long)(t0 + t) * F + n] = y;                          \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GLU)

// Y (T, N) += X @ W^T (+ bias): a product whose result goes straight into the residual
// stream (o_proj, down_proj). grid (ceil(N / FUSED_WARPS), ceil(T / GEMV_TOKENS)).
#define ELLM_GEMV_ADD(name, deq)                                                          \
extern "C" __global__ void __launch_bounds__(32 * FUSED_WARPS, 1) gemv_add_##name(        \
        const u8* __restrict__ W, long long row_bytes,                                    \
        const float* __restrict__ X, const float* __restrict__ bias,                      \
        float* __restrict__ Y, int T, int K, int N) {                                     \
    grid_dependency_sync();                                                               \
    int n = blockIdx.x * FUSED_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;       \
    int t0 = blockIdx.y * GEMV_TOKENS, nt = min(GEMV_TOKENS, T - t0);                     \
    if (n >= N) return;                                                                   \
    float acc[GEMV_TOKENS], unused[GEMV_TOKENS];                                          \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = unused[t] = 0.0f;    \
    dot2_##name(W + (long long)n * row_bytes, nullptr, X, nullptr, K, t0, nt, lane, acc, unused, unused); \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                             \
        if (t < nt) {                                                                     \
            float s = warp_sum(acc[t]);                                                   \
            if (lane == 0) {                                                              \
                float* y = Y + (long long)(t0 + t) * N + n;                               \
                *y += bias ? s + bias[n] : s;                                             \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_GEMV_ADD)

// Norm + q/k/v + RoPE + paged KV write: h = rmsnorm(X); q = h Wq^T + bq rotated into
// q_out (T, nh, hd); k = h Wk^T + bk rotated and v = h Wv^T + bv stored in their cache
// slot (f32, or bf16 when kv_bf16: rounded to nearest even). RoPE as ops/reference.py
// rope: dims < 2 n_rot rotate in pairs (2i, 2i+1) when interleaved, else (i, i + n_rot),
// cos and sin of pos * inv_freq[i] times mscale; the rest pass through. A warp computes
// a task (common.cuh qkv_task: both rows of a rotated pair, or one row) and stores it
// through qkv_rope_store. Tokens whose block-table entry is -1 (the padding rows of a
// captured batch) write no cache slot. grid (ceil(tasks / FUSED_WARPS), ceil(T /
// GEMV_TOKENS)), block 32 * FUSED_WARPS.
#define ELLM_QKV_ROPE(name, deq)                                                          \
extern "C" __global__ void __launch_bounds__(32 * FUSED_WARPS, 1) qkv_rope_##name(        \
        ELLM_QKV_ROPE_PARAMS) {                                                           \
    grid_dependency_sync();                                                               \
    int t0 = blockIdx.y * GEMV_TOKENS, nt = min(GEMV_TOKENS, T - t0), lane = threadIdx.x & 31; \
    QkvTask k = qkv_task(blockIdx.x * FUSED_WARPS + (threadIdx.x >> 5), nh, nkv, hd, n_rot, interleaved); \
    if (k.which < 0) return;                                                              \
    const u8* W = k.which == 0 ? Wq : k.which == 1 ? Wk : Wv;                             \
    long long rb = k.which == 0 ? rbq : k.which == 1 ? rbk : rbv;                         \
    float a0[GEMV_TOKENS], a1[GEMV_TOKENS], ss[GEMV_TOKENS];                              \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) a0[t] = a1[t] = ss[t] = 0.0f; \
    dot2_##name(W + (long long)(k.head * hd + k.d0) * rb,                                 \
                k.d1 >= 0 ? W + (long long)(k.head * hd + k.d1) * rb : nullptr, X, g, K,  \
                t0, nt, lane, a0, a1, ss);                                                \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                             \
        if (t >= nt) continue;                                                            \
        float inv = warp_inv_rms(ss[t], g, K, eps);                                       \
        float x0 = warp_sum(a0[t]) * inv;                                                 \
        float x1 = k.d1 >= 0 ? warp_sum(a1[t]) * inv : 0.0f;                              \
        if (lane == 0) qkv_rope_store(k, t0 + t, x0, x1, ELLM_QKV_ROPE_STORE_ARGS);       \
    }                                                                                     \
}
ELLM_FOR_EACH_WEIGHT_TYPE(ELLM_QKV_ROPE)
