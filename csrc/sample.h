/* Sampling kernels over one row of logits: top-k selection, sums of exponentials and
 * inverse-CDF draws. They exist because numpy needs ~2.8 ms for an argpartition and
 * ~1 ms for a cumsum over Gemma's 262144-entry vocabulary, per token.
 * No Python here; callers pass every buffer; nothing allocates.
 *
 * Weights. expsum and draw agree on one weight per entry:
 *     w[i] = exp((x[i] - mx) * scale)   when x[i] >= lo and (x[i] - mx) * scale > -87.3
 *     w[i] = 0                          otherwise (NaN entries included)
 * Callers pass mx >= max(x) (the row maximum), so every exponent is <= 0 and nothing
 * overflows; `lo` is a logit floor (min-p), -INFINITY for none.
 */
#ifndef ELLM_SAMPLE_H
#define ELLM_SAMPLE_H
#include <stdint.h>

/* The k largest entries of x, sorted by value descending and, among equal values, by
 * index ascending (so k = 1 agrees with a first-occurrence argmax). NaNs are never
 * selected.
 *   x   (n,)    the logits
 *   idx (cap,)  out: token ids in idx[0 .. returned count); all of it is scratch
 *   val (cap,)  out: their values, likewise
 * cap >= k. With cap >= 2k (4k is comfortable) and k >= 64 the kernel first guesses a
 * threshold from a strided sample, gathers the entries above it into the buffers and
 * selects among those; when the guess was too low or too high it falls back to one
 * heap pass over x. The result is the same either way.
 * Returns the number written: min(k, number of non-NaN entries); 0 if k <= 0 or cap < k. */
int64_t ellm_topk_f32(const float *x, int64_t n, int64_t k, int32_t *idx, float *val, int64_t cap);

/* Sum of the weights above over x (n,). Accumulated per 64-entry chunk in float, across
 * chunks in double. */
double ellm_expsum_f32(const float *x, int64_t n, float mx, float scale, float lo);

/* Inverse CDF over the same weights, walked in index order: the first i whose running
 * sum exceeds target. Pass target = u * ellm_expsum_f32(...) with u uniform in [0, 1).
 * When rounding leaves the total at or below target, returns the last i with w[i] > 0;
 * returns -1 when every weight is 0. */
int64_t ellm_draw_f32(const float *x, int64_t n, float mx, float scale, float lo, double target);

/* Mass histogram, for top-p over any nucleus width without sorting the vocabulary.
 * Only entries with a weight and an exponent t = (x - mx) * scale above -span count
 * (span in (0, 87.3]); the bins split (-span, 0] evenly, highest weights in bin 0:
 *     bin(x) = min(nbins - 1, (int)(-t * (nbins / span)))
 * which never increases as x grows, so bins 0 .. b-1 hold exactly the counted entries
 * above bin b in value order.
 *   hist (nbins,)  out: per bin, the sum of its entries' weights, added in index order
 *                  in double; ellm_bin_collect_f32 returns the same weights, so adding
 *                  them the same way gives the same sums. */
void ellm_mass_hist_f32(const float *x, int64_t n, float mx, float scale, float lo, float span,
                        int64_t nbins, double *hist);

/* The counted entries of one histogram bin, in index order.
 *   idx (cap,), val (cap,), w (cap,)  out: ids, logits and weights
 * Returns the count, or -1 when more than cap entries fall in the bin. */
int64_t ellm_bin_collect_f32(const float *x, int64_t n, float mx, float scale, float lo,
                             float span, int64_t nbins, int64_t bin, int32_t *idx, float *val,
                             float *w, int64_t cap);

/* Grammar mask (constrained decoding). bits (nwords,) holds one bit per token: token i is
 * bit i % 32 of word i / 32 (llguidance's bitmask layout). Every x[i], i < n, whose bit is
 * 0 -- and every i >= 32 * nwords -- becomes -INFINITY; allowed entries are left as they
 * are. Returns how many of x's n entries are allowed (0: the grammar allows nothing).
 *   x    (n,)       the logits, written in place
 *   bits (nwords,)  the mask; words past ceil(n / 32) are not read */
int64_t ellm_mask_apply_f32(float *x, int64_t n, const uint32_t *bits, int64_t nwords);

#endif
