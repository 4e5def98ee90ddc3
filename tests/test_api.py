"""The public API's shape, as other tools call it."""
from __future__ import annotations

import numpy as np
import pytest

import ellm


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return ellm.load(smollm2_gguf, max_model_len=1024)


def test_documented_calls(llm) -> None:
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=True)
    assert ids == [504, 3575, 282, 4649, 314]
    assert llm.tokenizer.decode(ids) == "The capital of France is"
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    logits = llm.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (5, llm.config.vocab_size)
    out = llm.generate("The capital of France is", ellm.SamplingParams(temperature=0.0, max_tokens=8))
    assert isinstance(out.text, str) and len(out.token_ids) <= 8
    assert out.finish_reason in ("stop", "length")
    # keyword arguments instead of SamplingParams; token-id prompts; lists give lists
    same = llm.generate(ids, temperature=0.0, max_tokens=8)
    assert same.token_ids == out.token_ids
    many = llm.generate(["a", ids], max_tokens=4, temperature=0.0)
    assert isinstance(many, list) and len(many) == 2 and many[1].token_ids == out.token_ids[:4]
    reply = llm.chat([{"role": "user", "content": "Hi!"}], max_tokens=16, temperature=0.0)
    assert reply.text.strip()


def test_seed_makes_sampling_reproducible(llm) -> None:
    a = llm.generate("Once upon a time", temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    b = llm.generate("Once upon a time", temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    c = llm.generate("Once upon a time", temperature=1.0, top_p=0.9, seed=8, max_tokens=16)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_arguments_are_clear(llm) -> None:
    with pytest.raises(TypeError, match="max_tokenz"):
        llm.generate("x", max_tokenz=3)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", temperature=-1.0)
    with pytest.raises(ValueError, match="n must be"):
        llm.generate("x", n=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("x", {"temperature": 0})
    with pytest.raises(ValueError, match="threads"):
        ellm.load("smollm2-135m-instruct", threads=-2)
    with pytest.raises(ValueError, match="max_model_len"):
        ellm.load("smollm2-135m-instruct", max_model_len=0)
    with pytest.raises(ValueError, match="neither a Jinja template"):
        ellm.load("smollm2-135m-instruct", chat_template="no-such-file.jinja")
    with pytest.raises(ValueError, match="device"):
        ellm.load("smollm2-135m-instruct", device="tpu")
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        ellm.load("no-such-model")


def test_module_level_generate_uses_the_default_model(smollm2_gguf) -> None:
    out = ellm.generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert isinstance(out, ellm.CompletionOutput) and out.text


def test_a_failed_constraint_says_why_in_the_completion(llm) -> None:
    """finish_reason "error" (a grammar matcher failed) carries its reason up to the
    CompletionOutput the Python API returns (the engine's RequestOutput.error)."""
    from ellm.engine.async_engine import _final
    from ellm.llm import _completion

    params = ellm.SamplingParams(choice=["red", "green"], temperature=0.0, max_tokens=8)
    ids = llm.tokenizer.encode("Pick a colour:")
    with llm._loop().lock:   # step the engine by hand, as the loop thread would
        eng = llm.engine
        rid = eng.add_request(ids, params)
        eng.seqs[rid].grammar.advance(llm.tokenizer.encode("zzz", add_special_tokens=False)[0])
        last = None
        while eng.has_unfinished():
            for out in eng.step():
                last = out
    assert last is not None and last.finish_reason == "error" and last.error
    done = _completion(_final(last, []), params)
    assert done.finish_reason == "error" and done.error == last.error
