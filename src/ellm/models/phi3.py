"""The Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4-mini): Llama with fused projections
(`qkv_proj`, `gate_up_proj`, split here by rows without copying), partial rotary
(`partial_rotary_factor`: only the first part of each head rotates), and LongRoPE
("longrope", formerly "su") frequency factors with an attention factor on cos and sin.

Which LongRoPE factors: transformers uses `short_factor` while a sequence has at most
`original_max_position_embeddings` tokens, and once it grows past that it switches every
position to `long_factor` and recomputes the whole cache. ellm cannot do that and keep a
token's logits independent of its batch and of how long its sequence later grows (its
keys are cached once), so it uses the short factors at every position: the same numbers
as transformers up to original_max_position_embeddings (4096 for Phi-3.5-mini and
Phi-4-mini); past it ellm goes on with the short factors where transformers (and
llama.cpp with a context larger than that) would use the long ones, so quality past
there is the short factors' extrapolation. The attention factor is applied either way,
as transformers does. (llama.cpp pads its context to a multiple of 256 and takes the long
factors whenever that exceeds the original length.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError, GGUFMeta, ModelConfig, check_window
from ..weights import Linear, WeightSource
from .blocks import Attention, Decoder, DecoderLayer, MLP, embedding_and_head, load_norm

# llama.cpp writes the fused projections under their own names (its ffn_up holds gate
# and up, gate first, like Hugging Face's gate_up_proj)
GGUF_TENSORS: list[tuple[str, str]] = [
    (r"blk\.(\d+)\.attn_qkv\.weight", "model.layers.{i}.self_attn.qkv_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{i}.mlp.gate_up_proj.weight"),
    (r"rope_factors_short\.weight", "rope_factors_short.weight"),
    (r"rope_factors_long\.weight", "rope_factors_long.weight"),
]


@dataclass
class Args(ModelConfig):
    original_max_position_embeddings: int = 4096
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None

    gguf_architectures = ("phi3",)

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        head_dim = kwargs["head_dim"]
        kwargs["partial_rotary_factor"] = meta.int("rope.dimension_count", head_dim, hi=head_dim) / head_dim
        kwargs["original_max_position_embeddings"] = meta.int("rope.scaling.original_context_length",
                                                              kwargs["max_position_embeddings"])
        # phi3.attention.sliding_window is written by the converter but llama.cpp (0.3.36)
        # disables Phi-3's window ("Phi SWA is currently disabled"): a GGUF means full
        # attention, so the key is not read here
        if "rope_factors_short.weight" in meta.tensors:
            # the factors are tensors of the file: Model reads them (weights_factors)
            kwargs["rope_scaling"] = {"rope_type": "longrope", "factors_in_weights": True,
                                      "attention_factor": meta.float("rope.scaling.attn_factor", 1.0)}

    @classmethod
    def prepare(cls, kwargs: dict[str, Any], raw: dict[str, Any]) -> None:
        super().prepare(kwargs, raw)
        # transformers 5 keeps partial_rotary_factor inside rope_parameters
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and "partial_rotary_factor" in params:
            kwargs.setdefault("partial_rotary_factor", params["partial_rotary_factor"])

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.sliding_window)
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                              f"gives {self.rotary_dim} rotary dims; need a positive even number")
        if self.original_max_position_embeddings < 1:
            raise ConfigError("original_max_position_embeddings must be >= 1")
        scaling = dict(self.rope_scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in ("su", "yarn"):   # Phi-3's older names for the same scheme
            kind = "longrope"
        if kind not in ("default", "longrope"):
            raise ConfigError(f"Phi-3 rope_scaling type must be longrope, got {kind!r}")
        self._longrope = kind == "longrope"
        self._short_factor: np.ndarray | None = None
        if self._longrope and scaling.get("factors_in_weights"):   # a GGUF file's
            self._mscale = self._attention_factor(scaling)
        elif self._longrope:
            for key in ("short_factor", "long_factor"):
                f = scaling.get(key)
                if not isinstance(f, list) or len(f) != self.rotary_dim // 2 or \
                        not all(isinstance(v, (int, float)) and v > 0 for v in f):
                    raise ConfigError(f"rope_scaling.{key} must be {self.rotary_dim // 2} positive numbers")
            self._short_factor = np.asarray(scaling["short_factor"], np.float32)
            self._mscale = self._attention_factor(scaling)
        else:
            self._mscale = 1.0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _attention_factor(self, scaling: dict[str, Any]) -> float:
        # transformers' rule: the given attention_factor, else sqrt(1 + ln f / ln orig) with
        # f = factor or max_position_embeddings / original_max_position_embeddings
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        orig = int(scaling.get("original_max_position_embeddings", self.original_max_position_embeddings))
        factor = scaling.get("factor")
        factor = float(factor) if factor is not None else self.max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig))

    @property
    def rope_mscale(self) -> float:
        return self._mscale

    def inv_freq(self, layer: int) -> np.ndarray:
        """(rotary_dim/2,) f32, in f32 arithmetic as transformers computes it."""
        return self.longrope_inv_freq(self._short_factor)

    def longrope_inv_freq(self, factors: np.ndarray | None) -> np.ndarray:
        """1 / (factors * theta^(2i/rotary_dim)); factors None: plain RoPE."""
        dim = self.rotary_dim
        exponent = (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)).astype(np.float32)
        base = np.float32(self.rope_theta) ** exponent
        if factors is not None:
            if factors.shape != base.shape or not np.all(factors > 0):
                raise ConfigError(f"LongRoPE factors must be {len(base)} positive numbers, got shape {factors.shape}")
            base = factors.astype(np.float32) * base
        elif self._longrope:
            raise ConfigError("longrope scaling without short_factor")
        return (np.float32(1.0) / base).astype(np.float32)

    def layer_window(self, layer: int) -> int:
        return self.sliding_window or 0

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(rotary_dims=f"{self.rotary_dim} of {self.head_dim}",
                 rope_scaling=("longrope (short factors), attention factor "
                               f"{self._mscale:.4f}") if self._longrope else None)
        return d


def _fused_attention(weights: WeightSource, c: Args, i: int, inv_freq: np.ndarray) -> Attention:
    nh, nkv, hd, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    p = f"model.layers.{i}.self_attn."
    qkv = weights.linear(p + "qkv_proj.weight")
    if (qkv.out_features, qkv.in_features) != ((nh + 2 * nkv) * hd, H):
        raise ValueError(f"{p}qkv_proj.weight is {(qkv.out_features, qkv.in_features)}, "
                         f"the config says {((nh + 2 * nkv) * hd, H)}")
    o = weights.linear(p + "o_proj.weight")
    if (o.out_features, o.in_features) != (H, nh * hd):
        raise ValueError(f"{p}o_proj.weight is {(o.out_features, o.in_features)}, the config says {(H, nh * hd)}")
    q_end, k_end = nh * hd, (nh + nkv) * hd
    return Attention(q=qkv.rows(0, q_end), k=qkv.rows(q_end, k_end), v=qkv.rows(k_end, k_end + nkv * hd), o=o,
                     n_heads=nh, n_kv_heads=nkv, head_dim=hd, inv_freq=inv_freq, scale=c.attention_scale,
                     window=c.layer_window(i), rope_mscale=c.rope_mscale, eps=c.rms_norm_eps)


def _fused_mlp(weights: WeightSource, c: Args, i: int) -> MLP:
    H, F, p = c.hidden_size, c.intermediate_size, f"model.layers.{i}.mlp."
    gate_up: Linear = weights.linear(p + "gate_up_proj.weight")
    down = weights.linear(p + "down_proj.weight")
    if (gate_up.out_features, gate_up.in_features) != (2 * F, H) or (down.out_features, down.in_features) != (H, F):
        raise ValueError(f"{p}gate_up_proj / down_proj are {(gate_up.out_features, gate_up.in_features)} / "
                         f"{(down.out_features, down.in_features)}, the config says {(2 * F, H)} / {(H, F)}")
    if c.hidden_act not in ("silu", "swish"):
        raise ValueError(f"Phi-3 hidden_act must be silu, got {c.hidden_act!r}")
    return MLP(gate=gate_up.rows(0, F), up=gate_up.rows(F, 2 * F), down=down, act="silu")


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c, H = config, config.hidden_size
        embed, lm_head = embedding_and_head(weights, c)
        # a GGUF file holds the LongRoPE factors as tensors (llama.cpp's rope_factors_short)
        inv_freq = (c.longrope_inv_freq(weights.vector("rope_factors_short.weight"))
                    if "rope_factors_short.weight" in weights else c.inv_freq(0))
        layers = [DecoderLayer(attn=_fused_attention(weights, c, i, inv_freq), mlp=_fused_mlp(weights, c, i),
                               input_norm=load_norm(weights, f"model.layers.{i}.input_layernorm.weight", H),
                               pre_mlp_norm=load_norm(weights, f"model.layers.{i}.post_attention_layernorm.weight", H))
                  for i in range(c.num_hidden_layers)]
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", H))
