// LoRA adapters over a shared base (ops/reference.py lora_add has their meaning): for each
// row t of slot s = slots[t] >= 0 whose adapter changes this projection,
// y[t, n] += scale_s * sum_j B_s[n, j] * (A_s[j] . x[t]).
// Every adapter's factors of one projection lie in two flat arrays (a_all, b_all) at the
// offsets of their slot. Each output element is summed in one fixed order (A rows by a warp
// over K, then B's r terms in order), whatever the batch holds: batch invariance.
#include "common.cuh"

#define LORA_WARPS 4
#define LORA_THREADS 256

// grid (T, ceil(max_rank / LORA_WARPS)), block 32 * LORA_WARPS: u[t, j] = A_s[j] . x[t].
extern "C" __global__ void __launch_bounds__(32 * LORA_WARPS) lora_shrink_f32(
        const float* __restrict__ x,          // (T, K)
        const int* __restrict__ slots,        // (T,) -1: none
        const float* __restrict__ a_all,      // every slot's A (rank_s, K), at a_off[s]
        const long long* __restrict__ a_off,  // (S,)
        const int* __restrict__ ranks,        // (S,) 0: the slot leaves this projection alone
        float* __restrict__ u,                // (T, max_rank)
        int K, int max_rank) {
    grid_dependency_sync();
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int j = blockIdx.y * LORA_WARPS + (threadIdx.x >> 5);
    const int s = slots[t];
    if (s < 0 || j >= ranks[s]) return;
    const float* a = a_all + a_off[s] + (long long)j * K;
    const float* xr = x + (long long)t * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32) acc += a[k] * xr[k];
    acc = warp_sum(acc);
    if (lane == 0) u[(long long)t * max_rank + j] = acc;
}

// grid (T, ceil(N / LORA_THREADS)), block LORA_THREADS: y[t, n] += scale_s * B_s[n] . u[t].
extern "C" __global__ void __launch_bounds__(LORA_THREADS) lora_expand_f32(
        const float* __restrict__ u,          // (T, max_rank)
        const int* __restrict__ slots,
        const float* __restrict__ b_all,      // every slot's B (N, rank_s), at b_off[s]
        const long long* __restrict__ b_off,
        const int* __restrict__ ranks,
        const float* __restrict__ scales,     // (S,)
        float* __restrict__ y, long long ldy, // (T, >= N)
        int N, int max_rank) {
    grid_dependency_sync();
    const int t = blockIdx.x, n = blockIdx.y * LORA_THREADS + threadIdx.x;
    const int s = slots[t];
    if (s < 0 || n >= N) return;
    const int r = ranks[s];
    if (r == 0) return;
    const float* b = b_all + b_off[s] + (long long)n * r;
    const float* ur = u + (long long)t * max_rank;
    float acc = 0.0f;
    for (int j = 0; j < r; j++) acc += b[j] * ur[j];
    y[(long long)t * ldy + n] += scales[s] * acc;
}
