// RoPE + paged causal attention, the meaning of ops/reference.py rope_attention: RoPE on
// q and k (partial rotary, interleaved or rotate-half pairs, mscale on cos and sin), this
// step's k / v written into the paged cache, then attention with an optional sliding
// window and soft-capping of the scores.
//
// Three launches, in order (two for decode, where attn_decode is attn_partial and
// attn_combine in one launch: the last block of a (token, head) to finish merges):
//   rope_kv_write      rotated q into q_rot; rotated k and v into their cache slots (all
//                      of a step's keys are written before any attention reads them).
//   qk_norm_rope_kv_write  the same after q and k's RMSNorms (Qwen3, Gemma 3, OLMo 2).
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
#define ATTN_CHUNK_MAX 512   // = ops/cuda.py PREFILL_CHUNK, the largest chunk
// blocks of attn_partial / attn_decode resident an SM (up to 128 registers a thread, for
// loads in flight) = ops/cuda.py ATTN_BLOCKS_PER_SM, which sizes the grid's key split
#define ATTN_MIN_BLOCKS 4

// One (token, head) of a block: grid (T, nh + nkv), threads d < hd each one value.
// wh: null, or the head's q/k norm weights (hd), with denom the head's (or its
// projection's) root mean square: the values rotated are then (x / denom) * wh.
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
        int nh, int nkv, int hd, int block_size,
        const float* __restrict__ wh, float denom) {
    int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    int pos = positions[t];
    bool is_q = head < nh;
    int kvh = head - nh;
    const float* x = is_q ? q + ((long long)t * nh + head) * hd
                          : k + ((long long)t * nkv + kvh) * hd;
    float val = wh ? (x[d] / denom) * wh[d] : x[d];
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
        float other = wh ? (x[partner] / denom) * wh[partner] : x[partner];
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
    grid_dependency_sync();                                                               \
    rope_kv_write_t<KV>(q, k, v, positions, seq_ids, block_tables, max_blocks, q_rot,     \
                        k_cache, v_cache, inv_freq, n_rot, interleaved, mscale, nh, nkv,  \
                        hd, block_size, nullptr, 1.0f);                                   \
}
ELLM_ROPE_KV_WRITE(, float)
ELLM_ROPE_KV_WRITE(_bf16, u16)

// q/k norms, then rope_kv_write: one launch for what was three (Qwen3 and Gemma 3 norm
// each head's hd values, OLMo 2 a token's whole q or k projection: `whole`, with norm
// weights of nh * hd and nkv * hd). The sum of squares is rmsnorm_f32's for a row of the
// same length (the same strided loop and block_sum), so the rotated values are the bits
// of the plain path (rmsnorm, then rope_kv_write). grid (T, nh + nkv), block NORM_THREADS
// (>= HD_MAX).
#define ELLM_QK_NORM_ROPE_KV_WRITE(suffix, KV)                                            \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) qk_norm_rope_kv_write##suffix( \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, \
        const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,    \
        int whole, const int* __restrict__ positions, const int* __restrict__ seq_ids,    \
        const int* __restrict__ block_tables, int max_blocks, float* __restrict__ q_rot,  \
        KV* __restrict__ k_cache, KV* __restrict__ v_cache,                               \
        const float* __restrict__ inv_freq, int n_rot, int interleaved, float mscale,     \
        int nh, int nkv, int hd, int block_size) {                                        \
    grid_dependency_sync();                                                               \
    __shared__ float scratch[32];                                                         \
    int head = blockIdx.y;                                                                \
    bool is_q = head < nh;                                                                \
    int n = is_q ? nh : nkv, h = is_q ? head : head - nh;                                 \
    const float* proj = (is_q ? q : k) + (long long)blockIdx.x * n * hd;                  \
    const float* row = whole ? proj : proj + (long long)h * hd;                           \
    int H = whole ? n * hd : hd;                                                          \
    float ss = 0.0f;                                                                      \
    for (int i = threadIdx.x; i < H; i += NORM_THREADS) ss += row[i] * row[i];            \
    float denom = sqrtf(block_sum(ss, scratch) / (float)H + eps);                         \
    const float* w = is_q ? q_norm : k_norm;                                              \
    rope_kv_write_t<KV>(q, k, v, positions, seq_ids, block_tables, max_blocks, q_rot,     \
                        k_cache, v_cache, inv_freq, n_rot, interleaved, mscale, nh, nkv,  \
                        hd, block_size, whole ? w + (long long)h * hd : w, denom);        \
}
ELLM_QK_NORM_ROPE_KV_WRITE(, float)
ELLM_QK_NORM_ROPE_KV_WRITE(_bf16, u16)

// Four of a cached row's values from element i (i % 4 == 0, the row 16-byte (f32) or
// 8-byte (bf16) aligned: hd % 4 == 0).
__device__ __forceinline__ float4 kv_load4(const float* p, long long i) { return *(const float4*)(p + i); }
__device__ __forceinline__ float4 kv_load4(const u16* p, long long i) {
    uint2 w = *(const uint2*)(p + i);
    float4 r = {bf16_to_f32((u16)(w.x & 0xffffu)), bf16_to_f32((u16)(w.x >> 16)),
                bf16_to_f32((u16)(w.y & 0xffffu)), bf16_to_f32((u16)(w.y >> 16))};
    return r;
}

// q . k over hd dims: four running sums (dims d % 4, for the FMA latency) added in one
// order at the end; vector loads where hd % 4 == 0, the same sums either way.
template <typename KV>
__device__ __forceinline__ float q_dot_k(const float* sq, const KV* __restrict__ kp, int hd) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    if ((hd & 3) == 0) {
        #pragma unroll 4
        for (int d = 0; d < hd; d += 4) {
            float4 k = kv_load4(kp, d);
            a0 = fmaf(sq[d], k.x, a0);
            a1 = fmaf(sq[d + 1], k.y, a1);
            a2 = fmaf(sq[d + 2], k.z, a2);
            a3 = fmaf(sq[d + 3], k.w, a3);
        }
    } else {
        for (int d = 0; d < hd; d += 4) {
            a0 = fmaf(sq[d], kv_load(kp, d), a0);
            if (d + 1 < hd) a1 = fmaf(sq[d + 1], kv_load(kp, d + 1), a1);
            if (d + 2 < hd) a2 = fmaf(sq[d + 2], kv_load(kp, d + 2), a2);
            if (d + 3 < hd) a3 = fmaf(sq[d + 3], kv_load(kp, d + 3), a3);
        }
    }
    return (a0 + a1) + (a2 + a3);
}

// The partials of the chunks this block takes (blockIdx.z, + gridDim.z, ...) of token
// blockIdx.y's head blockIdx.x. part_ml (T, nh, max_chunks, 2): max, sum;
// part_o (T, nh, max_chunks, hd). chunk <= ATTN_CHUNK_MAX.
//
// A chunk in three phases, each with every key (or dim) in flight at once rather than one
// key after another: a thread per key takes its score (q . k, scaled, soft-capped); the
// chunk's max, then each key's weight exp(s - max) and their sum; a thread per (dim, key
// group) sums weight x value over its keys, the groups summed in order. Every sum has an
// order fixed by the chunk's keys, hd and the block's size, never by the batch.
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
    constexpr int NT = 32 * ATTN_WARPS;
    __shared__ float sm_q[HD_MAX];
    __shared__ float sm_w[ATTN_CHUNK_MAX];          // scores, then weights
    __shared__ long long sm_row[ATTN_CHUNK_MAX];    // a key's cache row (element index), -1: none
    __shared__ float sm_o[HD_MAX];                  // (group, dim) sums
    __shared__ float sm_red[ATTN_WARPS];
    int h = blockIdx.x, t = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = positions[t], e = key_limit[t];
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    int n_chunks = min((e - lo) / chunk + 1, max_chunks);
    int kvh = h / (nh / nkv);
    // dims a thread of the value phase takes: groups of keys when hd leaves threads over
    int groups = hd <= NT ? NT / hd : 1, g = threadIdx.x / hd;
    const int* table = block_tables + (long long)seq_ids[t] * max_blocks;
    const float* qp = q_rot + ((long long)t * nh + h) * hd;
    for (int d = threadIdx.x; d < hd; d += NT) sm_q[d] = qp[d];
    __syncthreads();

    for (int c = blockIdx.z; c < n_chunks; c += gridDim.z) {
        int k_lo = lo + c * chunk, n = min(k_lo + chunk, e + 1) - k_lo;
        // scores; this thread's max
        float m = ELLM_NEG_INF;
        for (int i = threadIdx.x; i < n; i += NT) {
            int pos = k_lo + i, blk = table[pos / block_size];
            float s = ELLM_NEG_INF;
            long long row = -1;
            if (blk >= 0) {   // else a padding row of a captured batch: no keys
                row = (((long long)blk * block_size + pos % block_size) * nkv + kvh) * hd;
                s = q_dot_k(sm_q, k_cache + row, hd) * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            }
            sm_w[i] = s;
            sm_row[i] = row;
            m = fmaxf(m, s);
        }
        m = warp_max(m);
        if (lane == 0) sm_red[warp] = m;
        __syncthreads();
        float M = ELLM_NEG_INF;
        #pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm_red[w]);
        __syncthreads();   // sm_red is reused for the sum
        // weights and their sum (each thread's keys in order, the warp's butterfly, warps in order)
        float l = 0.0f;
        for (int i = threadIdx.x; i < n; i += NT) {
            float w = sm_w[i] == ELLM_NEG_INF ? 0.0f : expf(sm_w[i] - M);
            sm_w[i] = w;
            l += w;
        }
        l = warp_sum(l);
        if (lane == 0) sm_red[warp] = l;
        __syncthreads();
        // weighted values: thread (g, d) over keys g, g + groups, ...
        if (g < groups) {
            for (int d = threadIdx.x - g * hd; d < hd; d += NT) {
                float acc = 0.0f;
                // no branch around a key's load: under `if (row >= 0)` ptxas waited for
                // each value before it asked for the next. A key of none (a padding row)
                // reads row 0, in bounds, and adds 0 x 0 (acc, never -0, unchanged)
                #pragma unroll 16
                for (int i = g; i < n; i += groups) {
                    long long row = sm_row[i];
                    bool key = row >= 0;
                    float v = kv_load(v_cache, (key ? row : 0) + d);
                    acc = fmaf(key ? sm_w[i] : 0.0f, key ? v : 0.0f, acc);
                }
                sm_o[g * hd + d] = acc;   // g * hd + d < NT when groups > 1, else d < hd
            }
        }
        __syncthreads();
        long long part = ((long long)t * nh + h) * max_chunks + c;
        for (int d = threadIdx.x; d < hd; d += NT) {
            float o = 0.0f;
            for (int k = 0; k < groups; k++) o += sm_o[k * hd + d];
            part_o[part * hd + d] = o;
        }
        if (threadIdx.x == 0) {
            float L = 0.0f;
            #pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++) L += sm_red[w];
            part_ml[part * 2] = M;
            part_ml[part * 2 + 1] = L;
        }
        __syncthreads();   // the shared arrays are the next chunk's
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
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS, ATTN_MIN_BLOCKS) attn_partial##suffix(   \
        ATTN_PARTIAL_PARAMS(KV)) {                                                        \
    grid_dependency_sync();                                                               \
    attn_chunks<KV>(ATTN_PARTIAL_ARGS);                                                   \
}
ELLM_ATTN_PARTIAL(, float)
ELLM_ATTN_PARTIAL(_bf16, u16)

// Decode: attn_partial, then the last of the Z blocks of a (head, token) to finish merges
// the partials as attn_combine does (same order, same bits), so one launch. counters
// (T * nh) int32 start at zero and are left at zero (the merging block resets its own).
// grid (nh, T, Z), block 32 * ATTN_WARPS.
#define ELLM_ATTN_DECODE(suffix, KV)                                                      \
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS, ATTN_MIN_BLOCKS) attn_decode##suffix(    \
        ATTN_PARTIAL_PARAMS(KV), int* __restrict__ counters, float* __restrict__ out) {   \
    grid_dependency_sync();                                                               \
    __shared__ int last;                                                                  \
    attn_chunks<KV>(ATTN_PARTIAL_ARGS);                                                   \
    int* counter = counters + (long long)blockIdx.y * nh + blockIdx.x;                    \
    if (!last_block_to_finish(counter, (int)gridDim.z, &last)) return;                    \
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
    grid_dependency_sync();
    attn_merge(blockIdx.x, blockIdx.y, positions, key_limit, part_ml, part_o, nh, hd, window, chunk,
               max_chunks, out);
}

// ---------------------------------------------------------------------------------
// Prefill attention on the tensor cores (the meaning of attn_partial + attn_combine, for
// head_dim a multiple of 32 up to 256): a warp per 16 query tokens of one head, every key
// they see, flash-attention style (running max and sum per row, no partials in memory).
// Scores Q K^T and the sums P V are mma.sync m16n8k16 with f32 accumulation; each f32
// operand goes in as two bf16 terms (hi + lo, 16 significant bits) and the products that
// matter are summed (hi hi, hi lo, lo hi), so the result stays near f32 (a bf16 cache
// holds exact bf16: its lo terms are zero and skipped).
//
// A block's W warps (FA_WARPS: 64 query rows of a head) take the keys in steps of
// FA_KEYS together: the block's threads put a step's K (FA_OUT dims at a time), then its
// V, in shared memory once (an f32 cache's values split into their bf16 terms once) and
// every warp reads them there, so a key is read from L2 once a block, not once a warp. The rows of a block may
// belong to several sequences (a batched prefill): the block walks its sequences in
// turn, each from its first key the block's rows of it see, rounded down to a multiple
// of FA_KEYS, to the last; a warp sits out the steps none of its rows sees (which would
// change none of its sums: every score masked, max and sums kept exactly). The steps start
// at multiples of FA_KEYS, so a row's keys fall into the same steps whichever rows share
// its block: a prompt's attention has the same bits wherever it sits in the batch.
//
// Lane 4 g + q holds query rows g and g + 8 of its warp; of each 32 dims it reads the 8 at
// 8q (of Q and of K, the same positions on both sides of the dot).
//
// A warp keeps at most FA_OUT dims of its rows' output in registers (64 registers). Above
// that (Gemma's head_dim 256) blockIdx.z picks which FA_OUT dims a block sums, and each
// block takes every score itself (`attn_prefill_wide`, FA_WIDE_WARPS warps a block: Q of
// 32 rows of up to 256 dims fills the shared memory 64 rows of 128 do): the scores' work
// is done twice, but the two blocks' scores, maxima and sums are the same instructions on
// the same values, so both halves are normalized alike.
// ---------------------------------------------------------------------------------
#define FA_OUT 128
#define FA_KEYS 16     // keys per step: two n8 tiles of scores, one k16 of P V
#define FA_WARPS 4       // attn_prefill's warps a block (ops/cuda.py FA_WARPS)
#define FA_WIDE_WARPS 2  // attn_prefill_wide's (FA_WIDE_WARPS): Q of 32 rows x 256 dims is 33 KB
// Blocks an SM is meant to hold: registers capped at 170 a thread (ptxas left alone took
// 128 for attn_prefill_bf16 on sm_90 and spilled); 3 x 44 KB of shared memory fits sm_80's 164.
#define FA_MIN_BLOCKS 3

// 8 cache elements from i as 4 words of bf16 pairs (element 2w in word w's low half), the
// A / B operand of an mma: an f32 cache's as hi + lo terms, a bf16 cache's its own bits
// (no lo terms: they would be zero)
__device__ __forceinline__ void kv_words8(const float* p, long long i, u32* hi, u32* lo) {
    float4 a = *(const float4*)(p + i), b = *(const float4*)(p + i + 4);
    split_bf16(a.x, a.y, hi[0], lo[0]);
    split_bf16(a.z, a.w, hi[1], lo[1]);
    split_bf16(b.x, b.y, hi[2], lo[2]);
    split_bf16(b.z, b.w, hi[3], lo[3]);
}

__device__ __forceinline__ void kv_words8(const u16* p, long long i, u32* hi, u32* lo) {
    uint4 u = *(const uint4*)(p + i);
    hi[0] = u.x; hi[1] = u.y; hi[2] = u.z; hi[3] = u.w;
    lo[0] = lo[1] = lo[2] = lo[3] = 0u;
}

// Dims d..d+7 of a key's K or V (head kvh) through the block table as kv_words8's words;
// zeros past kend or in no block.
template <typename KV>
__device__ __forceinline__ void key_words8(const KV* __restrict__ cache, const int* __restrict__ table, int key,
                                           int kend, int block_size, int nkv, int kvh, int hd, int d,
                                           u32* hi, u32* lo) {
    hi[0] = hi[1] = hi[2] = hi[3] = lo[0] = lo[1] = lo[2] = lo[3] = 0u;
    int blk = key <= kend ? table[key / block_size] : -1;
    if (blk >= 0)
        kv_words8(cache, (((long long)blk * block_size + key % block_size) * nkv + kvh) * hd + d, hi, lo);
}

__device__ __forceinline__ int warp_min_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_max_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The minimum (MAX: maximum) of v over a block of W warps; red holds W ints. Every thread
// of the block calls it.
template <int W, bool MAX>
__device__ __forceinline__ int block_extreme_int(int v, int* red) {
    v = MAX ? warp_max_int(v) : warp_min_int(v);
    if constexpr (W > 1) {
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
        __syncthreads();
        v = red[0];
        for (int w = 1; w < W; w++) v = MAX ? max(v, red[w]) : min(v, red[w]);
        __syncthreads();   // red may be written again
    }
    return v;
}

__device__ __forceinline__ void store_words4(u16* dst, const u32* w) {
    uint4 u;
    u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
    *(uint4*)dst = u;
}

// grid (nh, ceil(T / (16 W)), ceil(hd / FA_OUT)), block 32 W. hd % 32 == 0, hd <= QD (ops/cuda.py checks).
template <typename KV, int QD, int W>
__device__ __forceinline__ void attn_prefill_t(
        const float* __restrict__ q_rot, const int* __restrict__ positions, const int* __restrict__ key_limit,
        const int* __restrict__ seq_ids, const int* __restrict__ block_tables, int max_blocks,
        const KV* __restrict__ k_cache, const KV* __restrict__ v_cache, int T, int nh, int nkv, int hd,
        int block_size, float scale, int window, float softcap, float* __restrict__ out) {
    constexpr bool EXACT = sizeof(KV) == 2;   // a bf16 cache: no lo terms for K and V
    constexpr int NT = EXACT ? 1 : 2;          // the terms of K and V staged: hi (, lo)
    constexpr int K_TILE = NT * FA_KEYS * (FA_OUT + 8), V_TILE = NT * FA_OUT * (FA_KEYS + 2);
    __shared__ __align__(16) u16 qs[2][16 * W][QD + 8];                 // hi, lo: rows x dims
    __shared__ __align__(16) u16 kv[K_TILE > V_TILE ? K_TILE : V_TILE];   // a step's K (by slices), then its V
    __shared__ int red[W];
    auto ks = reinterpret_cast<u16 (*)[FA_KEYS][FA_OUT + 8]>(kv);    // [term][key][dim of the slice]
    auto vs = reinterpret_cast<u16 (*)[FA_OUT][FA_KEYS + 2]>(kv);  // [term][this block's dim][key]
    const int NO_SEQ = 0x7fffffff;
    int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int b0 = blockIdx.y * 16 * W, wr = 16 * (tid >> 5), t0 = b0 + wr;   // wr: the warp's rows in qs
    int dz = blockIdx.z * FA_OUT, od = min(hd - dz, FA_OUT);   // the output dims this block sums
    int kvh = h / (nh / nkv), tiles = od >> 3;
    int row[2] = {t0 + g, t0 + g + 8}, seq[2], lo[2], hi_key[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        bool ok = row[r] < T;
        int p = ok ? positions[row[r]] : 0;
        seq[r] = ok ? seq_ids[row[r]] : NO_SEQ;
        hi_key[r] = ok ? key_limit[row[r]] : -1;
        lo[r] = window > 0 ? max(0, p - window + 1) : 0;
    }
    for (int i = tid; i < 16 * W * (hd >> 1); i += 32 * W) {   // the block's query rows, split hi / lo
        int r = i / (hd >> 1), d = 2 * (i - r * (hd >> 1));
        float a = 0.0f, b = 0.0f;
        if (b0 + r < T) {
            const float* qp = q_rot + ((long long)(b0 + r) * nh + h) * hd + d;
            a = qp[0];
            b = qp[1];
        }
        u32 wh, wl;
        split_bf16(a, b, wh, wl);
        *(u32*)&qs[0][r][d] = wh;
        *(u32*)&qs[1][r][d] = wl;
    }
    __syncthreads();
    float o[FA_OUT / 8][4];
    #pragma unroll
    for (int t = 0; t < FA_OUT / 8; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    float m[2] = {ELLM_NEG_INF, ELLM_NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int prev = -1;;) {
        int cand = NO_SEQ;   // the next sequence among the block's rows
        #pragma unroll
        for (int r = 0; r < 2; r++)
            if (seq[r] != NO_SEQ && seq[r] > prev) cand = min(cand, seq[r]);
        cand = block_extreme_int<W, false>(cand, red);
        if (cand == NO_SEQ) break;
        prev = cand;
        bool in[2] = {seq[0] == cand, seq[1] == cand};
        // this warp's keys of the sequence (none: wbeg NO_SEQ, wend -1), then the block's
        int wbeg = warp_min_int(min(in[0] ? lo[0] : NO_SEQ, in[1] ? lo[1] : NO_SEQ));
        int wend = warp_max_int(max(in[0] ? hi_key[0] : -1, in[1] ? hi_key[1] : -1));
        int kbeg = block_extreme_int<W, false>(wbeg, red) / FA_KEYS * FA_KEYS;
        int kend = block_extreme_int<W, true>(wend, red);
        const int* table = block_tables + (long long)cand * max_blocks;
        for (int kb = kbeg; kb <= kend; kb += FA_KEYS) {
            bool active = kb <= wend && kb + FA_KEYS - 1 >= wbeg;   // the warp's rows see a key of the step
            // scores of rows g, g + 8 against keys kb + 8 j + g (as B columns), K staged
            // FA_OUT dims at a time (one slice up to 128 dims; Gemma's 256: two)
            float s[2][4];
            #pragma unroll
            for (int j = 0; j < 2; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            for (int dk = 0; dk < hd; dk += FA_OUT) {
                int dn = min(hd - dk, FA_OUT);
                __syncthreads();   // every warp has read the last slice of K, or the last step's V
                for (int i = tid; i < FA_KEYS * (dn >> 3); i += 32 * W) {   // 16 keys x dn dims
                    int kk = i / (dn >> 3), d0 = 8 * (i - kk * (dn >> 3));
                    u32 kh[4], kl[4];
                    key_words8(k_cache, table, kb + kk, kend, block_size, nkv, kvh, hd, dk + d0, kh, kl);
                    store_words4(&ks[0][kk][d0], kh);
                    if constexpr (!EXACT) store_words4(&ks[1][kk][d0], kl);
                }
                __syncthreads();
                if (!active) continue;
                for (int c = dk >> 5; c < (dk + dn) >> 5; c++) {
                    int d0 = 32 * c + 8 * q, e0 = d0 - dk;   // e0: the dims' place in the slice
                    uint4 qa = *(const uint4*)&qs[0][wr + g][d0], qb = *(const uint4*)&qs[0][wr + g + 8][d0];
                    uint4 la = *(const uint4*)&qs[1][wr + g][d0], lb = *(const uint4*)&qs[1][wr + g + 8][d0];
                    const u32 ah1[4] = {qa.x, qb.x, qa.y, qb.y}, ah2[4] = {qa.z, qb.z, qa.w, qb.w};
                    const u32 al1[4] = {la.x, lb.x, la.y, lb.y}, al2[4] = {la.z, lb.z, la.w, lb.w};
                    #pragma unroll
                    for (int j = 0; j < 2; j++) {
                        uint4 kh = *(const uint4*)&ks[0][8 * j + g][e0];
                        const u32 bh1[2] = {kh.x, kh.y}, bh2[2] = {kh.z, kh.w};
                        mma_bf16_16816(s[j], ah1, bh1);
                        mma_bf16_16816(s[j], ah2, bh2);
                        mma_bf16_16816(s[j], al1, bh1);
                        mma_bf16_16816(s[j], al2, bh2);
                        if constexpr (!EXACT) {
                            uint4 kl = *(const uint4*)&ks[1][8 * j + g][e0];
                            const u32 bl1[2] = {kl.x, kl.y}, bl2[2] = {kl.z, kl.w};
                            mma_bf16_16816(s[j], ah1, bl1);
                            mma_bf16_16816(s[j], ah2, bl2);
                        }
                    }
                }
            }
            u32 ph[4] = {0u, 0u, 0u, 0u}, pl[4] = {0u, 0u, 0u, 0u};   // P as the A operand: keys of tile 0 at k 0-7, tile 1 at 8-15
            if (active) {
                // scale, soft-cap and mask; element (j, i): row i >> 1, key kb + 8 j + 2 q + (i & 1)
                float mx[2] = {ELLM_NEG_INF, ELLM_NEG_INF};
                #pragma unroll
                for (int j = 0; j < 2; j++) {
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int r = i >> 1, key = kb + 8 * j + 2 * q + (i & 1);
                        // the table read whatever the rest says (at min(key, kend), in the
                        // sequence's table), not after it: eight loads at once, where a load
                        // behind && was a branch ptxas waited in, one after another
                        bool listed = table[min(key, kend) / block_size] >= 0;
                        bool ok = in[r] && key >= lo[r] && key <= hi_key[r] && listed;
                        float x = s[j][i] * scale;
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                        s[j][i] = ok ? x : ELLM_NEG_INF;
                        mx[r] = fmaxf(mx[r], s[j][i]);
                    }
                }
                float corr[2];
                #pragma unroll
                for (int r = 0; r < 2; r++) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    float m_new = fmaxf(m[r], mx[r]);
                    corr[r] = m_new == ELLM_NEG_INF ? 1.0f : expf(m[r] - m_new);
                    m[r] = m_new;
                }
                float psum[2] = {0.0f, 0.0f};
                #pragma unroll
                for (int j = 0; j < 2; j++) {
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int r = i >> 1;
                        float p = s[j][i] == ELLM_NEG_INF ? 0.0f : expf(s[j][i] - m[r]);
                        s[j][i] = p;
                        psum[r] += p;
                    }
                }
                l[0] = l[0] * corr[0] + psum[0];
                l[1] = l[1] * corr[1] + psum[1];
                #pragma unroll
                for (int t = 0; t < FA_OUT / 8; t++) {   // constant bounds keep o[] in registers
                    if (t >= tiles) break;
                    o[t][0] *= corr[0]; o[t][1] *= corr[0];
                    o[t][2] *= corr[1]; o[t][3] *= corr[1];
                }
                split_bf16(s[0][0], s[0][1], ph[0], pl[0]);
                split_bf16(s[0][2], s[0][3], ph[1], pl[1]);
                split_bf16(s[1][0], s[1][1], ph[2], pl[2]);
                split_bf16(s[1][2], s[1][3], ph[3], pl[3]);
            }
            __syncthreads();   // every warp has read K
            for (int i = tid; i < FA_KEYS * (od >> 3); i += 32 * W) {   // V: 16 keys x od, transposed
                int kk = i / (od >> 3), d0 = 8 * (i - kk * (od >> 3));
                u32 vh[4], vl[4];
                key_words8(v_cache, table, kb + kk, kend, block_size, nkv, kvh, hd, dz + d0, vh, vl);
                #pragma unroll
                for (int e = 0; e < 8; e++) {
                    vs[0][d0 + e][kk] = (u16)(vh[e >> 1] >> (16 * (e & 1)));
                    if constexpr (!EXACT) vs[1][d0 + e][kk] = (u16)(vl[e >> 1] >> (16 * (e & 1)));
                }
            }
            __syncthreads();
            if (!active) continue;
            #pragma unroll
            for (int t = 0; t < FA_OUT / 8; t++) {
                if (t >= tiles) break;
                int d = 8 * t + g;
                const u32 bh[2] = {*(const u32*)&vs[0][d][2 * q], *(const u32*)&vs[0][d][8 + 2 * q]};
                mma_bf16_16816(o[t], ph, bh);
                mma_bf16_16816(o[t], pl, bh);
                if constexpr (!EXACT) {
                    const u32 bl[2] = {*(const u32*)&vs[1][d][2 * q], *(const u32*)&vs[1][d][8 + 2 * q]};
                    mma_bf16_16816(o[t], ph, bl);
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    #pragma unroll
    for (int t = 0; t < FA_OUT / 8; t++) {
        if (t >= tiles) break;
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = i >> 1;
            if (row[r] >= T) continue;
            float v = l[r] > 0.0f ? o[t][i] / l[r] : 0.0f;
            out[((long long)row[r] * nh + h) * hd + dz + 8 * t + 2 * q + (i & 1)] = v;
        }
    }
}

#define ELLM_ATTN_PREFILL(suffix, KV, QD, W)                                              \
extern "C" __global__ void __launch_bounds__(32 * W, FA_MIN_BLOCKS) attn_prefill##suffix( \
        const float* __restrict__ q_rot, const int* __restrict__ positions,               \
        const int* __restrict__ key_limit, const int* __restrict__ seq_ids,               \
        const int* __restrict__ block_tables, int max_blocks,                             \
        const KV* __restrict__ k_cache, const KV* __restrict__ v_cache, int T, int nh,    \
        int nkv, int hd, int block_size, float scale, int window, float softcap,          \
        float* __restrict__ out) {                                                        \
    grid_dependency_sync();                                                               \
    attn_prefill_t<KV, QD, W>(q_rot, positions, key_limit, seq_ids, block_tables,         \
                              max_blocks, k_cache, v_cache, T, nh, nkv, hd, block_size,   \
                              scale, window, softcap, out);                               \
}
ELLM_ATTN_PREFILL(, float, FA_OUT, FA_WARPS)
ELLM_ATTN_PREFILL(_bf16, u16, FA_OUT, FA_WARPS)
// a warp a block, each reading every key itself (ELLM_CUDA_FA_WARPS=1: the comparison; the same bits)
ELLM_ATTN_PREFILL(_w1, float, FA_OUT, 1)
ELLM_ATTN_PREFILL(_w1_bf16, u16, FA_OUT, 1)
ELLM_ATTN_PREFILL(_wide, float, 256, FA_WIDE_WARPS)
ELLM_ATTN_PREFILL(_wide_bf16, u16, 256, FA_WIDE_WARPS)
