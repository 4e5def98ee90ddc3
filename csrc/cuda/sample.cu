// Token sampling on the device: one block per sequence row of logits, so only the chosen
// token ids cross the bus. The order of operations is engine/sampler.py's:
//   logit_bias; repetition penalty (prompt + output tokens), frequency / presence
//   penalties (output counts); greedy (argmax, first index on ties) when inv_temp == 0
//   or top_k == 1; otherwise temperature, min-p, top-k, top-p, one inverse-CDF draw.
// Differences from the CPU sampler (docs/gpu.md): the uniform comes from a counter-based
// hash of (seed, step) instead of numpy's PCG64, so a seeded request is reproducible on
// the GPU but draws other tokens than on the CPU; tokens tied with the k-th (top-k) or
// the last nucleus token (top-p) are all kept; the draw walks the kept tokens in index
// order. Greedy is the same as on the CPU.
#include "common.cuh"

#define SAMPLE_THREADS 1024

// float -> u32 whose unsigned order is the float order (NaN excluded)
__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__device__ float block_reduce_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (SAMPLE_THREADS / 32) ? sh[lane] : 0.0f;
    return warp_sum(v);
}

__device__ int block_reduce_count(int v, int* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (SAMPLE_THREADS / 32) ? sh[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// grid B, block SAMPLE_THREADS. logits are scratch: the penalties are applied in place.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
        float* __restrict__ logits,             // (B, V)
        int V,
        const float* __restrict__ inv_temp,     // (B,) 0: greedy
        const int* __restrict__ top_k,          // (B,) 0: off
        const float* __restrict__ top_p,        // (B,) 0 or >= 1: off
        const float* __restrict__ log_min_p,    // (B,) -inf: off
        const float* __restrict__ rep_penalty,  // (B,) 1: off
        const float* __restrict__ freq_penalty, // (B,)
        const float* __restrict__ pres_penalty, // (B,)
        const int* __restrict__ bias_offsets,   // (B + 1,) rows of bias_ids / bias_vals
        const int* __restrict__ bias_ids,
        const float* __restrict__ bias_vals,
        const int* __restrict__ pen_offsets,    // (B + 1,) rows of pen_ids / pen_counts
        const int* __restrict__ pen_ids,        // distinct ids seen (prompt + output)
        const float* __restrict__ pen_counts,   // times each was generated (0: prompt only)
        const u64* __restrict__ seeds,          // (B,)
        u64* __restrict__ steps,                // (B,) draws so far; incremented
        int* __restrict__ out_ids) {            // (B,)
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ float s_best;
    __shared__ int s_best_id, s_found;
    __shared__ float s_prefix[SAMPLE_THREADS];
    int b = blockIdx.x, tid = threadIdx.x;
    float* x = logits + (long long)b * V;

    for (int i = bias_offsets[b] + tid; i < bias_offsets[b + 1]; i += SAMPLE_THREADS)
        x[bias_ids[i]] += bias_vals[i];
    __syncthreads();
    float rp = rep_penalty[b], fp = freq_penalty[b], pp = pres_penalty[b];
    for (int i = pen_offsets[b] + tid; i < pen_offsets[b + 1]; i += SAMPLE_THREADS) {
        float v = x[pen_ids[i]], cnt = pen_counts[i];
        if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
        if (cnt > 0.0f) v -= fp * cnt + pp;
        x[pen_ids[i]] = v;
    }
    __syncthreads();

    // the maximum and its first index
    float best = ELLM_NEG_INF;
    int best_id = 0x7fffffff;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        float v = x[i];
        if (v > best) { best = v; best_id = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
        if (ov > best || (ov == best && oi < best_id)) { best = ov; best_id = oi; }
    }
    if (tid == 0) { s_best = ELLM_NEG_INF; s_best_id = 0x7fffffff; }
    __syncthreads();
    if ((tid & 31) == 0) { shf[tid >> 5] = best; shi[tid >> 5] = best_id; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 0; w < SAMPLE_THREADS / 32; w++)
            if (shf[w] > s_best || (shf[w] == s_best && shi[w] < s_best_id)) { s_best = shf[w]; s_best_id = shi[w]; }
    }
    __syncthreads();
    float mx = s_best;
    int argmax = s_best_id == 0x7fffffff ? 0 : s_best_id;
    float it = inv_temp[b];
    int k = top_k[b];
    if (it == 0.0f || k == 1) {
        if (tid == 0) out_ids[b] = argmax;
        return;
    }

    // min-p: p_i >= min_p p_max  <=>  x_i >= mx + log(min_p) / inv_temp
    float lo = log_min_p[b] == ELLM_NEG_INF ? ELLM_NEG_INF : mx + log_min_p[b] / it;
    u32 floor_key = order_key(lo);
    // top-k: the largest key with at least k entries at or above it (bisection on bits)
    if (k > 0 && k < V) {
        u32 a = floor_key, c = order_key(mx);
        while (a < c) {
            u32 mid = a + (c - a + 1) / 2;
            float thr = key_float(mid);
            int n = 0;
            for (int i = tid; i < V; i += SAMPLE_THREADS) n += x[i] >= thr;
            n = block_reduce_count(n, shi);
            if (n >= k) a = mid; else c = mid - 1;
        }
        floor_key = a;
    }
    float floor_v = key_float(floor_key);
    float total = 0.0f;
    for (int i = tid; i < V; i += SAMPLE_THREADS)
        if (x[i] >= floor_v) total += expf((x[i] - mx) * it);
    total = block_reduce_sum(total, shf);
    // top-p: the largest threshold whose mass at or above it reaches top_p * total
    float tp = top_p[b];
    if (tp > 0.0f && tp < 1.0f) {
        u32 a = floor_key, c = order_key(mx);
        float need = tp * total;
        while (a < c) {
            u32 mid = a + (c - a + 1) / 2;
            float thr = key_float(mid), m = 0.0f;
            for (int i = tid; i < V; i += SAMPLE_THREADS)
                if (x[i] >= thr) m += expf((x[i] - mx) * it);
            m = block_reduce_sum(m, shf);
            if (m >= need) a = mid; else c = mid - 1;
        }
        floor_v = key_float(a);
    }

    // the draw: contiguous slices per thread, a prefix over the slices, one walk
    int per = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    int i0 = tid * per, i1 = min(V, i0 + per);
    float mine = 0.0f;
    for (int i = i0; i < i1; i++)
        if (x[i] >= floor_v) mine += expf((x[i] - mx) * it);
    s_prefix[tid] = mine;
    if (tid == 0) s_found = 0x7fffffff;
    __syncthreads();
    for (int off = 1; off < SAMPLE_THREADS; off <<= 1) {   // inclusive scan (Hillis-Steele)
        float add = tid >= off ? s_prefix[tid - off] : 0.0f;
        __syncthreads();
        s_prefix[tid] += add;
        __syncthreads();
    }
    float kept = s_prefix[SAMPLE_THREADS - 1];
    u64 r = splitmix64(seeds[b] ^ splitmix64(steps[b]));
    float target = (float)((double)(r >> 11) * (1.0 / 9007199254740992.0)) * kept;
    float before = tid ? s_prefix[tid - 1] : 0.0f;
    if (mine > 0.0f && target >= before && target < before + mine) {
        float acc = before;
        int pick = -1, last = -1;
        for (int i = i0; i < i1; i++) {
            if (x[i] >= floor_v) {
                last = i;
                acc += expf((x[i] - mx) * it);
                if (target < acc) { pick = i; break; }
            }
        }
        atomicMin(&s_found, pick >= 0 ? pick : last);
    }
    __syncthreads();
    if (tid == 0) {
        out_ids[b] = s_found == 0x7fffffff ? argmax : s_found;
        steps[b] += 1;
    }
}
