"""ModelConfig: one dataclass for every architecture, in Hugging Face field names.

Built from a folder's config.json (+ generation_config.json) or from GGUF metadata;
validated on construction; unknown config.json keys are ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "gemma", "gemma2", "gemma3_text", "gemma3")


class ConfigError(ValueError):
    """A model configuration is missing a field or holds an impossible value."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0                      # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Gemma family
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None   # "sliding_attention" | "full_attention" per layer
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # How the weights lay out Q/K rows for RoPE: GGUF llama files are permuted for
    # interleaved pairs; everything else pairs (i, i + head_dim/2).
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {self.model_type!r} "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("hidden_size is not divisible by num_attention_heads and no head_dim is given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = [int(i) for i in (self.eos_token_id or [])]

    # -- derived values -------------------------------------------------------------

    @property
    def is_gemma(self) -> bool:
        return self.model_type.startswith("gemma")

    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar:
            return self.query_pre_attn_scalar ** -0.5
        return self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int:
        """Sliding-window length for a layer, or 0 for full attention."""
        if self.layer_types is None or not self.sliding_window:
            return 0
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    def inv_freq(self, layer: int) -> np.ndarray:
        """(head_dim/2,) f32 RoPE inverse frequencies for a layer, with llama-3 scaling."""
        theta = self.rope_theta
        if self.layer_window(layer) and self.rope_local_base_freq:
            theta = self.rope_local_base_freq
        dim = self.head_dim
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
        inv = inv.astype(np.float32)
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3" and not self.layer_window(layer):
            inv = _llama3_scaled(inv, scaling)
        elif kind == "linear" and not self.layer_window(layer):
            inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
        elif kind not in (None, "default", "llama3", "linear", "gguf_freq_factors"):
            raise ConfigError(f"rope_scaling type {kind!r} is not supported")
        return inv

    # -- constructors ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        raw = dict(raw)
        if raw.get("model_type") == "gemma3" and "text_config" in raw:  # multimodal wrapper
            raw = {**raw["text_config"], "model_type": "gemma3_text"}
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        if "model_type" not in kwargs:
            raise ConfigError("config.json has no model_type")
        if "rope_parameters" in raw and "rope_theta" not in kwargs:  # transformers 5 layout
            params = raw["rope_parameters"]
            if "full_attention" in params:
                kwargs["rope_theta"] = params["full_attention"].get("rope_theta", 10000.0)
                local = params.get("sliding_attention", {})
                if "rope_theta" in local:
                    kwargs["rope_local_base_freq"] = local["rope_theta"]
                scaling = params["full_attention"]
            else:
                kwargs["rope_theta"] = params.get("rope_theta", 10000.0)
                scaling = params
            if scaling.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = scaling
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "hidden_activation" in raw:
            kwargs["hidden_act"] = raw["hidden_activation"]
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        kwargs["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos or [])
        _fill_gemma_defaults(kwargs)
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"config.json is missing a field: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        try:
            raw = json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"{folder}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{folder / 'config.json'}: invalid JSON ({e})") from None
        gen_path = folder / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_dict(raw, generation)

    @classmethod
    def from_gguf(cls, gguf: "Any") -> "ModelConfig":
        """From a GGUFFile's metadata (`{arch}.*` keys)."""
        meta = gguf.metadata
        arch = meta.get("general.architecture")
        if arch not in ("llama", "gemma", "gemma2", "gemma3"):
            raise ConfigError(f"{gguf.path}: GGUF architecture {arch!r} is not supported")

        def get(key: str, default: Any = None, required: bool = False) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                if required:
                    raise ConfigError(f"{gguf.path}: GGUF metadata lacks {full}")
                return default
            return meta[full]

        n_heads = int(get("attention.head_count", required=True))
        hidden = int(get("embedding_length", required=True))
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = int(get("vocab_size", 0)) or (len(tokens) if tokens is not None else 0)
        if not vocab and "token_embd.weight" in gguf.tensors:
            vocab = gguf.tensors["token_embd.weight"].shape[0]
        n_kv = get("attention.head_count_kv", n_heads)
        if not isinstance(n_kv, int):  # per-layer arrays exist in some files; all equal here
            n_kv = int(np.asarray(n_kv).max())
        kwargs: dict[str, Any] = dict(
            model_type="gemma3_text" if arch == "gemma3" else arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_hidden_layers=int(get("block_count", required=True)),
            num_attention_heads=n_heads,
            num_key_value_heads=int(n_kv),
            head_dim=int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or 0),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else [],
            rope_interleaved=(arch == "llama"),
        )
        if arch == "llama":
            kwargs["head_dim"] = hidden // n_heads  # rope.dimension_count may be partial in other archs
            scale_type = get("rope.scaling.type")
            if scale_type == "linear":
                kwargs["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
            if "rope_freqs.weight" in gguf.tensors:
                # llama-3 scaling baked into per-frequency divisors
                kwargs["rope_scaling"] = {"rope_type": "gguf_freq_factors"}
        if arch.startswith("gemma"):
            kwargs["hidden_act"] = "gelu_pytorch_tanh"
            sw = get("attention.sliding_window")
            if sw:
                kwargs["sliding_window"] = int(sw)
            softcap = get("final_logit_softcapping")
            if softcap:
                kwargs["final_logit_softcapping"] = float(softcap)
            attn_cap = get("attn_logit_softcapping")
            if attn_cap:
                kwargs["attn_logit_softcapping"] = float(attn_cap)
        _fill_gemma_defaults(kwargs)
        return cls(**kwargs)


def _fill_gemma_defaults(kwargs: dict[str, Any]) -> None:
    """Gemma values that GGUF files (and some configs) leave out: the published defaults."""
    mt = kwargs.get("model_type")
    if mt not in ("gemma", "gemma2", "gemma3_text"):
        return
    kwargs.setdefault("tie_word_embeddings", True)
    kwargs.setdefault("hidden_act", "gelu_pytorch_tanh")
    if mt == "gemma3_text":
        n = kwargs["num_hidden_layers"]
        kwargs.setdefault("query_pre_attn_scalar", kwargs.get("head_dim") or 256)
        kwargs.setdefault("rope_local_base_freq", 10000.0)
        kwargs.setdefault("sliding_window", 512)
        if not kwargs.get("layer_types"):
            pattern = 6  # every sixth layer is global
            kwargs["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n)]
    elif mt == "gemma2":
        n = kwargs["num_hidden_layers"]
        kwargs.setdefault("query_pre_attn_scalar", kwargs.get("head_dim") or 256)
        kwargs.setdefault("sliding_window", 4096)
        kwargs.setdefault("final_logit_softcapping", 30.0)
        kwargs.setdefault("attn_logit_softcapping", 50.0)
        if not kwargs.get("layer_types"):
            kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _llama3_scaled(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv.astype(np.float64)
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wavelen, inv / factor,
                      np.where(wavelen < high_wavelen, inv, (1 - smooth) * inv / factor + smooth * inv))
    return scaled.astype(np.float32)
