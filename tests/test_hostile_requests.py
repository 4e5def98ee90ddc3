"""Hostile requests: one request must never hurt another.

- Sampling values are checked against what the float32 kernels can represent: values at
  the edges of the ranges sample real model logits at temperature > 0, values past them
  are a ValueError naming the field (400 at the server), never an error in a step.
- Booleans are not token ids; numbers too large for a float are refused, not an
  OverflowError.
- The engine's per-request error boundary, tested by fault injection on the real model:
  one sequence's sampler (or detokenizer) raises mid-generation; that request alone is
  finished with finish_reason "error" and the others produce exactly the text they
  produce when run without it; every KV block comes back.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm.engine.engine import RequestError, SequenceError
from ellm.engine.sampler import SequenceSampler
from ellm.sampling_params import (
    MAX_TEMPERATURE,
    MIN_TOP_P,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    check_token_ids,
)


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> ellm.LLM:
    return ellm.load(smollm2_gguf, max_model_len=512, max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def real_logits(llm: ellm.LLM) -> np.ndarray:
    """Logits of the real model after a prompt: the rows the sampler really sees."""
    # (Engine.logits directly: the LLM facade would start its engine thread, and the
    # tests below step the engine from this thread)
    return llm.engine.logits(llm.tokenizer.encode("The capital of France is"))[-3:]


# -- numeric validation ---------------------------------------------------------------------

EDGES = [
    {"repetition_penalty": REPETITION_PENALTY_RANGE[0]},
    {"repetition_penalty": REPETITION_PENALTY_RANGE[1]},
    {"temperature": MAX_TEMPERATURE},
    {"temperature": 1.0000001e-5},
    {"top_p": MIN_TOP_P},
    {"top_p": MIN_TOP_P, "temperature": MAX_TEMPERATURE},
    {"min_p": 1.0, "repetition_penalty": REPETITION_PENALTY_RANGE[1]},
    {"top_k": 3, "repetition_penalty": REPETITION_PENALTY_RANGE[0], "temperature": 50.0},
    {"frequency_penalty": 2.0, "presence_penalty": -2.0, "logit_bias": {0: 100.0, 1: -100.0}},
]


@pytest.mark.parametrize("extra", EDGES)
def test_values_at_the_edges_sample_real_logits(real_logits: np.ndarray, extra: dict) -> None:
    vocab = real_logits.shape[1]
    kw = {"temperature": 1.0, "seed": 3, **extra}
    params = SamplingParams(**kw)
    # prompt and output tokens include the likely ones, so the penalty really applies
    top = np.argsort(real_logits[0])[-50:].tolist()
    s = SequenceSampler(params, top, vocab)
    for row in real_logits:
        before = row.copy()
        res = s.sample(row)
        assert 0 <= res.token_id < vocab
        np.testing.assert_array_equal(row, before)  # the caller's row is left as it was
        s.append(res.token_id)
    processed = s.process(real_logits[0])
    assert np.isfinite(processed[top]).all(), "penalised logits must stay finite"


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", REPETITION_PENALTY_RANGE[0] / 2), ("repetition_penalty", 1e30),
    ("repetition_penalty", 1e-45), ("repetition_penalty", 10**400), ("repetition_penalty", float("nan")),
    ("temperature", MAX_TEMPERATURE * 2), ("temperature", 1e300), ("temperature", 10**400),
    ("top_p", MIN_TOP_P / 10), ("top_p", 1e-300), ("top_p", 0.0), ("top_p", 10**400),
    ("min_p", 10**400), ("frequency_penalty", -(10**400)), ("n", 129), ("n", 10**400),
])
def test_values_past_the_edges_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_the_refused_values_did_break_the_sampler(real_logits: np.ndarray) -> None:
    """Why the ranges are where they are: just past them, the unchecked sampler fails
    (the reason a step used to raise for its whole batch)."""
    vocab = real_logits.shape[1]
    top = np.argsort(real_logits[0])[-50:].tolist()
    broken = 0
    for field, value in [("repetition_penalty", 1e-45), ("top_p", 1e-300)]:
        params = SamplingParams(temperature=1.0)
        object.__setattr__(params, field, value)  # past validation, as before the fix
        s = SequenceSampler(params, top, vocab)
        uniform = np.zeros(vocab, np.float32)
        try:
            with np.errstate(all="ignore"):
                s.sample(real_logits[0] if field == "repetition_penalty" else uniform)
        except (ValueError, IndexError):
            broken += 1
    assert broken == 2


@pytest.mark.parametrize("ids", [[True, 5], [5, False], [np.bool_(True)], [1.0], ["1"], [None], "12"])
def test_booleans_and_non_ints_are_not_token_ids(llm: ellm.LLM, ids: object) -> None:
    with pytest.raises(ValueError, match="token id"):
        check_token_ids(ids, 100)
    with pytest.raises(RequestError, match="token id"):
        llm.engine.add_request(ids, SamplingParams(max_tokens=1))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished()


def test_numpy_ints_are_token_ids(llm: ellm.LLM) -> None:
    assert check_token_ids(np.array([1, 2, 3], np.int64), 10) == [1, 2, 3]
    assert check_token_ids([np.int32(4)], 10) == [4] and type(check_token_ids([np.int32(4)], 10)[0]) is int
    for bad in ({"stop_token_ids": [True]}, {"logit_bias": {True: 1.0}}, {"logit_bias": {False: 1.0}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- the error boundary of one request ------------------------------------------------------

def _run_all(llm: ellm.LLM, prompts: list[list[int]], params: list[SamplingParams],
             inject=None) -> dict[str, object]:
    """Runs the requests together through Engine.step; inject(engine, request ids) may
    break one of them. Returns request id -> final RequestOutput."""
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    if inject is not None:
        inject(eng, rids)
    final: dict[str, object] = {}
    for _ in range(2000):
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if not eng.has_unfinished():
            break
    return {str(i): final[r] for i, r in enumerate(rids)}


def _workload(llm: ellm.LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    enc = llm.tokenizer.encode
    prompts = [enc("The capital of France is"), enc("Write a haiku about rain."), enc("1, 2, 3,"), enc("Hello")]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=7, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=11, top_p=0.9, max_tokens=12, logprobs=2)]
    return prompts, params


def _break_sampler_of(victim: int, after: int, exc: Exception):
    def inject(eng, rids) -> None:
        sampler = eng.seqs[rids[victim]].sampler
        real = sampler.sample
        calls = {"n": 0}

        def failing(*args, **kwargs):  # the real sampler, until the fault
            calls["n"] += 1
            if calls["n"] > after:
                raise exc
            return real(*args, **kwargs)

        sampler.sample = failing  # only this sequence's sampler object
    return inject


@pytest.mark.parametrize("victim,after,exc", [
    (1, 3, ValueError("logits have no finite maximum")),
    (2, 0, FloatingPointError("injected")),  # (request 0 is plain greedy: a batched argmax, no sampler call)
    (3, 5, MemoryError()),
    (1, 1, IndexError("index -1 is out of bounds")),
])
def test_a_failing_sampler_fails_its_request_alone(llm: ellm.LLM, victim: int, after: int, exc: Exception) -> None:
    prompts, params = _workload(llm)
    free_before = llm.engine.blocks.num_free()
    clean = _run_all(llm, prompts, params)
    hurt = _run_all(llm, prompts, params, _break_sampler_of(victim, after, exc))
    bad = hurt[str(victim)]
    assert bad.finish_reason == "error" and type(exc).__name__ in bad.error
    assert len(bad.token_ids) == after
    for i in map(str, range(len(prompts))):
        if i != str(victim):
            assert hurt[i].finish_reason == clean[i].finish_reason != "error"
            assert hurt[i].token_ids == clean[i].token_ids, f"request {i} changed because {victim} failed"
            assert hurt[i].text == clean[i].text
    assert llm.engine.blocks.num_free() == free_before and not llm.engine.seqs


def test_a_failing_detokenizer_fails_its_request_alone(llm: ellm.LLM) -> None:
    prompts, params = _workload(llm)
    clean = _run_all(llm, prompts, params)

    def inject(eng, rids) -> None:
        detok = eng.seqs[rids[2]].detok
        detok.push = lambda token_id: (_ for _ in ()).throw(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))

    hurt = _run_all(llm, prompts, params, inject)
    assert hurt["2"].finish_reason == "error" and "UnicodeDecodeError" in hurt["2"].error
    for i in ("0", "1", "3"):
        assert hurt[i].token_ids == clean[i].token_ids


def test_async_stream_of_a_failing_request_raises_and_others_finish(llm: ellm.LLM) -> None:
    prompts, params = _workload(llm)
    clean = _run_all(llm, prompts, params)
    ae = llm.async_engine  # the one engine loop of this LLM
    ae.start()
    try:
        async def go() -> list[object]:
            streams = [ae.submit(p, sp) for p, sp in zip(prompts, params)]

            async def collect(s) -> object:
                last = None
                async for out in s:
                    last = out
                return last

            # Break the victim's own sampler object once it is inside the engine (12
            # tokens take far longer than the polling); the engine thread calls it next.
            victim = streams[1].request_id
            for _ in range(10_000):
                seq = llm.engine.seqs.get(victim)
                if seq is not None:
                    seq.sampler.sample = lambda *a, **k: (_ for _ in ()).throw(ValueError("injected"))
                    break
                await asyncio.sleep(0.0005)
            return await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)

        results = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        snap = ae.snapshot_now()
        ae.shutdown()
    assert isinstance(results[1], SequenceError) and "injected" in str(results[1])
    for i in (0, 2, 3):
        assert results[i].token_ids == clean[str(i)].token_ids
    assert snap.kv_blocks_used == 0 and snap.num_running == 0


def test_all_greedy_batch_keeps_the_boundary(llm: ellm.LLM) -> None:
    """Every row plain greedy: one batched argmax serves them, and a detokenizer that fails
    for one request still fails only that request."""
    enc = llm.tokenizer.encode
    prompts = [enc("The capital of France is"), enc("1, 2, 3,"), enc("Hello")]
    params = [SamplingParams(temperature=0.0, max_tokens=10) for _ in prompts]
    clean = _run_all(llm, prompts, params)

    def inject(eng, rids) -> None:
        eng.seqs[rids[1]].detok.push = lambda token_id: (_ for _ in ()).throw(RuntimeError("injected"))

    hurt = _run_all(llm, prompts, params, inject)
    assert hurt["1"].finish_reason == "error" and "RuntimeError: injected" in hurt["1"].error
    assert hurt["0"].token_ids == clean["0"].token_ids and hurt["2"].token_ids == clean["2"].token_ids
    assert not llm.engine.seqs
