// Decode products on the tensor cores: up to MMV_TOKENS tokens against BF16, F16 or
// quantized weight rows, each weight read once whatever the batch. The same meanings as
// linear.cu's gemv / nmv3 / glu / gemv_add / qkv_rope (ops/reference.py), which keep
// serving F32 weights and K not a multiple of 32.
//
// A block takes a tile of 16 weight rows (slots 0..15) and every token; its MMV_WARPS warps
// split K in steps of 32 (warp w takes steps w, w + MMV_WARPS, ...), each step two
// mma.sync.m16n8k16 per 8 tokens, and the block sums the warps' partials in warp order.
//
// Exactness. Activations are split into two bfloat16 terms, x = hi + lo (hi = bf16(x),
// lo = bf16(x - hi): 16 significant bits), and both go through the tensor cores, so the
// products lose ~2^-17 of x rather than bf16's 2^-9. BF16 weights are exact bf16; an F16
// weight (11 significant bits) goes in as two bf16 terms as well, hi + lo, exactly, so an
// F16 step takes four products where a BF16 one takes two; a quantized block goes in as
// its integers (exact in bf16: |q| <= 32 or int8) and its f32
// scale multiplies the step's sum afterwards; a block min multiplies the step's sum of x
// (an mma against ones). f32 accumulation.
//
// Batch invariance: a token's result depends on its own column only. Each output's steps,
// mma order and warp order are fixed by K, never by the number of tokens, so a token gets
// the same bits in a batch of 1 or of 64 (DESIGN.md's contract among decode steps).
//
// Fragments. Lane l = 4 g + q of a warp holds slots g and g + 8 of A (weights) and token
// column g of B (activations). The 32 k of a step are dealt to lanes so that each lane
// reads contiguous weight bytes: "wide" types give lane q the 8 k at 8q (word i = k 8q + 2i,
// 8q + 2i + 1; words 0-1 feed the first mma, 2-3 the second); "split" types give it the 4 k
// at 4q for the first mma and the 4 k at 16 + 4q for the second (so each mma covers 16
// consecutive k: Q6_K's scales change every 16, the nibble types keep k and k + 16 in one
// byte). The sum over k does not care which mma slot a k lands in, as long as the weight
// and activation fragments agree: both use the lane's positions below.
#include "common.cuh"

#define MMV_TOKENS 64   // = ops/cuda.py GEMM_MIN_TOKENS: the largest decode step
#define MMV_WARPS 8
#define MMV_UNROLL 4    // steps whose weights a warp loads before multiplying, above one tile a block

struct Frag {
    u32 w[4];      // the A words of this lane's row for the step (bf16 pairs, low half first)
    u32 wl[4];     // F16: the words of the weights' lo terms (w: their hi terms)
    float sc[2];   // the scale of the first / second mma's k (quantized types; 0: no row)
    float mn[2];   // the added constant per element of each (types with a min)
};

__device__ __forceinline__ u32 pack_int_pair(int a, int b) {
    return pack_bf16x2((float)a, (float)b);   // |a|, |b| <= 256: exact
}

// Each type reads a lane's bytes of step s of a row in load() (every load of a step, the
// scales' aside: a Raw) and makes the fragment from them in unpack(), apart, so that
// mmv_warp has all its unrolled steps' loads in flight before the first is used (in one
// function, a load's use followed it at once, and ptxas waited for each load of a
// quantized row before it issued the next: one load in flight a lane).

// BF16 rows: 16 bytes at 32 s + 8q.
struct WBf16 {
    static constexpr bool split = false, scaled = false, has_min = false, rows_split = false, scale_words = false;
    static constexpr bool two_terms = false;
    using Raw = uint4;
    static constexpr int unroll = 4;
    static __device__ __forceinline__ const u8* values(const u8* row, int s) { return row + 64 * s; }
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        return *(const uint4*)(values(row, s) + 16 * q);   // 16-byte aligned (K % 32 == 0)
    }
    static __device__ __forceinline__ void unpack(const Raw& v, int s, int lane, Frag& f) {
        f.w[0] = v.x; f.w[1] = v.y; f.w[2] = v.z; f.w[3] = v.w;
        f.sc[0] = f.sc[1] = 1.0f;
        f.mn[0] = f.mn[1] = 0.0f;
    }
};

// F16 rows: as BF16's (16 bytes at 32 s + 8q), each pair of halves made two bf16 pairs,
// hi = bf16(w) and lo = w - hi: an f16's 11 significant bits fit the two exactly (and its
// exponents bf16's), so the products are those of the f16 weights.
struct WF16 : WBf16 {
    static constexpr bool two_terms = true;
    static __device__ __forceinline__ void unpack(const Raw& v, int s, int lane, Frag& f) {
        const u32 words[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int i = 0; i < 4; i++)
            split_bf16(f16_to_f32((u16)(words[i] & 0xffffu)), f16_to_f32((u16)(words[i] >> 16)), f.w[i], f.wl[i]);
        f.sc[0] = f.sc[1] = 1.0f;
        f.mn[0] = f.mn[1] = 0.0f;
    }
};

// Q8_0, Q4_0, Q4_1 and Q6_K as the GPU keeps them (common.cuh, ops/cuda_kernels.py rows_split):
// a row's values, then its scales. A lane's values of a step are one load; the scales are
// the caller's: mmv_warp loads a row's scales of several steps at once (scale_load(), a
// ScaleRaw), passes each step's to the lanes of the row (scale_shfl()) and each fragment
// takes its step's (set_scales()). SplitRows<VB, SB>: VB bytes of values a step of 32, then
// SB bytes of scales a step (2: f16 d, or Q6_K's two int8 scales; 4: f16 d, then f16 m);
// scale_tail: any further scale bytes of a step (Q6_K's block d).
template <int VB, int SB>
struct SplitRows {
    static constexpr bool rows_split = true, scale_words = true, two_terms = false;
    static __device__ __forceinline__ const u8* values(const u8* row, int s) { return row + VB * s; }
    static __device__ __forceinline__ const u8* scales(const u8* row, int K, int s) {
        return split_scales(row, K, VB, SB, s);
    }
    using ScaleRaw = u32;   // the step's scale word
    static __device__ __forceinline__ ScaleRaw scale_load(const u8* row, int K, int s) {
        return SB == 4 ? *(const u32*)scales(row, K, s) : (u32)(*(const u16*)scales(row, K, s));
    }
    static __device__ __forceinline__ ScaleRaw scale_shfl(const ScaleRaw& r, int src) {
        return __shfl_sync(0xffffffffu, r, src);
    }
    static __device__ __forceinline__ void set_scales(const ScaleRaw& word, Frag& f) {
        f.sc[0] = f.sc[1] = f16_to_f32((u16)(word & 0xffffu));
        f.mn[0] = f.mn[1] = SB == 4 ? f16_to_f32((u16)(word >> 16)) : 0.0f;
    }
    static __device__ __forceinline__ const u8* scale_tail(const u8* row, int K, int s) { return nullptr; }
};

// Q8_0: 32 int8 a step; the 8 q at 8q in one 8-byte load. Scale word: f16 d.
struct WQ8_0 : SplitRows<32, 2> {
    static constexpr bool split = false, scaled = true, has_min = false;
    static constexpr int unroll = 8;
    using Raw = uint2;
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        return *(const uint2*)(values(row, s) + 8 * q);
    }
    static __device__ __forceinline__ void unpack(const Raw& v, int s, int lane, Frag& f) {
        #pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 word = i ? v.y : v.x;
            f.w[2 * i] = pack_int_pair((int)(i8)(word & 0xffu), (int)(i8)((word >> 8) & 0xffu));
            f.w[2 * i + 1] = pack_int_pair((int)(i8)((word >> 16) & 0xffu), (int)(i8)(word >> 24));
        }
    }
};

// A split type's lane fragment from its 4 bytes of nibbles (bytes 4q .. 4q + 3: k 4q + i in
// the low nibbles, 16 + 4q + i in the high ones) and, for Q5_K, its byte of fifth bits
// (k 4q + i at bit i, 16 + 4q + i at bit 4 + i); each value plus bias.
__device__ __forceinline__ void frag_nibbles(u32 v, u32 fifth, int bias, Frag& f) {
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        int c0 = (v >> (16 * i)) & 0xff, c1 = (v >> (16 * i + 8)) & 0xff;
        int b0 = (fifth >> (2 * i)) & 1, b1 = (fifth >> (2 * i + 1)) & 1;
        int b2 = (fifth >> (4 + 2 * i)) & 1, b3 = (fifth >> (5 + 2 * i)) & 1;
        f.w[i] = pack_int_pair(((c0 & 15) | (b0 << 4)) + bias, ((c1 & 15) | (b1 << 4)) + bias);
        f.w[2 + i] = pack_int_pair(((c0 >> 4) | (b2 << 4)) + bias, ((c1 >> 4) | (b3 << 4)) + bias);
    }
}

// Q4_0: 16 bytes of nibbles a step, k < 16 the low nibble of byte k, k >= 16 the high
// nibble of byte k - 16; value d (q - 8). Split: bytes 4q .. 4q + 3 (one 4-byte load) hold
// both mmas' k. Scale word: f16 d.
struct WQ4_0 : SplitRows<16, 2> {
    static constexpr bool split = true, scaled = true, has_min = false;
    static constexpr int unroll = 16;
    using Raw = u32;
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        return *(const u32*)(values(row, s) + 4 * q);
    }
    static __device__ __forceinline__ void unpack(const Raw& v, int s, int lane, Frag& f) { frag_nibbles(v, 0u, -8, f); }
};

// Q4_1: nibbles as Q4_0; value d q + m. Scale word: f16 d, then f16 m.
struct WQ4_1 : SplitRows<16, 4> {
    static constexpr bool split = true, scaled = true, has_min = true;
    static constexpr int unroll = 8;
    using Raw = u32;
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        return *(const u32*)(values(row, s) + 4 * q);
    }
    static __device__ __forceinline__ void unpack(const Raw& v, int s, int lane, Frag& f) { frag_nibbles(v, 0u, 0, f); }
};

// Q4_K and Q5_K as the GPU keeps them (common.cuh k_head): STEP bytes a step (its nibbles
// as Q4_0's, then Q5_K's 4 bytes of fifth bits), then the block heads. Step s is
// sub-block s % 8 (scale d sc, min dmin mn, from three words of its block's head; a
// warp's unrolled steps are in different blocks, so the steps share no head, but the
// four lanes of a row do: Raw below); value d sc q - dmin mn.
template <int STEP, int UNROLL>
struct KQuantRows {
    static constexpr bool split = true, scaled = true, has_min = true, rows_split = true, scale_words = false;
    static constexpr bool two_terms = false;
    static constexpr int unroll = UNROLL;
    static __device__ __forceinline__ const u8* values(const u8* row, int s) { return row + STEP * s; }
    static __device__ __forceinline__ const u8* scales(const u8* row, int K, int s) {
        return k_head<STEP>(row, K, s >> 3);
    }
    static __device__ __forceinline__ const u8* scale_tail(const u8* row, int K, int s) { return nullptr; }
    // The four lanes of a row load one word each of the step's 16-byte block head (word q)
    // and unpack() passes round the three the step needs: a lane keeps one register of
    // head a step, not three, which lets Q4_K take 8 steps ahead in 128 registers.
    struct Raw {
        u32 v, fifth;   // the lane's 4 bytes of nibbles; Q5_K's byte of fifth bits
        u32 head;       // word q of the block head
    };
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        const u8* rec = values(row, s);
        return {*(const u32*)(rec + 4 * q), STEP == 20 ? (u32)rec[16 + q] : 0u, *(const u32*)(scales(row, K, s) + 4 * q)};
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int s, int lane, Frag& f) {
        int quad = lane & ~3;   // (every lane of the warp comes here: the shuffles see them all)
        KHead h;
        h.dt.x = __shfl_sync(0xffffffffu, r.head, quad);
        h.dt.y = __shfl_sync(0xffffffffu, r.head, quad | 1);
        h.low = __shfl_sync(0xffffffffu, r.head, quad | (2 + ((s & 7) >> 2)));
        float sc, mn;
        k_head_scale_min(h, s & 7, &sc, &mn);
        frag_nibbles(r.v, r.fifth, 0, f);
        f.sc[0] = f.sc[1] = sc;
        f.mn[0] = f.mn[1] = -mn;
    }
};
struct WQ4_K : KQuantRows<16, 8> {};   // 144 bytes / 256
struct WQ5_K : KQuantRows<20, 4> {};   // 176 bytes / 256 (8 steps ahead would take 150 registers)

// Q6_K as the GPU keeps it (common.cuh deq8_q6_k): a step's 24-byte record, lane q's
// nibbles in bytes 4q .. 4q + 3 (k 4q + i low, 16 + 4q + i high: one 4-byte load) and its
// high bit pairs in u16 word q (one 2-byte load). Scale word: the step's two int8 scales
// (each mma's 16 k share one), then the block's f16 d.
struct WQ6_K : SplitRows<24, 2> {
    static constexpr bool split = true, scaled = true, has_min = false;
    static constexpr int unroll = 8;
    static __device__ __forceinline__ const u8* scale_tail(const u8* row, int K, int s) {
        return q6_k_d(row, K, s >> 3);
    }
    // the step's two int8 scales and the block's f16 d, kept apart until set_scales: a
    // word made of them as they were loaded had ptxas wait for the loads before it issued
    // the weights' (two shuffles a step instead of one)
    struct ScaleRaw {
        u32 sc, d;
    };
    static __device__ __forceinline__ ScaleRaw scale_load(const u8* row, int K, int s) {
        return {(u32)(*(const u16*)scales(row, K, s)), (u32)(*(const u16*)scale_tail(row, K, s))};
    }
    static __device__ __forceinline__ ScaleRaw scale_shfl(const ScaleRaw& r, int src) {
        return {__shfl_sync(0xffffffffu, r.sc, src), __shfl_sync(0xffffffffu, r.d, src)};
    }
    static __device__ __forceinline__ void set_scales(const ScaleRaw& r, Frag& f) {
        float d = f16_to_f32((u16)r.d);
        f.sc[0] = d * (float)(i8)(r.sc & 0xffu);
        f.sc[1] = d * (float)(i8)((r.sc >> 8) & 0xffu);
        f.mn[0] = f.mn[1] = 0.0f;
    }
    struct Raw {
        u32 v, h;   // the lane's 4 bytes of nibbles and its u16 of high bit pairs
    };
    static __device__ __forceinline__ Raw load(const u8* row, int K, int s, int q) {
        const u8* rec = values(row, s);
        return {*(const u32*)(rec + 4 * q), (u32)(*(const u16*)(rec + 16 + 2 * q))};
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int s, int lane, Frag& f) {
        u32 v = r.v, h = r.h;
        #pragma unroll
        for (int m = 0; m < 2; m++) {   // the two mmas: k 4q + i (low nibbles), 16 + 4q + i (high)
            int e[4];
            #pragma unroll
            for (int i = 0; i < 4; i++)
                e[i] = (int)(((v >> (8 * i + 4 * m)) & 15u) | (((h >> (8 * m + 2 * i)) & 3u) << 4)) - 32;
            f.w[2 * m] = pack_int_pair(e[0], e[1]);
            f.w[2 * m + 1] = pack_int_pair(e[2], e[3]);
        }
    }
};

// A row of K floats (a token's activations, or the norm weight) at this lane's 8 k of the
// step (the k its fragments cover).
template <bool SPLIT>
__device__ __forceinline__ void act_load(const float* __restrict__ xrow, int k0, int q, float (&x)[8]) {
    int p0 = SPLIT ? k0 + 4 * q : k0 + 8 * q, p1 = SPLIT ? k0 + 16 + 4 * q : k0 + 8 * q + 4;
    float4 a = *(const float4*)(xrow + p0), b = *(const float4*)(xrow + p1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// Their squares' sum, in one order (explicit fma: one rounding whatever the compiler).
__device__ __forceinline__ float sum_sq8(const float (&x)[8]) {
    float s = 0.0f;
    #pragma unroll
    for (int i = 0; i < 8; i++) s = fmaf(x[i], x[i], s);
    return s;
}

// hi and lo bf16 words of the activations of one token at this lane's 8 k of the step
// (times the norm weight g when folded); -> their squares' sum when asked for, else 0.
template <bool SPLIT>
__device__ __forceinline__ float act_frag(const float* __restrict__ xrow, const float* __restrict__ g, int k0,
                                          int q, u32* hi, u32* lo, bool want_sq) {
    float x[8];
    act_load<SPLIT>(xrow, k0, q, x);
    float sq = want_sq ? sum_sq8(x) : 0.0f;
    if (g) {
        float gs[8];
        act_load<SPLIT>(g, k0, q, gs);
        #pragma unroll
        for (int i = 0; i < 8; i++) x[i] *= gs[i];
    }
    #pragma unroll
    for (int i = 0; i < 4; i++) split_bf16(x[2 * i], x[2 * i + 1], hi[i], lo[i]);
    return sq;
}

// A step's products on the tensor cores: c1 += a1 (bh1 + bl1), then c2 += a2 (bh2 + bl2),
// each activation as its hi and then its lo bf16 term (c1 and c2 may be one array).
__device__ __forceinline__ void step_products(float* c1, float* c2, const u32* a1, const u32* a2,
                                              const u32* bh1, const u32* bl1, const u32* bh2, const u32* bl2) {
    mma_bf16_16816(c1, a1, bh1);
    mma_bf16_16816(c1, a1, bl1);
    mma_bf16_16816(c2, a2, bh2);
    mma_bf16_16816(c2, a2, bl2);
}

// A type's ScaleRaw, or a word for the types without scale words (never loaded).
template <class WT, bool HAS>
struct ScaleRawOf { using type = u32; };
template <class WT>
struct ScaleRawOf<WT, true> { using type = typename WT::ScaleRaw; };

// Which row of X (rows of K floats) token t of a product reads: row t (RowsInOrder), or
// another (moe.cu: an entry's token).
struct RowsInOrder {
    __device__ __forceinline__ int operator()(int t) const { return t; }
};

// This warp's share of RT tiles: for tile r, rows ra[r] (slot g) and rb[r] (slot g + 8)
// of this lane against tokens 0 .. T-1 of X (token t: row rows(t)), over its steps of K, into
// acc[r]. The activations of a step are read once for the RT tiles (a block of RT tiles
// reads X once, not RT times); each tile's accumulator sees the same products in the same
// order whatever RT is, so its sums are the same bits. With a norm weight g, ss[j] takes
// this lane's share of token 8 j + gi's sum of squares, step by step: from the products'
// own loads with two tiles; with one (whose registers are full during the loop) from a
// second read of the same steps after it, which the warp's L1 mostly holds. The same
// sums in the same order either way.
template <class WT, int RT, class Rows>
__device__ __forceinline__ void mmv_warp(const u8* const* ra, const u8* const* rb, const float* __restrict__ X,
                                         const float* __restrict__ g, int T, int K,
                                         float (&acc)[RT][MMV_TOKENS / 8][4], float (&ss)[MMV_TOKENS / 8],
                                         Rows rows) {
    // steps whose loads are in flight at once: with one tile the type's (more for the types
    // of fewer bytes a step), with RT tiles MMV_UNROLL / RT (the same bytes for any RT)
    constexpr int U = RT == 1 ? WT::unroll : MMV_UNROLL / RT;
    constexpr int SW = (U + 3) / 4;   // scale words a lane loads for a row
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gi = lane >> 2, q = lane & 3;
    int tiles = (T + 7) >> 3;
    #pragma unroll
    for (int r = 0; r < RT; r++) {
        #pragma unroll
        for (int j = 0; j < MMV_TOKENS / 8; j++) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < MMV_TOKENS / 8; j++) ss[j] = 0.0f;
    const u32 ones = 0x3f803f80u;   // bf16 1.0 twice
    const u32 ones_a[4] = {ones, ones, ones, ones};
    int steps = K >> 5;
    // U of this warp's steps at a time: their weight loads are all issued before the first
    // product, so enough bytes are in flight at batch 1 (the steps, and so the order of
    // the sums, are those of a one-step loop)
    for (int s0 = warp; s0 < steps; s0 += U * MMV_WARPS) {
      // Split rows (Q8_0, Q4_0, Q4_1, Q6_K): lane q loads its rows' scale words of steps
      // s0 + (q + 4 i) MMV_WARPS (q + 4 i < U) and the four lanes of a row pass them round
      // below: a lane's load a row for up to four steps (U = 1, four tiles: each lane its
      // own step's, below)
      using ScaleRaw = typename ScaleRawOf<WT, WT::scale_words>::type;
      ScaleRaw das[RT][SW], dbs[RT][SW];
      if constexpr (WT::scale_words && U > 1) {
        #pragma unroll
        for (int i = 0; i < SW; i++) {
            int sq = s0 + (q + 4 * i) * MMV_WARPS;
            bool mine = q + 4 * i < U && sq < steps;
            #pragma unroll
            for (int r = 0; r < RT; r++) {
                das[r][i] = mine && ra[r] ? WT::scale_load(ra[r], K, sq) : ScaleRaw{};
                dbs[r][i] = mine && rb[r] ? WT::scale_load(rb[r], K, sq) : ScaleRaw{};
            }
        }
      }
      // every load of the U steps first, nothing of them used until all are issued (four
      // tiles of a scaled type: each tile's as it is used, which their registers need)
      constexpr bool ahead = U > 1 || !WT::scale_words;
      typename WT::Raw was[U][RT], wbs[U][RT];
      #pragma unroll
      for (int u = 0; u < (ahead ? U : 0); u++) {
        int s = s0 + u * MMV_WARPS;
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            was[u][r] = s < steps && ra[r] ? WT::load(ra[r], K, s, q) : typename WT::Raw{};
            wbs[u][r] = s < steps && rb[r] ? WT::load(rb[r], K, s, q) : typename WT::Raw{};
        }
      }
      #pragma unroll
      for (int u = 0; u < U; u++) {
        int s = s0 + u * MMV_WARPS;
        if (s >= steps) break;   // (the same s for the whole warp: the shuffles below see every lane)
        int k0 = s << 5;
        Frag fas[RT], fbs[RT];
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            if constexpr (!ahead) {
                was[u][r] = ra[r] ? WT::load(ra[r], K, s, q) : typename WT::Raw{};
                wbs[u][r] = rb[r] ? WT::load(rb[r], K, s, q) : typename WT::Raw{};
            }
            // (a row of none, past the matrix's end, unpacks zero bytes: its slot's sums,
            // which an mma keeps apart from the other slots', are never stored)
            WT::unpack(was[u][r], s, lane, fas[r]);
            WT::unpack(wbs[u][r], s, lane, fbs[r]);
            if constexpr (WT::scale_words) {
                ScaleRaw da, db;
                if constexpr (U > 1) {
                    da = WT::scale_shfl(das[r][u >> 2], (lane & ~3) | (u & 3));
                    db = WT::scale_shfl(dbs[r][u >> 2], (lane & ~3) | (u & 3));
                } else {
                    da = ra[r] ? WT::scale_load(ra[r], K, s) : ScaleRaw{};
                    db = rb[r] ? WT::scale_load(rb[r], K, s) : ScaleRaw{};
                }
                WT::set_scales(da, fas[r]);   // (a row of none: scale 0, min 0)
                WT::set_scales(db, fbs[r]);
            }
        }
        #pragma unroll
        for (int j = 0; j < MMV_TOKENS / 8; j++) {
            if (j >= tiles) break;
            int t = 8 * j + gi;
            u32 hi[4] = {0u, 0u, 0u, 0u}, lo[4] = {0u, 0u, 0u, 0u};
            if (t < T) {
                float sq = act_frag<WT::split>(X + (long long)rows(t) * K, g, k0, q, hi, lo, RT > 1 && g);
                if (RT > 1 && g) ss[j] += sq;
            }
            const u32 bh1[2] = {hi[0], hi[1]}, bl1[2] = {lo[0], lo[1]};
            const u32 bh2[2] = {hi[2], hi[3]}, bl2[2] = {lo[2], lo[3]};
            #pragma unroll
            for (int r = 0; r < RT; r++) {
                const Frag& fa = fas[r];
                const Frag& fb = fbs[r];
                const u32 a1[4] = {fa.w[0], fb.w[0], fa.w[1], fb.w[1]};
                const u32 a2[4] = {fa.w[2], fb.w[2], fa.w[3], fb.w[3]};
                if (!WT::scaled) {
                    step_products(acc[r][j], acc[r][j], a1, a2, bh1, bl1, bh2, bl2);
                    if constexpr (WT::two_terms) {   // the weights' lo terms after their hi terms
                        const u32 l1[4] = {fa.wl[0], fb.wl[0], fa.wl[1], fb.wl[1]};
                        const u32 l2[4] = {fa.wl[2], fb.wl[2], fa.wl[3], fb.wl[3]};
                        step_products(acc[r][j], acc[r][j], l1, l2, bh1, bl1, bh2, bl2);
                    }
                    continue;
                }
                float c1[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                step_products(c1, c2, a1, a2, bh1, bl1, bh2, bl2);
                #pragma unroll
                for (int i = 0; i < 4; i++) {   // c[0], c[1]: slot g; c[2], c[3]: slot g + 8
                    const Frag& f = i < 2 ? fa : fb;
                    acc[r][j][i] += f.sc[0] * c1[i] + f.sc[1] * c2[i];
                }
                if (WT::has_min) {
                    float s1[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    step_products(s1, s2, ones_a, ones_a, bh1, bl1, bh2, bl2);
                    #pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const Frag& f = i < 2 ? fa : fb;
                        acc[r][j][i] += f.mn[0] * s1[i] + f.mn[1] * s2[i];
                    }
                }
            }
        }
      }
    }
    if (RT == 1 && g) {
        #pragma unroll
        for (int j = 0; j < MMV_TOKENS / 8; j++) {
            int t = 8 * j + gi;
            if (j >= tiles) break;
            if (t >= T) continue;
            for (int s = warp; s < steps; s += MMV_WARPS) {
                float x[8];
                act_load<WT::split>(X + (long long)rows(t) * K, s << 5, q, x);
                ss[j] += sum_sq8(x);
            }
        }
    }
}

// Before grid_dependency_sync: the lines of this warp's first 8 steps of the block's rows
// into L2 (lane 4 g + q: steps warp + q MMV_WARPS and warp + (q + 4) MMV_WARPS of its rows
// g and g + 8 of each tile: the first two rounds of mmv_warp's loads with one tile, four
// with two), so the weights' trip from memory overlaps the kernel before, and a product
// of up to 8 steps a warp (K <= 2048) finds all its weights on the way.
template <class WT, int RT>
__device__ __forceinline__ void prefetch_first_steps(const u8* const* ra, const u8* const* rb, int K) {
    int warp = threadIdx.x >> 5, q = threadIdx.x & 3;
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        int s = warp + (q + 4 * i) * MMV_WARPS;
        if (s >= (K >> 5)) return;
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            if constexpr (WT::rows_split) {   // values and scales apart
                const u8* rows[2] = {ra[r], rb[r]};
                #pragma unroll
                for (int x = 0; x < 2; x++) {
                    if (!rows[x]) continue;
                    prefetch_l2(WT::values(rows[x], s));
                    prefetch_l2(WT::scales(rows[x], K, s));
                    if (const u8* tail = WT::scale_tail(rows[x], K, s)) prefetch_l2(tail);
                }
            } else {   // BF16: the values alone
                if (ra[r]) prefetch_l2(WT::values(ra[r], s));
                if (rb[r]) prefetch_l2(WT::values(rb[r], s));
            }
        }
    }
}

// After grid_dependency_sync (X is the kernel before's output): the lines of X's first 8
// tokens and of the norm weight g that this warp's steps read, into L1. mmv_warp loads a
// step's activations only after the step before is multiplied (registers hold the
// weights' loads in flight), so each is a trip to memory in turn: from L2 ~0.2 µs, a
// round of U steps U of them, longer than the round's weights take to arrive from HBM for
// the types of 16 steps ahead. Asked for here all at once, they are near when needed.
template <class Rows = RowsInOrder>
__device__ __forceinline__ void prefetch_activations(const float* __restrict__ X, const float* __restrict__ g,
                                                     int T, int K, Rows rows = Rows()) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int first = T < 8 ? T : 8, steps = K >> 5;
    for (int r = 0; r <= first; r++) {
        const float* row = r < first ? X + (long long)rows(r) * K : g;
        if (!row) break;
        for (int s = warp + lane * MMV_WARPS; s < steps; s += 32 * MMV_WARPS) prefetch_l1(row + (s << 5));
    }
}

// One tile's accumulators into part[warp][slot][token], for the block's ordered sum.
__device__ __forceinline__ void store_part(const float (&acc)[MMV_TOKENS / 8][4], int T,
                                           float (*part)[16][MMV_TOKENS]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gi = lane >> 2, q = lane & 3;
    int tiles = (T + 7) >> 3;
    #pragma unroll
    for (int j = 0; j < MMV_TOKENS / 8; j++) {
        if (j >= tiles) break;
        int t = 8 * j + 2 * q;
        part[warp][gi][t] = acc[j][0];
        part[warp][gi][t + 1] = acc[j][1];
        part[warp][gi + 8][t] = acc[j][2];
        part[warp][gi + 8][t + 1] = acc[j][3];
    }
}

// The block's sum of slot s, token t (warps in order).
__device__ __forceinline__ float tile_sum(float (*part)[16][MMV_TOKENS], int s, int t) {
    float v = 0.0f;
    #pragma unroll
    for (int w = 0; w < MMV_WARPS; w++) v += part[w][s][t];
    return v;
}

// The warps' shares of each token's sum of squares (mmv_warp's ss) into sq[warp][t]: the
// 4 lanes of a token's column summed by a butterfly (the same bits in each), then one
// lane writes. Read by token_inv after the block's barrier.
__device__ __forceinline__ void store_sq(float (&ss)[MMV_TOKENS / 8], int T, float (*sq)[MMV_TOKENS]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gi = lane >> 2, q = lane & 3;
    #pragma unroll
    for (int j = 0; j < MMV_TOKENS / 8; j++) {
        if (8 * j >= T) break;   // uniform across the warp: every lane takes part in the shuffles
        float v = ss[j];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        int t = 8 * j + gi;
        if (q == 0 && t < T) sq[warp][t] = v;
    }
}

// 1 / sqrt(mean(x_t^2) + eps) of token t from the warps' shares in warp order (each token's
// squares summed in an order fixed by K: lane, step, lanes of a column, warps), or 1
// without a norm weight.
__device__ __forceinline__ float token_inv(float (*sq)[MMV_TOKENS], bool norm, int t, int K, float eps) {
    if (!norm) return 1.0f;
    float ss = 0.0f;
    #pragma unroll
    for (int w = 0; w < MMV_WARPS; w++) ss += sq[w][t];
    return 1.0f / sqrtf(ss / (float)K + eps);
}

#define MMV_SHARED                                                                        \
    __shared__ float part[MMV_WARPS][16][MMV_TOKENS];                                     \
    __shared__ float sq[MMV_WARPS][MMV_TOKENS];

// The block's RT tiles: the warps' products (mmv_warp), then, tile by tile, the partials
// into part and epilogue(r) over them (the block's sums read through tile_sum, the
// tokens' norms through token_inv). The norm needs no pass of its own over X: its squares
// come with the products' loads, so a block starts reading weights at once.
template <class WT, int RT, class Epilogue, class Rows = RowsInOrder>
__device__ __forceinline__ void mmv_tiles(const u8* const* ra, const u8* const* rb, const float* __restrict__ X,
                                          const float* __restrict__ g, int T, int K,
                                          float (*part)[16][MMV_TOKENS], float (*sq)[MMV_TOKENS],
                                          Epilogue epilogue, Rows rows = Rows()) {
    float acc[RT][MMV_TOKENS / 8][4];
    float ss[MMV_TOKENS / 8];
    mmv_warp<WT, RT>(ra, rb, X, g, T, K, acc, ss, rows);
    if (g) store_sq(ss, T, sq);
    #pragma unroll
    for (int r = 0; r < RT; r++) {
        if (r) __syncthreads();   // the previous tile's sums are read
        store_part(acc[r], T, part);
        __syncthreads();
        epilogue(r);
    }
}

// A block's row groups: blockIdx.x, then every gridDim.x-th after it where the grid is
// smaller than the groups (ops/cuda.py caps it at what is resident: a vocabulary head, a
// wide MLP's gate/up). point(grp, a, b) sets the rows of group grp a lane reads; tile(grp,
// r) is the epilogue of its tile r. The next group's first weights are asked for before
// this one's are summed and stored, to arrive meanwhile; each group's sums are those of a
// block of its own.
template <class WT, int RT, class Point, class Tile, class Rows = RowsInOrder>
__device__ __forceinline__ void mmv_groups(int groups, Point point, const float* __restrict__ X,
                                           const float* __restrict__ g, int T, int K,
                                           float (*part)[16][MMV_TOKENS], float (*sq)[MMV_TOKENS], Tile tile,
                                           Rows rows = Rows()) {
    int grp = blockIdx.x;
    const u8* ra[RT];
    const u8* rbs[RT];
    point(grp, ra, rbs);
    prefetch_first_steps<WT, RT>(ra, rbs, K);
    grid_dependency_sync();   // what the kernel before wrote is read from here on
    prefetch_activations(X, g, T, K, rows);
    for (;;) {
        int next = grp + (int)gridDim.x;
        if (next < groups) {
            const u8* na[RT];
            const u8* nb[RT];
            point(next, na, nb);
            prefetch_first_steps<WT, RT>(na, nb, K);
        }
        mmv_tiles<WT, RT>(ra, rbs, X, g, T, K, part, sq, [&](int r) { tile(grp, r); }, rows);
        if (next >= groups) break;
        grp = next;
        point(grp, ra, rbs);
        __syncthreads();   // this group's sums are read before the next one's are stored
    }
}

// Up to three matrices of one type against X, with the norm folded in when g is not null
// (nmv3's meaning; gemv3's with g null): Yi (T, Ni) = rmsnorm(X) @ Wi^T (+ bi), or with
// add, Yi += ... (gemv_add's meaning). Rows of the three are one sequence of N0 + N1 + N2;
// a block takes RT tiles of 16 of them (a group), or several groups in turn where the grid
// is smaller. grid at most ceil((N0 + N1 + N2) / (16 RT)), block
// 32 * MMV_WARPS. T <= MMV_TOKENS, K % 32 == 0.
// A greedy head (keys not null; one matrix, no add) also gives each token's argmax_rows
// answer over its row of Y0, in ids (T,): each block keeps its tokens' largest argmax_key
// in shared memory, adds it to keys (T,) by atomicMax, and the last block to finish (done
// counts them) turns keys into ids and leaves keys and done at zero for the next launch:
// the step's argmax needs no launch of its own, nor another pass over the logits.
template <class WT, int RT>
__device__ __forceinline__ void mmv3_t(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        long long rb0, long long rb1, long long rb2,
        const float* __restrict__ b0, const float* __restrict__ b1, const float* __restrict__ b2,
        float* Y0, float* Y1, float* Y2, const float* __restrict__ X, const float* __restrict__ g,
        float eps, int T, int K, int N0, int N1, int N2, int add,
        u64* keys, int* done, int* ids) {
    MMV_SHARED
    __shared__ u64 best[MMV_TOKENS];   // a greedy head's largest key per token, this block's rows
    __shared__ int last;
    int lane = threadIdx.x & 31, gi = lane >> 2;
    if (threadIdx.x < MMV_TOKENS) best[threadIdx.x] = 0ull;   // read after mmv_tiles' barriers
    auto row_of = [&](int n) -> const u8* {
        if (n < N0) return W0 + (long long)n * rb0;
        if (n < N0 + N1) return W1 + (long long)(n - N0) * rb1;
        if (n < N0 + N1 + N2) return W2 + (long long)(n - N0 - N1) * rb2;
        return nullptr;
    };
    // the rows of group grp (RT tiles of 16) this lane reads
    auto point = [&](int grp, const u8* (&a)[RT], const u8* (&b)[RT]) {
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            int n0 = (grp * RT + r) * 16;
            a[r] = row_of(n0 + gi);
            b[r] = row_of(n0 + gi + 8);
        }
    };
    int groups = (N0 + N1 + N2 + 16 * RT - 1) / (16 * RT);
    mmv_groups<WT, RT>(groups, point, X, g, T, K, part, sq, [&](int grp, int r) {
        int n0 = (grp * RT + r) * 16;
        for (int it = threadIdx.x; it < 16 * T; it += blockDim.x) {
            int s = it & 15, t = it >> 4, n = n0 + s;
            float v = tile_sum(part, s, t) * token_inv(sq, g, t, K, eps), *y;
            const float* bias;
            if (n < N0) { y = Y0 + (long long)t * N0 + n; bias = b0; }
            else if (n < N0 + N1) { n -= N0; y = Y1 + (long long)t * N1 + n; bias = b1; }
            else if (n < N0 + N1 + N2) { n -= N0 + N1; y = Y2 + (long long)t * N2 + n; bias = b2; }
            else continue;
            float r2 = bias ? v + bias[n] : v;
            *y = add ? *y + r2 : r2;
        }
        if (keys) {   // a greedy head: the tile's largest key of each token, into best
            // the same items on the same threads, so each reads back what it has just stored;
            // a warp's lanes take the same trips, and a token's 16 their maximum by shuffles
            for (int base = threadIdx.x & ~31; base < 16 * T; base += blockDim.x) {
                int it = base + lane, s = it & 15, t = it >> 4, n = n0 + s;
                u64 key = it < 16 * T && n < N0 ? argmax_key(Y0[(long long)t * N0 + n], n) : 0ull;
                #pragma unroll
                for (int o = 8; o > 0; o >>= 1) {
                    u64 w = __shfl_xor_sync(0xffffffffu, key, o);
                    key = w > key ? w : key;
                }
                if (s == 0 && it < 16 * T && key > best[t]) best[t] = key;   // one lane a token
            }
        }
    });
    if (!keys) return;
    __syncthreads();   // every tile's best is in
    if (threadIdx.x < T) atomicMax(keys + threadIdx.x, best[threadIdx.x]);
    if (!last_block_to_finish(done, (int)gridDim.x, &last)) return;
    if (threadIdx.x < T) {
        volatile u64* k = keys + threadIdx.x;
        ids[threadIdx.x] = argmax_id(*k);
        *k = 0ull;   // ready for the next launch
    }
    if (threadIdx.x == 0) *done = 0;
}

// glu's meaning: out (T, F) = act(h Wg^T + bg) * (h Wu^T + bu), h = rmsnorm(X) (g null:
// X; token t's row of X is rows(t)). A tile takes 8 outputs: gate rows in slots 0-7, up
// rows in 8-15; a block RT tiles (a group), or several groups in turn where the grid is
// smaller, as mmv3_t walks them. grid at most ceil(F / (8 RT)).
template <class WT, int RT, class Rows = RowsInOrder>
__device__ __forceinline__ void mmv_glu_t(
        const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long rbg, long long rbu,
        const float* __restrict__ bg, const float* __restrict__ bu, const float* __restrict__ X,
        const float* __restrict__ g, float eps, float* __restrict__ out, int T, int K, int F, int act,
        Rows rows = Rows()) {
    MMV_SHARED
    int lane = threadIdx.x & 31;
    // the gate and up rows of group grp this lane reads
    auto point = [&](int grp, const u8* (&a)[RT], const u8* (&b)[RT]) {
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            int n = (grp * RT + r) * 8 + (lane >> 2);
            a[r] = n < F ? Wg + (long long)n * rbg : nullptr;
            b[r] = n < F ? Wu + (long long)n * rbu : nullptr;
        }
    };
    int groups = (F + 8 * RT - 1) / (8 * RT);
    mmv_groups<WT, RT>(groups, point, X, g, T, K, part, sq, [&](int grp, int r) {
        int n0 = (grp * RT + r) * 8;
        for (int it = threadIdx.x; it < 8 * T; it += blockDim.x) {
            int s = it & 7, t = it >> 3, m = n0 + s;
            if (m >= F) continue;
            float inv = token_inv(sq, g, t, K, eps);
            float a = tile_sum(part, s, t) * inv, u = tile_sum(part, s + 8, t) * inv;
            if (bg) a += bg[m];
            if (bu) u += bu[m];
            float y;
            if (act == 0) {
                y = a / (1.0f + expf(-a)) * u;
            } else {
                const float c = 0.7978845608028654f;   // sqrt(2 / pi)
                y = 0.5f * a * (1.0f + tanhf(c * (a + 0.044715f * a * a * a))) * u;
            }
            out[(long long)t * F + m] = y;
        }
    }, rows);
}

// qkv_rope's meaning (linear.cu): norm + q/k/v + bias + RoPE + the paged KV write, over
// common.cuh's tasks (a rotated pair of rows, or one row); a tile takes 8 tasks: a task's
// first row in slot s, its pair's row (none for a single) in slot s + 8, and stores them
// through qkv_rope_store; a block RT tiles. grid ceil(tasks / (8 RT)).
template <class WT, int RT>
__device__ __forceinline__ void mmv_qkv_rope_t(ELLM_QKV_ROPE_PARAMS) {
    MMV_SHARED
    int lane = threadIdx.x & 31;
    const u8* ra[RT];
    const u8* rbs[RT];
    #pragma unroll
    for (int r = 0; r < RT; r++) {
        QkvTask k = qkv_task((blockIdx.x * RT + r) * 8 + (lane >> 2), nh, nkv, hd, n_rot, interleaved);
        const u8* W = k.which == 0 ? Wq : k.which == 1 ? Wk : Wv;
        long long rb = k.which == 0 ? rbq : k.which == 1 ? rbk : rbv;
        ra[r] = k.which >= 0 ? W + (long long)(k.head * hd + k.d0) * rb : nullptr;
        rbs[r] = k.which >= 0 && k.d1 >= 0 ? W + (long long)(k.head * hd + k.d1) * rb : nullptr;
    }
    prefetch_first_steps<WT, RT>(ra, rbs, K);
    grid_dependency_sync();   // what the kernel before wrote is read from here on
    prefetch_activations(X, g, T, K);
    mmv_tiles<WT, RT>(ra, rbs, X, g, T, K, part, sq, [&](int r) {
        int task0 = (blockIdx.x * RT + r) * 8;
        for (int it = threadIdx.x; it < 8 * T; it += blockDim.x) {
            int s = it & 7, t = it >> 3;
            QkvTask k = qkv_task(task0 + s, nh, nkv, hd, n_rot, interleaved);
            if (k.which < 0) continue;
            float inv = token_inv(sq, g, t, K, eps);
            qkv_rope_store(k, t, tile_sum(part, s, t) * inv,
                           k.d1 >= 0 ? tile_sum(part, s + 8, t) * inv : 0.0f, ELLM_QKV_ROPE_STORE_ARGS);
        }
    });
}

// RT = 1 for up to MMV_X2_ABOVE tokens (ops/cuda.py; more blocks at batch 1), RT = 2 above
// (the activations read half as often); ops/cuda.py chooses. Same bits either way.
#define ELLM_MMV_KERNELS_RT(name, WT, sfx, RT)                                            \
extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS) mmv3##sfx##_##name(          \
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,  \
        long long rb0, long long rb1, long long rb2,                                      \
        const float* __restrict__ b0, const float* __restrict__ b1,                       \
        const float* __restrict__ b2, float* Y0, float* Y1, float* Y2,                    \
        const float* __restrict__ X, const float* __restrict__ g, float eps,              \
        int T, int K, int N0, int N1, int N2, int add, u64* keys, int* done, int* ids) {  \
    mmv3_t<WT, RT>(W0, W1, W2, rb0, rb1, rb2, b0, b1, b2, Y0, Y1, Y2, X, g, eps, T, K, N0, N1, N2, add, \
                   keys, done, ids);                                                      \
}                                                                                         \
extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS) mmv_glu##sfx##_##name(       \
        const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long rbg, long long rbu, \
        const float* __restrict__ bg, const float* __restrict__ bu,                       \
        const float* __restrict__ X, const float* __restrict__ g, float eps,              \
        float* __restrict__ out, int T, int K, int F, int act) {                          \
    mmv_glu_t<WT, RT>(Wg, Wu, rbg, rbu, bg, bu, X, g, eps, out, T, K, F, act);            \
}                                                                                         \
extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS) mmv_qkv_rope##sfx##_##name(  \
        ELLM_QKV_ROPE_PARAMS) {                                                           \
    mmv_qkv_rope_t<WT, RT>(ELLM_QKV_ROPE_ARGS);                                           \
}
#define ELLM_MMV_KERNELS(name, WT)                                                        \
    ELLM_MMV_KERNELS_RT(name, WT, , 1)                                                    \
    ELLM_MMV_KERNELS_RT(name, WT, x2, 2)
// RT = 4 above MMV_X4_ABOVE tokens for the types whose four tiles fit the registers
// (239-252 of 255; those with a block min or K-quant scales would spill, F16's two weight
// terms take 251-255, too near the edge): the activations
// read a quarter as often as with one tile. Same bits again.
#define ELLM_MMV_KERNELS_X4(name, WT)                                                     \
    ELLM_MMV_KERNELS(name, WT)                                                            \
    ELLM_MMV_KERNELS_RT(name, WT, x4, 4)
// by GGML type id: ops/cuda.py compiles one type at a time (common.cuh ELLM_ONLY_TYPE);
// moe.cu includes this file for its device functions alone (ELLM_MMV_DEVICE_ONLY)
#ifndef ELLM_MMV_DEVICE_ONLY
#if ELLM_TYPE_ON(1)
ELLM_MMV_KERNELS(f16, WF16)
#endif
#if ELLM_TYPE_ON(30)
ELLM_MMV_KERNELS_X4(bf16, WBf16)
#endif
#if ELLM_TYPE_ON(2)
ELLM_MMV_KERNELS_X4(q4_0, WQ4_0)
#endif
#if ELLM_TYPE_ON(3)
ELLM_MMV_KERNELS(q4_1, WQ4_1)
#endif
#if ELLM_TYPE_ON(8)
ELLM_MMV_KERNELS_X4(q8_0, WQ8_0)
#endif
#if ELLM_TYPE_ON(12)
ELLM_MMV_KERNELS(q4_k, WQ4_K)
#endif
#if ELLM_TYPE_ON(13)
ELLM_MMV_KERNELS(q5_k, WQ5_K)
#endif
#if ELLM_TYPE_ON(14)
ELLM_MMV_KERNELS(q6_k, WQ6_K)
#endif
#endif   // ELLM_MMV_DEVICE_ONLY
