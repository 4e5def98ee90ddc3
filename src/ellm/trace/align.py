"""Bring ellm's recorded arrays into the layout of transformers' before they are compared.

Two things differ:
- GGUF llama files store each head's Q and K rows permuted by llama.cpp's converter so
  that RoPE pairs (2i, 2i+1) instead of (i, i + hd/2) (config.rope_interleaved). ellm
  computes in the file's layout; transformers un-permutes when it loads the GGUF. So row
  2i+s of a head in ellm is row s*hd/2 + i in transformers, for q, k and what follows
  from them per head (q_norm, k_norm, q_rope, k_rope). Attention weights and outputs do
  not depend on the order of dimensions inside a head.
- Fused projections (qkv_proj, gate_up_proj) are split by the reference runner into the
  q/k/v and gate/up parts ellm records, so nothing is left to do here for them.
"""
from __future__ import annotations

import numpy as np

from .recorder import Key

_PER_HEAD_Q = ("q", "q_norm", "q_rope")
_PER_HEAD_K = ("k", "k_norm", "k_rope")


def deinterleave_heads(x: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """(R, n_heads*hd) in pairs-adjacent order -> (R, n_heads*hd) in half-split order."""
    r = x.shape[0]
    return np.ascontiguousarray(
        x.reshape(r, n_heads, head_dim // 2, 2).transpose(0, 1, 3, 2)).reshape(r, n_heads * head_dim)


def to_transformers_layout(arrays: dict[Key, np.ndarray], config: object) -> dict[Key, np.ndarray]:
    """ellm's arrays, with GGUF-permuted Q/K rows put back in transformers' order."""
    if not getattr(config, "rope_interleaved", False):
        return dict(arrays)
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim  # type: ignore[attr-defined]
    out = {}
    for (layer, op), a in arrays.items():
        if op in _PER_HEAD_Q:
            a = deinterleave_heads(a, nh, hd)
        elif op in _PER_HEAD_K:
            a = deinterleave_heads(a, nkv, hd)
        out[(layer, op)] = a
    return out
