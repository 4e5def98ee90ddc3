"""What one forward pass runs on: the new tokens of every scheduled sequence."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    token_ids: np.ndarray      # (T,) int32: new tokens of all sequences, concatenated
    positions: np.ndarray      # (T,) int32: each token's position in its sequence
    seq_ids: np.ndarray        # (T,) int32: each token's row in the block tables
    block_tables: dict[int, np.ndarray]  # window (0 = full) -> (B, max_blocks) int32, -1 unused
    logits_rows: np.ndarray    # (R,) int32: the tokens whose logits are wanted
    # [vision] rows of the batch whose embeddings are given (image tokens), and those
    # embeddings: (M,) int32 indices into token_ids, (M, H) f32; None: every row is embedded
    embed_rows: np.ndarray | None = None
    embed_values: np.ndarray | None = None
    # [vision] (T,) int32 last position each token attends to (>= its own): an image token
    # of a model with bidirectional images sees its whole image; None: causal everywhere
    key_limit: np.ndarray | None = None
    # [lora] (T,) int32 each row's LoRA adapter slot (model.lora; -1: the base alone);
    # None: no row of the batch uses an adapter
    adapter_slots: np.ndarray | None = None

    @classmethod
    def single(cls, token_ids: np.ndarray, start: int, block_tables: dict[int, np.ndarray],
               all_logits: bool = False) -> "Batch":
        """One sequence's tokens at positions start, start+1, ..."""
        t = len(token_ids)
        return cls(
            token_ids=np.asarray(token_ids, dtype=np.int32),
            positions=np.arange(start, start + t, dtype=np.int32),
            seq_ids=np.zeros(t, dtype=np.int32),
            block_tables=block_tables,
            logits_rows=np.arange(t, dtype=np.int32) if all_logits else np.array([t - 1], dtype=np.int32),
        )
