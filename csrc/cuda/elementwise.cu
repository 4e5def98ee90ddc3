// Row-wise and element-wise ops on f32 activations (ops/reference.py has their meaning):
// RMSNorm, residual add + RMSNorm, RMSNorm + residual add, SwiGLU, GeGLU, soft-capping,
// scaling, adding, and the gather of chosen rows (the rows whose logits are wanted).
#include "common.cuh"

// grid rows, block NORM_THREADS. out may be x (in place).
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_f32(
        const float* __restrict__ x,      // (rows, H)
        const float* __restrict__ w,      // (H,)
        float* out,                       // (rows, H)
        int H, float eps) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * H;
    float* o = out + (long long)blockIdx.x * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) ss += xr[i] * xr[i];
    float denom = sqrtf(block_sum(ss, scratch) / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) o[i] = (xr[i] / denom) * w[i];
}

// residual += x; out = rmsnorm(residual). grid rows, block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rmsnorm_f32(
        float* __restrict__ residual,     // (rows, H), updated
        const float* __restrict__ x,      // (rows, H)
        const float* __restrict__ w,      // (H,)
        float* __restrict__ out,          // (rows, H)
        int H, float eps) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    float* r = residual + (long long)blockIdx.x * H;
    const float* xr = x + (long long)blockIdx.x * H;
    float* o = out + (long long)blockIdx.x * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) {
        float v = r[i] + xr[i];
        r[i] = v;
        ss += v * v;
    }
    float denom = sqrtf(block_sum(ss, scratch) / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) o[i] = (r[i] / denom) * w[i];
}

// residual += scale * rmsnorm(x) (w null: scale * x): a block's post norm and residual
// multiplier with its residual add in one launch (Gemma 2/3, OLMo 2, Granite:
// ops/fused_stack.py). grid rows, block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_add_f32(
        float* __restrict__ residual,     // (rows, H), updated
        const float* __restrict__ x,      // (rows, H)
        const float* __restrict__ w,      // (H,) or null
        int H, float eps, float scale) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    float* r = residual + (long long)blockIdx.x * H;
    const float* xr = x + (long long)blockIdx.x * H;
    if (!w) {
        for (int i = threadIdx.x; i < H; i += NORM_THREADS) r[i] += xr[i] * scale;
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) ss += xr[i] * xr[i];
    float denom = sqrtf(block_sum(ss, scratch) / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) r[i] += ((xr[i] / denom) * w[i]) * scale;
}

// out = silu(gate) * up over n elements (out may be gate: models/blocks.py MLP).
extern "C" __global__ void swiglu_f32(const float* gate, const float* __restrict__ up,
                                      float* out, long long n) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out = gelu_tanh(gate) * up over n elements (out may be gate).
extern "C" __global__ void geglu_f32(const float* gate, const float* __restrict__ up,
                                     float* out, long long n) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        const float c = 0.7978845608028654f;   // sqrt(2 / pi)
        out[i] = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * up[i];
    }
}

// x = cap * tanh(x / cap), in place.
extern "C" __global__ void softcap_f32(float* x, long long n, float cap) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// x *= s, in place.
extern "C" __global__ void scale_f32(float* x, long long n, float s) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// a += b, in place.
extern "C" __global__ void add_f32(float* __restrict__ a, const float* __restrict__ b, long long n) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}

// out = bf16(x), round to nearest even (the input of a cuBLAS product).
extern "C" __global__ void to_bf16_f32(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}

// y (rows, N) += bias (N,) on every row; n = rows * N.
extern "C" __global__ void add_bias_rows_f32(float* __restrict__ y, const float* __restrict__ bias, long long n,
                                             int N) {
    grid_dependency_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += bias[i % N];
}

// out[r] = x[rows[r]]; grid R, block 256.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x,   // (T, H)
                                           const int* __restrict__ rows,  // (R,)
                                           float* __restrict__ out,       // (R, H)
                                           int H) {
    grid_dependency_sync();
    const float* src = x + (long long)rows[blockIdx.x] * H;
    float* dst = out + (long long)blockIdx.x * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
}

// out[rows[r]] += w[r] * h[r] (one expert's MLP outputs into their tokens' rows; a token
// picks an expert once, so the rows of one launch are distinct). grid R, block 256.
extern "C" __global__ void scatter_add_rows_f32(float* __restrict__ out,        // (T, H)
                                                const int* __restrict__ rows,   // (R,)
                                                const float* __restrict__ w,    // (R,)
                                                const float* __restrict__ h,    // (R, H)
                                                int H) {
    grid_dependency_sync();
    float* dst = out + (long long)rows[blockIdx.x] * H;
    const float* src = h + (long long)blockIdx.x * H;
    float s = w[blockIdx.x];
    for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] += s * src[i];
}

// x[rows[r]] = values[r] (rows distinct: image embeddings into the batch's rows).
// grid R, block 256.
extern "C" __global__ void scatter_rows_f32(float* __restrict__ x,             // (T, H)
                                            const int* __restrict__ rows,      // (R,)
                                            const float* __restrict__ values,  // (R, H)
                                            int H) {
    grid_dependency_sync();
    float* dst = x + (long long)rows[blockIdx.x] * H;
    const float* src = values + (long long)blockIdx.x * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
}
