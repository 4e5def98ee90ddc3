"""Speculative decoding: guess a few tokens per sequence, check them in the one batched forward.

A proposer guesses the next k tokens of a decoding sequence: `ngram` (prompt lookup: the
tokens that followed the latest earlier occurrence of the sequence's last n tokens) or
`draft_model` (a second, smaller ellm model sharing the vocabulary, run greedily on its
own small KV cache). The engine feeds the sequence's last token plus the k guesses in the
step's one forward and asks for their k + 1 logits rows; then, row by row, the target's
own sampler (temperature, top-k/p, min-p, penalties that count the tokens accepted so
far, logprobs) draws a token y_i from p_i. The guess d_i is kept when y_i == d_i; at the
first y_i != d_i, y_i is the output and the rest is dropped; when all k agree, the last
row gives one token more.

Why this is exact. Both proposers are deterministic, so the proposal q is a point mass on
d_i, and standard rejection sampling (accept with min(1, p/q) = p(d_i), else draw from
the residual max(p - q, 0) renormalised = p without d_i) gives y ~ p. Drawing y ~ p and
comparing with d_i is the same distribution, and more: it uses exactly one draw of the
sequence's random generator per output token, in the same order as without speculation,
so a seeded request gives the same tokens bit for bit (the target's logits do not depend
on the batch: a contract of the kernels). Greedy is the case where p is a point mass.

The rows of rejected guesses wrote K/V past the accepted tokens; the engine moves the
sequence's computed count back and frees whole blocks past it (BlockManager.truncate).
Those slots are overwritten before any later query can see them (causal attention).

Back-off, so open-ended text does not pay for guesses that fail: a sequence proposes only
when its n-gram matches (or a draft model runs), and k is chosen per sequence per step
from its recent acceptance rate alpha and the cost of a wider forward: k maximises the
expected extra tokens sum_{i=1..k} alpha^i minus what k more rows cost, in tokens of the
batch's current rate. A large batch (a high rate) or a failing proposer gives k = 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"},
    "draft_model": {"method", "model", "num_speculative_tokens", "adaptive"},
}
MAX_SPECULATIVE_TOKENS = 16

# What one more token in a forward costs, as a fraction of a one-token decode step. On
# SmolLM2-135M Q4_1 with 2 threads, benchmarks/bench_speculative.py --cost measured 0.05-0.2
# per extra row for forwards of 3-17 tokens of one sequence (a loaded shared host, so
# noisy), and the prefill rate (1,077 vs 285 tok/s decode, FACTS) puts a row at ~0.26 of a
# step for long forwards; 0.15 errs toward guessing less.
ROW_COST = 0.15
# Acceptance prior (pseudo-counts accepted / tried: 0.3, so a first check is short) and
# how fast old evidence fades.
_PRIOR_ACCEPTED, _PRIOR_TRIED = 0.6, 2.0
_DECAY = 0.7


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config names. method "ngram": prompt_lookup_max / _min bound the
    length of the n-gram matched (each defaults to the other; both 4 and 2 when neither is
    given). method "draft_model": model is the draft's path or name. adaptive (ellm's own
    key, default True): choose k per step from the acceptance rate and cost (see the module
    docstring); False always proposes num_speculative_tokens when a guess exists."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        # parse() passes a SpeculativeConfig through as it is: one made directly is checked
        # here, or a draft_model without its model would load the default model as the draft
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"speculative_config: method 'draft_model' needs 'model' (a path or name), "
                             f"got {self.model!r}")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A dict (or its JSON text), a SpeculativeConfig, or None (off). A bad value is a
        ValueError naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} for method "
                             f"{method!r} (known: {', '.join(sorted(_KEYS[method]))})")

        def count(name: str, default: int | None, low: int = 1) -> int:
            v = value.get(name, default)
            if v is None or isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"speculative_config: {name} must be an int in [{low}, {MAX_SPECULATIVE_TOKENS}], "
                                 f"got {v!r}")
            return v

        k = count("num_speculative_tokens", None)
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
        if method == "ngram":
            lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo, hi = 2, 4
            hi = count("prompt_lookup_max", hi if hi is not None else lo)
            lo = count("prompt_lookup_min", lo if lo is not None else hi)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
            return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo, adaptive=adaptive)
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config: method 'draft_model' needs 'model' (a path or name), got {model!r}")
        return cls(method, k, model=model, adaptive=adaptive)


def ngram_proposal(ids: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Prompt lookup over ids (L,) int: the up to k tokens that followed the latest earlier
    occurrence of the longest suffix of ids whose length is in n_min..n_max. Empty when
    no suffix that long recurs."""
    L = len(ids)
    if L < 2 or k <= 0:
        return ids[:0]
    # End positions j < L - 1 of earlier occurrences of the last m + 1 tokens, narrowed
    # one token at a time (vectorised over the candidates, not over the text).
    ends = np.flatnonzero(ids[:L - 1] == ids[L - 1])
    best = ends if n_min <= 1 else ends[:0]
    for m in range(1, min(n_max, L - 1)):
        ends = ends[ends >= m]
        ends = ends[ids[ends - m] == ids[L - 1 - m]]
        if len(ends) == 0:
            break
        if m + 1 >= n_min:
            best = ends
    if len(best) == 0:
        return ids[:0]
    j = int(best[-1])
    return ids[j + 1:j + 1 + k]


class AcceptanceTracker:
    """A sequence's recent acceptance rate: guesses accepted / guesses checked (a check
    stops at the first miss), with old evidence fading, over a prior of 0.3."""

    __slots__ = ("accepted", "tried")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.tried = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + _PRIOR_ACCEPTED) / (self.tried + _PRIOR_TRIED)

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted = self.accepted * _DECAY + accepted
        self.tried = self.tried * _DECAY + min(proposed, accepted + 1)

    def fade(self) -> None:
        """A step without a guess: the evidence fades toward the prior, so a sequence that
        stopped guessing tries again later."""
        self.accepted *= _DECAY
        self.tried *= _DECAY


def best_k(alpha: float, k_max: int, token_cost: float) -> int:
    """The k in 0..k_max maximising sum_{i=1..k} alpha^i - token_cost * k (the expected
    extra tokens minus the cost of k more rows, in output tokens)."""
    best, gain, value, term = 0, 0.0, 0.0, 1.0
    for k in range(1, k_max + 1):
        term *= alpha
        value += term - token_cost
        if value > gain:
            best, gain = k, value
    return best


class _SeqState:
    """Per sequence: its acceptance tracker and its tokens as one growing array."""

    __slots__ = ("tracker", "ids", "n")

    def __init__(self) -> None:
        self.tracker = AcceptanceTracker()
        self.ids = np.empty(256, np.int32)
        self.n = 0

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        if total > len(self.ids):
            grown = np.empty(max(total, 2 * len(self.ids)), np.int32)
            grown[:self.n] = self.ids[:self.n]
            self.ids = grown
        if self.n < len(prompt):
            self.ids[self.n:len(prompt)] = prompt[self.n:]
            self.n = len(prompt)
        if self.n < total:
            self.ids[self.n:total] = output[self.n - len(prompt):]
            self.n = total
        return self.ids[:total]


class Speculator:
    """The engine's side of speculation: which decoding sequences guess how many tokens
    this step, the guesses themselves, and the acceptance counts (Engine.stats)."""

    def __init__(self, config: SpeculativeConfig, draft: Any = None, row_cost: float = ROW_COST) -> None:
        self.cfg = config
        self.draft = draft                # a DraftModel for method "draft_model"
        self.row_cost = row_cost
        # a draft token costs the draft's forward too (its share of a target step)
        self.draft_cost = draft.relative_cost if draft is not None else 0.0
        self.states: dict[str, _SeqState] = {}

    def propose(self, seqs: list[tuple[Any, int]], n_out: int, n_tokens: int) -> dict[str, list[int]]:
        """Guesses for this step. seqs: (sequence, most guesses it may take) for the
        decoding sequences that may speculate; n_out / n_tokens: outputs and tokens of the
        step without guesses (they set the rate a guess must beat). -> request id -> guesses."""
        rate = n_out / (1.0 + self.row_cost * max(0, n_tokens - 1))
        token_cost = rate * (self.row_cost + self.draft_cost)
        wanted: list[tuple[Any, _SeqState, int]] = []
        for seq, cap in seqs:
            st = self.states.get(seq.request_id)
            if st is None:
                st = self.states[seq.request_id] = _SeqState()
            k = min(cap, self.cfg.num_speculative_tokens)
            if self.cfg.adaptive:
                k = best_k(st.tracker.alpha, k, token_cost)
            if k <= 0:
                st.tracker.fade()
                continue
            wanted.append((seq, st, k))
        if not wanted:
            return {}
        if self.draft is not None:
            guesses = self.draft.propose([(seq.request_id, st.sync(seq.prompt_ids, seq.output_ids), k)
                                          for seq, st, k in wanted])
        else:
            c = self.cfg
            guesses = {seq.request_id: ngram_proposal(st.sync(seq.prompt_ids, seq.output_ids), k,
                                                      c.prompt_lookup_min, c.prompt_lookup_max).tolist()
                       for seq, st, k in wanted}
        out = {}
        for seq, st, _ in wanted:
            g = [int(t) for t in guesses.get(seq.request_id, ())]
            bad = [i for i, t in enumerate(g) if t >= seq.sampler.vocab_size]  # a draft's padded vocabulary
            g = g[:bad[0]] if bad else g
            if g:
                out[seq.request_id] = g
            else:
                st.tracker.fade()
        return out

    def verified(self, request_id: str, proposed: int, accepted: int, num_valid: int) -> None:
        """After the check: accepted of proposed guesses were kept; the sequence's first
        num_valid tokens are final (the draft model's cache rolls back to them)."""
        st = self.states.get(request_id)
        if st is not None:
            st.tracker.update(proposed, accepted)
        if self.draft is not None:
            self.draft.rollback(request_id, num_valid)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)


@dataclass(eq=False)
class _Guessing:
    """A sequence DraftModel.propose is guessing for."""
    key: str
    ids: np.ndarray          # its tokens so far
    k: int                   # guesses wanted
    done: int                # tokens with K/V in the draft's cache
    guesses: list[int] = field(default_factory=list)


class DraftModel:
    """A second ellm model that guesses greedily, on a small paged KV cache of its own.

    Per sequence it keeps how many of the sequence's tokens have K/V in its cache. To
    guess k tokens it first runs the tokens it has not seen (one forward for all
    sequences, in chunks of max_batch_tokens), takes the argmax, then runs k - 1 one-token
    forwards of all guessing sequences together. After the target's check the count moves
    back to the tokens that were kept (rollback)."""

    def __init__(self, model: Any, engine_config: Any, relative_cost: float) -> None:
        from dataclasses import replace

        from .kv_cache import BlockManager
        from .runner import ModelRunner

        self.model = model
        self.max_positions = model.config.max_position_embeddings
        self.max_batch_tokens = engine_config.max_batch_tokens
        self.relative_cost = relative_cost
        # the draft's own KV cache and workspace on its backend, sized like the target's
        self.runner = ModelRunner(model, replace(engine_config, speculative=None))
        self.kv = self.runner.kv
        self.blocks = BlockManager(self.kv, enable_prefix_caching=False)
        self.computed: dict[str, int] = {}

    def _forward(self, items: list[tuple[str, np.ndarray, int]], want: list[int]) -> np.ndarray:
        """One forward: per item (key, tokens, first position); logits of each item's
        last token (want: the items' indexes, in order)."""
        from ..models.batch import Batch

        token_ids = np.concatenate([tok for _, tok, _ in items]).astype(np.int32)
        positions = np.concatenate([np.arange(p, p + len(tok), dtype=np.int32) for _, tok, p in items])
        seq_ids = np.concatenate([np.full(len(tok), b, np.int32) for b, (_, tok, _) in enumerate(items)])
        ends = np.cumsum([len(tok) for _, tok, _ in items]) - 1
        tables = {}
        for w in self.kv.windows:
            rows = [self.blocks.table(key, w) for key, _, _ in items]
            arr = np.full((len(items), max(1, max(map(len, rows)))), -1, np.int32)
            for b, tbl in enumerate(rows):
                arr[b, :len(tbl)] = tbl
            tables[w] = arr
        batch = Batch(token_ids, positions, seq_ids, tables, ends[want].astype(np.int32))
        return self.runner.forward(batch)

    def propose(self, wanted: list[tuple[str, np.ndarray, int]]) -> dict[str, list[int]]:
        """wanted: (key, the sequence's tokens so far, k) -> key -> up to k guesses."""
        live = []
        for key, ids, k in wanted:
            done = min(self.computed.get(key, 0), len(ids) - 1)
            if len(ids) + k - 1 > self.max_positions or not self.blocks.allocate(key, len(ids) + k - 1):
                continue   # no room in the draft's cache now: this sequence does not guess
            self.blocks.release_out_of_window(key, done)
            live.append(_Guessing(key, ids, k, done))
        # catch up on the tokens not yet seen, a token budget at a time
        pending = list(live)
        while pending:
            budget = self.max_batch_tokens
            items: list[tuple[str, np.ndarray, int]] = []
            finishing: list[int] = []
            for st in pending:
                n = min(len(st.ids) - st.done, budget)
                if n <= 0:
                    break
                items.append((st.key, st.ids[st.done:st.done + n], st.done))
                st.done += n
                budget -= n
                if st.done == len(st.ids):
                    finishing.append(len(items) - 1)
            logits = self._forward(items, finishing)
            by_key = {items[i][0]: logits[r] for r, i in enumerate(finishing)}
            for st in pending:
                if st.key in by_key:
                    st.guesses.append(int(np.argmax(by_key[st.key])))
            pending = [st for st in pending if st.done < len(st.ids)]
        # then one token at a time for those that want more
        while True:
            more = [st for st in live if len(st.guesses) < st.k]
            if not more:
                break
            items = [(st.key, np.asarray(st.guesses[-1:], np.int32), st.done) for st in more]
            logits = self._forward(items, list(range(len(items))))
            for st, row in zip(more, logits):
                st.done += 1
                st.guesses.append(int(np.argmax(row)))
        out = {}
        for st in live:
            self.computed[st.key] = st.done
            out[st.key] = st.guesses
        return out

    def rollback(self, key: str, num_valid: int) -> None:
        if key in self.computed:
            self.computed[key] = min(self.computed[key], num_valid)
            self.blocks.truncate(key, num_valid + 1)

    def release(self, key: str) -> None:
        self.computed.pop(key, None)
        self.blocks.free(key)


def _weight_elements(config: Any) -> float:
    """A rough count of a model's matmul weights per token (its decode cost)."""
    h, n = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * h) or 4 * h
    kv = config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    return n * (h * (2 * q + 2 * kv) + 3 * h * inter) + h * config.vocab_size


def check_same_vocabulary(target_tok: Any, draft_tok: Any) -> None:
    """The draft must share the target's tokenizer: same token -> id map."""
    a = target_tok.backend.get_vocab(with_added_tokens=True)
    b = draft_tok.backend.get_vocab(with_added_tokens=True)
    if a == b:
        return
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    tok, idx = diff[0]
    where = "target" if a.get(tok) == idx else "draft"
    raise ValueError(f"speculative_config: the draft model's vocabulary differs from the target's "
                     f"({len(a)} vs {len(b)} tokens; e.g. {tok!r} is id {idx} only in the {where}'s)")


def make_speculator(engine_config: Any, model: Any, draft_model: Any = None) -> Speculator:
    """The Speculator an Engine uses for engine_config.speculative; draft_model is the
    loaded draft (method "draft_model")."""
    cfg = engine_config.speculative
    if not isinstance(cfg, SpeculativeConfig):
        raise TypeError(f"EngineConfig.speculative must be a SpeculativeConfig, got {type(cfg).__name__}")
    if cfg.method == "ngram":
        if draft_model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no draft model")
        return Speculator(cfg)
    if draft_model is None:
        raise ValueError("speculative_config: method 'draft_model' needs the draft model loaded")
    draft = DraftModel(draft_model, engine_config,
                       relative_cost=_weight_elements(draft_model.config) / _weight_elements(model.config))
    return Speculator(cfg, draft)
