"""Overlapped greedy decoding (Engine._step_ahead) on the real SmolLM2: step N+1 launched
before step N's tokens are read must give every request the tokens, text and finish
reason it gets without it, whatever stops, arrives, aborts or runs out of blocks.

On the CPU the runner computes a launched step at once (ReadyTokens), so this checks the
engine's bookkeeping; the device half (ids fed from one captured step to the next) is
checked in tests/test_cuda.py, on a GPU or through tests/cuda_host."""
from __future__ import annotations

import pytest

import ellm
from ellm.engine.engine import EngineConfig
from ellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return ellm.load(smollm2_gguf, max_model_len=2048)


def _prompt(llm, n: int) -> list[int]:
    from ellm.bench import bench_prompt
    return bench_prompt(llm, n)


def _outcome(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def _both(llm, prompts, params) -> tuple[list[tuple], list[tuple], int]:
    """(outcomes without overlap, with it, steps that ran overlapped)."""
    eng = llm.engine
    eng.overlap = False
    plain = _outcome(llm.generate(prompts, params))
    eng.overlap = True
    before = eng.stats["overlapped_steps"]
    try:
        ahead = _outcome(llm.generate(prompts, params))
    finally:
        eng.overlap = eng.runner.overlaps
    return plain, ahead, eng.stats["overlapped_steps"] - before


def test_a_host_backend_does_not_overlap_by_default(smollm2) -> None:
    assert smollm2.engine.runner.overlaps is False and smollm2.engine.overlap is False


def test_overlapped_greedy_equals_plain_with_every_kind_of_stop(smollm2) -> None:
    eng = smollm2.engine
    prompts = [_prompt(smollm2, n) for n in (5, 23, 61, 17)]
    full = smollm2.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)).text
    stop_word = full.strip().split()[2]
    params = [SamplingParams(temperature=0.0, max_tokens=3),                     # a length stop early
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30),                    # may stop on EOS
              SamplingParams(temperature=0.0, max_tokens=20, stop=[stop_word])]  # a stop string
    script = {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]}
    plain, ahead, overlapped = _scripted_both(eng, script)
    assert ahead == plain
    assert plain["r3"][2] == "stop" and plain["r0"][2] == "length" and len(plain["r1"][0]) == 17
    assert overlapped > 10
    assert eng.stats["padding_rows"] > 0   # r0 stopped early: its row stayed, as padding


def test_a_chat_stopping_on_eos_is_the_same_overlapped(smollm2) -> None:
    eng = smollm2.engine
    msgs = [{"role": "user", "content": "Say hi."}]
    eng.overlap = False
    plain = smollm2.chat(msgs, max_tokens=64, temperature=0.0)
    eng.overlap = True
    try:
        ahead = smollm2.chat(msgs, max_tokens=64, temperature=0.0)
    finally:
        eng.overlap = False
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in smollm2.tokenizer.eos_token_ids
    assert (ahead.token_ids, ahead.text, ahead.finish_reason) == (plain.token_ids, plain.text, "stop")


def test_no_step_is_launched_past_every_sequences_last_token(smollm2) -> None:
    """When each running sequence's next token is its last by length, nothing runs ahead of
    it: the same number of forward steps as without the overlap."""
    eng = smollm2.engine
    prompts = [_prompt(smollm2, n) for n in (7, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    steps = []
    for overlap in (False, True):
        eng.overlap = overlap
        before = eng.stats["steps"]
        try:
            outs = smollm2.generate(prompts, params)
        finally:
            eng.overlap = False
        assert [len(o.token_ids) for o in outs] == [9, 9]
        steps.append(eng.stats["steps"] - before)
    assert steps[1] == steps[0]


def test_a_step_nobody_reads_is_let_finish_before_the_engine_is_idle(smollm2) -> None:
    """A request ending on EOS had its next step launched already: the engine still has
    work (that step) until one more step() lets it finish, and then nothing."""
    eng = smollm2.engine
    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    eng.overlap = True
    try:
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=64), request_id="eos")
        final = None
        for _ in range(100):
            final = next((o for o in eng.step() if o.finished), None)
            if final is not None:
                break
        assert final is not None and final.finish_reason == "stop"
        assert eng.has_unfinished()   # the step launched past the EOS
        assert eng.step() == [] and not eng.has_unfinished()
    finally:
        eng.overlap = False


def test_rows_whose_sampling_looks_back_do_not_run_ahead(smollm2) -> None:
    """On a host backend, which samples a step from what the samplers have seen: logprobs
    and penalties keep the plain loop. (The cuda backend counts the token it has not
    handed back and runs penalised rows ahead: tests/test_cuda.py.)"""
    assert not smollm2.engine.runner.penalties_ahead
    prompt = _prompt(smollm2, 9)
    for params in (SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=8, presence_penalty=0.5,
                                  ignore_eos=True)):
        plain, ahead, overlapped = _both(smollm2, [prompt], params)
        assert ahead == plain and overlapped == 0, params


def test_seeded_sampling_runs_ahead_with_the_same_draws(smollm2) -> None:
    """Temperature, top-k / top-p / min-p and logit_bias look at nothing but the row and
    the draws so far: such rows run ahead, and a seeded request draws the same tokens."""
    eng = smollm2.engine
    prompts = [_prompt(smollm2, n) for n in (6, 15, 31)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=8, max_tokens=18,
                             logit_bias={42: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)]
    script = {0: [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]}
    plain, ahead, overlapped = _scripted_both(eng, script)
    assert ahead == plain and len(plain["s0"][0]) == 25
    assert overlapped > 10


def _run(eng, script: dict[int, list], steps: int = 400) -> dict[str, tuple]:
    """Steps the engine, adding (request id, prompt, params) or aborting ("abort", id) at
    the step numbers of `script`; -> per request its (ids, text, finish reason)."""
    done: dict[str, tuple] = {}
    for i in range(steps):
        for action in script.get(i, []):
            if action[0] == "abort":
                eng.abort(action[1])
                done[action[1]] = "aborted"
            else:
                eng.add_request(action[1], action[2], request_id=action[0])
        if not eng.has_unfinished() and i > max(script):
            break
        for o in eng.step():
            assert o.request_id not in done, f"an output for {o.request_id} after it finished"
            if o.finished:
                done[o.request_id] = (o.token_ids, o.text, o.finish_reason)
    return done


def _scripted_both(eng, script: dict[int, list]) -> tuple[dict, dict, int]:
    """_run without the overlap, then with it -> (plain, ahead, steps that ran overlapped)."""
    eng.overlap = False
    plain = _run(eng, script)
    eng.overlap = True
    before = eng.stats["overlapped_steps"]
    try:
        ahead = _run(eng, script)
    finally:
        eng.overlap = False
    return plain, ahead, eng.stats["overlapped_steps"] - before


def test_arrivals_and_aborts_while_a_step_runs_ahead(smollm2) -> None:
    eng = smollm2.engine
    g = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    script = {0: [("a", _prompt(smollm2, 12), g), ("b", _prompt(smollm2, 30), g)],
              6: [("c", _prompt(smollm2, 7), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))],
              9: [("abort", "b")],
              14: [("d", _prompt(smollm2, 40), g)]}
    eng.blocks.clear_prefix_cache()
    plain, ahead, overlapped = _scripted_both(eng, script)
    assert ahead == plain and set(plain) == {"a", "b", "c", "d"} and plain["b"] == "aborted"
    assert overlapped > 10
    eng.blocks.clear_prefix_cache()
    assert eng.blocks.num_used() == 0 and not eng.has_unfinished()


def test_overlap_when_blocks_run_out_and_at_the_context_limit(smollm2_gguf) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=512)
    g = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [_prompt(llm, n) for n in (14, 30, 46, 62)]
    alone = [llm.generate(p, g).token_ids for p in prompts]
    # 10 blocks of 16 tokens hold the four prompts but not one more token each: preemption
    llm.engine.__init__(llm.model, llm.tokenizer,
                        EngineConfig(max_model_len=512, kv_cache_tokens=10 * 16, max_batch_tokens=64,
                                     enable_prefix_caching=False, overlap_decode=True))
    assert llm.engine.overlap
    together = [o.token_ids for o in llm.generate(prompts, g)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats["overlapped_steps"] > 0
    assert together == alone
    assert llm.engine.blocks.num_used() == 0
    # a sequence that reaches max_model_len stops there, overlapped or not
    llm.engine.__init__(llm.model, llm.tokenizer, EngineConfig(max_model_len=40, overlap_decode=True))
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    out = llm.generate(prompts[0], long)
    assert out.finish_reason == "length" and len(prompts[0]) + len(out.token_ids) == 40
    assert out.token_ids == llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=26,
                                                                     ignore_eos=True)).token_ids


def test_a_row_that_cannot_be_sampled_fails_its_request_alone(smollm2) -> None:
    """A sampler that raises while its step runs ahead finishes its own request with the
    error after the tokens it had; the other request's tokens are those of a clean run."""
    eng = smollm2.engine
    prompts = [_prompt(smollm2, 8), _prompt(smollm2, 13)]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=12, ignore_eos=True)]
    script = {0: [("x", prompts[0], params[0]), ("y", prompts[1], params[1])]}
    eng.overlap = True
    try:
        clean = _run(eng, script)
        eng.add_request(prompts[0], params[0], request_id="x")
        eng.add_request(prompts[1], params[1], request_id="y")
        sampler = eng.seqs["x"].sampler
        real, calls = sampler.sample, {"n": 0}

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 3:
                raise FloatingPointError("injected")
            return real(*args, **kwargs)
        sampler.sample = failing
        before = eng.stats["overlapped_steps"]
        hurt: dict[str, object] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    hurt[o.request_id] = o
    finally:
        eng.overlap = False
    assert eng.stats["overlapped_steps"] > before
    x, y = hurt["x"], hurt["y"]
    assert x.finish_reason == "error" and "FloatingPointError: injected" in x.error
    assert x.token_ids == clean["x"][0][:3]
    assert (y.token_ids, y.text, y.finish_reason) == clean["y"]
    eng.blocks.clear_prefix_cache()
    assert eng.blocks.num_used() == 0 and not eng.seqs
