"""Logit lens and attention maps, read off a Recording.

Logit lens: each layer's residual stream (after its MLP) put through the model's final
norm and output head, as if the model stopped there; the last layer's lens is the model's
own output. Attention: the weights each head gave every earlier position.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .recorder import Key


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def decode_residual(model: Any, x: np.ndarray) -> np.ndarray:
    """(N, H) residual rows -> (N, vocab) logits through the final norm and the head, with
    the model's own output bias, scale and soft-cap (blocks.Decoder's tail)."""
    ops, c = model.ops, model.config
    h = ops.rmsnorm(ops.upload(np.ascontiguousarray(x, np.float32)), model.norm, c.rms_norm_eps)
    logits = ops.linear(h, model.lm_head)
    bias = getattr(model.lm_head, "bias", None)
    if bias is not None and not getattr(ops, "linear_adds_bias", False):
        logits += bias
    scale = getattr(model, "logits_scale", 1.0)
    if scale != 1.0:
        ops.scale(logits, scale)
    cap = getattr(model, "final_softcap", 0.0)
    return np.asarray(ops.to_host(ops.softcap(logits, cap) if cap > 0 else logits))   # a device backend's copied back


def logit_lens(model: Any, arrays: Mapping[Key, np.ndarray], top_k: int = 5) -> dict[str, np.ndarray]:
    """{"ids": (L, R, k) int, "probs": (L, R, k), "norms": (L, R)} for every layer and kept
    position of a recording's arrays (Recording.arrays)."""
    n_layers = model.config.num_hidden_layers
    res = np.stack([arrays[(i, "resid_mlp")] for i in range(n_layers)])     # (L, R, H)
    L, R, H = res.shape
    probs = _softmax(decode_residual(model, res.reshape(L * R, H)).astype(np.float64))
    k = min(top_k, probs.shape[1])
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return {"ids": top.reshape(L, R, k),
            "probs": np.take_along_axis(probs, top, axis=1).reshape(L, R, k).astype(np.float32),
            "norms": np.linalg.norm(res, axis=-1).astype(np.float32)}


def attention_map(model: Any, arrays: Mapping[Key, np.ndarray], layer: int) -> np.ndarray:
    """(nh, R, L) the attention weights of `layer` (rows: kept positions, columns: keys) in a
    recording's arrays (Recording.arrays)."""
    a = arrays.get((layer, "attn_probs"))
    if a is None:
        raise ValueError(f"layer {layer} has no attention weights in this recording")
    nh = model.config.num_attention_heads
    return a.reshape(a.shape[0], nh, -1).transpose(1, 0, 2)
