// RoPE + paged causal attention, the meaning of ops/reference.py rope_attention: RoPE on
// q and k (partial rotary, interleaved or rotate-half pairs, mscale on cos and sin), this
// step's k / v written into the paged cache, then attention with an optional sliding
// window and soft-capping of the scores.
//
// Three launches, in order (two for decode, where attn_decode is attn_partial and
// attn_combine in one launch: the last block of a (token, head) to finish merges):
//   rope_kv_write      rotated q into q_rot; rotated k and v into their cache slots (all
//                      of a step's keys are written before any attention reads them).
//   attn_partial       split over keys (flash-decoding): a token's keys [lo, p] are cut
//                      into chunks of `chunk`; each chunk gives an unnormalised partial
//                      (max, sum, weighted values). Blocks of grid z take chunks z, z + Z, ...
//   attn_combine       the partials of a token, merged in chunk order.
// A token's chunks depend only on its position, its key limit, the window and `chunk`,
// never on the other tokens of the batch, so its result does not either (batch invariance).
// key_limit (T,): the last position each token sees, >= its own (an image's tokens see the
// whole image); ops/cuda.py passes positions itself for causal attention.
//
// Cache layout: (num_blocks, block_size, nkv, hd) f32, or bf16 (the *_bf16 entries: each
// rotated key and value rounded to bf16 as it is stored, read back exactly; scores, softmax
// and sums stay f32); block_tables (B, max_blocks) int32.
#include "common.cuh"

#define ATTN_WARPS 4
#define HD_MAX 256   // head_dim <= HD_MAX (checked in ops/cuda.py)

// grid (T, nh + nkv), block hd.
template <typename KV>
__device__ __forceinline__ void rope_kv_write_t(
        const float* __restrict__ q,            // (T, nh, hd)
        const float* __restrict__ k,            // (T, nkv, hd)
        const float* __restrict__ v,            // (T, nkv, hd)
        const int* __restrict__ positions,      // (T,)
        const int* __restrict__ seq_ids,        // (T,)
        const int* __restrict__ block_tables,   // (B, max_blocks)
        int max_blocks,
        float* __restrict__ q_rot,              // (T, nh, hd)
        KV* __restrict__ k_cache,               // (num_blocks, block_size, nkv, hd)
        KV* __restrict__ v_cache,
        const float* __restrict__ inv_freq,     // (n_rot,)
        int n_rot, int interleaved, float mscale,
        int nh, int nkv, int hd, int block_size) {
    int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    int pos = positions[t];
    bool is_q = head < nh;
    int kvh = head - nh;
    const float* x = is_q ? q + ((long long)t * nh + head) * hd
                          : k + ((long long)t * nkv + kvh) * hd;
    float val = x[d];
    if (d < 2 * n_rot) {
        int i, partner;
        bool first;
        if (interleaved) {
            i = d >> 1;
            first = (d & 1) == 0;
            partner = first ? d + 1 : d - 1;
        } else {
            first = d < n_rot;
            i = first ? d : d - n_rot;
            partner = first ? d + n_rot : d - n_rot;
        }
        float ang = (float)pos * inv_freq[i];
        float c = cosf(ang) * mscale, s = sinf(ang) * mscale;
        float other = x[partner];
        // pair (a, b): a' = a cos - b sin, b' = b cos + a sin
        val = first ? val * c - other * s : val * c + other * s;
    }
    if (is_q) {
        q_rot[((long long)t * nh + head) * hd + d] = val;
        return;
    }
    int blk = block_tables[(long long)seq_ids[t] * max_blocks + pos / block_size];
    if (blk < 0) return;   // the host checks every table entry a token needs
    long long slot = (((long long)blk * block_size + pos % block_size) * nkv + kvh) * hd + d;
    kv_store(k_cache, slot, val);
    kv_store(v_cache, slot, v[((long long)t * nkv + kvh) * hd + d]);
}

#define ELLM_ROPE_KV_WRITE(suffix, KV)                                                    \
extern "C" __global__ void rope_kv_write##suffix(                                         \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, \
        const int* __restrict__ positions, const int* __restrict__ seq_ids,               \
        const int* __restrict__ block_tables, int max_blocks, float* __restrict__ q_rot,  \
        KV* __restrict__ k_cache, KV* __restrict__ v_cache,                               \
        const float* __restrict__ inv_freq, int n_rot, int interleaved, float mscale,     \
        int nh, int nkv, int hd, int block_size) {                                        \
    rope_kv_write_t<KV>(q, k, v, positions, seq_ids, block_tables, max_blocks, q_rot,     \
                        k_cache, v_cache, inv_freq, n_rot, interleaved, mscale, nh, nkv,  \
                        hd, block_size);                                                  \
}
ELLM_ROPE_KV_WRITE(, float)
ELLM_ROPE_KV_WRITE(_bf16, u16)

// The partials of the chunks this block takes (blockIdx.z, + gridDim.z, ...) of token
// blockIdx.y's head blockIdx.x. part_ml (T, nh, max_chunks, 2): max, sum;
// part_o (T, nh, max_chunks, hd).
template <typename KV>
__device__ __forceinline__ void attn_chunks(
        const float* __restrict__ q_rot,        // (T, nh, hd)
        const int* __restrict__ positions,
        const int* __restrict__ key_limit,      // (T,)
        const int* __restrict__ seq_ids,
        const int* __restrict__ block_tables,
        int max_blocks,
        const KV* __restrict__ k_cache,
        const KV* __restrict__ v_cache,
        int nh, int nkv, int hd, int block_size,
        float scale, int window, float softcap,
        int chunk, int max_chunks,
        float* __restrict__ part_ml,
        float* __restrict__ part_o) {
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    __shared__ float sm_o[ATTN_WARPS][HD_MAX];
    int h = blockIdx.x, t = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = positions[t], e = key_limit[t];
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    int n_chunks = min((e - lo) / chunk + 1, max_chunks);
    int kvh = h / (nh / nkv), D = (hd + 31) >> 5;   // dims lane + 32 j, j < D, of each head
    const int* table = block_tables + (long long)seq_ids[t] * max_blocks;
    float qd[HD_MAX / 32];
    const float* qp = q_rot + ((long long)t * nh + h) * hd;
    for (int j = 0; j < HD_MAX / 32; j++) qd[j] = j < D && lane + 32 * j < hd ? qp[lane + 32 * j] : 0.0f;

    for (int c = blockIdx.z; c < n_chunks; c += gridDim.z) {
        int k_lo = lo + c * chunk, k_hi = min(k_lo + chunk, e + 1);
        float m = ELLM_NEG_INF, l = 0.0f, o[HD_MAX / 32];
        for (int j = 0; j < HD_MAX / 32; j++) o[j] = 0.0f;
        for (int pos = k_lo + warp; pos < k_hi; pos += ATTN_WARPS) {
            int blk = table[pos / block_size];
            if (blk < 0) continue;   // a padding row of a captured batch: no keys
            long long base = (((long long)blk * block_size + pos % block_size) * nkv + kvh) * hd;
            const KV* kp = k_cache + base;
            const KV* vp = v_cache + base;
            float dot = 0.0f;
            for (int j = 0; j < HD_MAX / 32; j++)
                if (j < D && lane + 32 * j < hd) dot += qd[j] * kv_load(kp, lane + 32 * j);
            float s = warp_sum(dot) * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            float m_new = fmaxf(m, s);
            float corr = expf(m - m_new), w = expf(s - m_new);
            l = l * corr + w;
            for (int j = 0; j < HD_MAX / 32; j++)
                if (j < D && lane + 32 * j < hd) o[j] = o[j] * corr + w * kv_load(vp, lane + 32 * j);
            m = m_new;
        }
        if (lane == 0) {
            sm_m[warp] = m;
            sm_l[warp] = l;
        }
        for (int j = 0; j < HD_MAX / 32; j++)   // a fixed bound keeps o[] in registers
            if (j < D && lane + 32 * j < hd) sm_o[warp][lane + 32 * j] = o[j];
        __syncthreads();
        long long part = ((long long)t * nh + h) * max_chunks + c;
        float M = ELLM_NEG_INF;
        for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm_m[w]);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float acc = 0.0f;
            for (int w = 0; w < ATTN_WARPS; w++)
                if (sm_m[w] != ELLM_NEG_INF) acc += sm_o[w][d] * expf(sm_m[w] - M);
            part_o[part * hd + d] = acc;
        }
        if (threadIdx.x == 0) {
            float L = 0.0f;
            for (int w = 0; w < ATTN_WARPS; w++)
                if (sm_m[w] != ELLM_NEG_INF) L += sm_l[w] * expf(sm_m[w] - M);
            part_ml[part * 2] = M;
            part_ml[part * 2 + 1] = L;
        }
        __syncthreads();
    }
}

#define ATTN_PARTIAL_PARAMS(KV)                                                           \
        const float* __restrict__ q_rot, const int* __restrict__ positions,               \
        const int* __restrict__ key_limit, const int* __restrict__ seq_ids,               \
        const int* __restrict__ block_tables, int max_blocks,                             \
        const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,                   \
        int nh, int nkv, int hd, int block_size, float scale, int window, float softcap,  \
        int chunk, int max_chunks, float* __restrict__ part_ml, float* __restrict__ part_o
#define ATTN_PARTIAL_ARGS                                                                 \
        q_rot, positions, key_limit, seq_ids, block_tables, max_blocks, k_cache, v_cache, \
        nh, nkv, hd, block_size, scale, window, softcap, chunk, max_chunks, part_ml, part_o

// The merge of token t's head h partials, in chunk order, by the threads of one block
// (d = threadIdx.x, + blockDim.x, ...). volatile: the partials may come from other
// blocks of the same launch (attn_decode), which L1 does not see.
__device__ __forceinline__ void attn_merge(
        int h, int t, const int* __restrict__ positions, const int* __restrict__ key_limit,
        const volatile float* part_ml, const volatile float* part_o,
        int nh, int hd, int window, int chunk, int max_chunks, float* __restrict__ out) {
    int p = positions[t], e = key_limit[t];
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    int n_chunks = min((e - lo) / chunk + 1, max_chunks);
    long long base = ((long long)t * nh + h) * max_chunks;
    float M = ELLM_NEG_INF;
    for (int c = 0; c < n_chunks; c++) M = fmaxf(M, part_ml[(base + c) * 2]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float L = 0.0f, O = 0.0f;
        for (int c = 0; c < n_chunks; c++) {
            float m = part_ml[(base + c) * 2];
            if (m == ELLM_NEG_INF) continue;
            float w = expf(m - M);
            L += part_ml[(base + c) * 2 + 1] * w;
            O += part_o[(base + c) * hd + d] * w;
        }
        // L == 0 only for the padding rows of a captured decode batch (no keys at all)
        out[((long long)t * nh + h) * hd + d] = L > 0.0f ? O / L : 0.0f;
    }
}

// grid (nh, T, Z), block 32 * ATTN_WARPS.
#define ELLM_ATTN_PARTIAL(suffix, KV)                                                     \
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS, 8) attn_partial##suffix(   \
        ATTN_PARTIAL_PARAMS(KV)) {                                                        \
    attn_chunks<KV>(ATTN_PARTIAL_ARGS);                                                   \
}
ELLM_ATTN_PARTIAL(, float)
ELLM_ATTN_PARTIAL(_bf16, u16)

// Decode: attn_partial, then the last of the Z blocks of a (head, token) to finish merges
// the partials as attn_combine does (same order, same bits), so one launch. counters
// (T * nh) int32 start at zero and are left at zero (the merging block resets its own).
// grid (nh, T, Z), block 32 * ATTN_WARPS.
#define ELLM_ATTN_DECODE(suffix, KV)                                                      \
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS, 8) attn_decode##suffix(    \
        ATTN_PARTIAL_PARAMS(KV), int* __restrict__ counters, float* __restrict__ out) {   \
    __shared__ int last;                                                                  \
    attn_chunks<KV>(ATTN_PARTIAL_ARGS);                                                   \
    __threadfence();   /* this block's partials visible to the merging block */           \
    __syncthreads();                                                                      \
    int* counter = counters + (long long)blockIdx.y * nh + blockIdx.x;                    \
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.z - 1;             \
    __syncthreads();                                                                      \
    if (!last) return;                                                                    \
    __threadfence();                                                                      \
    attn_merge(blockIdx.x, blockIdx.y, positions, key_limit, part_ml, part_o, nh, hd,     \
               window, chunk, max_chunks, out);                                           \
    if (threadIdx.x == 0) *counter = 0;   /* ready for the next launch (graph replays) */ \
}
ELLM_ATTN_DECODE(, float)
ELLM_ATTN_DECODE(_bf16, u16)

// grid (nh, T), block hd. out (T, nh, hd).
extern "C" __global__ void attn_combine(
        const int* __restrict__ positions,
        const int* __restrict__ key_limit,      // (T,)
        const float* __restrict__ part_ml,
        const float* __restrict__ part_o,
        int nh, int hd, int window, int chunk, int max_chunks,
        float* __restrict__ out) {
    attn_merge(blockIdx.x, blockIdx.y, positions, key_limit, part_ml, part_o, nh, hd, window, chunk,
               max_chunks, out);
}
