"""Model weights as views into the mapped files, under Hugging Face tensor names.

A GGUF or safetensors source is wrapped in a WeightSource that answers `linear(name)`
(a matrix for the matmul kernels, quantized blocks left as they are) and `vector(name)`
(a small f32 array: norms, biases). GGUF names are translated by the family's table
(models/<family>.py GGUF_TENSORS over the common ones in models/blocks.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

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
    bias: np.ndarray | None = None   # (out_features,) f32, added after the product

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

        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise FormatError(self.name, f"bias of shape {self.bias.shape} for {self.out_features} rows")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, lo: int, hi: int) -> "Linear":
        """Rows lo..hi-1 (a fused qkv or gate_up split), sharing memory: GGML rows are
        independent blocks, so a row range of a quantized matrix is still a valid matrix."""
        if not 0 <= lo < hi <= self.out_features:
            raise ValueError(f"{self.name}: rows {lo}:{hi} out of range for {self.out_features} rows")
        bias = self.bias[lo:hi] if self.bias is not None else None
        return Linear(self.data[lo:hi], self.qtype, hi - lo, self.in_features, f"{self.name}[{lo}:{hi}]", bias)


def gguf_to_hf_name(name: str, table: Sequence[tuple[str, str]]) -> str | None:
    """A GGUF tensor name under Hugging Face naming by a family's table of (regex, target)
    pairs ({i} in a target is the layer index), or None for a tensor the table lacks."""
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

    def fingerprints(self) -> list[Any]:
        """The mapped files' formats.files.FileFingerprints (a rewrite in place is noticed)."""
        return []

    def names(self) -> list[str]:
        return list(self._names)

    def linear(self, name: str) -> Linear:
        raise NotImplementedError

    def vector(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def require(self, name: str) -> None:
        if name not in self._names:
            raise FormatError(self.path, f"missing tensor {name}")

    def renamed(self, rename: Callable[[str], str]) -> "WeightSource":
        """This source seen under other names (a family's `sanitize`), nothing copied."""
        return RenamedWeights(self, rename)


class RenamedWeights(WeightSource):
    def __init__(self, inner: WeightSource, rename: Callable[[str], str]) -> None:
        self._inner_name = {rename(n): n for n in inner.names()}
        super().__init__(inner.path, dict(self._inner_name))
        self.inner = inner
        self.norm_weights_include_one = inner.norm_weights_include_one

    def linear(self, name: str) -> Linear:
        self.require(name)
        return self.inner.linear(self._inner_name[name])

    def vector(self, name: str) -> np.ndarray:
        self.require(name)
        return self.inner.vector(self._inner_name[name])


class GGUFWeights(WeightSource):
    norm_weights_include_one = True

    def __init__(self, gguf: GGUFFile, table: Sequence[tuple[str, str]]) -> None:
        """table: the family's GGUF -> Hugging Face names (ellm.models.gguf_weights gives
        the one of the file's `general.architecture`)."""
        names = {}
        for tname in gguf.tensors:
            hf = gguf_to_hf_name(tname, table)
            if hf is not None:
                names[hf] = tname
        super().__init__(gguf.path, names)
        self.gguf = gguf

    def fingerprints(self) -> list[Any]:
        return [self.gguf.fingerprint]

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

    def fingerprints(self) -> list[Any]:
        return [f.fingerprint for f in self.st.files.values()]

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
