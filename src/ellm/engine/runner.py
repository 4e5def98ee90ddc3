"""The model runner: between the engine's host-side batches and the backend's memory.

The engine (scheduler, block manager, sampler) is pure host-side policy; the runner owns
what lives on the backend: the paged KV cache and the activation workspace, both
allocated by the op set (ops.kv_zeros, ops.empty), and the step executor that runs a
Batch through the model (ops.step_executor: eager here, a CUDA-graph replay on a backend
that captures its decode steps). It hands back logits on the host for the sampler, or
lets the backend sample on its device so that only token ids cross the bus. A decode
step can also be launched without waiting for its ids (launch_decode), the next one
taking them as its tokens on the device.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..models.batch import Batch
from ..ops.memory import DeviceMemoryError, mem_size
from ..ops.reference import kv_storage_dtype
from ..ops.workspace import Workspace
from .kv_cache import KVCache, kv_cache_bytes

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .engine import EngineConfig
    from .sampler import SampleResult, SequenceSampler


class PendingTokens(Protocol):
    """The token ids of a launched step: `wait` blocks until they are known (rows,);
    `feeds_next` says whether a step launched now may still take them as its tokens;
    once `wait` has returned, `errors`, None or per row what its sampling raised (None:
    nothing), and `logprobs`, None or per row None or (the token's logprob, its top
    (id, logprob) pairs) for the rows that asked (only where `logprobs_ahead`)."""

    rows: int
    errors: list[Exception | None] | None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None

    @property
    def feeds_next(self) -> bool: ...

    def wait(self) -> np.ndarray: ...


class ReadyTokens:
    """PendingTokens already known: a host backend's step has run when it is launched."""

    feeds_next = True
    # a host backend's launched rows ask for none (runner.logprobs_ahead)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

    def __init__(self, ids: np.ndarray, errors: list[Exception | None] | None = None) -> None:
        self.ids, self.rows, self.errors = ids, len(ids), errors

    def wait(self) -> np.ndarray:
        return self.ids


# Device memory left free beside the KV cache: the workspace's activations, the attention
# partials, cuBLAS's dequantized scratch and the captured graphs (a few hundred MB at 8B)
KV_HEADROOM = 1 << 30


def kv_cache_blocks(mc: Any, config: "EngineConfig", ops: Any) -> tuple[int, int | None]:
    """(blocks of the full-attention pool, of the sliding-window pool or None) of the KV cache:
    kv_cache_tokens, or max(max_model_len, 16384) tokens. On a device backend the cache
    must fit in the memory free after the weights, less KV_HEADROOM: the default size is
    cut to what fits if that still holds one sequence of max_model_len; otherwise, or
    when kv_cache_tokens was asked for, DeviceMemoryError says what fits and what to change."""
    bs = config.block_size
    windows = {mc.layer_window(i) for i in range(mc.num_hidden_layers)} - {0}

    def sliding(num_blocks: int) -> int | None:
        if not windows:
            return None
        # each running sequence needs at most window + 2 blocks per sliding layer
        per_seq = -(-max(windows) // bs) + 2 + -(-config.max_batch_tokens // bs)
        return min(num_blocks, per_seq * config.max_num_seqs)

    num_blocks = -(-(config.kv_cache_tokens or max(config.max_model_len, 16384)) // bs)
    memory = ops.device_memory()
    if memory is None:
        return num_blocks, sliding(num_blocks)
    dtype = kv_storage_dtype(config.kv_cache_dtype)

    def need(n: int) -> int:
        return kv_cache_bytes(mc, n, bs, sliding(n), dtype)

    available, total = memory
    budget = available - KV_HEADROOM
    if need(num_blocks) <= budget:
        return num_blocks, sliding(num_blocks)
    lo, hi = 0, num_blocks   # the most blocks that fit: need() grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    fit_tokens = lo * bs
    if not config.kv_cache_tokens and fit_tokens >= config.max_model_len:
        log.info("KV cache: %d tokens, not %d: what fits in the GPU's %s free after the weights",
                 fit_tokens, num_blocks * bs, mem_size(available))
        return lo, sliding(lo)
    where = (f"{mem_size(available)} of the GPU's {mem_size(total)} are free after the weights, "
             f"{mem_size(KV_HEADROOM)} of which stay for activations: {fit_tokens} tokens fit")
    halve = "" if dtype.itemsize <= 2 else ", kv_cache_dtype='bfloat16' (half the bytes)"
    if config.kv_cache_tokens:
        raise DeviceMemoryError(
            f"kv_cache_tokens={config.kv_cache_tokens} needs {mem_size(need(num_blocks))} of GPU memory for its "
            f"{config.kv_cache_dtype} keys and values, but {where}; pass a smaller kv_cache_tokens{halve}")
    one_sequence = -(-config.max_model_len // bs)
    raise DeviceMemoryError(
        f"the KV cache of one max_model_len={config.max_model_len} sequence needs "
        f"{mem_size(need(one_sequence))} of GPU memory ({config.kv_cache_dtype}), but {where}; pass a smaller "
        f"max_model_len{halve}, or use a smaller or quantized model")


class ModelRunner:
    """Runs batches of `model` on its backend (model.ops) with a KV cache sized by `config`."""

    def __init__(self, model: Any, config: "EngineConfig") -> None:
        self.model, self.ops = model, model.ops
        mc = model.config
        num_blocks, sliding_blocks = kv_cache_blocks(mc, config, self.ops)
        self.kv = KVCache(mc, num_blocks, config.block_size, sliding_blocks, ops=self.ops,
                          dtype=kv_storage_dtype(config.kv_cache_dtype))
        self.workspace = Workspace(self.ops)
        # the one place a backend may swap in another way of running a step (CUDA graphs)
        self.executor = self.ops.step_executor(model, self.kv, self.workspace)

    def execute(self, batch: Batch, hidden_only: bool = False) -> Any:
        """One forward pass -> the backend's array: logits (R, vocab), or with hidden_only
        the final-normed hidden states (R, H), R = len(batch.logits_rows). A workspace view,
        valid until the next pass."""
        return self.executor(batch, hidden_only)

    @property
    def overlaps(self) -> bool:
        """Whether launch_decode lets the host go on while the step runs (a device backend
        replaying captured steps); on a host backend the step runs in the call."""
        return bool(getattr(self.executor, "overlaps", False))

    @property
    def penalties_ahead(self) -> bool:
        """Whether launch_decode may take rows whose penalties look at the tokens so far:
        the device counts the `after` step's tokens, which the samplers have not seen (a
        host backend samples from the samplers alone, so it may not)."""
        return bool(getattr(self.executor, "counts_pending_tokens", False))

    @property
    def logprobs_ahead(self) -> bool:
        """Whether launch_decode may take rows that ask for logprobs: a device that takes
        them itself returns them with the ids (PendingTokens.logprobs)."""
        return bool(getattr(self.executor, "returns_logprobs", False))

    def launch_decode(self, batch: Batch, samplers: Sequence["SequenceSampler"],
                      after: PendingTokens | None = None,
                      padding: np.ndarray | None = None) -> PendingTokens | None:
        """Starts a decode step whose every row is sampled by samplers[i], none of which
        looks at the tokens so far (`history_free`) unless `penalties_ahead`, or asks for
        logprobs unless `logprobs_ahead`, and returns its ids to wait for, or
        None when this step cannot be launched so (run it with execute). after: the step
        launched just before, same rows in the same order, whose ids are this step's
        tokens (batch.token_ids are placeholders then): on a device they go from one step
        to the next without crossing the bus. padding: a bool per row, True for a row kept
        only so that the rows line up with after's (position 0, block tables of -1): its
        id means nothing."""
        launch = getattr(self.executor, "launch_decode", None)
        if launch is not None:
            return launch(batch, samplers, after)   # padding rows are the graphs' own kind
        from .sampler import sample_batch
        if any(s.params.logprobs is not None for s in samplers):
            raise ValueError("launch_decode: a host backend's launched step returns no logprobs")
        if after is not None:
            batch.token_ids[:] = after.wait()
        rows = np.arange(len(samplers)) if padding is None else np.flatnonzero(~padding)
        ids = np.zeros(len(samplers), np.int32)
        errors: list[Exception | None] = [None] * len(samplers)
        if not len(rows):
            return ReadyTokens(ids)
        if len(rows) < len(samplers):   # a host backend runs the real rows alone
            n = np.arange(len(rows), dtype=np.int32)
            batch = Batch(batch.token_ids[rows], batch.positions[rows], n,
                          {w: t[rows] for w, t in batch.block_tables.items()}, n)
        logits = self.to_host(self.execute(batch))
        chosen = [samplers[i] for i in rows.tolist()]
        if all(s.plain_greedy for s in chosen):
            ids[rows] = [r.token_id for r in sample_batch(chosen, logits)]
            return ReadyTokens(ids)
        # row by row, as the engine samples such rows: one row's failure is its own
        for b, (i, s) in enumerate(zip(rows.tolist(), chosen)):
            try:
                ids[i] = sample_batch([s], logits[b:b + 1], None)[0].token_id
            except Exception as e:  # noqa: BLE001 - reported on the row's request
                errors[i] = e
        return ReadyTokens(ids, errors if any(errors) else None)

    def sample(self, logits: Any, samplers: Sequence["SequenceSampler"],
               masks: Sequence[np.ndarray | None] | None = None,
               rows: Sequence[int] | None = None) -> list["SampleResult | Exception"] | None:
        """The tokens chosen on the device for every row of logits (a row's exception in
        its place: raise it on that row's request), or None: sample on the host (to_host,
        then the engine's sampler). masks: None or per row a grammar's bitmask row or
        None. rows: the rows of logits the samplers take, in order (None: every row).
        Host backends always say None."""
        return self.ops.sample(logits, samplers, masks, rows)

    def to_host(self, x: Any) -> np.ndarray:
        """A backend array as a host float32 array (host backends: the same array)."""
        return self.ops.to_host(x)

    def forward(self, batch: Batch, hidden_only: bool = False) -> np.ndarray:
        """execute + to_host: host float32 logits (R, vocab) or hidden states (R, H), valid
        until the next pass (the meaning `model.forward(batch, kv, hidden_only)` had)."""
        return self.to_host(self.execute(batch, hidden_only))
