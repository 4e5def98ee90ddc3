"""The Qwen3-MoE family (Qwen3-30B-A3B and its kin): Qwen3's attention (q/k RMSNorm per
head, its own head_dim) with a mixture-of-experts feed-forward: a router picks each
token's `num_experts_per_tok` of `num_experts` SwiGLU experts (softmax, top-k, divided by
their sum when `norm_topk_prob`), and their outputs are summed with those weights.

Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense
MLP of `intermediate_size`. The experts are read where they lie, never copied: one
matrix per expert as transformers' save_pretrained writes them
(`mlp.experts.{e}.gate_proj.weight`), or expert e's slice of a GGUF file's stacked
`blk.N.ffn_gate_exps` (E, F, H). llama.cpp always renormalises the chosen experts'
weights for qwen3moe and its converter writes no flag for it, so a GGUF means
norm_topk_prob = True.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import ConfigError, GGUFMeta
from ..formats.ggml_types import GGMLType
from ..ops.reference import Experts
from ..ops.workspace import Workspace
from ..weights import Linear, WeightSource
from . import qwen3
from .blocks import Decoder, DecoderLayer, embedding_and_head, load_attention, load_linear, load_mlp, load_norm

GGUF_TENSORS: list[tuple[str, str]] = [
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", "model.layers.{i}.mlp.gate.weight"),
]


@dataclass
class Args(qwen3.Args):
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    gguf_architectures = ("qwen3moe",)

    @classmethod
    def gguf_model_type(cls, arch: str) -> str:
        return "qwen3_moe"

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        super().gguf_kwargs(meta, kwargs)
        kwargs.update(num_experts=meta.int("expert_count", hi=4096), num_experts_per_tok=meta.int("expert_used_count"),
                      moe_intermediate_size=meta.int("expert_feed_forward_length"), norm_topk_prob=True)

    @classmethod
    def prepare(cls, kwargs: dict[str, Any], raw: dict[str, Any]) -> None:
        super().prepare(kwargs, raw)
        # transformers 5 writes num_experts as num_local_experts; released configs say num_experts
        if "num_experts" not in raw and isinstance(raw.get("num_local_experts"), int):
            kwargs["num_experts"] = raw["num_local_experts"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_experts <= 4096:
            raise ConfigError(f"num_experts must be between 1 and 4096, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= min(self.num_experts, 64):
            raise ConfigError(f"num_experts_per_tok must be between 1 and min(num_experts, 64), "
                              f"got {self.num_experts_per_tok}")
        if not 1 <= self.moe_intermediate_size <= 1 << 20:
            raise ConfigError(f"moe_intermediate_size must be between 1 and {1 << 20}, "
                              f"got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ConfigError(f"mlp_only_layers must list layer indices below {self.num_hidden_layers}")

    def is_moe_layer(self, layer: int) -> bool:
        # transformers' rule for which layers get the sparse block
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["experts"] = (f"{self.num_experts_per_tok} of {self.num_experts} per token "
                        f"(F={self.moe_intermediate_size}, renormalised={self.norm_topk_prob}); "
                        f"MoE layers {sum(map(self.is_moe_layer, range(self.num_hidden_layers)))} "
                        f"of {self.num_hidden_layers}")
        return d


@dataclass
class MoE:
    """The sparse feed-forward block; called like blocks.MLP."""
    router: Linear        # (E, H)
    experts: Experts
    top_k: int
    norm_topk_prob: bool

    def stack_moe(self) -> tuple[Linear, Experts, int, bool]:
        """What a layer stack's norm_moe_add takes of this block (models/blocks.py)."""
        return self.router, self.experts, self.top_k, self.norm_topk_prob

    def __call__(self, ops: Any, ws: Workspace, h: np.ndarray, out: np.ndarray,
                 rec: Any = None, layer: int = 0, lora: Any = None) -> np.ndarray:
        # lora: [lora] experts take no adapter (ellm.lora refuses one that targets them)
        ops.moe(h, self.router, self.experts, self.top_k, self.norm_topk_prob, out=out)
        if rec is not None:   # [trace] the block's output, under the MLP's name for it
            rec(layer, "down", out)
        return out


def _gguf_experts(gguf: Any, name: str, E: int, N: int, K: int) -> list[Linear]:
    """Expert e's (N, K) matrix of a stacked GGUF tensor (E, N, K), as views."""
    info = gguf.tensors[name]
    if tuple(info.shape) != (E, N, K):
        raise ValueError(f"{name} is {tuple(info.shape)}, the config says {(E, N, K)}")
    if info.qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        data = gguf.array(name)
        data = data.view(np.uint16) if data.dtype == np.float16 else data
    else:
        data = gguf.raw(name).reshape(E, N, -1)
    return [Linear(data[e], info.qtype, N, K, f"{name}[{e}]") for e in range(E)]


def load_moe(weights: WeightSource, c: Args, layer: int) -> MoE:
    p, H, F, E = f"model.layers.{layer}.mlp.", c.hidden_size, c.moe_intermediate_size, c.num_experts
    shapes = {"gate": (F, H), "up": (F, H), "down": (H, F)}
    gguf = getattr(weights, "gguf", None)
    if gguf is not None and f"blk.{layer}.ffn_gate_exps.weight" in gguf.tensors:
        mats = {name: _gguf_experts(gguf, f"blk.{layer}.ffn_{name}_exps.weight", E, *shape)
                for name, shape in shapes.items()}
    else:
        mats = {name: [load_linear(weights, f"{p}experts.{e}.{name}_proj", *shape) for e in range(E)]
                for name, shape in shapes.items()}
    return MoE(router=load_linear(weights, p + "gate", E, H), experts=Experts(**mats),
               top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c, H = config, config.hidden_size
        embed, lm_head = embedding_and_head(weights, c)
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = load_attention(weights, c, i)
            attn.q_norm = load_norm(weights, p + "self_attn.q_norm.weight", c.head_dim)
            attn.k_norm = load_norm(weights, p + "self_attn.k_norm.weight", c.head_dim)
            mlp = load_moe(weights, c, i) if c.is_moe_layer(i) else load_mlp(weights, c, p + "mlp.")
            layers.append(DecoderLayer(attn=attn, mlp=mlp,
                                       input_norm=load_norm(weights, p + "input_layernorm.weight", H),
                                       pre_mlp_norm=load_norm(weights, p + "post_attention_layernorm.weight", H)))
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", H))
