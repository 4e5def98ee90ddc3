"""Constrained decoding (ellm.engine.structured on llguidance) on the real models.

Every output is checked by a matcher that is not llguidance: Python's `re`, the
`jsonschema` package, a small recursive-descent parser for the arithmetic grammar, plain
membership for `choice`. The requests are sampled (temperature 1, seeded, top-k / top-p /
min-p mixed) and run in one batch beside unconstrained ones, so the masks must follow each
sequence through continuous batching. The C mask kernel is compared with a NumPy
reference at every SIMD level.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import ellm
from ellm._native import _core, _sample
from ellm.engine.engine import EngineConfig
from ellm.engine.sampler import SequenceSampler, apply_mask, sample_batch
from ellm.engine.structured import GrammarState, MaskFiller, llg_tokenizer
from ellm.sampling_params import SamplingParams

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
# Bounded, so every sample ends well inside max_tokens.
ARITH_GBNF = r"""
root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" num (op num){1,2} ")"
num  ::= [1-9] [0-9]{0,2}
op   ::= " + " | " - " | " * "
"""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
COLORS = ["red", "green", "blue", "dark purple"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return ellm.load(smollm2_gguf, max_model_len=1024, max_num_seqs=64, progress=False)


def _chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def _variety(i: int) -> dict:
    """Sampling settings that differ from request to request."""
    return [dict(temperature=1.0), dict(temperature=0.8, top_k=20), dict(temperature=1.2, top_p=0.9),
            dict(temperature=1.0, min_p=0.05), dict(temperature=0.0)][i % 5]


# ---------------------------------------------------------------- an independent parser

def parse_arith(text: str) -> int:
    """Evaluates ARITH_GBNF's language by recursive descent (left to right, * before +/-);
    raises ValueError on anything outside it."""
    pos = 0

    def expect(s: str) -> None:
        nonlocal pos
        if not text.startswith(s, pos):
            raise ValueError(f"expected {s!r} at {pos} in {text!r}")
        pos += len(s)

    def num() -> int:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if not m:
            raise ValueError(f"expected a number at {pos} in {text!r}")
        pos = m.end()
        return int(m.group())

    def op() -> str | None:
        for o in (" + ", " - ", " * "):
            if text.startswith(o, pos):
                return o
        return None

    def chain(operand, least: int, most: int) -> int:
        vals, ops = [operand()], []
        while len(ops) < most and (o := op()) is not None:
            expect(o)
            ops.append(o.strip())
            vals.append(operand())
        if len(ops) < least:
            raise ValueError(f"expected an operator at {pos} in {text!r}")
        # * first, then + and - left to right
        acc, sums = vals[0], []
        for o, v in zip(ops, vals[1:]):
            if o == "*":
                acc *= v
            else:
                sums.append(acc)
                sums.append(o)
                acc = v
        sums.append(acc)
        total = sums[0]
        for o, v in zip(sums[1::2], sums[2::2]):
            total = total + v if o == "+" else total - v
        return total

    def term() -> int:
        if text.startswith("(", pos):
            expect("(")
            v = chain(num, 1, 2)
            expect(")")
            return v
        return num()

    value = chain(term, 0, 3)
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")
    return value


def test_the_arithmetic_parser_itself() -> None:
    assert parse_arith("12 + (3 * 4) - 5") == 19
    assert parse_arith("2 * 3 + 4") == 10
    for bad in ("", "0", "1 +", "(1)", "1 + 2 + 3 + 4 + 5", "1  + 2", "1234"):
        with pytest.raises(ValueError):
            parse_arith(bad)


# ---------------------------------------------------------------- the C mask kernel

@pytest.mark.parametrize("level", _core.supported_simd_levels())
def test_mask_kernel_matches_numpy_at_every_level(level: str) -> None:
    rng = np.random.default_rng(7)
    saved = _sample.simd_level()
    try:
        _sample.set_simd_level(level)
        for n in (1, 31, 32, 33, 95, 1000, 49152, 262144 + 5):
            for nwords in ((n + 31) // 32, n // 32, 1, 0):
                x = rng.standard_normal(n).astype(np.float32)
                bits = rng.integers(-2**31, 2**31, nwords, dtype=np.int64).astype(np.int32)
                if nwords >= 4:  # the all-ones, all-zero and single-bit word paths
                    bits[:3] = (-1, 0, 1)
                allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)[:n]
                allowed = np.concatenate([allowed, np.zeros(n - len(allowed), bool)])
                want = np.where(allowed, x, np.float32(-np.inf))
                got = _sample.mask_apply(x, bits)
                assert got == int(allowed.sum())
                assert np.array_equal(x, want), (level, n, nwords)
    finally:
        _sample.set_simd_level(saved)


def test_masked_sampling_draws_only_allowed_tokens() -> None:
    rng = np.random.default_rng(3)
    V = 1000
    bits = np.zeros((V + 31) // 32, np.int32)
    allowed = np.array([5, 17, 400, 999])
    for t in allowed:
        bits[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-2**31)
    for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(top_k=2), dict(top_p=0.5),
               dict(min_p=0.5), dict(temperature=0.0, logprobs=2)):
        s = SequenceSampler(SamplingParams(seed=1, **kw), [1, 2], V)
        for _ in range(20):
            logits = rng.standard_normal(V).astype(np.float32) * 5
            raw = logits.copy()
            res = s.sample(logits, bits)
            assert res.token_id in allowed
            if kw.get("temperature") == 0.0:  # greedy: the best allowed token
                assert res.token_id == allowed[np.argmax(raw[allowed])]
            if "logprobs" in kw:  # logprobs are the raw model's, before the mask
                lse = np.log(np.exp(raw.astype(np.float64) - raw.max()).sum()) + raw.max()
                assert res.logprob == pytest.approx(raw[res.token_id] - lse, abs=1e-5)
    # the batched greedy path applies the masks too
    logits = rng.standard_normal((2, V)).astype(np.float32)
    samplers = [SequenceSampler(SamplingParams(temperature=0.0), [1], V) for _ in range(2)]
    out = sample_batch(samplers, logits, [bits, None])
    assert out[0].token_id in allowed
    with pytest.raises(ValueError, match="allows no token"):
        apply_mask(np.zeros(V, np.float32), np.zeros_like(bits))


# ---------------------------------------------------------------- parameters

def test_constraint_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="only one constraint"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="(?s)regex is invalid.*unclosed group"):
        SamplingParams(regex="(abc")
    with pytest.raises(ValueError, match="(?s)json_schema is invalid.*nonsense"):
        SamplingParams(json_schema={"type": "nonsense"})
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{oops")
    with pytest.raises(ValueError, match="(?s)grammar is invalid.*undefined_rule"):
        SamplingParams(grammar="root ::= undefined_rule")
    with pytest.raises(ValueError, match="grammar is invalid"):
        SamplingParams(grammar="start: ( 'a'")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SamplingParams(choice=[])
    with pytest.raises(ValueError, match="json_schema must be a dict"):
        SamplingParams(json_schema=42)
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    p = SamplingParams(json_schema=Person)
    assert p.json_schema["required"] == ["name", "age"] and p.constraint[0] == "json_schema"
    assert SamplingParams().constraint is None
    # replace() keeps the constraint valid and compiled
    import dataclasses
    assert dataclasses.replace(p, temperature=0.5).constraint == p.constraint


# ---------------------------------------------------------------- tokenizers

TEXTS = ["Hello world 123", " été\n\n  x = {\"a\": [1, 2]}", "日本語のテキスト"]


def _same_vocabulary(tok) -> None:
    """llguidance reads the tokenizers JSON of ellm's Tokenizer, whether ellm built it
    from a folder's tokenizer.json or from a GGUF vocabulary: it must tokenize and decode
    as ellm does."""
    llt = llg_tokenizer(tok, tok.vocab_size, tok.eos_token_ids)
    assert llt.vocab_size == tok.vocab_size
    assert set(llt.eos_tokens) == set(tok.eos_token_ids)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert llt.decode_bytes(ids).decode("utf-8") == text
        assert llt.tokenize_str(text) == ids
    assert llg_tokenizer(tok, tok.vocab_size, tok.eos_token_ids) is llt  # cached


def test_llguidance_sees_the_same_vocabulary_as_ellm(smollm2, smollm2_hf_f32) -> None:
    from ellm.tokenizer import Tokenizer

    _same_vocabulary(smollm2.tokenizer)                      # from the GGUF vocabulary
    _same_vocabulary(Tokenizer.from_folder(smollm2_hf_f32))  # from tokenizer.json


def test_mask_filler_matches_each_matcher_alone(smollm2) -> None:
    tok = llg_tokenizer(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.engine.eos_ids)
    grammars = [SamplingParams(json_schema=PERSON).constraint[1], SamplingParams(regex=DATE).constraint[1]]
    states = [GrammarState(tok, g) for g in grammars]
    states[0].advance(smollm2.tokenizer.encode('{"', add_special_tokens=False)[0])
    filler = MaskFiller(smollm2.config.vocab_size)
    rows = filler.start([states[0], None, states[1]]).wait()
    assert rows[1] is None
    for st, row in zip(states, (rows[0], rows[2])):
        # compute_bitmask() rounds its length up by a word; the bits past the vocabulary are 0
        alone = np.frombuffer(st.matcher.compute_bitmask(), np.int32)
        assert np.array_equal(row, alone[:len(row)]) and not alone[len(row):].any()
        assert row.any()
    filler.close()


# ---------------------------------------------------------------- generation

def _run_mixed(llm, requests: list[tuple[list[int], SamplingParams]]):
    """All requests in one engine, stepped together; returns RequestOutputs in order. The
    engine loop's lock keeps its thread from stepping the engine meanwhile."""
    with llm._loop().lock:
        ids = [llm.engine.add_request(p, sp) for p, sp in requests]
        done = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[i] for i in ids]


def test_constrained_and_free_requests_in_one_batch(smollm2) -> None:
    """choice, a date regex, a GBNF arithmetic grammar and a JSON schema, 10 seeded samples
    each with varied settings, batched with unconstrained requests: every constrained
    output is accepted by an independent matcher and ends by the grammar, not by length."""
    prompts = {
        "choice": _chat_ids(smollm2, "What is your favourite colour?"),
        "regex": _chat_ids(smollm2, "When was the Eiffel Tower finished? Answer with a date."),
        "grammar": _chat_ids(smollm2, "Write a sum."),
        "json": _chat_ids(smollm2, "Describe a user account as JSON."),
        "free": _chat_ids(smollm2, "Tell me a story."),
    }
    reqs: list[tuple[str, list[int], SamplingParams]] = []
    for i in range(10):
        v = _variety(i)
        reqs += [("choice", prompts["choice"], SamplingParams(choice=COLORS, seed=i, max_tokens=16, **v)),
                 ("regex", prompts["regex"], SamplingParams(regex=DATE, seed=i, max_tokens=24, **v)),
                 ("grammar", prompts["grammar"], SamplingParams(grammar=ARITH_GBNF, seed=i, max_tokens=64, **v)),
                 ("json", prompts["json"], SamplingParams(json_schema=PERSON, seed=i, max_tokens=96, **v))]
        if i % 3 == 0:
            reqs.append(("free", prompts["free"], SamplingParams(seed=i, max_tokens=24, **v)))
    outs = _run_mixed(smollm2, [(p, sp) for _, p, sp in reqs])
    seen: dict[str, set[str]] = {}
    for (kind, _, _), out in zip(reqs, outs):
        seen.setdefault(kind, set()).add(out.text)
        if kind == "free":
            continue
        assert out.finish_reason == "stop", (kind, out.text)
        if kind == "choice":
            assert out.text in COLORS
        elif kind == "regex":
            assert re.fullmatch(DATE, out.text), out.text
        elif kind == "grammar":
            parse_arith(out.text)
        else:
            jsonschema.validate(json.loads(out.text), PERSON)
    # sampling still samples: the seeded requests do not all say the same thing
    for kind in ("regex", "grammar", "json"):
        assert len(seen[kind]) >= 3, (kind, seen[kind])


def test_seeded_constrained_output_does_not_depend_on_the_batch(smollm2) -> None:
    ids = _chat_ids(smollm2, "Describe a user account as JSON.")
    p = SamplingParams(json_schema=PERSON, seed=11, temperature=1.0, max_tokens=96, logprobs=2)
    alone = smollm2.generate(ids, p)
    others = [(ids, SamplingParams(regex=DATE, seed=s, max_tokens=24)) for s in range(3)] + \
        [(ids, SamplingParams(seed=s, max_tokens=30)) for s in range(3)]
    together = _run_mixed(smollm2, others[:3] + [(ids, p)] + others[3:])[3]
    assert together.token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), PERSON)
    assert len(alone.logprobs) == len(alone.token_ids)
    assert all(np.isfinite(lp.logprob) and lp.logprob <= 0 for lp in alone.logprobs)


def test_streaming_and_stop_strings_with_a_constraint(smollm2) -> None:
    ids = _chat_ids(smollm2, "Describe a user account as JSON.")
    p = SamplingParams(json_schema=PERSON, seed=2, max_tokens=96)
    pieces = list(smollm2.stream(ids, p))
    whole = smollm2.generate(ids, p).text
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), PERSON)
    # a stop string ends the constrained output early, where it first appears
    cut = smollm2.generate(ids, SamplingParams(json_schema=PERSON, seed=2, max_tokens=96, stop=['"age"']))
    assert cut.finish_reason == "stop" and whole.startswith(cut.text) and '"age"' not in cut.text


def test_eos_only_where_the_grammar_may_end(smollm2) -> None:
    """With a grammar that may end early or go on ("a" then up to 5 more "a"s), the model
    may stop at any accepting point but never before; ignore_eos keeps it to the end."""
    ids = _chat_ids(smollm2, "Say something.")
    outs = smollm2.generate([ids] * 8, SamplingParams(regex="(ab){1,6}", temperature=1.5, seed=3, max_tokens=20))
    for o in outs:
        assert re.fullmatch("(ab){1,6}", o.text) and o.finish_reason == "stop"
    full = smollm2.generate(ids, SamplingParams(regex="(ab){1,6}", temperature=0.0, ignore_eos=True,
                                                max_tokens=40))
    assert full.text == "ab" * 6 and full.finish_reason == "stop"


def test_constrained_requests_survive_preemption(smollm2_gguf) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=512, progress=False)
    prompts = [_chat_ids(llm, f"Describe user number {i} as JSON.") for i in range(4)]
    params = SamplingParams(json_schema=PERSON, temperature=0.0, max_tokens=60)
    alone = [llm.generate(p, params).token_ids for p in prompts]
    small = ellm.load(smollm2_gguf, max_model_len=512, progress=False)
    small.engine.__init__(small.model, small.tokenizer,
                          EngineConfig(max_model_len=512, kv_cache_tokens=max(map(len, prompts)) * 4 + 48,
                                       max_batch_tokens=64, enable_prefix_caching=False))
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    for o in outs:
        jsonschema.validate(json.loads(o.text), PERSON)


def test_gemma_json_schema(gemma3_gguf) -> None:
    """Gemma 3's 262144-token SentencePiece vocabulary (a base model, no chat template)."""
    llm = ellm.load(gemma3_gguf, max_model_len=512, max_num_seqs=8, progress=False)
    _same_vocabulary(llm.tokenizer)
    ids = llm.tokenizer.encode("A user account in JSON:\n", add_special_tokens=True)
    outs = llm.generate([ids] * 4, SamplingParams(json_schema=PERSON, temperature=1.0, seed=5, max_tokens=80))
    free = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=8))
    assert free.finish_reason in ("stop", "length")
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


def test_a_failed_matcher_finishes_its_request_alone(smollm2) -> None:
    """A matcher in error (here: fed a token its grammar refuses, as a grammar past
    llguidance's limits would be) ends its own request with finish_reason "error"; the
    batch goes on."""
    ids = _chat_ids(smollm2, "Pick a colour.")
    with smollm2._loop().lock:
        eng = smollm2.engine
        bad = eng.add_request(ids, SamplingParams(choice=COLORS, temperature=0.0, max_tokens=8))
        good = eng.add_request(ids, SamplingParams(regex=DATE, temperature=0.0, max_tokens=24))
        eng.seqs[bad].grammar.advance(smollm2.tokenizer.encode("zzz", add_special_tokens=False)[0])
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
    assert done[bad].finish_reason == "error" and done[bad].error
    assert done[good].finish_reason == "stop" and re.fullmatch(DATE, done[good].text)
