"""The cpu backend's one-call layer stack (ellm/_native/_stack.pyx): the same logits as
the layers run op by op, bit for bit, on the real GGUFs in batched decode; the paths it
leaves to the ops; and bad input to it named, not followed.

(tests/test_tiny_models.py::test_forward_uses_only_ops holds it to the ops for every
family: its "opaque" backend runs the ops one by one, the cpu backend the stack.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm._native import _stack
from ellm.models.batch import Batch
from ellm.sampling_params import SamplingParams


def _prompts(n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[200 + i] + rng.integers(300, 9000, length - 1 + 7 * i).tolist() for i in range(n)]


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_batched_decode_is_bit_identical_with_and_without_the_stack(request, fixture: str) -> None:
    """Six sequences of different lengths decoded together (prefill chunks, then steps of
    six rows): every logprob the same with the stack as with the ops one at a time."""
    llm = ellm.load(request.getfixturevalue(fixture), max_num_seqs=8, progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=8)
    with_stack = llm.generate(_prompts(6, 30), sp)
    assert any(s is not None for s in (v[4] for v in llm.model.__dict__["_stacks"].values()))
    llm.model.ops.layer_stack = None           # the instance attribute hides the method
    one_by_one = llm.generate(_prompts(6, 30), sp)
    for a, b in zip(with_stack, one_by_one):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_exact_activations_run_op_by_op(smollm2_gguf: Path) -> None:
    """activations="f32" has kernels of its own: the stack is not built for it."""
    llm = ellm.load(smollm2_gguf, activations="f32", progress=False)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2))
    assert all(v[4] is None for v in llm.model.__dict__["_stacks"].values())


def _stack_and_batch(llm, t: int) -> tuple[_stack.LayerStack, Batch]:
    model, engine = llm.model, llm.engine
    assert engine.blocks.allocate("x", 8)
    tables = {w: np.asarray([engine.blocks.table("x", w)], np.int32) for w in engine.kv.windows}
    batch = Batch.single(np.arange(5, 5 + t, dtype=np.int32), 0, tables)
    engine.runner.forward(batch)
    return model._layer_stack(engine.runner.workspace, t, engine.kv), batch


def test_bad_step_arguments_are_named_and_run_nothing(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, max_num_seqs=1, progress=False)
    stack, batch = _stack_and_batch(llm, 2)
    assert stack is not None and stack.T == 2
    k0 = llm.engine.kv.k[0].copy()
    with pytest.raises(ValueError, match="3 positions"):
        stack.run(np.zeros(3, np.int32), batch.seq_ids, batch.block_tables)
    with pytest.raises(ValueError, match="key_limit has 1"):
        stack.run(batch.positions, batch.seq_ids, batch.block_tables, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="int32|dtype|Buffer"):
        stack.run(batch.positions.astype(np.int64), batch.seq_ids, batch.block_tables)
    # a block id past the cache: the kernel's own check, before anything is written
    bad = {w: np.full_like(t, llm.engine.kv.k[0].shape[0] + 5) for w, t in batch.block_tables.items()}
    with pytest.raises(ValueError, match="rope_attention"):
        stack.run(batch.positions, batch.seq_ids, bad)
    assert np.array_equal(llm.engine.kv.k[0], k0)
    with pytest.raises(ValueError, match="sequence|seq|row"):
        stack.run(batch.positions, np.array([0, 7], np.int32), batch.block_tables)
    stack.run(batch.positions, batch.seq_ids, batch.block_tables)   # still usable


def test_a_wrong_buffer_is_refused_when_the_stack_is_built(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, max_num_seqs=1, progress=False)
    model, engine = llm.model, llm.engine
    ws, t, H = engine.runner.workspace, 2, llm.config.hidden_size
    stack, _ = _stack_and_batch(llm, t)
    assert stack is not None
    specs = [model._layer_spec(ws, t, engine.kv, 0, model.layers[0], model.layers[1].input_norm)]
    ok = (np.zeros((t, H), np.float32), np.zeros((t, H), np.float32), np.zeros((t, H), np.float32))
    assert _stack.LayerStack(specs, t, H, *ok, 1e-5).T == t
    with pytest.raises(ValueError, match="residual"):
        _stack.LayerStack(specs, t, H, np.zeros((t, H + 1), np.float32), *ok[1:], 1e-5)
    with pytest.raises(ValueError, match="float32"):
        _stack.LayerStack(specs, t, H, np.zeros((t, H), np.float64), *ok[1:], 1e-5)
    wrong = dict(specs[0], q_out=np.zeros((t + 1, 576), np.float32))
    with pytest.raises(ValueError, match="q must be"):
        _stack.LayerStack([wrong], t, H, *ok, 1e-5)
    wrong = dict(specs[0], k_cache=llm.engine.kv.k[0][:, :, :1])
    with pytest.raises(ValueError, match="k_cache"):
        _stack.LayerStack([wrong], t, H, *ok, 1e-5)
    wrong = dict(specs[0], o=specs[0]["q"])   # (576, 576) where (576, 576) fits: fine
    assert _stack.LayerStack([wrong], t, H, *ok, 1e-5).T == t
    wrong = dict(specs[0], down=specs[0]["up"])   # takes H inputs, the MLP gives it F
    with pytest.raises(ValueError, match="down_proj takes 576 inputs"):
        _stack.LayerStack([wrong], t, H, *ok, 1e-5)
    with pytest.raises(ValueError, match="T must be"):
        _stack.LayerStack(specs, 0, H, *ok, 1e-5)
