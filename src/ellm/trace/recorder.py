"""The recording interface: what a forward pass hands over when someone is tracing it.

A model holds `recorder = None`; each recording point in its forward is one
`if rec is not None:` in Python, so a run that is not traced pays one comparison per point
and allocates nothing. When a Recorder is set, the forward calls `rec(layer, op, x)` with
the (T, ...) array of every token in the batch; the recorder copies the rows of the
positions it was asked for. `rec.attention(...)` runs after the fused RoPE + attention
kernel: that kernel keeps q after RoPE and the attention weights to itself, so the
recorder rebuilds q after RoPE with the NumPy reference ops, reads k after RoPE back from
the KV cache the kernel wrote, and computes the weights from those two (only when tracing).

Op names, in the order a layer runs them (layer = None for embed / final_norm / logits):
attn_norm, q, k, v, [q_norm, k_norm], q_rope, k_rope, attn_probs, attn, o_proj,
[post_attn_norm], resid_attn, mlp_norm, gate, up, act, down, [post_mlp_norm], resid_mlp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..ops import reference as ref

Key = tuple[int | None, str]

# The canonical order of ops inside a layer; a family records the subset it has.
LAYER_OPS = ("attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_probs",
             "attn", "o_proj", "post_attn_norm", "resid_attn", "mlp_norm", "gate", "up", "act",
             "down", "post_mlp_norm", "resid_mlp")
MODEL_OPS_BEFORE = ("embed",)
MODEL_OPS_AFTER = ("final_norm", "logits")


def forward_order(num_layers: int) -> list[Key]:
    """Every key a model could record, in the order its forward pass computes them."""
    keys: list[Key] = [(None, op) for op in MODEL_OPS_BEFORE]
    keys += [(i, op) for i in range(num_layers) for op in LAYER_OPS]
    keys += [(None, op) for op in MODEL_OPS_AFTER]
    return keys


@dataclass
class Recorder:
    """Collects named intermediates of one forward pass over one sequence.

    positions: the sequence positions to keep (None: every position of the batch).
    Call `start(batch)` before the forward pass (it forgets any earlier pass); the whole
    prompt goes through one pass, so attention weights cover every earlier key.
    """
    positions: Iterable[int] | None = None
    attention_weights: bool = True
    _wanted: frozenset[int] | None = field(init=False, default=None)
    _rows: np.ndarray | None = field(init=False, default=None)
    _batch: Any = field(init=False, default=None)
    _parts: dict[Key, np.ndarray] = field(init=False, default_factory=dict)
    _kept: np.ndarray = field(init=False, default_factory=lambda: np.zeros(0, np.int32))
    # the backend the pass runs on (bind()): its arrays are copied back through it; None:
    # host arrays
    _ops: Any = field(init=False, default=None)

    def bind(self, ops: Any) -> None:
        """Reads the pass's arrays through `ops` (a device backend's are copied back on its
        stream, and only the cache rows a trace needs leave the device)."""
        self._ops = ops

    def _host(self, x: Any) -> np.ndarray:
        return np.asarray(x) if self._ops is None else np.asarray(self._ops.to_host(x))

    def _cache_rows(self, cache: Any, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """cache[blocks, offsets] as float32 on the host (a bfloat16 cache's bits widened)."""
        if self._ops is not None:
            blocks, offsets = self._ops.upload(blocks), self._ops.upload(offsets)
        rows = self._host(cache[blocks, offsets])
        return ref.from_bf16_bits(rows) if rows.dtype == ref.KV_BF16 else rows.astype(np.float32, copy=False)

    def __post_init__(self) -> None:
        if self.positions is not None:
            wanted = [int(p) for p in self.positions]
            if any(p < 0 for p in wanted):
                raise ValueError(f"positions must be >= 0, got {sorted(wanted)}")
            self._wanted = frozenset(wanted)

    def start(self, batch: Any) -> None:
        """Chooses the rows of `batch` to keep; the batch must hold one sequence."""
        if len(np.unique(batch.seq_ids)) != 1:
            raise ValueError("a Recorder traces one sequence; this batch holds several")
        pos = np.asarray(batch.positions)
        keep = np.ones(len(pos), bool) if self._wanted is None else np.isin(pos, list(self._wanted))
        self._rows = np.flatnonzero(keep)
        self._batch = batch
        self._kept = pos[self._rows].astype(np.int32)
        self._parts = {}

    def _started_rows(self) -> np.ndarray:
        if self._rows is None:
            raise RuntimeError("Recorder.start(batch) was not called before the forward pass")
        return self._rows

    def __call__(self, layer: int | None, op: str, x: np.ndarray) -> None:
        """x (T, ...): one row per token of the batch given to start()."""
        rows = self._started_rows()
        x = self._host(x)
        self._parts[(layer, op)] = x.reshape(x.shape[0], -1)[rows].astype(np.float32, copy=True)

    def attention(self, layer: int, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  block_table: np.ndarray, inv_freq: np.ndarray, interleaved: bool, scale: float,
                  window: int = 0, softcap: float = 0.0, rope_mscale: float = 1.0) -> None:
        """After rope_attention: records q_rope (rebuilt), k_rope (read from the cache) and
        attn_probs (T_kept, nh * L) with L = the last kept position + 1.

        q (T, nh, hd) is q as it went into the kernel (the kernel leaves q unchanged);
        block_table (B, max_blocks) is the window's table given to the kernel."""
        rows = self._started_rows()
        b = self._batch
        pos = np.asarray(b.positions)[rows].astype(np.int32)
        nh = q.shape[1]
        q_rope = ref.rope(self._host(q).astype(np.float32)[rows], pos, self._host(inv_freq), interleaved,
                          rope_mscale)                                                    # (R, nh, hd)
        self._parts[(layer, "q_rope")] = q_rope.reshape(len(rows), -1)
        table = self._host(block_table)[int(b.seq_ids[0])]
        bs = k_cache.shape[1]
        nkv = k_cache.shape[2]
        k_rows = self._cache_rows(k_cache, table[pos // bs], pos % bs)                    # (R, nkv, hd)
        self._parts[(layer, "k_rope")] = k_rows.reshape(len(rows), -1).copy()
        if not self.attention_weights or len(rows) == 0:
            return
        last = int(pos.max())
        lo = max(0, int(pos.min()) - window + 1) if window > 0 else 0   # the earliest key any row sees
        key_pos = np.arange(lo, last + 1)
        blocks = table[key_pos // bs]
        if (blocks < 0).any():   # a sliding layer's early blocks may be handed back already
            key_pos = key_pos[blocks >= 0]
            blocks = blocks[blocks >= 0]
        keys = self._cache_rows(k_cache, blocks, key_pos % bs)                           # (L, nkv, hd)
        group = nh // nkv
        kh = np.repeat(keys, group, axis=1)                                               # (L, nh, hd)
        s = np.einsum("rhd,lhd->rhl", q_rope, kh) * np.float32(scale)                     # (R, nh, L)
        s = ref.softcap(s, softcap)
        visible = key_pos[None, :] <= pos[:, None]
        if window > 0:
            visible &= key_pos[None, :] > (pos[:, None] - window)
        s = np.where(visible[:, None, :], s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        full = np.zeros((len(rows), nh, last + 1), np.float32)
        full[:, :, key_pos] = w
        self._parts[(layer, "attn_probs")] = full.reshape(len(rows), -1)

    # -- reading ---------------------------------------------------------------------

    # -- reading ---------------------------------------------------------------------

    @property
    def kept_positions(self) -> np.ndarray:
        """(R,) the sequence positions of the kept rows, in row order."""
        return self._kept.copy()

    def arrays(self) -> dict[Key, np.ndarray]:
        """{(layer, op): (R, features)} float32, in the order they were recorded."""
        return dict(self._parts)
