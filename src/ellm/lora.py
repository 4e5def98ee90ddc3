"""LoRA adapters over one loaded base: read, checked against the base, and laid out for
the backends.

An adapter is read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)
or a llama.cpp GGUF LoRA file (`general.type` = adapter). Each adapted projection W of the
base gets y += scale * B (A x), with A (r, in) and B (out, r) kept in float32 beside the
base, whose weights stay as they are (mapped, quantized). Many adapters share one base:
each is a slot (0, 1, ...) and a batch row names its slot (-1: the base alone), so one
forward serves requests of different adapters together (ops `lora`, csrc/lora.c).

Everything in an adapter is checked against the base before it is used: a module the
base lacks, a layer past its last, a factor whose shape does not fit the base's matrix or
whose rank disagrees with the config is an error naming the file and the tensor.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .formats.errors import FormatError

# The projections an adapter may change, as the blocks name them.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
# Hugging Face module names -> the projections they hold, in row order (fused families
# such as Phi-3 keep q/k/v and gate/up in one matrix; its B rows split the same way)
HF_MODULES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up"),
}
_PEFT_KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
_GGUF_KEY = re.compile(r"(blk\.\d+\.\w+\.weight)\.lora_([ab])")
# PEFT settings this reader cannot honour; refused rather than ignored
_REFUSED: dict[str, tuple[Any, Any]] = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
    "modules_to_save": (None, []), "lora_bias": (False, None), "target_parameters": (None, [])}
MAX_ADAPTERS = 1024
# safetensors dtypes -> the factor types the kernels keep
_FILE_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


@dataclass
class LoraFactors:
    """One adapter's change to one projection: y += scale * b @ (a @ x)."""
    a: np.ndarray      # (r, in_features) float32, C-contiguous
    b: np.ndarray      # (out_features, r) float32, C-contiguous
    scale: float
    dtype: str = "f32"  # what the file held: "f32", "f16" or "bf16" (a and b are exactly those values)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoraAdapter:
    name: str
    path: Path
    factors: dict[tuple[int, str], LoraFactors]   # (layer, projection) -> factors

    @property
    def rank(self) -> int:
        return max((f.rank for f in self.factors.values()), default=0)

    @property
    def targets(self) -> list[str]:
        return [p for p in PROJECTIONS if any(k[1] == p for k in self.factors)]


@dataclass
class LoraProjection:
    """Every adapter's factors for one projection of one layer: slot s is adapter s (None
    where it leaves the projection alone). What ops.prepare_lora makes its table of."""
    out_features: int
    in_features: int
    slots: tuple[LoraFactors | None, ...]


@dataclass
class LoraSet:
    """The adapters attached to a model: their names in slot order, and per layer the
    backend's prepared table (ops.prepare_lora) of each projection any adapter changes."""
    names: list[str]
    adapters: list[LoraAdapter]
    layers: list[dict[str, Any]] = field(default_factory=list)

    def slot(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(name) from None


# -- the base's matrices -----------------------------------------------------------------

def base_projections(model: Any) -> list[dict[str, Any]]:
    """Per layer, the base's Linear of each projection an adapter may change (a layer
    whose MLP is not a plain gated MLP, MoE, offers only its attention)."""
    from .models.blocks import MLP, Attention
    out = []
    for layer in getattr(model, "layers", None) or []:
        found: dict[str, Any] = {}
        if isinstance(layer.attn, Attention):
            found.update(q=layer.attn.q, k=layer.attn.k, v=layer.attn.v, o=layer.attn.o)
        if type(layer.mlp) is MLP:
            found.update(gate=layer.mlp.gate, up=layer.mlp.up, down=layer.mlp.down)
        out.append(found)
    if not out:
        raise ValueError("this model has no decoder layers an adapter could change")
    return out


def _permute_rows(b: np.ndarray, n_heads: int) -> np.ndarray:
    """B's rows in the order llama.cpp's converter gives a Llama GGUF's q/k rows (each
    head's two RoPE halves interleaved), so an adapter made for the folder fits the GGUF."""
    n = b.shape[0]
    return np.ascontiguousarray(b.reshape(n_heads, 2, n // n_heads // 2, -1).swapaxes(1, 2).reshape(b.shape))


# -- reading ---------------------------------------------------------------------------

def load_adapter(name: str, path: str | Path, model: Any) -> LoraAdapter:
    """An adapter from a PEFT folder (or its adapter_config.json) or a GGUF LoRA file,
    checked against `model`'s matrices."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "adapter_config.json":
        p = p.parent
    if p.is_dir():
        return _read_peft(name, p, model)
    if p.is_file() and p.suffix == ".gguf":
        return _read_gguf(name, p, model)
    if not p.exists():
        raise FileNotFoundError(f"LoRA adapter {name!r}: {p} does not exist")
    raise FormatError(p, f"LoRA adapter {name!r}: expected a PEFT folder (adapter_config.json + "
                         "adapter_model.safetensors) or a llama.cpp LoRA .gguf file")


def _pattern_value(patterns: Any, module: str, default: Any, where: Path, key: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the end of
    the module's name, else default."""
    if not patterns:
        return default
    if not isinstance(patterns, dict):
        raise FormatError(where, f"{key} must be an object, got {type(patterns).__name__}")
    for k, v in patterns.items():
        try:
            if re.fullmatch(rf"(.*\.)?{k}", module):
                return v
        except (re.error, TypeError):
            raise FormatError(where, f"{key} holds {k!r}, not a module name pattern") from None
    return default


def _number(cfg: dict[str, Any], key: str, where: Path, default: Any = None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise FormatError(where, f"{key} must be a positive number, got {v!r}")
    return float(v)


def _read_peft(name: str, folder: Path, model: Any) -> LoraAdapter:
    from .formats.safetensors import SafetensorsFile
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise FormatError(folder, f"LoRA adapter {name!r}: no adapter_config.json in the folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(cfg_path, f"not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise FormatError(cfg_path, "must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise FormatError(cfg_path, f"peft_type {peft_type!r}: only LORA adapters are supported")
    for key, allowed in _REFUSED.items():
        if cfg.get(key, allowed[0]) not in allowed:
            raise FormatError(cfg_path, f"{key}={cfg[key]!r} is not supported (LoRA with {key}="
                                        f"{allowed[0]!r} only)")
    r = _number(cfg, "r", cfg_path)
    alpha = _number(cfg, "lora_alpha", cfg_path, r)
    rslora = bool(cfg.get("use_rslora", False))
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        hint = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise FormatError(folder, f"LoRA adapter {name!r}: no adapter_model.safetensors{hint}")
    st = SafetensorsFile(weights)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    dtypes: dict[str, set[str]] = {}
    layers: dict[str, int] = {}
    for tname, info in st.tensors.items():
        m = _PEFT_KEY.fullmatch(tname)
        if m is None:
            raise FormatError(weights, f"tensor {tname}: not a LoRA factor of a decoder layer's "
                                       f"projection ({', '.join(HF_MODULES)})")
        module, layer, proj, which = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if proj not in HF_MODULES:
            raise FormatError(weights, f"tensor {tname}: module {proj} is not one an adapter may change "
                                       f"({', '.join(HF_MODULES)})")
        if info.dtype not in ("F32", "F16", "BF16") or len(info.shape) != 2:
            raise FormatError(weights, f"tensor {tname}: {info.dtype} {list(info.shape)}; a LoRA factor is "
                                       "an F32, F16 or BF16 matrix")
        from .formats.dequant import dequantize
        from .weights import _ST_QTYPE
        arr = st.array(tname)
        pairs.setdefault(module, {})[which] = dequantize(arr.reshape(1, -1).view(np.uint8),
                                                         _ST_QTYPE[info.dtype], info.shape)
        dtypes.setdefault(module, set()).add(_FILE_DTYPES[info.dtype])
        layers[module] = layer
    factors: dict[tuple[int, str], LoraFactors] = {}
    base = base_projections(model)
    for module, ab in pairs.items():
        where = f"{weights}: {module}"
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise FormatError(weights, f"tensor {module}.lora_{missing}.weight is missing (its pair is there)")
        rank = int(_pattern_value(cfg.get("rank_pattern"), module, r, cfg_path, "rank_pattern"))
        a_alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha, cfg_path, "alpha_pattern"))
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise FormatError(weights, f"tensor {module}.lora_A.weight {list(a.shape)} / lora_B.weight "
                                       f"{list(b.shape)}: rank {a.shape[0]}/{b.shape[1]}, the config says r={rank}")
        scale = a_alpha / (math.sqrt(rank) if rslora else rank)
        # both factors 16-bit of one kind: kept so (exactly); anything else: float32
        kind = dtypes[module].pop() if len(dtypes[module]) == 1 else "f32"
        _place(factors, base, layers[module], module.rsplit(".", 1)[1], a, b, scale, model, where,
               permute=True, dtype=kind)
    return LoraAdapter(name, folder, factors)


def _place(factors: dict[tuple[int, str], LoraFactors], base: list[dict[str, Any]], layer: int,
           module: str, a: np.ndarray, b: np.ndarray, scale: float, model: Any, where: str,
           permute: bool, dtype: str = "f32") -> None:
    """Checks one module's A (r, in) and B (out, r) against the base's matrices and splits a
    fused module's B into its projections."""
    if layer >= len(base):
        raise FormatError(where, f"layer {layer}: the base has {len(base)} layers")
    projs = HF_MODULES[module]
    missing = [p for p in projs if p not in base[layer]]
    if missing:
        raise FormatError(where, f"the base's layer {layer} has no plain {'/'.join(missing)} projection "
                                 "to adapt (an MoE layer's experts cannot take a LoRA adapter)")
    mats = [base[layer][p] for p in projs]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] < 1 or b.shape[1] != a.shape[0]:
        raise FormatError(where, f"lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a rank-r pair")
    k = mats[0].in_features
    n = sum(m.out_features for m in mats)
    if a.shape[1] != k or b.shape[0] != n:
        raise FormatError(where, f"lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base's "
                                 f"{'+'.join(projs)} matrix ({n}, {k}): expected ({a.shape[0]}, {k}) "
                                 f"and ({n}, {a.shape[0]})")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise FormatError(where, "a LoRA factor holds NaN or infinity")
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    row = 0
    attn = model.layers[layer].attn
    for p, m in zip(projs, mats):
        part = b[row:row + m.out_features]
        row += m.out_features
        if permute and p in ("q", "k") and getattr(attn, "interleaved", False):
            part = _permute_rows(part, attn.n_heads if p == "q" else attn.n_kv_heads)
        if (layer, p) in factors:
            raise FormatError(where, f"layer {layer} projection {p} is adapted twice")
        factors[(layer, p)] = LoraFactors(a32, np.ascontiguousarray(part, dtype=np.float32), float(scale), dtype)


def _read_gguf(name: str, path: Path, model: Any) -> LoraAdapter:
    """A llama.cpp LoRA adapter (convert_lora_to_gguf.py): tensors `<base tensor>.lora_a`
    (r, in) and `.lora_b` (out, r), scale adapter.lora.alpha / r (1 without an alpha)."""
    from .formats.gguf import GGUFFile
    from .models import family_for_gguf
    from .models.blocks import gguf_tensor_table
    from .weights import gguf_to_hf_name
    g = GGUFFile(path)
    meta = g.metadata
    if meta.get("general.type") != "adapter" or str(meta.get("adapter.type", "")).lower() != "lora":
        raise FormatError(path, f"not a LoRA adapter: general.type={meta.get('general.type')!r}, "
                                f"adapter.type={meta.get('adapter.type')!r} (expected 'adapter', 'lora')")
    arch = str(meta.get("general.architecture", ""))
    archs = type(model.config).gguf_architectures
    if arch not in archs:
        raise FormatError(path, f"general.architecture {arch!r}: the adapter is for another family "
                                f"than the base ({', '.join(archs)})")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise FormatError(path, f"adapter.lora.alpha must be a number >= 0, got {alpha!r}")
    table = gguf_tensor_table(getattr(family_for_gguf(arch), "GGUF_TENSORS", ()))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    kinds: dict[str, set[str]] = {}
    gguf_names: dict[str, str] = {}   # HF name -> the base tensor's GGUF name
    for tname, info in g.tensors.items():
        m = _GGUF_KEY.fullmatch(tname)
        hf = gguf_to_hf_name(m.group(1), table) if m else None
        hm = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight", hf or "")
        if m is None or hf is None or hm is None or hm.group(2) not in HF_MODULES:
            raise FormatError(path, f"tensor {tname}: not a LoRA factor of a decoder layer's projection")
        if len(info.shape) != 2:
            raise FormatError(path, f"tensor {tname}: shape {list(info.shape)}, expected a matrix")
        pairs.setdefault(hf, {})[m.group(2)] = g.dequantize(tname)
        gguf_names[hf] = m.group(1)
        kinds.setdefault(hf, set()).add({"F16": "f16", "BF16": "bf16"}.get(info.qtype.name, "f32"))
    factors: dict[tuple[int, str], LoraFactors] = {}
    base = base_projections(model)
    for hf, ab in pairs.items():
        where = f"{path}: {gguf_names[hf]}"
        if set(ab) != {"a", "b"}:
            raise FormatError(where, f"lora_{({'a', 'b'} - set(ab)).pop()} is missing (its pair is there)")
        hm = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight", hf)
        assert hm is not None   # each name in pairs matched it above
        a, b = ab["a"], ab["b"]
        rank = a.shape[0]
        scale = float(alpha) / rank if alpha else 1.0
        _place(factors, base, int(hm.group(1)), hm.group(2), a, b, scale, model, where, permute=False,
               dtype=kinds[hf].pop() if len(kinds[hf]) == 1 else "f32")
    return LoraAdapter(name, path, factors)


# -- attaching -------------------------------------------------------------------------

def check_adapter_names(adapters: Mapping[str, Any]) -> None:
    if not isinstance(adapters, Mapping):
        raise TypeError(f"lora_adapters must be a mapping of names to paths, got {type(adapters).__name__}")
    if len(adapters) > MAX_ADAPTERS:
        raise ValueError(f"{len(adapters)} LoRA adapters; at most {MAX_ADAPTERS}")
    for n in adapters:
        if not isinstance(n, str) or not n or n.strip() != n or len(n) > 256:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string without surrounding "
                             f"spaces, at most 256 characters, got {n!r}")


def attach_adapters(model: Any, adapters: Mapping[str, str | Path]) -> LoraSet:
    """Reads every adapter, lays them out per projection on the model's backend
    (ops.prepare_lora) and attaches them to the model (model.lora)."""
    check_adapter_names(adapters)
    loaded = [load_adapter(n, p, model) for n, p in adapters.items()]
    base = base_projections(model)
    lora = LoraSet([a.name for a in loaded], loaded)
    for i, mats in enumerate(base):
        tables: dict[str, Any] = {}
        for p in PROJECTIONS:
            slots = tuple(a.factors.get((i, p)) for a in loaded)
            if any(s is not None for s in slots):
                m = mats[p]
                tables[p] = model.ops.prepare_lora(LoraProjection(m.out_features, m.in_features, slots))
        lora.layers.append(tables)
    model.lora = lora
    return lora
