"""SamplingParams validation, the sampling kernels and SequenceSampler, checked against plain
numpy references written here (full sorts, float64 softmax), at every SIMD level the CPU has."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ellm._native import _sample
from ellm.engine.sampler import SampleResult, SequenceSampler, sample_batch
from ellm.sampling_params import SamplingParams

LEVELS = [lvl for lvl in ("scalar", "avx2") if lvl == "scalar" or _sample.simd_level() in ("avx2", "avx512")]


@pytest.fixture(params=LEVELS)
def simd(request):
    """Runs the test at one SIMD level of the sampling kernels, then restores the level."""
    before = _sample.simd_level()
    _sample.set_simd_level(request.param)
    yield request.param
    _sample.set_simd_level(before)


def gemma_like(rng: np.random.Generator, vocab: int, peaks: int = 30) -> np.ndarray:
    """Logits shaped like Gemma 3's (measured: median about -2, spread about 5, a few
    tokens 20-25 above the bulk)."""
    x = rng.normal(-2.0, 5.0, vocab).astype(np.float32)
    x[rng.choice(vocab, peaks, replace=False)] += rng.uniform(10, 25, peaks).astype(np.float32)
    return x


# ---------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------

def ref_order(x: np.ndarray) -> np.ndarray:
    """Indices of the non-NaN entries by value descending, index ascending."""
    ids = np.flatnonzero(~np.isnan(x))
    return ids[np.lexsort((ids, -x[ids].astype(np.float64)))]


def ref_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution vLLM's order defines: temperature, min-p, top-k, then top-p over
    what is left, renormalised. Full sorts, float64."""
    z = x.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones(len(x), bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    order = ref_order(x)
    if 0 < p.top_k < len(x):
        keep[order[p.top_k:]] = False
    if p.top_p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        cum = np.cumsum(q[order])
        n = int(np.searchsorted(cum, p.top_p, side="left")) + 1
        nucleus = np.zeros(len(x), bool)
        nucleus[order[:n]] = True
        keep &= nucleus
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def ref_process(x: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """logit_bias, then repetition, frequency and presence penalties, one token at a time."""
    y = x.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        y[t] += b
    for t in set(prompt) | set(output):
        y[t] = y[t] / p.repetition_penalty if y[t] > 0 else y[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        y[t] -= p.frequency_penalty * c + p.presence_penalty
    return y


def chi_square(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled in one)."""
    exp = probs * n
    big = exp >= 5
    obs_cells = list(counts[big]) + [counts[~big].sum()]
    exp_cells = list(exp[big]) + [exp[~big].sum()]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells) if e > 0)
    return stat, max(1, sum(1 for e in exp_cells if e > 0) - 1)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (50, 50), (50, 80), (1000, 1), (1000, 40),
                                 (9000, 64), (9000, 1024), (262144, 40), (262144, 1024)])
def test_topk_matches_sort(simd, n, k):
    rng = np.random.default_rng(n * 7 + k)
    x = gemma_like(rng, n, peaks=min(30, n))
    ref = ref_order(x)[:k]
    for cap in (k, 4 * k):  # cap 4k lets the kernel pre-filter
        idx = np.full(cap, -1, np.int32)
        val = np.zeros(cap, np.float32)
        m = _sample.topk(x, k, idx, val)
        assert m == min(k, n)
        np.testing.assert_array_equal(idx[:m], ref)
        np.testing.assert_array_equal(val[:m], x[ref])


def test_topk_ties_nan_inf(simd):
    rng = np.random.default_rng(1)
    # Values from a small set: many ties, so the index order decides.
    x = rng.integers(0, 20, 20000).astype(np.float32)
    x[rng.choice(20000, 300, replace=False)] = np.nan
    x[rng.choice(20000, 300, replace=False)] = -np.inf
    x[5] = np.inf
    for k in (1, 10, 100, 2000):
        idx = np.empty(4 * k, np.int32)
        val = np.empty(4 * k, np.float32)
        m = _sample.topk(x, k, idx, val)
        np.testing.assert_array_equal(idx[:m], ref_order(x)[:k])
    # Fewer non-NaN entries than k.
    y = np.full(10, np.nan, np.float32)
    y[[2, 7]] = [1.0, 3.0]
    idx = np.empty(5, np.int32)
    val = np.empty(5, np.float32)
    assert _sample.topk(y, 5, idx, val) == 2
    assert idx[:2].tolist() == [7, 2]


def test_topk_adversarial_order(simd):
    # Ascending logits: every entry beats the heap root, and the strided sample threshold
    # lands where the pre-filter must still be exact.
    x = np.arange(30000, dtype=np.float32)
    idx = np.empty(4096, np.int32)
    val = np.empty(4096, np.float32)
    assert _sample.topk(x, 1024, idx, val) == 1024
    np.testing.assert_array_equal(idx[:1024], np.arange(29999, 29999 - 1024, -1))


def test_topk_rejects_small_buffers():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="k=5"):
        _sample.topk(x, 5, np.empty(4, np.int32), np.empty(5, np.float32))


def ref_weights(x: np.ndarray, mx: float, scale: float, lo: float) -> np.ndarray:
    t = (x.astype(np.float64) - mx) * scale
    with np.errstate(invalid="ignore"):
        ok = (x >= lo) & (t > -87.3)
    return np.where(ok, np.exp(np.where(ok, t, 0.0)), 0.0)


@pytest.mark.parametrize("scale,lo_gap", [(1.0, None), (1 / 0.7, None), (1 / 1.5, 4.0), (100.0, None)])
def test_expsum(simd, scale, lo_gap):
    rng = np.random.default_rng(3)
    for n in (1, 63, 64, 65, 1001, 262144):
        x = gemma_like(rng, n, peaks=min(30, n))
        if n > 10:
            x[:3] = [np.nan, -np.inf, -1e30]
        mx = float(np.nanmax(x))
        lo = -math.inf if lo_gap is None else mx - lo_gap
        got = _sample.expsum(x, mx, scale, lo)
        assert got == pytest.approx(ref_weights(x, mx, scale, lo).sum(), rel=2e-6)


def test_draw_hits_each_interval(simd):
    rng = np.random.default_rng(4)
    x = gemma_like(rng, 5000)
    mx = float(x.max())
    for scale, lo in ((1.0, -math.inf), (0.5, mx - 6.0)):
        w = ref_weights(x, mx, scale, lo)
        cum = np.cumsum(w)
        z = _sample.expsum(x, mx, scale, lo)
        # Aim at the middle of every interval wide enough to be unambiguous in float32.
        for i in np.flatnonzero(w > 1e-4 * w.max()):
            target = (cum[i] - w[i] / 2) * z / cum[-1]
            assert _sample.draw(x, mx, scale, lo, target) == i


def test_draw_edges(simd):
    x = np.array([0.0, np.nan, 1.0, -np.inf, 2.0, -50.0], np.float32)
    # target at or past the total (rounding): the last token with weight.
    assert _sample.draw(x, 2.0, 1.0, -math.inf, 1e9) == 5
    assert _sample.draw(x, 2.0, 1.0, 0.5, 1e9) == 4
    # Zero target: the first token with weight.
    assert _sample.draw(x, 2.0, 1.0, 0.5, 0.0) == 2
    # Nothing has weight.
    assert _sample.draw(x, 2.0, 1.0, 3.0, 0.0) == -1
    assert _sample.expsum(x, 2.0, 1.0, 3.0) == 0.0


def ref_bins(x: np.ndarray, mx: float, scale: float, lo: float, span: float, nbins: int):
    """(bin per entry or -1, float64 weight per entry), with the kernel's float32 steps."""
    t = (x - np.float32(mx)) * np.float32(scale)
    u = -t * (np.float32(nbins) / np.float32(span))
    with np.errstate(invalid="ignore"):
        counted = (x >= lo) & (t > -np.float32(span))
        b = np.clip(np.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0), 0, nbins - 1).astype(np.int64)
    return np.where(counted, b, -1), np.exp(np.where(counted, t, 0.0).astype(np.float64))


@pytest.mark.parametrize("scale,lo_gap,span", [(1.0, None, 15.0), (1 / 1.5, 3.0, 40.0), (2.0, None, 200.0)])
def test_mass_hist_and_bin_collect(simd, scale, lo_gap, span):
    rng = np.random.default_rng(14)
    x = gemma_like(rng, 20011)  # odd length: the masked tail
    x[:3] = [np.nan, -np.inf, -1e30]
    mx = float(np.nanmax(x))
    lo = -math.inf if lo_gap is None else mx - lo_gap
    nbins = 512
    hist = np.full(nbins, np.nan)
    _sample.mass_hist(x, mx, scale, lo, span, hist)
    bins, w = ref_bins(x, mx, scale, lo, min(span, 87.3), nbins)
    want = np.bincount(bins[bins >= 0], weights=w[bins >= 0], minlength=nbins)
    np.testing.assert_allclose(hist, want, rtol=2e-6, atol=1e-300)
    ids = np.empty(20011, np.int32)
    val = np.empty(20011, np.float32)
    ws = np.empty(20011, np.float32)
    for b in np.flatnonzero(want)[:40]:
        c = _sample.bin_collect(x, mx, scale, lo, span, nbins, int(b), ids, val, ws)
        np.testing.assert_array_equal(ids[:c], np.flatnonzero(bins == b))
        np.testing.assert_array_equal(val[:c], x[ids[:c]])
        acc = 0.0
        for v in ws[:c].tolist():  # the documented invariant: same weights, same order, same sum
            acc += v
        assert acc == hist[b]
    counts = np.bincount(bins[bins >= 0], minlength=nbins)
    b = int(np.argmax(counts))
    cap = int(counts[b]) - 1  # one short: the kernel must refuse, not overrun
    assert _sample.bin_collect(x, mx, scale, lo, span, nbins, b, ids[:cap], val[:cap], ws[:cap]) == (
        -1)


# ---------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01),
    ("seed", 1.5), ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop_token_ids", [-1]),
    ("stop_token_ids", "x"), ("ignore_eos", 1), ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", [1]), ("logprobs", -1), ("logprobs", 21), ("n", 0),
    ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
])
def test_params_invalid_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_normalise_and_merge():
    p = SamplingParams(stop="###", logit_bias={"42": 3, 7: -1.5}, temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == []
    assert p.logit_bias == {42: 3.0, 7: -1.5}
    assert p.greedy and SamplingParams(top_k=1).greedy and not SamplingParams().greedy
    assert SamplingParams(top_k=-1).top_k == -1
    q = SamplingParams.from_kwargs(p, max_tokens=5, stop=["a", "b"])
    assert (q.max_tokens, q.stop, q.temperature, q.logit_bias) == (5, ["a", "b"], 0.0, {42: 3.0, 7: -1.5})
    assert p.max_tokens == 256  # the original is untouched
    assert SamplingParams.from_kwargs(None, top_p=0.5).top_p == 0.5
    assert SamplingParams.from_kwargs() == SamplingParams()
    with pytest.raises(TypeError, match="top_n"):
        SamplingParams.from_kwargs(p, top_n=3)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_kwargs(p, top_p=2.0)


# ---------------------------------------------------------------------------------------
# SequenceSampler
# ---------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_topk1(simd):
    rng = np.random.default_rng(5)
    for vocab in (3, 1000, 262144):
        x = gemma_like(rng, vocab, peaks=min(30, vocab))
        x[vocab // 2] = x[vocab - 1] = x.max() + 1  # a tie: the first index wins
        want = vocab // 2 if vocab > 2 else int(np.argmax(x))
        for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1),
                  SamplingParams(temperature=1e-6, top_p=0.5)):
            r = SequenceSampler(p, [0], vocab).sample(x)
            assert r.token_id == want == int(np.argmax(x))
            assert math.isnan(r.logprob) and r.top_logprobs is None


def test_seeded_reproducible_in_any_batch(simd):
    rng = np.random.default_rng(6)
    vocab = 3000
    rows = [gemma_like(rng, vocab) * 0.2 for _ in range(40)]
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(companions: int) -> list[int]:
        s = SequenceSampler(p, [1, 2], vocab)
        others = [SequenceSampler(SamplingParams(temperature=1.3, seed=c), [3], vocab) for c in range(companions)]
        out = []
        for x in rows:
            batch = np.stack([x] + [np.roll(x, c + 1) for c in range(companions)])
            res = sample_batch([s] + others, batch)
            out.append(res[0].token_id)
            s.append(res[0].token_id)
        return out

    a, b, c = run(0), run(3), run(1)
    assert a == b == c
    assert len(set(a)) > 5  # it does sample
    other = SequenceSampler(SamplingParams(temperature=1.0, top_p=0.95, seed=99), [1], vocab)
    assert [other.sample(x).token_id for x in rows] != a
    sib = SequenceSampler(p, [1, 2], vocab, sibling=1)
    assert [sib.sample(x).token_id for x in rows] != a


DIST_CASES = [  # (params, draws)
    (SamplingParams(temperature=0.7), 20000),
    (SamplingParams(temperature=1.3, top_k=5), 20000),
    (SamplingParams(temperature=1.0, top_k=2000), 4000),             # pre-filtered top-k
    (SamplingParams(temperature=1.0, top_p=0.8), 20000),             # ~580 tokens
    (SamplingParams(temperature=1.0, top_p=0.95), 20000),            # ~3000 tokens
    (SamplingParams(temperature=1.0, min_p=0.1), 20000),
    (SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02), 20000),
    # vLLM's order keeps 4 tokens here; min-p after top-p (transformers' order) keeps 6.
    (SamplingParams(temperature=1.0, top_p=0.7, min_p=0.3), 20000),
]


def headed_logits(vocab: int = 9000) -> np.ndarray:
    """A bulk of low logits and a 300-token head, so that each filter above cuts inside a
    populated region (kept: 4 to ~3000 tokens). 9000 tokens is enough for the C top-k to
    take its pre-filtered path."""
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1.5, vocab).astype(np.float32)
    x[:300] += np.float32(4.0) + rng.normal(0, 1, 300).astype(np.float32)
    rng.shuffle(x)
    return x


@pytest.mark.parametrize("p,n", DIST_CASES, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}"
                         if isinstance(c, SamplingParams) else str(c))
def test_distribution_matches_reference(simd, p, n):
    x = headed_logits()
    probs = ref_probs(x, p)
    s = SequenceSampler(p, [], len(x))
    s._rng = np.random.default_rng(2024)
    draws = np.array([s.sample(x).token_id for _ in range(n)])
    counts = np.bincount(draws, minlength=len(x))
    assert probs[draws].min() > 0, "drew a token the filters exclude"
    stat, df = chi_square(counts, probs, n)
    assert stat < df + 6 * math.sqrt(2 * df), (stat, df)


class FixedRng:
    """Stands in for a Generator: every draw returns u."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.6, top_p=0.95),
                               SamplingParams(temperature=1.7, top_p=0.5, min_p=0.01),
                               SamplingParams(temperature=1.2, top_k=300, top_p=0.7)],
                         ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_nucleus_boundary_exact(simd, p):
    # u just below 1 draws the least likely token of the nucleus: the sampler's nucleus
    # must end exactly where the reference's does (one token more or less fails).
    rng = np.random.default_rng(15)
    for trial in range(25):
        x = headed_logits(9000) if trial == 0 else gemma_like(rng, 9000) * rng.uniform(0.1, 0.5)
        probs = ref_probs(x, p)
        order = ref_order(x)
        last = order[np.flatnonzero(probs[order] > 0)[-1]]
        s = SequenceSampler(p, [], len(x))
        s._rng = FixedRng(1.0 - 1e-12)
        assert s.sample(x).token_id == last
        s._rng = FixedRng(0.0)
        assert probs[s.sample(x).token_id] > 0


def test_top_p_wide_nucleus(simd):
    # Nearly flat logits: the 0.9 nucleus holds ~90% of 6000 tokens, dozens per histogram
    # bin, and the draw lands in bins below the boundary most of the time.
    rng = np.random.default_rng(8)
    x = rng.normal(0, 0.05, 6000).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    probs = ref_probs(x, p)
    assert (probs > 0).sum() > 5000
    s = SequenceSampler(p, [], len(x))
    draws = np.array([s.sample(x).token_id for _ in range(1500)])
    assert probs[draws].min() > 0
    # The excluded ~10% (lowest logits) are never drawn, the kept ones spread evenly.
    assert np.mean(x[draws]) == pytest.approx(np.sum(probs * x), abs=0.005)


def test_gemma_vocab_filters(simd):
    rng = np.random.default_rng(9)
    x = gemma_like(rng, 262144)
    for p in (SamplingParams(temperature=0.8, top_k=40, seed=1), SamplingParams(temperature=1.5, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, min_p=0.05, seed=3), SamplingParams(temperature=1.0, seed=4)):
        probs = ref_probs(x, p)
        s = SequenceSampler(p, [], len(x))
        draws = [s.sample(x).token_id for _ in range(200)]
        assert probs[draws].min() > 0
        if p.top_k == 40:
            assert set(draws) <= set(ref_order(x)[:40].tolist())


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=-0.3),
    SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=2.0, logit_bias={3: 5.0, 17: -100.0}),
    SamplingParams(temperature=0, logit_bias={0: 100.0}),
])
def test_penalties_and_bias_match_reference(p):
    rng = np.random.default_rng(10)
    vocab = 50
    prompt = [1, 2, 2, 5, 9, 9, 9]
    s = SequenceSampler(p, prompt, vocab)
    out: list[int] = []
    for _ in range(40):
        x = rng.normal(0, 2.0, vocab).astype(np.float32)
        before = x.copy()
        want = ref_process(x, p, prompt, out)
        np.testing.assert_allclose(s.process(x), want, rtol=1e-6, atol=1e-5)
        tok = s.sample(x).token_id
        np.testing.assert_array_equal(x, before)  # the caller's row is restored
        assert tok == int(np.argmax(want))
        s.append(tok)
        out.append(tok)
    if p.logit_bias == {0: 100.0}:
        assert out == [0] * 40


def test_bias_and_penalties_shift_the_distribution(simd):
    x = np.zeros(4, np.float32)
    p = SamplingParams(temperature=1.0, logit_bias={1: math.log(3.0)}, seed=0)
    s = SequenceSampler(p, [], 4)
    counts = np.bincount([s.sample(x).token_id for _ in range(6000)], minlength=4)
    np.testing.assert_allclose(counts / 6000, [1 / 6, 1 / 2, 1 / 6, 1 / 6], atol=0.025)


def test_logprobs_are_raw_log_softmax(simd):
    rng = np.random.default_rng(11)
    for vocab in (100, 262144):
        x = gemma_like(rng, vocab, peaks=min(30, vocab))
        ref = x.astype(np.float64) - np.logaddexp.reduce(x.astype(np.float64))
        order = ref_order(x)
        # Bias and penalties must not leak into the reported logprobs.
        p = SamplingParams(temperature=0.8, top_k=50, logprobs=5, seed=1, repetition_penalty=1.5,
                           logit_bias={int(order[-1]): 100.0})
        s = SequenceSampler(p, [int(order[0])], vocab)
        r = s.sample(x)
        assert r.logprob == pytest.approx(ref[r.token_id], abs=2e-5)
        assert [t for t, _ in r.top_logprobs] == order[:5].tolist()
        np.testing.assert_allclose([lp for _, lp in r.top_logprobs], ref[order[:5]], atol=2e-5)
        g = SequenceSampler(SamplingParams(temperature=0, logprobs=0), [], vocab).sample(x)
        assert g == SampleResult(int(order[0]), pytest.approx(ref[order[0]], abs=2e-5), [])


def test_caller_array_untouched_and_odd_inputs():
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1, 64).astype(np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={int(np.argmin(x)): 50.0})
    s = SequenceSampler(p, list(range(64)), 64)
    want = s.sample(x).token_id
    assert want == int(np.argmin(x))
    ro = x.copy()
    ro.flags.writeable = False
    assert s.sample(ro).token_id == want
    assert s.sample(x.astype(np.float64)).token_id == want
    assert s.sample(np.repeat(x, 2)[::2]).token_id == want  # strided
    with pytest.raises(ValueError, match="shape"):
        s.sample(np.zeros(63, np.float32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SequenceSampler(SamplingParams(), [64], 64)
    with pytest.raises(ValueError, match="logit_bias"):
        SequenceSampler(SamplingParams(logit_bias={64: 1.0}), [0], 64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.append(-1)
    with pytest.raises(ValueError, match="NaN"):
        SequenceSampler(SamplingParams(temperature=1.0), [], 4).sample(np.full(4, np.nan, np.float32))


def test_sample_batch():
    rng = np.random.default_rng(13)
    logits = rng.normal(0, 3, (4, 500)).astype(np.float32)
    plain = [SequenceSampler(SamplingParams(temperature=0), [1], 500) for _ in range(4)]
    assert [r.token_id for r in sample_batch(plain, logits)] == np.argmax(logits, 1).tolist()
    mixed = plain[:2] + [SequenceSampler(SamplingParams(temperature=0, logprobs=2), [1], 500),
                         SequenceSampler(SamplingParams(temperature=0.5, seed=0), [1], 500)]
    res = sample_batch(mixed, logits)
    assert [r.token_id for r in res[:3]] == np.argmax(logits, 1)[:3].tolist()
    assert len(res[2].top_logprobs) == 2
    with pytest.raises(ValueError, match="shape"):
        sample_batch(plain, logits[:3])
