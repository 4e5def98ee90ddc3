// Token sampling on the device: one block per sequence row of logits, so only the chosen
// token ids cross the bus. The order of operations is engine/sampler.py's:
//   a grammar's mask; logit_bias; repetition penalty (prompt + output tokens), frequency / presence
//   penalties (output counts); greedy (argmax, first index on ties) when inv_temp == 0
//   or top_k == 1; otherwise temperature, min-p, top-k, top-p, one inverse-CDF draw.
// Differences from the CPU sampler (docs/gpu.md): the uniform comes from a counter-based
// hash of (seed, step) instead of numpy's PCG64, so a seeded request is reproducible on
// the GPU but draws other tokens than on the CPU; tokens tied with the k-th (top-k) or
// the last nucleus token (top-p) are all kept; the draw walks the kept tokens in index
// order. Greedy is the same as on the CPU.
#include "common.cuh"

#define SAMPLE_THREADS 1024
// Entries a thread (a lane, in the draw) loads before it uses any, in each pass over a
// row (a grammar's mask, top-k's and top-p's radix passes, the draw's sums and walk).
// One at a time (ptxas issued each load where it was used), every entry cost a thread an
// L2 round trip: ~125 in turn a pass over a 128k-entry row, ~20 µs at ~300 cycles each,
// on the one SM the row has. tests/test_cuda_compile.py counts the batches in the SASS.
#define SAMPLE_AHEAD 8
#define WALK_ROUND (SAMPLE_THREADS / 32 * SAMPLE_AHEAD)   // chunks of 32 entries the draw's walk scans at once

__device__ __forceinline__ float key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// A thread's next N entries of x[0, end): x[i + stride u], NaN past the end
// (which every pass skips, as it skips a NaN logit: no comparison holds for it)
template <int N>
__device__ __forceinline__ void load_ahead(const float* __restrict__ x, int i, int stride, int end, float (&v)[N]) {
    #pragma unroll
    for (int u = 0; u < N; u++) {
        int j = i + stride * u;
        v[u] = j < end ? x[j] : __uint_as_float(0x7fffffffu);
    }
}

// An entry's weight in the draw: exp((v - mx) inv_temp) at or above the filters' floor,
// else 0 (NaN included)
__device__ __forceinline__ float draw_weight(float v, float floor_v, float mx, float it) {
    return v >= floor_v ? expf((v - mx) * it) : 0.0f;
}

// The sum of v over a block of THREADS threads (warps' sums, then the sum of those), in
// every thread; sh holds THREADS / 32 values.
template <class T, int THREADS>
__device__ T block_sum(T v, T* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (THREADS / 32) ? sh[lane] : (T)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Top-k's and top-p's thresholds by radix selection on the entries' order keys, 8 bits a
// pass from the top (4 passes over the row, where a bisection took one a bit, up to 32):
// each pass counts the entries whose higher bits are those chosen so far per value of
// the next 8 bits, or sums their weights exp((x - mx) inv_temp); a warp then finds the
// bin holding the need-th unit from the top. Counts and weights are integers (a weight
// in units of 2^-40 of the largest one's), added in any order to the same sum, so a
// seeded draw does not depend on the threads' timing.
#define SAMPLE_BINS 256
#define WEIGHT_UNITS 1099511627776.0f   // 2^40

__device__ __forceinline__ u64 fixed_weight(float v, float mx, float it) {
    float w = v > ELLM_NEG_INF ? expf((v - mx) * it) : 0.0f;   // <= 1 (v <= mx)
    return w > 0.0f ? (u64)(w * WEIGHT_UNITS) : 0ull;           // (NaN: none)
}

// hist[bin] over the entries >= floor_v whose key has `prefix` under `mask`, bin = key
// bits [shift, shift + 8): their count (!MASS) or fixed_weight sum (MASS). A thread adds a
// run of its entries in one bin at once: keys crowd into few bins, and the shared
// counters of one bin serialize every add.
template <bool MASS>
__device__ void radix_hist(const float* __restrict__ x, int V, float floor_v, float mx, float it, u32 prefix,
                           u32 mask, int shift, u64* hist) {
    for (int j = threadIdx.x; j < SAMPLE_BINS; j += SAMPLE_THREADS) hist[j] = 0ull;
    __syncthreads();
    int run_bin = 0;
    u64 run = 0ull;
    for (int i0 = threadIdx.x; i0 < V; i0 += SAMPLE_THREADS * SAMPLE_AHEAD) {
        float ahead[SAMPLE_AHEAD];
        load_ahead(x, i0, SAMPLE_THREADS, V, ahead);
        #pragma unroll
        for (int u = 0; u < SAMPLE_AHEAD; u++) {
            float v = ahead[u];
            u32 key = order_key(v);
            if (!(v >= floor_v) || (key & mask) != prefix) continue;
            u64 add = MASS ? fixed_weight(v, mx, it) : 1ull;
            if (!add) continue;
            int bin = (int)((key >> shift) & 0xffu);
            if (bin != run_bin) {
                if (run) atomicAdd(hist + run_bin, run);
                run_bin = bin;
                run = 0ull;
            }
            run += add;
        }
    }
    if (run) atomicAdd(hist + run_bin, run);
    __syncthreads();
}

// Warp 0: the bin from the top in which the bins' running sum reaches need (frac > 0:
// need = frac x the bins' total, at least 1), and what is still needed inside it, into
// s_bin and s_rem; s_bin -1 where the bins hold less. A lane sums 8 bins (lane 0 the top
// ones), a scan over the lanes, and the lane whose range crosses need walks its 8.
__device__ void radix_pick(const u64* hist, u64 need, float frac, int* s_bin, u64* s_rem) {
    int lane = threadIdx.x & 31;
    u64 mine = 0ull;
    for (int j = 0; j < 8; j++) mine += hist[SAMPLE_BINS - 1 - 8 * lane - j];
    u64 incl = warp_inclusive_sum(mine);
    if (frac > 0.0f) {
        double want = ceil((double)frac * (double)__shfl_sync(0xffffffffu, incl, 31));
        need = want > 1.0 ? (u64)want : 1ull;
    }
    u64 c = incl - mine;   // in the bins above this lane's
    if (c < need && need <= incl) {
        int bin = SAMPLE_BINS - 1 - 8 * lane;
        for (int j = 0; j < 7; j++, bin--) {
            if (c + hist[bin] >= need) break;
            c += hist[bin];
        }
        *s_bin = bin;
        *s_rem = need - c;
    }
    if (lane == 31 && incl < need) *s_bin = -1;
}

// The largest key K such that the counted entries (radix_hist's) with keys >= K hold at
// least need units (frac > 0: frac of all of them); 0 where they hold fewer (no key of
// a number is 0, so a caller's max with its floor keeps the floor).
template <bool MASS>
__device__ u32 radix_select(const float* __restrict__ x, int V, float floor_v, float mx, float it, u64 need,
                            float frac, u64* hist, int* s_bin, u64* s_rem) {
    u32 prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        radix_hist<MASS>(x, V, floor_v, mx, it, prefix, mask, shift, hist);
        if (threadIdx.x < 32) radix_pick(hist, need, shift == 24 ? frac : 0.0f, s_bin, s_rem);
        __syncthreads();
        int bin = *s_bin;
        need = *s_rem;
        __syncthreads();   // read by all before the next pass writes hist, s_bin, s_rem
        if (bin < 0) return 0u;
        prefix |= (u32)bin << shift;
        mask |= 0xffu << shift;
    }
    return prefix;
}

// grid B, block SAMPLE_THREADS. logits are scratch: the penalties are applied in place.
// (a block an SM said: without it ptxas aimed at two, 32 registers a thread, and spilled)
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_rows(
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
        const int* __restrict__ pending,        // (B,) or null: a token generated and not yet in
                                                // pen_ids / pen_counts (a step launched ahead)
        const u64* __restrict__ seeds,          // (B,)
        u64* __restrict__ steps,                // (B,) draws so far; incremented
        const int* __restrict__ mask_rows,      // (B,) or null: each row's grammar mask, -1: none
        const u32* __restrict__ masks,          // (masks, words): token i allowed when bit i % 32
        int words,                              // of word i / 32 is set (llguidance's layout)
        int* __restrict__ out_ids) {            // (B,)
    grid_dependency_sync();
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ float s_best;
    __shared__ int s_best_id, s_found, s_pending_listed;
    __shared__ float s_prefix[SAMPLE_THREADS / 32];
    __shared__ u64 s_hist[SAMPLE_BINS];
    __shared__ u64 s_rem;
    __shared__ int s_bin;
    __shared__ float s_chunk_sum[WALK_ROUND], s_pick_acc;   // the draw's walk
    __shared__ int s_chunk_last[WALK_ROUND], s_walk, s_pick_chunk, s_last;
    int b = blockIdx.x, tid = threadIdx.x;
    float* x = logits + (long long)b * V;

    // a grammar's mask first: what it forbids (and every token past its words) is -inf,
    // which logit_bias and the penalties leave at -inf
    int mask_row = mask_rows ? mask_rows[b] : -1;
    if (mask_row >= 0) {
        const u32* bits = masks + (long long)mask_row * words;
        for (int i0 = tid; i0 < V; i0 += SAMPLE_THREADS * SAMPLE_AHEAD) {
            u32 word[SAMPLE_AHEAD];   // each entry's word, loaded at once (0: past the words)
            #pragma unroll
            for (int u = 0; u < SAMPLE_AHEAD; u++) {
                int i = i0 + SAMPLE_THREADS * u;
                word[u] = i < V && (i >> 5) < words ? bits[i >> 5] : 0u;
            }
            #pragma unroll
            for (int u = 0; u < SAMPLE_AHEAD; u++) {
                int i = i0 + SAMPLE_THREADS * u;
                if (i < V && !((word[u] >> (i & 31)) & 1u)) x[i] = ELLM_NEG_INF;
            }
        }
        __syncthreads();
    }
    for (int i = bias_offsets[b] + tid; i < bias_offsets[b + 1]; i += SAMPLE_THREADS)
        x[bias_ids[i]] += bias_vals[i];
    __syncthreads();
    float rp = rep_penalty[b], fp = freq_penalty[b], pp = pres_penalty[b];
    bool penalised = rp != 1.0f || fp != 0.0f || pp != 0.0f;
    // the pending token counts once more: in the list (distinct ids) or, if not there, alone
    int pend = pending && penalised ? pending[b] : -1;
    if (tid == 0) s_pending_listed = 0;
    __syncthreads();
    for (int i = pen_offsets[b] + tid; i < pen_offsets[b + 1]; i += SAMPLE_THREADS) {
        float v = x[pen_ids[i]], cnt = pen_counts[i];
        if (pen_ids[i] == pend) { cnt += 1.0f; s_pending_listed = 1; }
        if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
        if (cnt > 0.0f) v -= fp * cnt + pp;
        x[pen_ids[i]] = v;
    }
    __syncthreads();
    if (tid == 0 && pend >= 0 && pend < V && !s_pending_listed) {
        float v = x[pend];
        if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
        x[pend] = v - (fp + pp);
    }
    __syncthreads();

    // the maximum and its first index
    float best = ELLM_NEG_INF;
    int best_id = 0x7fffffff;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {   // (ptxas keeps 16 of these loads in flight)
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
    // top-k: the k-th largest key of the entries >= lo (every entry equal to it kept), or
    // lo where fewer entries are there
    if (k > 0 && k < V) {
        u32 kth = radix_select<false>(x, V, lo, mx, it, (u64)k, 0.0f, s_hist, &s_bin, &s_rem);
        floor_key = kth > floor_key ? kth : floor_key;
    }
    float floor_v = key_float(floor_key);
    // top-p: the largest key whose entries at or above it hold top_p of the mass >= floor_v
    float tp = top_p[b];
    if (tp > 0.0f && tp < 1.0f) {
        u32 nucleus = radix_select<true>(x, V, floor_v, mx, it, 1ull, tp, s_hist, &s_bin, &s_rem);
        u32 top = order_key(mx);
        nucleus = nucleus < top ? nucleus : top;
        floor_key = nucleus > floor_key ? nucleus : floor_key;
        floor_v = key_float(floor_key);
    }

    // the draw: a warp a contiguous segment of the row, its lanes reading 32 entries at a
    // time (a thread a contiguous slice made each warp load touch 32 lines), the segments'
    // sums scanned; the segment that holds the target is walked 32 entries (a chunk) at a
    // time, as one warp would: the first entry of weight > 0 whose running sum passes the
    // target (-inf, masked and filtered entries are never drawn), else the segment's last
    // entry of weight > 0
    constexpr int WARPS = SAMPLE_THREADS / 32;
    static_assert(WARPS == 32, "one warp scans the segments' sums");
    int warp = tid >> 5, lane = tid & 31;
    int seg = ((V + WARPS - 1) / WARPS + 31) & ~31;
    int i0 = min(V, warp * seg), i1 = min(V, i0 + seg);
    float mine = 0.0f;
    for (int c = i0 + lane; c < i1; c += 32 * SAMPLE_AHEAD) {
        float ahead[SAMPLE_AHEAD];
        load_ahead(x, c, 32, i1, ahead);
        #pragma unroll
        for (int u = 0; u < SAMPLE_AHEAD; u++)
            mine += draw_weight(ahead[u], floor_v, mx, it);
    }
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    if (lane == 0) s_prefix[warp] = mine;
    if (tid == 0) { s_found = 0x7fffffff; s_walk = WARPS; s_pick_chunk = -1; s_last = -1; }
    __syncthreads();
    if (warp == 0) s_prefix[lane] = warp_inclusive_sum(s_prefix[lane]);   // the segments' (WARPS = 32)
    __syncthreads();
    float kept = s_prefix[WARPS - 1];
    u64 r = splitmix64(seeds[b] ^ splitmix64(steps[b]));
    float target = (float)((double)(r >> 11) * (1.0 / 9007199254740992.0)) * kept;
    float before = warp ? s_prefix[warp - 1] : 0.0f;
    // the first segment whose range holds the target (rounding may make two overlap, or
    // leave the target in none: then the maximum's index)
    if (lane == 0 && mine > 0.0f && target >= before && target < before + mine) atomicMin(&s_walk, warp);
    __syncthreads();
    const int walked = s_walk;
    if (walked < WARPS) {
        // the walk's running sum is sequential (before + the chunks' sums in turn, each a
        // warp scan's last lane), so it is kept: each warp scans chunks of the segment at
        // once (SAMPLE_AHEAD each, a round of WARPS x SAMPLE_AHEAD), thread 0 adds their
        // sums in turn to the chunk where the target is passed, and warp 0 finds the entry
        // in it by the same scan (a warp walking the segment alone took ~125 chunks in turn
        // at a 128k vocabulary, a dozen shuffles' latency each)
        const int w0 = min(V, walked * seg), w1 = min(V, w0 + seg);
        const int chunks = (w1 - w0 + 31) / 32;
        float acc = warp ? 0.0f : (walked ? s_prefix[walked - 1] : 0.0f);   // thread 0's
        for (int r0 = 0; r0 < chunks; r0 += WALK_ROUND) {
            float ahead[SAMPLE_AHEAD];
            load_ahead(x, w0 + 32 * (r0 + warp * SAMPLE_AHEAD) + lane, 32, w1, ahead);
            #pragma unroll
            for (int u = 0; u < SAMPLE_AHEAD; u++) {
                float w = draw_weight(ahead[u], floor_v, mx, it);
                float incl = warp_inclusive_sum(w);
                int lastw = w > 0.0f ? lane : -1;
                for (int o = 16; o > 0; o >>= 1) lastw = max(lastw, __shfl_xor_sync(0xffffffffu, lastw, o));
                if (lane == 31) s_chunk_sum[warp * SAMPLE_AHEAD + u] = incl;
                if (lane == 0) s_chunk_last[warp * SAMPLE_AHEAD + u] = lastw;
            }
            __syncthreads();
            if (tid == 0) {
                for (int j = 0; j < WALK_ROUND && r0 + j < chunks; j++) {
                    if (s_chunk_last[j] >= 0) {
                        if (target < acc + s_chunk_sum[j]) {   // an entry of this chunk passes it
                            s_pick_chunk = r0 + j;
                            s_pick_acc = acc;
                            break;
                        }
                        s_last = w0 + 32 * (r0 + j) + s_chunk_last[j];
                    }
                    acc += s_chunk_sum[j];
                }
            }
            __syncthreads();
            if (s_pick_chunk >= 0) break;   // (the same for every thread)
        }
        if (warp == 0) {
            int pick = s_last;
            if (s_pick_chunk >= 0) {
                int c = w0 + 32 * s_pick_chunk, i = c + lane;
                float v = i < w1 ? x[i] : __uint_as_float(0x7fffffffu);
                float w = draw_weight(v, floor_v, mx, it);
                float incl = warp_inclusive_sum(w);
                int first = w > 0.0f && target < s_pick_acc + incl ? lane : 32;
                for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
                pick = c + first;
            }
            if (lane == 0) s_found = pick;
        }
    }
    __syncthreads();
    if (tid == 0) {
        out_ids[b] = s_found == 0x7fffffff ? argmax : s_found;
        steps[b] += 1;
    }
}

// Greedy rows on many blocks (a row without logit_bias, penalties or logprobs: what
// sample_rows' greedy branch gives, in a fraction of its time: one block scanning a
// 128k-entry row alone is the slowest kernel of a small model's step). Each element
// becomes common.cuh's argmax_key, whose maximum is the same in any order, so the result
// does not depend on how the row is cut (mmv.cu's greedy head takes the same maximum). grid (chunks, B), block
// ARGMAX_THREADS, chunks = ceil(V / ARGMAX_CHUNK); partial (B, chunks); counters (B,)
// start at zero and are left at zero (the last block of a row resets its own).
#define ARGMAX_THREADS 256
#define ARGMAX_CHUNK (ARGMAX_THREADS * 8)

__device__ __forceinline__ u64 block_max_u64(u64 v, u64* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max_u64(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (ARGMAX_THREADS / 32) ? sh[lane] : 0ull;
    return warp_max_u64(v);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(
        const float* __restrict__ logits,   // (B, V)
        int V,
        u64* __restrict__ partial,          // (B, chunks)
        int* __restrict__ counters,         // (B,)
        int* __restrict__ out_ids) {        // (B,)
    grid_dependency_sync();
    __shared__ u64 sh[ARGMAX_THREADS / 32];
    __shared__ int last;
    int c = blockIdx.x, b = blockIdx.y, chunks = gridDim.x;
    const float* x = logits + (long long)b * V;
    int end = min(V, (c + 1) * ARGMAX_CHUNK);
    u64 best = 0ull;
    for (int i = c * ARGMAX_CHUNK + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        u64 k = argmax_key(x[i], i);
        best = k > best ? k : best;
    }
    best = block_max_u64(best, sh);
    if (threadIdx.x == 0) partial[(long long)b * chunks + c] = best;
    if (!last_block_to_finish(counters + b, chunks, &last)) return;
    const volatile u64* row = partial + (long long)b * chunks;
    best = 0ull;
    for (int j = threadIdx.x; j < chunks; j += ARGMAX_THREADS) {
        u64 k = row[j];
        best = k > best ? k : best;
    }
    best = block_max_u64(best, sh);
    if (threadIdx.x == 0) {
        out_ids[b] = argmax_id(best);
        counters[b] = 0;   // ready for the next launch
    }
}

// Log-probabilities for the rows that ask for them, engine/sampler.py's meaning: the
// log-softmax of the raw logits (before logit_bias, penalties and temperature). Per row
// only a record crosses the bus, not the row: its log-sum-exp, its maximum, the raw logit
// of its chosen token and its n most likely tokens. Cut like argmax_rows: grid (chunks,
// R), a block per chunk of ARGMAX_CHUNK entries takes the chunk's maximum, its sum of
// exp(x - maximum) and its n best keys (larger value first, lower index among equals;
// -inf counts, NaN does not); the last block of a row to finish merges the chunks'. The
// row's n best are among its chunks' n best, each list taken in descending order by n
// rounds of "the largest key below the one taken last" (keys hold their index, so none
// is equal to another). A NaN anywhere makes the row's maximum NaN (the host refuses the
// row, as its sampler does).
#define LOGPROB_MAX 20    // sampling_params.MAX_LOGPROBS
#define LOGPROB_HELD 8    // a thread's share of the chunks' keys kept in registers by the last block
#define LOGPROB_HEAD 6    // a record's words before its ids: lse (f64), max, chosen logit, count, chosen id

__device__ __forceinline__ u64 logprob_key(float v, int i) {
    if (v != v) return 0ull;
    return ((u64)order_key(v) << 32) | (u64)(0xffffffffu - (u32)i);
}

// NaN wins, else the larger
__device__ __forceinline__ float nan_max(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

__device__ float block_nan_max(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (ARGMAX_THREADS / 32) ? sh[lane] : ELLM_NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) logprob_rows(
        const float* __restrict__ src,      // rows of raw logits, V each
        int V,
        const int* __restrict__ src_rows,   // (R,) each record's row of src; null: record r's is r
        const int* __restrict__ id_rows,    // (R,) each record's row of ids; null: r
        const int* __restrict__ ids,        // the chosen tokens, by row of the batch
        int n,                              // top tokens a record holds (<= LOGPROB_MAX)
        float* __restrict__ part_ms,        // (R, chunks, 2): each chunk's maximum and sum
        u64* __restrict__ part_keys,        // (R, chunks, n): each chunk's best keys, 0 after
        int* __restrict__ counters,         // (R,) start at zero, left at zero
        int* __restrict__ out) {            // (R, LOGPROB_HEAD + 2 n) int32 words
    grid_dependency_sync();
    __shared__ u64 shk[ARGMAX_THREADS / 32];
    __shared__ float shf[ARGMAX_THREADS / 32];
    __shared__ double shd[ARGMAX_THREADS / 32];
    __shared__ int last;
    int c = blockIdx.x, r = blockIdx.y, chunks = gridDim.x, tid = threadIdx.x;
    const float* x = src + (long long)(src_rows ? src_rows[r] : r) * V;
    int begin = c * ARGMAX_CHUNK, end = min(V, begin + ARGMAX_CHUNK);

    // this chunk: ARGMAX_CHUNK / ARGMAX_THREADS entries a thread, kept as keys
    const int per = ARGMAX_CHUNK / ARGMAX_THREADS;
    u64 key[per];
    float mx = ELLM_NEG_INF;
#pragma unroll
    for (int j = 0; j < per; j++) {
        int i = begin + tid + j * ARGMAX_THREADS;
        float v = i < end ? x[i] : ELLM_NEG_INF;
        key[j] = i < end ? logprob_key(v, i) : 0ull;
        mx = nan_max(mx, v);
    }
    mx = block_nan_max(mx, shf);
    float sum = 0.0f;
    if (mx > ELLM_NEG_INF && mx < -ELLM_NEG_INF) {   // finite (not NaN either)
#pragma unroll
        for (int j = 0; j < per; j++)
            if (key[j]) sum += expf(key_float((u32)(key[j] >> 32)) - mx);
    }
    double total = block_sum<double, ARGMAX_THREADS>((double)sum, shd);
    long long part = (long long)r * chunks + c;
    u64 below = ~0ull;
    for (int k = 0; k < n; k++) {
        u64 mine = 0ull;
#pragma unroll
        for (int j = 0; j < per; j++)
            if (key[j] < below && key[j] > mine) mine = key[j];
        below = block_max_u64(mine, shk);
        if (tid == 0) part_keys[part * n + k] = below;   // 0 once the chunk has no more
    }
    if (tid == 0) {
        part_ms[2 * part] = mx;
        part_ms[2 * part + 1] = (float)total;
    }
    if (!last_block_to_finish(counters + r, chunks, &last)) return;

    // the row: the chunks' maxima and sums merged, then their keys
    const volatile float* ms = part_ms + (long long)r * chunks * 2;
    const volatile u64* keys = part_keys + (long long)r * chunks * n;
    float row_mx = ELLM_NEG_INF;
    for (int j = tid; j < chunks; j += ARGMAX_THREADS) row_mx = nan_max(row_mx, ms[2 * j]);
    row_mx = block_nan_max(row_mx, shf);
    bool finite = row_mx > ELLM_NEG_INF && row_mx < -ELLM_NEG_INF;
    double s = 0.0;
    for (int j = tid; j < chunks; j += ARGMAX_THREADS) {
        float m = ms[2 * j];
        if (finite && m > ELLM_NEG_INF) s += (double)ms[2 * j + 1] * exp((double)m - (double)row_mx);
    }
    s = block_sum<double, ARGMAX_THREADS>(s, shd);
    int* rec = out + (long long)r * (LOGPROB_HEAD + 2 * n);
    // the chunks' keys, read once into registers where they fit (each of the n rounds
    // below read them all again from L2, a few loads in turn a round)
    const int n_keys = chunks * n;
    const bool held_all = n_keys <= ARGMAX_THREADS * LOGPROB_HELD;
    u64 held[LOGPROB_HELD];
#pragma unroll
    for (int u = 0; u < LOGPROB_HELD; u++) {
        int j = tid + ARGMAX_THREADS * u;
        held[u] = held_all && j < n_keys ? keys[j] : 0ull;
    }
    below = ~0ull;
    int count = 0;
    for (int k = 0; k < n; k++) {
        u64 mine = 0ull;
#pragma unroll
        for (int u = 0; u < LOGPROB_HELD; u++)
            if (held[u] < below && held[u] > mine) mine = held[u];
        for (int j = held_all ? n_keys : tid; j < n_keys; j += ARGMAX_THREADS) {   // (where they do not fit)
            u64 q = keys[j];
            if (q < below && q > mine) mine = q;
        }
        below = block_max_u64(mine, shk);
        if (!below) break;   // fewer than n entries that are not NaN
        if (tid == 0) {
            rec[LOGPROB_HEAD + k] = (int)(0xffffffffu - (u32)below);
            rec[LOGPROB_HEAD + n + k] = __float_as_int(key_float((u32)(below >> 32)));
        }
        count++;
    }
    if (tid == 0) {
        double lse = finite ? (double)row_mx + log(s) : (double)__int_as_float(0x7fc00000);
        u64 bits = (u64)__double_as_longlong(lse);
        rec[0] = (int)(u32)bits;
        rec[1] = (int)(u32)(bits >> 32);
        rec[2] = __float_as_int(row_mx);
        int tok = ids[id_rows ? id_rows[r] : r];
        rec[3] = __float_as_int(tok >= 0 && tok < V ? x[tok] : __int_as_float(0x7fc00000));
        rec[4] = count;
        rec[5] = tok;
        counters[r] = 0;   // ready for the next launch
    }
}
