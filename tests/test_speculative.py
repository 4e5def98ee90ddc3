"""Speculative decoding (ellm.engine.speculative) is exact.

On the real default model (SmolLM2-135M Q4_1): greedy ids with n-gram guesses equal those
without, for input-grounded and open-ended prompts run together, with prefill chunks and
a grammar-constrained request in the same steps; seeded sampling with penalties gives the
same tokens and the same logprobs bit for bit (the rows after a rejection are computed
over rolled-back KV slots, so this is also the rollback check); unseeded samples follow
the model's own distribution (chi-square against probabilities computed here in numpy
from llm.logits, p-value by simulation); the prefix cache holds only prompt blocks and no
block leaks; a draft model (the same model, then its bf16 Hugging Face folder) gives the
same text; bad configs are clear ValueErrors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm import SamplingParams
from ellm.engine.kv_cache import BlockManager
from ellm.engine.speculative import ROW_COST, SpeculativeConfig, best_k, ngram_proposal

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
# An input-grounded task (the answer copies the input) and open-ended ones.
SOURCE = README[:1200]
GROUNDED = [{"role": "user", "content": "Copy the following text exactly, word for word:\n\n" + SOURCE}]
OPEN = [[{"role": "user", "content": "Write a short poem about the sea."}],
        [{"role": "user", "content": "Why is the sky blue?"}]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module")
def base(smollm2_gguf):
    with ellm.load(smollm2_gguf, max_model_len=2048, max_batch_tokens=128, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(smollm2_gguf):
    with ellm.load(smollm2_gguf, max_model_len=2048, max_batch_tokens=128, progress=False,
                   speculative_config=NGRAM) as llm:
        yield llm


def _ids(llm, messages):
    return llm.encode_chat(messages)


# -- the proposer ------------------------------------------------------------------------

def _lookup_reference(ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup spelled out: the longest suffix first, the latest occurrence."""
    L = len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n:]
        for start in range(L - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_ngram_proposal_matches_a_plain_search() -> None:
    rng = np.random.default_rng(0)
    for trial in range(400):
        L = int(rng.integers(1, 60))
        ids = rng.integers(0, 4 if trial % 2 else 9, L).astype(np.int32)
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        got = ngram_proposal(ids, k, lo, hi).tolist()
        assert got == _lookup_reference(ids.tolist(), k, lo, hi), (ids.tolist(), k, lo, hi)


def test_back_off_chooses_no_guess_when_they_fail_or_cost_too_much() -> None:
    assert best_k(0.05, 4, ROW_COST) == 0          # guesses that rarely hold
    assert best_k(0.9, 4, ROW_COST) == 4           # guesses that do
    assert best_k(0.9, 4, 64 * ROW_COST) == 0      # a batch of 64: a row costs more than it gives


# -- greedy: the same ids ------------------------------------------------------------------

def test_greedy_ids_identical_batched_with_prefill_and_grammar(base, spec) -> None:
    prompts = [_ids(base, m) for m in OPEN] + [_ids(base, GROUNDED)]
    p = SamplingParams(temperature=0, max_tokens=48)
    want = [o.token_ids for o in base.generate(prompts, p)]
    # a constrained request in the same batch: it never guesses, and stays valid
    rx = SamplingParams(temperature=0, max_tokens=20, regex=r"[a-z]+( [a-z]+){2}")
    plans: list[list[tuple[int, int, int]]] = []
    engine = spec.engine
    build = engine._build_batch

    def spy(plan):   # records (tokens, guesses, still prefilling) per sequence of each step
        plans.append([(n, len(s.draft_ids), n > 1 + len(s.draft_ids)) for s, n in plan])
        return build(plan)

    engine._build_batch = spy
    try:
        before = dict(engine.stats)
        # the open-ended ones decode (and guess) when the long one arrives and prefills
        handles = [spec._loop().submit_blocking(ids, p) for ids in prompts[:-1]]
        hrx = spec._loop().submit_blocking(_ids(base, OPEN[1]), rx)
        for _ in range(3):
            next(handles[0])
        handles.append(spec._loop().submit_blocking(prompts[-1], p))
        outs = [h.result() for h in handles]
        out_rx = hrx.result()
    finally:
        engine._build_batch = build
    assert [o.token_ids for o in outs] == want
    assert re.fullmatch(r"[a-z]+( [a-z]+){2}", out_rx.text), out_rx.text
    proposed = engine.stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = engine.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < proposed      # guesses were kept and guesses were rejected
    # some step checked guesses while another sequence was prefilling
    assert any(any(g for _, g, _ in st) and any(pre for _, _, pre in st) for st in plans)


def test_open_ended_and_grounded_text_same_alone(base, spec) -> None:
    p = SamplingParams(temperature=0, max_tokens=40)
    for m in (GROUNDED, OPEN[0]):
        assert spec.chat(m, p).token_ids == base.chat(m, p).token_ids


# -- sampling: the same draws, the same distribution -------------------------------------------

def test_seeded_sampling_and_logprobs_identical(base, spec) -> None:
    """Penalties count the guesses kept earlier in the same check; each output token
    uses one draw of the request's generator, as without speculation; the logprobs of the
    rows after a rejection come from rolled-back KV slots and still equal, bit for bit."""
    prompt = _ids(base, GROUNDED)
    for seed in range(4):
        p = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, repetition_penalty=1.1,
                           frequency_penalty=0.2, seed=seed, max_tokens=40, logprobs=3)
        a, b = base.generate(prompt, p), spec.generate(prompt, p)
        assert a.token_ids == b.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in a.logprobs] == \
               [(t.token_id, t.logprob, t.top) for t in b.logprobs]
    stats = spec.engine.stats
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def _simulated_p_value(counts: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> float:
    """Chi-square goodness of fit, its p-value by simulating the statistic under probs."""
    n = counts.sum()
    expected = probs * n

    def stat(c: np.ndarray) -> np.ndarray:
        return ((c - expected) ** 2 / expected).sum(axis=-1)

    null = stat(rng.multinomial(n, probs, size=4000))
    return float((null >= stat(counts)).mean())


def test_samples_over_many_seeds_follow_the_model(smollm2_gguf, base) -> None:
    """Second and third tokens of many seeded samples (temperature 1, repetition
    penalty 1.05), given the most frequent first tokens, against the probabilities numpy
    computes from the model's logits."""
    prompt = base.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. "
                                   "the cat sat on the")
    T, rp = 1.0, 1.05
    # 4 x n=100 completions with seeds 1000..1099, 2000..2099, ...: independent draws, reproducible
    p = [SamplingParams(temperature=T, repetition_penalty=rp, max_tokens=3, ignore_eos=True, n=100, seed=1000 * j)
         for j in range(1, 5)]
    # waves of 32 sequences, with room in each step's budget for their guesses
    with ellm.load(smollm2_gguf, max_model_len=256, max_num_seqs=32, progress=False,
                   speculative_config=NGRAM) as spec:
        outs = [o for pj in p for o in spec.generate(prompt, pj)]
        stats = spec.engine.stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    rng = np.random.default_rng(7)
    tested = 0
    for pos in (1, 2):
        prefixes: dict[tuple[int, ...], list[int]] = {}
        for o in outs:
            prefixes.setdefault(tuple(o.token_ids[:pos]), []).append(o.token_ids[pos])
        for prefix, nexts in sorted(prefixes.items(), key=lambda kv: -len(kv[1]))[:2]:
            if len(nexts) < 30:
                continue
            ctx = prompt + list(prefix)
            x = base.logits(ctx)[-1].astype(np.float64)
            seen = np.unique(ctx)
            x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
            probs = np.exp((x - x.max()) / T)
            probs /= probs.sum()
            # bins: tokens expected >= 5 times, the rest together
            big = np.flatnonzero(probs * len(nexts) >= 5)
            idx = {int(t): i for i, t in enumerate(big)}
            counts = np.zeros(len(big) + 1)
            for t in nexts:
                counts[idx.get(t, len(big))] += 1
            pb = np.append(probs[big], max(0.0, 1.0 - probs[big].sum()))
            pb = pb / pb.sum()
            pv = _simulated_p_value(counts, pb, rng)
            assert pv > 1e-3, (pos, prefix)
            tested += 1
    assert tested >= 2


# -- the KV cache: rollback, prefix blocks, no leaks --------------------------------------------

def test_prefix_cache_holds_prompt_blocks_only_and_nothing_leaks(spec) -> None:
    engine = spec.engine
    bm = engine.blocks
    bm.clear_prefix_cache()
    prompts = [_ids(spec, GROUNDED), _ids(spec, OPEN[0])]
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    allowed = set()
    for ids in prompts:
        allowed |= set(BlockManager.block_hashes(ids, bm.block_size))
    assert bm.cached and set(bm.cached) <= allowed
    assert bm.num_used() == sum(len(b) for b in bm.cached.values())   # only the cache holds blocks


def test_truncate_frees_blocks_past_the_kept_tokens(spec) -> None:
    bm = spec.engine.blocks
    used0 = bm.num_used()
    key = ("test", 1)
    assert bm.allocate(key, 5 * bm.block_size + 3)
    assert len(bm.table(key, 0)) == 6
    bm.truncate(key, 2 * bm.block_size + 1)
    assert len(bm.table(key, 0)) == 3
    bm.free(key)
    assert bm.num_used() == used0


# -- a draft model ------------------------------------------------------------------------------

def test_model_as_its_own_draft_accepts_almost_everything(smollm2_gguf, base) -> None:
    cfg = {"method": "draft_model", "model": str(smollm2_gguf), "num_speculative_tokens": 4, "adaptive": False}
    with ellm.load(smollm2_gguf, max_model_len=2048, progress=False, speculative_config=cfg) as llm:
        p = SamplingParams(temperature=0, max_tokens=32)
        for m in (OPEN[1], GROUNDED):
            assert llm.chat(m, p).token_ids == base.chat(m, p).token_ids
        st = dict(llm.engine.stats)
        # the draft's logits are the target's (batch invariance): every greedy guess holds
        assert st["spec_accepted_tokens"] == st["spec_proposed_tokens"] > 0
        ps = SamplingParams(temperature=0.8, seed=3, max_tokens=24)
        assert llm.chat(OPEN[0], ps).token_ids == base.chat(OPEN[0], ps).token_ids


def test_other_draft_model_sharing_the_vocabulary(smollm2_gguf, smollm2_hf_bf16, base) -> None:
    cfg = {"method": "draft_model", "model": str(smollm2_hf_bf16), "num_speculative_tokens": 3, "adaptive": False}
    with ellm.load(smollm2_gguf, max_model_len=2048, progress=False, speculative_config=cfg) as llm:
        p = SamplingParams(temperature=0, max_tokens=24)
        assert llm.chat(GROUNDED, p).token_ids == base.chat(GROUNDED, p).token_ids
        assert llm.engine.stats["spec_accepted_tokens"] > 0


def test_draft_with_another_vocabulary_is_refused(smollm2_gguf, gemma3_gguf) -> None:
    cfg = {"method": "draft_model", "model": str(gemma3_gguf), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="vocabulary differs"):
        ellm.load(smollm2_gguf, progress=False, speculative_config=cfg)


# -- configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mx": 3}, "unknown key.*prompt_lookup_mx"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "unknown key.*'model'"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min .4. is above"),
    ({"method": "ngram", "num_speculative_tokens": 4, "adaptive": "yes"}, "adaptive must be"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "needs 'model'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_configs_are_clear_errors(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_a_draft_model_config_made_directly_needs_its_model() -> None:
    # parse() takes a SpeculativeConfig as it is: without this check load() went on to load
    # the default model as the draft
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig("draft_model", 3)
    assert SpeculativeConfig.parse(SpeculativeConfig("draft_model", 3, model="x")).model == "x"


def test_config_defaults_and_json() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == (5, 5, True)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)


def test_load_rejects_a_bad_config_before_loading(smollm2_gguf) -> None:
    with pytest.raises(ValueError, match="unknown key"):
        ellm.load(smollm2_gguf, progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                     "k": 1})


def test_cli_reports_a_bad_config(smollm2_gguf, capsys) -> None:
    from ellm.cli import main
    rc = main(["run", str(smollm2_gguf), "hi", "--speculative-config", json.dumps({"method": "nope"})])
    assert rc != 0
    assert "method must be one of" in capsys.readouterr().err


def test_serve_reports_a_bad_config(smollm2_gguf, capsys) -> None:
    from ellm.cli import main
    rc = main(["serve", str(smollm2_gguf), "--port", "1", "--speculative-config", '{"method": "ngram"}'])
    assert rc == 2
    assert "num_speculative_tokens must be an int" in capsys.readouterr().err


def test_metrics_report_the_counts(smollm2_gguf) -> None:
    from starlette.testclient import TestClient

    from ellm.server import create_app

    # an LLM of its own: the app's lifespan stops the engine loop it serves
    spec = ellm.load(smollm2_gguf, max_model_len=2048, progress=False, speculative_config=NGRAM)
    with TestClient(create_app(spec, served_model_name=["m"])) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": GROUNDED, "max_tokens": 24,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        text = http.get("/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("ellm_spec_")}
    st = spec.engine.stats
    assert values["ellm_spec_proposed_tokens_total"] == st["spec_proposed_tokens"] > 0
    assert values["ellm_spec_accepted_tokens_total"] == st["spec_accepted_tokens"] > 0
