"""Per-sequence token sampling over one row of logits.

One SequenceSampler per sequence. It owns the sequence's random Generator (so a seeded
request draws the same tokens whatever batch it runs in: exactly one uniform is drawn per
non-greedy token) and the token counts the penalties need.

Order of operations, as in vLLM (v1):
  1. logprobs, when asked, from log_softmax of the *raw* model logits: before logit_bias,
     penalties and temperature (vLLM's default "raw_logprobs" mode), and before the
     grammar mask (they say what the model itself gave each token).
  1b. the grammar mask of a constrained request (ellm.engine.structured): every token the
     grammar does not allow becomes -inf, in C (csrc/sample.h, ellm_mask_apply_f32), so
     everything after it -- greedy, top-k, top-p, min-p, the draw -- sees only allowed
     tokens.
  2. logit_bias is added.
  3. penalties: repetition (tokens of prompt + output: a positive logit is divided by it, a
     negative one multiplied), then frequency and presence (generated tokens only:
     logit -= frequency_penalty * count + presence_penalty * (count > 0)).
  4. greedy (temperature < 1e-5, or top_k == 1): the argmax, first index on ties. Done.
  5. temperature: logits / T.
  6. min-p: tokens with p < min_p * p_max are dropped.
  7. top-k, then top-p over what is left (renormalised; the smallest set of most likely
     tokens whose mass reaches top_p, at least one token).
  8. one draw by inverse CDF.
Min-p commutes with top-k (the most likely token survives both); vLLM applies it before
top-p, as here. Hugging Face transformers applies min-p after top-p instead, so the two
differ when both min_p and top_p are set.

Cost on a 262144-entry vocabulary (Gemma 3). A full sort takes ~27 ms and an
np.argpartition ~2.8 ms per token, so neither is used on the common paths:
  greedy        np.argmax (SIMD), no softmax unless logprobs are asked;
  top-k         a heap selection in C (csrc/sample.c) that touches only the entries
                beating the current k-th best, then numpy on k values;
  top-p alone   an exp-sum pass for the total mass, then a histogram of mass by exponent
                (C) that locates the bin where the nucleus ends; only that bin's few
                tokens are sorted, whatever the nucleus width;
  temperature / min-p alone
                an exp-sum pass and an inverse-CDF pass, both in C.

The caller's logits: logit_bias and the penalties touch only the few tokens they name.
sample() writes those entries of the caller's row in place and restores their original
values before it returns (also on error), so no full-vocabulary copy is made per token
and the row is unchanged afterwards. A row that is read-only, not float32 or not
contiguous is copied once instead. The grammar mask is the exception: with a mask, the
disallowed entries of the caller's row are left at -inf (the engine's rows are scratch;
copying a 262144-entry row per token to spare them would cost more than the mask).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._native import _sample
from ..sampling_params import SamplingParams

# Bins of the top-p mass histogram (see csrc/sample.h). Over the usual span of ~15 in the
# exponent a bin is ~0.004 wide, so the one bin that must be sorted holds few tokens.
_TOP_P_BINS = 4096
# Exponents below this have float weight 0 in the C kernels.
_EXP_SPAN = 87.3


@dataclass(slots=True)
class SampleResult:
    """token_id: the chosen token. logprob: its log-probability under the raw model
    logits, or NaN when the request did not ask for logprobs. top_logprobs: the
    params.logprobs most likely tokens as (token id, logprob), most likely first (empty
    for logprobs=0), or None when not asked."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


class _IdCounts:
    """Distinct token ids with a count each, in arrays that grow by doubling, so the
    penalties index numpy arrays without rebuilding them from a dict every token."""

    def __init__(self, capacity: int = 64) -> None:
        self.slot: dict[int, int] = {}
        self.ids = np.empty(capacity, np.intp)
        self.counts = np.zeros(capacity, np.float32)

    def __len__(self) -> int:
        return len(self.slot)

    def add(self, token_id: int, count: float = 1.0) -> None:
        s = self.slot.get(token_id)
        if s is None:
            s = len(self.slot)
            if s == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.slot[token_id] = s
            self.ids[s] = token_id
        self.counts[s] += count


class SequenceSampler:
    """Samples the next token of one sequence. See the module docstring for the order of
    operations and what happens to the caller's logits.

    params: the request's SamplingParams; prompt_ids: its prompt (the repetition penalty
    covers it); vocab_size: the length of every logits row. sibling: the index of this
    sequence among the n completions of one seeded request, so that siblings draw
    different tokens (0 keeps np.random.default_rng(seed) exactly).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 *, sibling: int = 0) -> None:
        if not (isinstance(vocab_size, (int, np.integer)) and vocab_size >= 1):
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.params = params
        self.vocab_size = V = int(vocab_size)
        self.num_generated = 0

        self._greedy = params.greedy
        self._inv_t = 0.0 if self._greedy else 1.0 / params.temperature
        # top_k >= vocab keeps everything: off.
        self._top_k = params.top_k if 0 < params.top_k < V else 0
        self._top_p = params.top_p if params.top_p < 1.0 else 0.0
        self._log_min_p = math.log(params.min_p) if params.min_p > 0.0 else None

        self._bias_ids: np.ndarray | None = None
        self._bias_vals: np.ndarray | None = None
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), np.intp, len(params.logit_bias))
            if ids.max() >= V:
                raise ValueError(f"logit_bias names token {int(ids.max())}, outside the vocabulary (size {V})")
            self._bias_ids = ids
            self._bias_vals = np.fromiter(params.logit_bias.values(), np.float32, len(ids))

        self._rep = params.repetition_penalty != 1.0
        self._freq_pres = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size and (prompt.min() < 0 or prompt.max() >= V):
            bad = prompt[(prompt < 0) | (prompt >= V)][0]
            raise ValueError(f"prompt token id {int(bad)} is outside the vocabulary (size {V})")
        # Repetition: every distinct id of prompt + output. Frequency/presence: output counts.
        self._seen = _IdCounts(max(64, 2 * prompt.size) if self._rep else 1)
        if self._rep:
            for t in np.unique(prompt).tolist():
                self._seen.add(t, 0.0)
        self._out = _IdCounts()

        self._modifies = self._bias_ids is not None or self._rep or self._freq_pres
        # Rows this sampler can take with a bare argmax (sample_batch does them together).
        self._plain_greedy = self._greedy and not self._modifies and params.logprobs is None
        # Its next token (and its logprobs) depend on the logits, its parameters and its
        # draws so far, not on the tokens before: a step may be sampled before the last
        # one's token is known.
        self._history_free = not (self._rep or self._freq_pres)

        seed = params.seed
        if seed is None:
            self._rng = np.random.default_rng()
        else:
            seed %= 2**64  # negative seeds are fine by the API; numpy wants >= 0
            self._rng = np.random.default_rng(seed if sibling == 0 else [seed, sibling])

        # Top-k / top-logprob scratch, 4x the largest k so the C selection can pre-filter.
        k = max(1, self._top_k, params.logprobs or 0)
        self._idx = np.empty(min(4 * k, V), np.int32)
        self._val = np.empty(min(4 * k, V), np.float32)
        # Top-p (without top-k) scratch: the mass histogram and one bin's entries.
        if self._top_p and not self._top_k:
            self._hist = np.empty(_TOP_P_BINS, np.float64)
            self._bin_bufs = self._bin_buffers(256)

    @property
    def plain_greedy(self) -> bool:
        """True when this sampler is a bare argmax (no penalties, bias or logprobs)."""
        return self._plain_greedy

    @property
    def argmax_choice(self) -> bool:
        """True when this sampler's token is the row's argmax (greedy, no penalties or
        bias), whether it asks for logprobs or not."""
        return self._greedy and not self._modifies

    @property
    def modifies_logits(self) -> bool:
        """True when sampling changes the row before choosing (logit_bias or penalties)."""
        return self._modifies

    @property
    def history_free(self) -> bool:
        """True when no penalty looks at the tokens so far: the choice depends on the row
        of logits, the parameters and the draws made, so the engine may sample a step
        before it has read the previous step's token."""
        return self._history_free

    # -- state -------------------------------------------------------------------------

    def append(self, token_id: int) -> None:
        """Records a generated token (the penalties count it from the next sample on)."""
        t = int(token_id)
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary (size {self.vocab_size})")
        self.num_generated += 1
        if self._rep:
            self._seen.add(t, 0.0)
        if self._freq_pres:
            self._out.add(t)

    # -- sampling ----------------------------------------------------------------------

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None) -> SampleResult:
        """Chooses the next token from logits (vocab,). Without a mask the row is left as
        it was; mask: an int32 grammar bitmask row (see csrc/sample.h), after which the
        row's disallowed entries stay -inf."""
        x = self._row(logits, writes=mask is not None)
        saved: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            top: list[tuple[int, float]] | None = None
            lse = math.nan
            if self.params.logprobs is not None:
                lse, top = self._raw_logprobs(x)
            if mask is not None:
                apply_mask(x, mask)
            if self._modifies:
                self._process(x, saved)
            tok = self._choose(x)
        finally:
            for ids, vals in reversed(saved):
                x[ids] = vals
        # The chosen token is allowed, so the mask left its raw logit in place.
        logprob = float(x[tok]) - lse if top is not None else math.nan
        return SampleResult(tok, logprob, top)

    def process(self, logits: np.ndarray) -> np.ndarray:
        """A copy of logits (vocab,) after logit_bias and the penalties (steps 2-3), as the
        temperature and the filters would see it. For inspection and tests."""
        x = np.array(logits, dtype=np.float32, order="C")
        if x.shape != (self.vocab_size,):
            raise ValueError(f"logits must have shape ({self.vocab_size},), got {x.shape}")
        if self._modifies:
            self._process(x, [])
        return x

    def _row(self, logits: np.ndarray, writes: bool = False) -> np.ndarray:
        if not isinstance(logits, np.ndarray):
            logits = np.asarray(logits)
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits must have shape ({self.vocab_size},), got {logits.shape}")
        ok = logits.dtype == np.float32 and logits.flags.c_contiguous
        if ok and (logits.flags.writeable or not (self._modifies or writes)):
            return logits
        return np.array(logits, dtype=np.float32, order="C")

    def _raw_logprobs(self, x: np.ndarray) -> tuple[float, list[tuple[int, float]]]:
        """log-sum-exp of the raw row and its params.logprobs best tokens."""
        n = min(self.params.logprobs or 0, self.vocab_size)   # (a vocabulary under 20 tokens)
        mx = float(x.max())
        if not math.isfinite(mx):
            raise no_finite_maximum(mx)
        lse = mx + math.log(_sample.expsum(x, mx, 1.0, -math.inf))
        if n == 0:
            return lse, []
        m = _sample.topk(x, n, self._idx, self._val)
        return lse, [(int(i), float(v) - lse) for i, v in zip(self._idx[:m], self._val[:m])]

    def _process(self, x: np.ndarray, saved: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """logit_bias, then the penalties, in place; originals go to saved."""
        p = self.params
        if self._bias_ids is not None:
            ids = self._bias_ids
            saved.append((ids, x[ids]))
            x[ids] += self._bias_vals
        if self._rep and len(self._seen):
            ids = self._seen.ids[:len(self._seen)]
            v = x[ids]
            saved.append((ids, v))
            rp = np.float32(p.repetition_penalty)
            x[ids] = np.where(v > 0, v / rp, v * rp)
        if self._freq_pres and len(self._out):
            m = len(self._out)
            ids = self._out.ids[:m]
            v = x[ids]
            saved.append((ids, v))
            x[ids] = v - (np.float32(p.frequency_penalty) * self._out.counts[:m] + np.float32(p.presence_penalty))

    def _choose(self, x: np.ndarray) -> int:
        if self._greedy:
            return int(np.argmax(x))
        u = self._rng.random()
        if self._top_k:
            return self._choose_top_k(x, u)
        mx = float(x.max())
        if not math.isfinite(mx):
            raise no_finite_maximum(mx)
        lo = self._min_p_floor(mx)
        z = _sample.expsum(x, mx, self._inv_t, lo)
        if self._top_p:
            return self._choose_top_p(x, u, mx, lo, z)
        return int(_sample.draw(x, mx, self._inv_t, lo, u * z))

    def _min_p_floor(self, mx: float) -> float:
        # p_i >= min_p * p_max  <=>  (x_i - mx) / T >= log(min_p)
        return -math.inf if self._log_min_p is None else mx + self._log_min_p / self._inv_t

    def _choose_top_k(self, x: np.ndarray, u: float) -> int:
        """top-k, with min-p and top-p inside the k, over the sorted k best."""
        m = _sample.topk(x, self._top_k, self._idx, self._val)
        if m == 0 or not math.isfinite(float(self._val[0])):
            raise ValueError("logits have no finite maximum: NaN or all -inf")
        vals = self._val[:m]
        mx = float(vals[0])
        lo = self._min_p_floor(mx)
        kept = m if lo == -math.inf else int(np.count_nonzero(vals >= np.float32(lo)))
        cum = np.cumsum(np.exp((vals[:kept].astype(np.float64) - mx) * self._inv_t))
        if self._top_p:
            n = int(np.searchsorted(cum, self._top_p * cum[-1], side="left")) + 1
            cum = cum[:min(n, kept)]
        j = min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(cum) - 1)
        return int(self._idx[j])

    def _choose_top_p(self, x: np.ndarray, u: float, mx: float, lo: float, z: float) -> int:
        """top-p without top-k (after min-p), for any nucleus width, without a sort.

        Tokens with exponent t = (x - mx) / T below log((1 - top_p) * z / vocab) weigh at
        most (1 - top_p) * z together, so the nucleus lies above that: a histogram of
        mass by exponent over the span above finds the bin where the nucleus ends; only
        that bin's tokens are sorted. The draw then picks a bin by cumulative mass and
        walks that bin's tokens (in index order, the order the histogram added them)."""
        need = self._top_p * z
        span = min(_EXP_SPAN, -math.log((1.0 - self._top_p) * z / self.vocab_size))
        hist = self._hist
        _sample.mass_hist(x, mx, self._inv_t, lo, span, hist)
        cum = np.cumsum(hist)
        b = min(int(np.searchsorted(cum, need, side="left")), len(hist) - 1)
        if hist[b] == 0.0:  # need rounded past the last mass: end at the last full bin
            b = int(np.flatnonzero(hist[:b + 1])[-1])
        m0 = float(cum[b - 1]) if b else 0.0
        ids, vals, ws = self._collect(x, mx, lo, span, b)
        order = np.lexsort((ids, -vals))  # value descending, index ascending
        cw = m0 + np.cumsum(ws[order], dtype=np.float64)
        n_in = min(int(np.searchsorted(cw, need, side="left")) + 1, len(cw))
        target = u * float(cw[n_in - 1])
        if target >= m0:
            j = min(int(np.searchsorted(cw[:n_in], target, side="right")), n_in - 1)
            return int(ids[order[j]])
        bb = int(np.searchsorted(cum, target, side="right"))  # cum[bb-1] <= target < cum[bb]
        ids, _, ws = self._collect(x, mx, lo, span, bb)
        local = target - (float(cum[bb - 1]) if bb else 0.0)
        j = min(int(np.searchsorted(np.cumsum(ws, dtype=np.float64), local, side="right")), len(ws) - 1)
        return int(ids[j])

    def _bin_buffers(self, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.empty(cap, np.int32), np.empty(cap, np.float32), np.empty(cap, np.float32)

    def _collect(self, x: np.ndarray, mx: float, lo: float, span: float,
                 b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views of (ids, logits, weights) of histogram bin b, growing the buffers if the
        bin is crowded (near-equal logits)."""
        while True:
            ids, vals, ws = self._bin_bufs
            c = _sample.bin_collect(x, mx, self._inv_t, lo, span, _TOP_P_BINS, b, ids, vals, ws)
            if c >= 0:
                return ids[:c], vals[:c], ws[:c]
            self._bin_bufs = self._bin_buffers(min(8 * len(ids), self.vocab_size))


class NoAllowedTokenError(ValueError):
    """A grammar mask allowed no token of the vocabulary."""


def apply_mask(x: np.ndarray, mask: np.ndarray) -> int:
    """Sets the entries of x (vocab,) float32 that the int32 bitmask row forbids to -inf,
    in C; returns how many are allowed. Raises NoAllowedTokenError when none is."""
    if mask.dtype != np.int32 or mask.ndim != 1:
        raise ValueError(f"a grammar mask must be a 1-D int32 array, got {mask.dtype} {mask.shape}")
    allowed = _sample.mask_apply(x, mask)
    if allowed == 0:
        raise NoAllowedTokenError("the grammar allows no token here")
    return allowed


def no_finite_maximum(mx: float) -> ValueError:
    """The error of a row whose logprobs cannot be taken: its maximum is NaN or infinite."""
    return ValueError(f"logits have no finite maximum (max is {mx}): NaN or all -inf")


def sample_batch(samplers: list[SequenceSampler], logits: np.ndarray,
                 masks: Sequence[np.ndarray | None] | None = None) -> list[SampleResult]:
    """One token per row of logits (B, vocab), row b for samplers[b]. Rows are independent:
    each sampler draws from its own Generator. masks: None, or per row a grammar bitmask
    row (int32) or None. When every row is plain greedy (no penalties, bias or logprobs)
    one batched argmax serves them all, after the masks are applied in place."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must have shape ({len(samplers)}, vocab), got {logits.shape}")
    if masks is not None and len(masks) != len(samplers):
        raise ValueError(f"masks must have one entry per row ({len(samplers)}), got {len(masks)}")
    plain = bool(samplers) and all(s._plain_greedy and s.vocab_size == logits.shape[1] for s in samplers)
    in_place = logits.dtype == np.float32 and logits.flags.c_contiguous and logits.flags.writeable
    if plain and (masks is None or in_place):
        for b, m in enumerate(masks or ()):
            if m is not None:
                apply_mask(logits[b], m)
        toks = np.argmax(logits, axis=1)
        return [SampleResult(int(t), math.nan, None) for t in toks.tolist()]
    return [s.sample(logits[b], None if masks is None else masks[b]) for b, s in enumerate(samplers)]
