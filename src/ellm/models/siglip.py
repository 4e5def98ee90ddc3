"""The SigLIP vision encoder that SmolVLM / Idefics3 and Gemma 3 put in front of their
text models.

An image tile (3, S, S) is cut into (S/P)^2 patches of P x P pixels; the patch
embedding (a P x P convolution with stride P) is a matmul of each flattened patch with
the conv weight seen as (D, 3 P P); a learned position embedding per patch is added; then
pre-norm transformer layers (layernorm with bias, attention over all patches of the tile
in both directions, layernorm, fc1, GELU(tanh), fc2, each block added to the residual)
and a final layernorm. -> (n_tiles, patches, D) rows that the family's connector turns
into text-model embeddings.

Every tile of every image goes through as one batch: the tiles are independent sequences
of the same length, which `ops.full_attention` keeps apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError
from ..formats.ggml_types import GGMLType
from ..weights import Linear, WeightSource
from .blocks import load_linear


@dataclass
class VisionConfig:
    """The tower's settings, in Hugging Face field names (config.json's vision_config)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "image_size", "patch_size", "num_channels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 16:
                raise ConfigError(f"vision_config.{name} must be an integer between 1 and 65536, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config.hidden_size ({self.hidden_size}) is not a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_size // self.num_attention_heads > 256:
            raise ConfigError(f"vision_config: heads of {self.hidden_size // self.num_attention_heads} dims "
                              f"are wider than the 256 the attention kernel takes")
        if self.image_size % self.patch_size:
            raise ConfigError(f"vision_config.image_size ({self.image_size}) is not a multiple of "
                              f"patch_size ({self.patch_size})")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not supported (gelu_pytorch_tanh)")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ConfigError(f"vision_config.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: Any, defaults: dict[str, Any] | None = None) -> "VisionConfig":
        """From config.json's vision_config (defaults: the family's values for missing keys)."""
        if not isinstance(raw, dict):
            raise ConfigError("vision_config must be a JSON object")
        known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "image_size", "patch_size", "num_channels", "layer_norm_eps", "hidden_act"}
        kwargs = {**(defaults or {}), **{k: v for k, v in raw.items() if k in known and v is not None}}
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"vision_config is missing a field: {e}") from None


@dataclass
class EncoderLayer:
    norm1: tuple[np.ndarray, np.ndarray]   # (D,), (D,) weight, bias
    q: Linear                              # (D, D) + bias
    k: Linear
    v: Linear
    o: Linear
    norm2: tuple[np.ndarray, np.ndarray]
    fc1: Linear                            # (F, D) + bias
    fc2: Linear                            # (D, F) + bias


def _layernorm(weights: WeightSource, prefix: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    w, b = weights.vector(prefix + ".weight"), weights.vector(prefix + ".bias")
    if w.shape != (size,) or b.shape != (size,):
        raise ValueError(f"{prefix} has shapes {w.shape} / {b.shape}, expected ({size},)")
    return w, b


def _with_bias(weights: WeightSource, prefix: str, rows: int, cols: int) -> Linear:
    lin = load_linear(weights, prefix, rows, cols)
    if lin.bias is None:
        raise ValueError(f"{prefix}.bias is missing (SigLIP's linear layers have biases)")
    return lin


class SiglipEncoder:
    """The tower under `prefix` (e.g. "model.vision_model." for SmolVLM, "vision_tower." for
    Gemma 3): pixel tiles (n, 3, S, S) f32 -> (n, patches, D) f32."""

    def __init__(self, config: VisionConfig, weights: WeightSource, ops: Any, prefix: str) -> None:
        c, D, F = config, config.hidden_size, config.intermediate_size
        self.config, self.ops = c, ops
        p = prefix + "embeddings."
        conv = weights.vector(p + "patch_embedding.weight")        # (D, C, P, P)
        expect = (D, c.num_channels, c.patch_size, c.patch_size)
        if conv.shape != expect:
            raise ValueError(f"{p}patch_embedding.weight has shape {conv.shape}, expected {expect}")
        bias = weights.vector(p + "patch_embedding.bias")
        if bias.shape != (D,):
            raise ValueError(f"{p}patch_embedding.bias has shape {bias.shape}, expected ({D},)")
        flat = np.ascontiguousarray(conv.reshape(D, -1), dtype=np.float32)   # (D, C P P)
        self.patch_embed = Linear(flat, GGMLType.F32, D, flat.shape[1], p + "patch_embedding", bias)
        self.positions = weights.vector(p + "position_embedding.weight")     # (patches, D)
        if self.positions.shape != (c.num_patches, D):
            raise ValueError(f"{p}position_embedding.weight has shape {self.positions.shape}, "
                             f"expected ({c.num_patches}, {D})")
        self.layers = []
        for i in range(c.num_hidden_layers):
            q = f"{prefix}encoder.layers.{i}."
            self.layers.append(EncoderLayer(
                norm1=_layernorm(weights, q + "layer_norm1", D),
                q=_with_bias(weights, q + "self_attn.q_proj", D, D),
                k=_with_bias(weights, q + "self_attn.k_proj", D, D),
                v=_with_bias(weights, q + "self_attn.v_proj", D, D),
                o=_with_bias(weights, q + "self_attn.out_proj", D, D),
                norm2=_layernorm(weights, q + "layer_norm2", D),
                fc1=_with_bias(weights, q + "mlp.fc1", F, D), fc2=_with_bias(weights, q + "mlp.fc2", D, F)))
        self.post_norm = _layernorm(weights, prefix + "post_layernorm", D)

    def check_pixels(self, pixel_values: Any) -> np.ndarray:
        """pixel_values as (n, C, S, S) contiguous f32; a ValueError naming what is wrong."""
        c = self.config
        if not isinstance(pixel_values, np.ndarray):
            raise ValueError(f"pixel_values must be a numpy array, got {type(pixel_values).__name__}")
        expect = (c.num_channels, c.image_size, c.image_size)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expect or pixel_values.shape[0] < 1:
            raise ValueError(f"pixel_values has shape {pixel_values.shape}; this model takes "
                             f"(n_tiles >= 1, {', '.join(map(str, expect))})")
        if pixel_values.dtype != np.float32:
            raise ValueError(f"pixel_values must be float32, got {pixel_values.dtype}")
        if not np.isfinite(pixel_values).all():
            raise ValueError("pixel_values holds NaN or infinite values")
        return np.ascontiguousarray(pixel_values)

    def patches(self, pixel_values: np.ndarray) -> np.ndarray:
        """(n, C, S, S) -> (n * g * g, C * P * P): each patch flattened as the conv weight is
        (channel, row, column), patches in row-major order over the g x g grid."""
        n, C, S, _ = pixel_values.shape
        P, g = self.config.patch_size, self.config.patches_per_side
        x = pixel_values.reshape(n, C, g, P, g, P).transpose(0, 2, 4, 1, 3, 5)
        return np.ascontiguousarray(x.reshape(n * g * g, C * P * P))

    def __call__(self, pixel_values: np.ndarray) -> np.ndarray:
        c, ops = self.config, self.ops
        pixel_values = self.check_pixels(pixel_values)
        n, N, D, nh, hd = len(pixel_values), c.num_patches, c.hidden_size, c.num_attention_heads, c.head_dim
        T = n * N
        h = ops.linear(self.patches(pixel_values), self.patch_embed)            # (T, D)
        # every tile is the full image_size here, so patch i sits at position i
        h.reshape(n, N, D)[...] += self.positions[None]
        x = np.empty((T, D), np.float32)
        q, k, v = (np.empty((T, D), np.float32) for _ in range(3))
        attn, proj = np.empty((T, nh, hd), np.float32), np.empty((T, D), np.float32)
        mid = np.empty((T, c.intermediate_size), np.float32)
        scale = hd ** -0.5
        for layer in self.layers:
            ops.layernorm(h, *layer.norm1, c.layer_norm_eps, out=x)
            ops.linear_multi(x, [(layer.q, q), (layer.k, k), (layer.v, v)])
            ops.full_attention(q.reshape(T, nh, hd), k.reshape(T, nh, hd), v.reshape(T, nh, hd), N, scale,
                               out=attn)
            ops.linear(attn.reshape(T, D), layer.o, out=proj)
            ops.add(h, proj)
            ops.layernorm(h, *layer.norm2, c.layer_norm_eps, out=x)
            ops.linear(x, layer.fc1, out=mid)
            ops.gelu_tanh(mid, out=mid)
            ops.linear(mid, layer.fc2, out=proj)
            ops.add(h, proj)
        out = ops.layernorm(h, *self.post_norm, c.layer_norm_eps, out=np.empty((T, D), np.float32))
        return out.reshape(n, N, D)


def f32_linear(matrix: np.ndarray, name: str) -> Linear:
    """A float matrix (N, K) as a Linear (a projector weight stored transposed, pooled...)."""
    m = np.ascontiguousarray(matrix, dtype=np.float32)
    return Linear(m, GGMLType.F32, m.shape[0], m.shape[1], name)

