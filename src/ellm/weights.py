"""Model weights as views into the mapped files, under Hugging Face tensor names.

A GGUF or safetensors source is wrapped in a WeightSource that answers `linear(name)`
(a matrix for the matmul kernels, quantized blocks left as they are) and `vector(name)`
(a small f32 array: norms, biases). GGUF names are translated by one table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .formats.errors import FormatError
from .formats.ggml_types import GGMLType, row_bytes
from .formats.gguf import GGUFFile
from .formats.safetensors import SafetensorsFolder


@dataclass
class Linear:
    """A weight matrix W (out_features, in_features) for Y = X @ W^T.

    data: (N, row_bytes) uint8 GGML blocks for quantized types, (N, K) float32 for F32,
    (N, K) uint16 bit patterns for F16/BF16. Usually a view into a mapped file.
    """
    data: np.ndarray
    qtype: GGMLType
    out_features: int
    in_features: int
    name: str = ""
    bias: np.ndarray | None = None  # (out_features,) f32, added after the sum

    def __post_init__(self) -> None:
        if self.data.ndim != 2 or self.data.shape[0] != self.out_features:
            raise FormatError(self.name, f"weight data shape {self.data.shape} does not hold "
                                         f"{self.out_features} rows")
        if self.qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            ok = self.data.shape[1] == self.in_features
        else:
            ok = self.data.shape[1] == row_bytes(self.qtype, self.in_features)
        if not ok:
            raise FormatError(self.name, f"{self.qtype.name} row of {self.in_features} does not match "
                                         f"{self.data.shape[1]} stored columns")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


# GGUF tensor names -> Hugging Face names ({i} is the layer index).
_GGUF_TO_HF = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"rope_freqs\.weight", "rope_freqs.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{i}.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{i}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{i}.mlp.down_proj.weight"),
    # llama: the norm before the MLP; gemma: see _GEMMA_OVERRIDES
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
]
# Gemma 2/3 have four norms per layer; GGUF's ffn_norm is the pre-MLP one.
_GEMMA_OVERRIDES = [
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
]


def gguf_to_hf_name(name: str, arch: str) -> str | None:
    table = (_GEMMA_OVERRIDES + _GGUF_TO_HF) if arch in ("gemma2", "gemma3") else _GGUF_TO_HF
    for pattern, target in table:
        m = re.fullmatch(pattern, name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    return None


class WeightSource:
    """Tensors by Hugging Face name, from a GGUF file or a safetensors folder."""

    # llama.cpp's converter stores Gemma's RMSNorm weights with the +1 already added.
    norm_weights_include_one = False

    def __init__(self, path: Path, names: dict[str, str]) -> None:
        self.path = path
        self._names = names  # HF name -> name in the file

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def names(self) -> list[str]:
        return list(self._names)

    def linear(self, name: str) -> Linear:
        raise NotImplementedError

    def vector(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def require(self, name: str) -> None:
        if name not in self._names:
            raise FormatError(self.path, f"missing tensor {name}")


class GGUFWeights(WeightSource):
    norm_weights_include_one = True

    def __init__(self, gguf: GGUFFile) -> None:
        arch = gguf.metadata.get("general.architecture", "")
        names = {}
        for tname in gguf.tensors:
            hf = gguf_to_hf_name(tname, arch)
            if hf is not None:
                names[hf] = tname
        super().__init__(gguf.path, names)
        self.gguf = gguf

    def linear(self, name: str) -> Linear:
        self.require(name)
        info = self.gguf.tensors[self._names[name]]
        if len(info.shape) != 2:
            raise FormatError(self.path, f"{name} has shape {info.shape}, expected a matrix")
        n, k = info.shape
        if info.qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            data = self.gguf.array(self._names[name])
            if info.qtype == GGMLType.F16:
                data = data.view(np.uint16)
        else:
            data = self.gguf.raw(self._names[name])
        return Linear(data, info.qtype, n, k, name)

    def vector(self, name: str) -> np.ndarray:
        self.require(name)
        return np.ascontiguousarray(self.gguf.dequantize(self._names[name]), dtype=np.float32)


_ST_QTYPE = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}


class SafetensorsWeights(WeightSource):
    def __init__(self, folder: SafetensorsFolder) -> None:
        super().__init__(folder.folder, {n: n for n in folder.names()})
        self.st = folder

    def linear(self, name: str) -> Linear:
        self.require(name)
        info = self.st.info(name)
        if info.dtype not in _ST_QTYPE:
            raise FormatError(self.path, f"{name} has dtype {info.dtype}; F32, F16 and BF16 are supported")
        if len(info.shape) != 2:
            raise FormatError(self.path, f"{name} has shape {info.shape}, expected a matrix")
        arr = self.st.array(name)
        return Linear(arr, _ST_QTYPE[info.dtype], info.shape[0], info.shape[1], name)

    def vector(self, name: str) -> np.ndarray:
        self.require(name)
        from .formats.dequant import dequantize
        info = self.st.info(name)
        arr = self.st.array(name)
        if info.dtype in _ST_QTYPE:
            return dequantize(arr.reshape(1, -1).view(np.uint8), _ST_QTYPE[info.dtype], info.shape)
        return arr.astype(np.float32)
