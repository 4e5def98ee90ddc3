/* Sampling kernels (see sample.h): scalar code and the run-time dispatch. The AVX2
 * variants live in sample_avx2.c. */
#include "sample.h"

#include <math.h>

#include "simd.h"

#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_AVX2_SAMPLE 1
void ellm_topk_scan_avx2(const float *x, int64_t n, int64_t start, int64_t k, int32_t *idx,
                         float *val);
int64_t ellm_topk_collect_avx2(const float *x, int64_t n, float tau, int32_t *idx, float *val,
                               int64_t cap);
double ellm_expsum_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo);
int64_t ellm_draw_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                           double target);
void ellm_mass_hist_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                             float span, int64_t nbins, float bin_scale, double *hist);
int64_t ellm_bin_collect_f32_avx2(const float *x, int64_t n, float mx, float scale, float lo,
                                  float span, int64_t nbins, float bin_scale, int64_t bin,
                                  int32_t *idx, float *val, float *w, int64_t cap);
int64_t ellm_mask_words_avx2(float *x, int64_t nfull, const uint32_t *bits);
int64_t ellm_mask_words_avx512(float *x, int64_t nfull, const uint32_t *bits);
#endif

/* Shared with sample_avx2.c. */
void ellm_sample_heap_offer(int32_t *idx, float *val, int64_t k, int32_t i, float v);

/* Below this exponent a float exp is subnormal; such weights are taken as 0 everywhere
 * (scalar and SIMD alike) so both paths define the same distribution. */
#define EXP_FLOOR (-87.3f)
#define CHUNK 64

/* ============================================================================
 * Top-k: a size-k min-heap over (value, index)
 * ============================================================================
 * "Less" means smaller value or, for equal values, larger index: the root is the entry
 * that leaves first, and heap-sorting leaves the array in descending value, ascending
 * index order. */

static inline int heap_less(const int32_t *idx, const float *val, int64_t a, int64_t b) {
    return val[a] < val[b] || (val[a] == val[b] && idx[a] > idx[b]);
}

static inline void heap_swap(int32_t *idx, float *val, int64_t a, int64_t b) {
    int32_t ti = idx[a];
    idx[a] = idx[b];
    idx[b] = ti;
    float tv = val[a];
    val[a] = val[b];
    val[b] = tv;
}

static void heap_sift_down(int32_t *idx, float *val, int64_t m, int64_t p) {
    for (;;) {
        int64_t l = 2 * p + 1, r = l + 1, s = p;
        if (l < m && heap_less(idx, val, l, s)) s = l;
        if (r < m && heap_less(idx, val, r, s)) s = r;
        if (s == p) return;
        heap_swap(idx, val, p, s);
        p = s;
    }
}

static void heap_sift_up(int32_t *idx, float *val, int64_t c) {
    while (c > 0) {
        int64_t p = (c - 1) / 2;
        if (!heap_less(idx, val, c, p)) return;
        heap_swap(idx, val, p, c);
        c = p;
    }
}

/* The heap holds k entries and v beat its root: v replaces the root. Entries arrive in
 * increasing index, so a tie with the root never displaces it (callers test v > root). */
void ellm_sample_heap_offer(int32_t *idx, float *val, int64_t k, int32_t i, float v) {
    idx[0] = i;
    val[0] = v;
    heap_sift_down(idx, val, k, 0);
}

/* Heap-sort m heap entries: each pass moves the least remaining entry to the back. */
static void heap_sort(int32_t *idx, float *val, int64_t m) {
    for (int64_t end = m - 1; end > 0; end--) {
        heap_swap(idx, val, 0, end);
        heap_sift_down(idx, val, end, 0);
    }
}

/* One heap pass over all of x: the k best in heap order; returns how many (<= k). */
static int64_t topk_heap(const float *x, int64_t n, int64_t k, int32_t *idx, float *val) {
    int64_t m = 0, i = 0;
    /* Fill: the first k non-NaN entries. */
    for (; i < n && m < k; i++) {
        float v = x[i];
        if (v != v) continue;
        idx[m] = (int32_t)i;
        val[m] = v;
        heap_sift_up(idx, val, m);
        m++;
    }
    if (m == k && i < n) {
#ifdef ELLM_HAVE_AVX2_SAMPLE
        if (ellm_simd_level() >= ELLM_SIMD_AVX2) {
            ellm_topk_scan_avx2(x, n, i, k, idx, val);
            i = n;
        }
#endif
        /* NaN > root is false, so NaNs drop out here without a test. */
        for (; i < n; i++)
            if (x[i] > val[0]) ellm_sample_heap_offer(idx, val, k, (int32_t)i, x[i]);
    }
    return m;
}

static int64_t collect_scalar(const float *x, int64_t n, float tau, int32_t *idx, float *val,
                              int64_t cap) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!(x[i] >= tau)) continue;
        if (c == cap) return -1;
        idx[c] = (int32_t)i;
        val[c] = x[i];
        c++;
    }
    return c;
}

/* Below this k the plain heap pass is already cheap (few entries beat a high root). */
#define TOPK_PREFILTER_MIN_K 64
#define TOPK_SAMPLES 4096

/* Threshold pre-filter (see sample.h); returns -1 when the caller must fall back. The
 * threshold is the r-th best of TOPK_SAMPLES strided entries, r set so that about
 * k + 4 standard deviations + 8 entries of x are expected above it. */
static int64_t topk_prefilter(const float *x, int64_t n, int64_t k, int32_t *idx, float *val,
                              int64_t cap) {
    int64_t stride = n / TOPK_SAMPLES;
    if (stride < 2) return -1;
    int64_t samples = n / stride;
    double expect = (double)k * (double)samples / (double)n;
    int64_t r = (int64_t)ceil(expect + 4.0 * sqrt(expect) + 8.0);
    if (r > samples || r > cap) return -1;
    int64_t m = 0;
    for (int64_t s = 0; s < samples; s++) {
        float v = x[s * stride];
        if (v != v) continue;
        if (m < r) {
            idx[m] = (int32_t)(s * stride);
            val[m] = v;
            heap_sift_up(idx, val, m);
            m++;
        } else if (v > val[0]) {
            ellm_sample_heap_offer(idx, val, r, (int32_t)(s * stride), v);
        }
    }
    if (m < r) return -1;
    float tau = val[0];
    int64_t c;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX2)
        c = ellm_topk_collect_avx2(x, n, tau, idx, val, cap);
    else
#endif
        c = collect_scalar(x, n, tau, idx, val, cap);
    /* Fewer than k above tau: the k-th best lies below it. Overflow: tau too low. */
    if (c < k) return -1;
    /* Every entry >= the k-th best is here, in index order: select among them in place
     * (entries j >= k are read before the heap could reach them; it never does). */
    for (int64_t j = 0; j < k; j++) heap_sift_up(idx, val, j);
    for (int64_t j = k; j < c; j++)
        if (val[j] > val[0]) ellm_sample_heap_offer(idx, val, k, idx[j], val[j]);
    return k;
}

int64_t ellm_topk_f32(const float *x, int64_t n, int64_t k, int32_t *idx, float *val, int64_t cap) {
    if (k <= 0 || n <= 0 || cap < k) return 0;
    int64_t m = -1;
    if (k >= TOPK_PREFILTER_MIN_K && cap >= 2 * k) m = topk_prefilter(x, n, k, idx, val, cap);
    if (m < 0) m = topk_heap(x, n, k, idx, val);
    heap_sort(idx, val, m);
    return m;
}

/* ============================================================================
 * Weights: sum and inverse-CDF draw
 * ============================================================================ */

static inline float weight(float x, float mx, float scale, float lo) {
    if (!(x >= lo)) return 0.0f; /* also NaN */
    float t = (x - mx) * scale;
    return t > EXP_FLOOR ? expf(t) : 0.0f;
}

static double expsum_scalar(const float *x, int64_t n, float mx, float scale, float lo) {
    double total = 0.0;
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t e = c + CHUNK < n ? c + CHUNK : n;
        float s = 0.0f;
        for (int64_t i = c; i < e; i++) s += weight(x[i], mx, scale, lo);
        total += (double)s;
    }
    return total;
}

static int64_t draw_scalar(const float *x, int64_t n, float mx, float scale, float lo,
                           double target) {
    double acc = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        float w = weight(x[i], mx, scale, lo);
        if (w > 0.0f) {
            acc += (double)w;
            last = i;
            if (acc > target) return i;
        }
    }
    return last;
}

double ellm_expsum_f32(const float *x, int64_t n, float mx, float scale, float lo) {
    if (n <= 0) return 0.0;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) return ellm_expsum_f32_avx2(x, n, mx, scale, lo);
#endif
    return expsum_scalar(x, n, mx, scale, lo);
}

int64_t ellm_draw_f32(const float *x, int64_t n, float mx, float scale, float lo, double target) {
    if (n <= 0) return -1;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) return ellm_draw_f32_avx2(x, n, mx, scale, lo, target);
#endif
    return draw_scalar(x, n, mx, scale, lo, target);
}

/* ============================================================================
 * Mass histogram and bin collection
 * ============================================================================ */

/* The bin of an entry with exponent t, or -1 when it is not counted. -t * bin_scale is
 * one multiply (nothing for the compiler to fuse); the AVX2 code computes the same float. */
static inline int64_t bin_of(float x, float t, float lo, float span, float bin_scale,
                             int64_t nbins) {
    if (!(x >= lo) || !(t > -span)) return -1;
    float u = -t * bin_scale;
    if (!(u > 0.0f)) return 0;
    if (u >= (float)(nbins - 1)) return nbins - 1;
    return (int64_t)u;
}

/* span clamped to (0, 87.3]: below -87.3 weights are 0 anyway (see weight()). */
static inline float clamp_span(float span) { return span > -EXP_FLOOR ? -EXP_FLOOR : span; }

void ellm_mass_hist_f32(const float *x, int64_t n, float mx, float scale, float lo, float span,
                        int64_t nbins, double *hist) {
    if (nbins <= 0) return;
    for (int64_t b = 0; b < nbins; b++) hist[b] = 0.0;
    if (!(span > 0.0f)) return;
    span = clamp_span(span);
    float bs = (float)nbins / span;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX2) {
        ellm_mass_hist_f32_avx2(x, n, mx, scale, lo, span, nbins, bs, hist);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        float t = (x[i] - mx) * scale;
        int64_t b = bin_of(x[i], t, lo, span, bs, nbins);
        if (b >= 0) hist[b] += (double)expf(t);
    }
}

int64_t ellm_bin_collect_f32(const float *x, int64_t n, float mx, float scale, float lo,
                             float span, int64_t nbins, int64_t bin, int32_t *idx, float *val,
                             float *w, int64_t cap) {
    if (nbins <= 0 || bin < 0 || bin >= nbins || !(span > 0.0f)) return 0;
    span = clamp_span(span);
    float bs = (float)nbins / span;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX2)
        return ellm_bin_collect_f32_avx2(x, n, mx, scale, lo, span, nbins, bs, bin, idx, val, w, cap);
#endif
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        float t = (x[i] - mx) * scale;
        if (bin_of(x[i], t, lo, span, bs, nbins) != bin) continue;
        if (c == cap) return -1;
        idx[c] = (int32_t)i;
        val[c] = x[i];
        w[c] = expf(t);
        c++;
    }
    return c;
}

/* ============================================================================
 * Grammar mask
 * ============================================================================
 * The SIMD variants take the whole 32-entry words (nfull of them); the last partial word
 * and anything past the mask are done here, so every level treats the edges alike. */

/* A popcount that needs no POPCNT instruction (not in the x86-64 baseline). */
static inline int64_t count_bits(uint32_t w) {
    w = w - ((w >> 1) & 0x55555555u);
    w = (w & 0x33333333u) + ((w >> 2) & 0x33333333u);
    w = (w + (w >> 4)) & 0x0F0F0F0Fu;
    return (int64_t)((w * 0x01010101u) >> 24);
}

static int64_t mask_words_scalar(float *x, int64_t nfull, const uint32_t *bits) {
    int64_t allowed = 0;
    for (int64_t k = 0; k < nfull; k++) {
        uint32_t w = bits[k];
        allowed += count_bits(w);
        if (w == 0xFFFFFFFFu) continue;
        float *row = x + 32 * k;
        for (int j = 0; j < 32; j++)
            if (!((w >> j) & 1u)) row[j] = -INFINITY;
    }
    return allowed;
}

int64_t ellm_mask_apply_f32(float *x, int64_t n, const uint32_t *bits, int64_t nwords) {
    if (n <= 0) return 0;
    if (nwords < 0) nwords = 0;
    int64_t covered = 32 * nwords < n ? 32 * nwords : n; /* entries the mask speaks for */
    int64_t nfull = covered / 32;
    int64_t allowed;
#ifdef ELLM_HAVE_AVX2_SAMPLE
    if (ellm_simd_level() >= ELLM_SIMD_AVX512)
        allowed = ellm_mask_words_avx512(x, nfull, bits);
    else if (ellm_simd_level() >= ELLM_SIMD_AVX2)
        allowed = ellm_mask_words_avx2(x, nfull, bits);
    else
#endif
        allowed = mask_words_scalar(x, nfull, bits);
    for (int64_t i = 32 * nfull; i < covered; i++) {
        if ((bits[i / 32] >> (i % 32)) & 1u)
            allowed++;
        else
            x[i] = -INFINITY;
    }
    for (int64_t i = covered; i < n; i++) x[i] = -INFINITY;
    return allowed;
}
