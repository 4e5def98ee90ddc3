"""Run an ellm model once over a prompt with a Recorder attached: ellm's side of a trace.

The prompt goes through the model in one prefill pass (every position's logits), on the
LLM's own KV cache, in blocks taken for this pass and handed back after it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from ..models.batch import Batch
from .lens import logit_lens
from .recorder import Key, Recorder

_trace_ids = itertools.count()


@dataclass
class Recording:
    """What one traced pass kept: arrays by (layer, op), rows = kept positions."""
    arrays: dict[Key, np.ndarray]
    positions: np.ndarray      # (R,) the sequence positions of the rows
    ids: list[int]             # the whole prompt
    logits: np.ndarray         # (T, vocab) every position's logits
    lens: dict[str, np.ndarray] | None = None   # lens.logit_lens() when asked for


def check_ids(ids: Sequence[int], vocab: int, max_len: int) -> list[int]:
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    if len(ids) > max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; tracing takes at most {max_len}")
    return ids


def record(llm: Any, ids: Sequence[int], positions: Iterable[int] | None = None,
           attention_weights: bool = True, max_tokens: int = 1024, lens_top_k: int = 0,
           adapter: str | None = None) -> Recording:
    """One forward pass of `llm` over ids with a Recorder; positions default to all;
    lens_top_k > 0 adds the logit lens; adapter: [lora] the name of a LoRA adapter given
    to ellm.load(lora_adapters=...) to run the pass with (None: the base alone).

    The pass (and the lens: the kernels' thread pool serves one caller at a time) runs on
    the LLM's engine thread between two steps, so tracing is safe while the LLM serves
    other requests."""
    model = llm.model
    ids = check_ids(ids, model.config.vocab_size, min(max_tokens, llm.engine.cfg.max_model_len))
    wanted = None if positions is None else sorted({_position(p, len(ids)) for p in positions})
    slot = llm.engine.adapter_slot(adapter)   # [lora] an unknown name is a RequestError naming those loaded
    rec = Recorder(wanted, attention_weights)
    loop = getattr(llm, "async_engine", None)
    if loop is None:   # an engine without a loop thread
        return _traced_pass(llm.engine, model, ids, rec, lens_top_k, slot)
    if not loop.is_running:
        loop.start()
    return loop.call(lambda engine: _traced_pass(engine, model, ids, rec, lens_top_k, slot)).result()


def _traced_pass(engine: Any, model: Any, ids: list[int], rec: Recorder, lens_top_k: int,
                 slot: int = -1) -> Recording:
    key = ("trace", next(_trace_ids))
    blocks = engine.blocks
    if not blocks.allocate(key, len(ids)):
        raise ValueError(f"{len(ids)} tokens do not fit in the KV cache")
    try:
        tables = {w: np.asarray([blocks.table(key, w)], np.int32) for w in engine.kv.windows}
        batch = Batch.single(np.asarray(ids, np.int32), 0, tables, all_logits=True)
        if slot >= 0:   # [lora] every row through the adapter's factors
            batch.adapter_slots = np.full(len(ids), slot, np.int32)
        rec.start(batch)
        rec.bind(engine.runner.ops)
        model.recorder = rec
        try:
            logits = np.array(engine.runner.forward(batch), np.float32)   # (T, vocab), copied
        finally:
            model.recorder = None
        rec(None, "logits", logits)
    finally:
        blocks.free(key)
    out = Recording(rec.arrays(), rec.kept_positions, ids, logits)
    if lens_top_k:
        out.lens = logit_lens(model, out.arrays, lens_top_k)
    return out


def _position(p: int, n: int) -> int:
    """A position, negative counting from the end (-1 = the last token)."""
    q = int(p) + n if int(p) < 0 else int(p)
    if not 0 <= q < n:
        raise ValueError(f"position {p} is outside the prompt of {n} tokens")
    return q
