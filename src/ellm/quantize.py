"""Quantize float weights at load time (`ellm.load(..., quantize="q8_0")`).

Wraps a WeightSource: matrices in F32/F16/BF16 are converted to GGML blocks once, then
run through the same quantized kernels as GGUF files. Norms and other vectors are kept.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .formats.dequant import dequantize
from .formats.ggml_types import GGMLType
from .weights import Linear, WeightSource

QUANTIZE_TYPES = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
_FLOAT = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


class QuantizedWeights(WeightSource):
    def __init__(self, inner: WeightSource, kind: str) -> None:
        if kind not in QUANTIZE_TYPES:
            raise ValueError(f"quantize={kind!r} is not supported; choose one of {sorted(QUANTIZE_TYPES)}")
        super().__init__(inner.path, {n: n for n in inner.names()})
        self.inner, self.qtype = inner, QUANTIZE_TYPES[kind]
        self.norm_weights_include_one = inner.norm_weights_include_one
        self._done: dict[str, Linear] = {}

    def fingerprints(self) -> list[Any]:
        return self.inner.fingerprints()

    def linear(self, name: str) -> Linear:
        if name in self._done:  # tied embeddings ask twice
            return self._done[name]
        w = self.inner.linear(name)
        if w.qtype not in _FLOAT or w.in_features % 32:
            return w
        from ._native import _quant
        rows = 4096  # convert a slab at a time: never a full f32 copy of a large matrix
        out = []
        for s in range(0, w.out_features, rows):
            part = w.data[s:s + rows]
            f32 = dequantize(np.ascontiguousarray(part).view(np.uint8), w.qtype, (len(part), w.in_features))
            out.append(_quant.quantize(f32, int(self.qtype)))
        q = Linear(np.concatenate(out), self.qtype, w.out_features, w.in_features, name)
        self._done[name] = q
        return q

    def vector(self, name: str) -> np.ndarray:
        return self.inner.vector(name)
