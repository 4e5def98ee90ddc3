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

// ---------------------------------------------------------------------------------
// Mixture of experts on the device (ops/cuda.py CudaOps.moe, decode steps): moe_route
// chooses each token's experts and lays the (token, expert) entries out by expert, so
// that moe.cu's products read each chosen expert once for all of its tokens; then
// moe_combine sums each token's experts' outputs. reference.moe_route / moe_experts are
// the meaning. Every token's result depends on its own logits and rows only: the same
// bits in a batch of 1 or of 64.
// ---------------------------------------------------------------------------------

#define MOE_ROUTE_THREADS 32    // a warp a token
#define MOE_EXPERTS_MAX 4096   // = models/qwen3_moe.py's bound on num_experts
#define MOE_ENTRIES_MAX 4096   // a decode step's 64 tokens x up to 64 experts (qwen3_moe.py's bound on k)

// Block t: softmax over token t's E router logits, its k most probable experts (most
// probable first, ties to the lower id: a key of probability over the complement of the
// id, so no two keys tie) and their probabilities (divided by their sum in that order
// when norm), into ids and wts (T, k); the softmax's sum in an order fixed by E. The last
// block to finish (done: a counter it leaves at 0) then lays the entries out by expert:
// slots = the chosen experts in ascending id (-1 past their count), starts (slots + 1) the
// first entry of each in that order (the rest T k), rows (T k) each entry's token, tokens
// in order within an expert; and per token its k entries in ascending expert id: at (T, k)
// in pos, their weights in wpos. grid T, block MOE_ROUTE_THREADS; T k <= MOE_ENTRIES_MAX,
// E <= MOE_EXPERTS_MAX, nslots = min(E, T k).
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route_f32(
        const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wts,
        int* __restrict__ slots, int* __restrict__ starts, int* __restrict__ rows,
        int* __restrict__ pos, float* __restrict__ wpos, int* done, int T, int E, int k, int nslots,
        int norm) {
    __shared__ int at[MOE_EXPERTS_MAX];   // an expert's entry count, then its next entry
    __shared__ int chose[MOE_ENTRIES_MAX];   // the last block's copy of ids
    __shared__ int last;
    grid_dependency_sync();
    int lane = threadIdx.x, t = blockIdx.x;
    const float* l = logits + (long long)t * E;
    float mx = ELLM_NEG_INF;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, l[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < E; i += 32) sum += expf(l[i] - mx);
    sum = warp_sum(sum);   // a butterfly: the same bits in every lane
    u64 below = ~0ull;     // the previous choice's key
    float chosen = 0.0f;
    for (int j = 0; j < k; j++) {
        u64 best = 0ull;
        for (int i = lane; i < E; i += 32) {
            float p = expf(l[i] - mx) / sum;
            u64 key = ((u64)(p == p ? order_key(p) : 0u) << 32) | (u64)(0xffffffffu - (u32)i);
            if (key < below && key > best) best = key;
        }
        best = warp_max_u64(best);
        below = best;
        int e = (int)(0xffffffffu - (u32)best);
        float p = expf(l[e] - mx) / sum;   // the bits its key was made of
        chosen += p;
        if (lane == 0) { ids[t * k + j] = e; wts[t * k + j] = p; }
    }
    if (norm && lane == 0)
        for (int j = 0; j < k; j++) wts[t * k + j] = wts[t * k + j] / chosen;
    if (!last_block_to_finish(done, T, &last)) return;
    // the last block: every token's choices are in
    int n = T * k;
    for (int e = lane; e < E; e += 32) at[e] = 0;
    for (int q = lane; q < n; q += 32) chose[q] = ids[q];
    __syncthreads();
    for (int q = lane; q < n; q += 32) atomicAdd(&at[chose[q]], 1);
    __syncthreads();
    int before = 0, used = 0;   // the chosen experts in ascending id, each's first entry: a scan
    for (int base = 0; base < E; base += 32) {
        int e = base + lane, c = e < E ? at[e] : 0;
        int sc = warp_inclusive_sum(c), su = warp_inclusive_sum((int)(c > 0));   // of the counts, of the chosen
        if (c > 0) {
            slots[used + su - 1] = e;
            starts[used + su - 1] = before + sc - c;
        }
        if (e < E) at[e] = before + sc - c;   // its next entry
        before += __shfl_sync(0xffffffffu, sc, 31);
        used += __shfl_sync(0xffffffffu, su, 31);
    }
    for (int s = used + lane; s < nslots; s += 32) slots[s] = -1;
    for (int s = used + lane; s <= nslots; s += 32) starts[s] = n;
    __syncwarp();
    // the entries 32 at a time, in order (token by token): an entry goes after its expert's
    // entries of the rounds before and of the lanes below it with that expert, so each
    // expert's entries stay in token order; the group's highest lane moves the expert on
    for (int base = 0; base < n; base += 32) {
        int q = base + lane, e = q < n ? chose[q] : -1 - lane;   // (a lane past n matches none)
        unsigned peers = __match_any_sync(0xffffffffu, e);
        int p = q < n ? at[e] + __popc(peers & ((1u << lane) - 1u)) : 0;
        __syncwarp();
        if (q < n) {
            rows[p] = q / k;
            pos[q] = p;
            if ((peers >> lane) == 1u) at[e] = p + 1;
        }
        __syncwarp();
    }
    for (int u = lane; u < T; u += 32) {   // a token's entries by position = by expert id
        int* ps = pos + u * k;
        float* ws = wpos + u * k;
        for (int j = 0; j < k; j++) ws[j] = wts[u * k + j];
        for (int j = 1; j < k; j++) {
            int p = ps[j];
            float w = ws[j];
            int i = j - 1;
            for (; i >= 0 && ps[i] > p; i--) { ps[i + 1] = ps[i]; ws[i + 1] = ws[i]; }
            ps[i + 1] = p;
            ws[i + 1] = w;
        }
    }
    if (lane == 0) *done = 0;   // ready for the next launch
}

// out[t] = the sum over token t's k entries, in ascending expert id (route's pos and
// wpos), of weight * y[entry] (y: moe.cu's down products, rows in entry order), from 0 as
// reference.moe_experts adds them; with add, out[t] += that sum (the residual's add).
// grid T, block 256.
extern "C" __global__ void moe_combine_f32(float* __restrict__ out, const float* __restrict__ y,
                                           const int* __restrict__ pos, const float* __restrict__ wpos,
                                           int k, int H, int add) {
    grid_dependency_sync();
    int t = blockIdx.x;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += wpos[t * k + j] * y[(long long)pos[t * k + j] * H + h];
        float* o = out + (long long)t * H + h;
        *o = add ? *o + acc : acc;
    }
}
