"""ModelConfig: the settings every architecture family shares, in Hugging Face field names.

Each family (`ellm.models.<family>`) subclasses it with its own fields and rules. A
family's class is built from a folder's config.json (+ generation_config.json) or from GGUF
metadata; choosing the family by `model_type` / `general.architecture` is the registry's
work, a floor above (`ellm.models.config_from_folder` / `config_from_gguf`). Unknown keys
are ignored, every value is type- and range-checked, and a bad value is a ConfigError
naming the file and key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np

# Far above any published model; a file claiming more is damaged or hostile, and would
# otherwise make per-layer lists and caches of absurd size.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_WIDTH = 1 << 20


class ConfigError(ValueError):
    """A model configuration is missing a field or holds an impossible value."""


def _coerce(name: str, value: Any, annotation: str) -> Any:
    """`value` checked against a field annotation such as 'int', 'float | None', 'list[str]'."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None:
        if "None" in kinds:
            return None
        raise ConfigError(f"{name} must not be null")
    is_bool = isinstance(value, (bool, np.bool_))
    for kind in kinds:
        if kind == "int" and isinstance(value, (int, np.integer)) and not is_bool:
            return int(value)
        if kind == "float" and isinstance(value, (int, float, np.integer, np.floating)) and not is_bool:
            if not math.isfinite(float(value)):
                break
            return float(value)
        if kind == "bool" and is_bool:
            return bool(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind.startswith("list") and isinstance(value, (list, tuple)):
            return list(value)
        if kind.startswith("dict") and isinstance(value, dict):
            return value
    wanted = " or ".join(k for k in kinds if k != "None")
    raise ConfigError(f"{name} must be {wanted}, got {value!r}")


def rope_inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None) -> np.ndarray:
    """(dim/2,) f32 RoPE inverse frequencies theta^(-2i/dim), with llama-3 or linear scaling."""
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        inv = _llama3_scaled(inv, scaling)
    elif kind == "linear":
        inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
    elif kind not in (None, "default", "gguf_freq_factors"):
        raise ConfigError(f"rope_scaling type {kind!r} is not supported")
    return inv


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0           # 0: num_attention_heads
    head_dim: int = 0                      # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # How the weights lay out Q/K rows for RoPE: llama.cpp's converter permutes them for
    # interleaved pairs in some architectures; Hugging Face pairs (i, i + head_dim/2).
    rope_interleaved: bool = False

    # The GGUF `general.architecture` names this family reads (set by each family).
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, (int, np.integer)) and not isinstance(self.eos_token_id, bool):
            self.eos_token_id = [int(self.eos_token_id)]
        for f in fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), str(f.type)))
        self.eos_token_id = [_coerce("eos_token_id", i, "int") for i in self.eos_token_id]
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        limits = {"vocab_size": MAX_WIDTH, "hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH,
                  "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
                  "num_key_value_heads": MAX_HEADS, "max_position_embeddings": 1 << 30}
        for name, hi in limits.items():
            v = getattr(self, name)
            if not 0 < v <= hi:
                raise ConfigError(f"{name} must be between 1 and {hi}, got {v}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("hidden_size is not divisible by num_attention_heads and no head_dim is given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not 0 < self.head_dim <= 4096 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even number up to 4096, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")

    # -- what the engine and the blocks ask of every family ---------------------------

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int:
        """Sliding-window length for a layer, or 0 for full attention."""
        return 0

    def inv_freq(self, layer: int) -> np.ndarray:
        """(head_dim/2,) f32 RoPE inverse frequencies for a layer."""
        return rope_inv_freq(self.rope_theta, self.head_dim, self.rope_scaling)

    def describe(self) -> dict[str, Any]:
        """What was chosen for this architecture, for `ellm info` (family-specific keys added)."""
        windows = sorted({self.layer_window(i) for i in range(self.num_hidden_layers)} - {0})
        return {"layers": self.num_hidden_layers, "hidden": self.hidden_size,
                "heads": f"{self.num_attention_heads} q / {self.num_key_value_heads} kv x {self.head_dim}",
                "rope_theta": self.rope_theta, "sliding_window": windows or None}

    # -- family hooks -----------------------------------------------------------------

    @classmethod
    def prepare(cls, kwargs: dict[str, Any], raw: dict[str, Any]) -> None:
        """Fill family defaults into kwargs (raw: the config.json, {} for GGUF)."""

    @classmethod
    def gguf_kwargs(cls, meta: "GGUFMeta", kwargs: dict[str, Any]) -> None:
        """Add the family's own settings read from GGUF metadata to kwargs."""

    # -- constructors -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        """From config.json's contents (on a family's class: ellm.models.config_from_dict chooses it)."""
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        _a_family(cls, "config_from_dict")
        raw = dict(raw)
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" not in kwargs:  # transformers 5 layout
            if "full_attention" in params:  # per layer kind (Gemma 3)
                if "rope_local_base_freq" in known and "rope_theta" in params.get("sliding_attention", {}):
                    kwargs["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
                params = params["full_attention"]
            if "rope_theta" in params:
                kwargs["rope_theta"] = params["rope_theta"]
            if params.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = params
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        kwargs["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos or [])
        cls.prepare(kwargs, raw)
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"config.json is missing a field: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        _a_family(cls, "config_from_folder")
        raw, generation = read_config_json(folder)
        return config_in_file(folder, lambda: cls.from_dict(raw, generation))

    @classmethod
    def from_gguf(cls, gguf: Any) -> "ModelConfig":
        """From a GGUFFile's metadata."""
        _a_family(cls, "config_from_gguf")
        meta = GGUFMeta(gguf)
        n_heads = meta.int("attention.head_count", hi=MAX_HEADS)
        hidden = meta.int("embedding_length", hi=MAX_WIDTH)
        vocab = meta.int("vocab_size", 0, lo=0, hi=MAX_WIDTH)
        if not vocab:
            tokens = meta.meta.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else 0
        if not vocab and "token_embd.weight" in gguf.tensors:
            vocab = int(gguf.tensors["token_embd.weight"].shape[0])
        head_dim = meta.int("attention.key_length", 0, lo=0, hi=4096)
        if not head_dim:
            if hidden % n_heads:
                raise ConfigError(f"{gguf.path}: {meta.arch}.embedding_length ({hidden}) is not a multiple "
                                  f"of {meta.arch}.attention.head_count ({n_heads})")
            head_dim = hidden // n_heads
        eos = meta.meta.get("tokenizer.ggml.eos_token_id")
        kwargs: dict[str, Any] = dict(
            model_type=cls.gguf_model_type(meta.arch),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.int("feed_forward_length", hi=MAX_WIDTH),
            num_hidden_layers=meta.int("block_count", hi=MAX_LAYERS),
            num_attention_heads=n_heads,
            num_key_value_heads=meta.int("attention.head_count_kv", n_heads, hi=MAX_HEADS),
            head_dim=head_dim,
            rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=meta.float("rope.freq_base", 10000.0),
            max_position_embeddings=meta.int("context_length", 2048, hi=1 << 30),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            bos_token_id=meta.meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[eos] if eos is not None else [],
        )
        cls.gguf_kwargs(meta, kwargs)
        cls.prepare(kwargs, {})
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{gguf.path}: {e}") from None

    @classmethod
    def gguf_model_type(cls, arch: str) -> str:
        """The model_type a GGUF architecture name stands for (the same name unless overridden)."""
        return arch


def _a_family(cls: type, registry_function: str) -> None:
    if cls is ModelConfig:
        raise TypeError(f"ModelConfig is the base of the families' configs; ellm.models.{registry_function}() "
                        "chooses the family and builds its config")


def read_config_json(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A folder's config.json (any JSON value: from_dict checks it) and its
    generation_config.json (a dict, or None when there is none)."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    gen_path = folder / "generation_config.json"
    generation = None
    if gen_path.exists():
        try:
            generation = json.loads(gen_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{gen_path}: invalid JSON ({e})") from None
        if not isinstance(generation, dict):
            raise ConfigError(f"{gen_path}: must hold a JSON object")
    return raw, generation


def config_in_file(folder: str | Path, build: Callable[[], "ModelConfig"]) -> "ModelConfig":
    """build(), with a ConfigError it raises prefixed by the folder's config.json."""
    try:
        return build()
    except ConfigError as e:
        raise ConfigError(f"{Path(folder) / 'config.json'}: {e}") from None


class GGUFMeta:
    """Checked reads of a GGUF file's `{arch}.*` metadata: a wrong type or range is a
    ConfigError naming the file and the key."""

    def __init__(self, gguf: Any) -> None:
        self.path, self.meta, self.tensors = gguf.path, gguf.metadata, gguf.tensors
        self.arch = str(self.meta.get("general.architecture", ""))

    def _fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.arch}.{key} {why}")

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def raw(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def _required(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            raise ConfigError(f"{self.path}: GGUF metadata lacks {full}")
        return self.meta[full]

    def int(self, key: str, default: int | None = None, *, lo: int = 1, hi: int = 1 << 62) -> int:
        if default is not None and not self.has(key):
            return default
        value = self._required(key)
        if isinstance(value, (list, tuple, np.ndarray)):  # per-layer arrays: all equal here
            values = {v for v in np.asarray(value).ravel().tolist()}
            if len(values) != 1:
                raise self._fail(key, f"differs between layers ({sorted(values)[:4]}...), which is not supported")
            value = values.pop()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self._fail(key, f"must be an integer, got {value!r}")
        if not lo <= int(value) <= hi:
            raise self._fail(key, f"must be between {lo} and {hi}, got {value}")
        return int(value)

    def float(self, key: str, default: float | None = None) -> float:
        if default is not None and not self.has(key):
            return default
        value = self._required(key)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(value)):
            raise self._fail(key, f"must be a finite number, got {value!r}")
        return float(value)


def layer_types_window(layer: int, layer_types: list[str] | None, sliding_window: int | None) -> int:
    """The common rule: a layer listed as "sliding_attention" slides over sliding_window."""
    if not sliding_window or layer_types is None:
        return 0
    return sliding_window if layer_types[layer] == "sliding_attention" else 0


def check_layer_types(layer_types: list[str] | None, n_layers: int) -> None:
    if layer_types is None:
        return
    if len(layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    bad = set(layer_types) - {"sliding_attention", "full_attention"}
    if bad:
        raise ConfigError(f"layer_types holds unknown kinds {sorted(bad)}")


def check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and not 0 < sliding_window <= 1 << 30:
        raise ConfigError(f"sliding_window must be a positive integer, got {sliding_window}")


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
