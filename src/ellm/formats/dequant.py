"""Dequantization of GGML blocks to float32 (the C kernels do the work)."""
from __future__ import annotations

import numpy as np

from .._native import _core
from .ggml_types import GGMLType


def dequantize(raw: np.ndarray, qtype: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """raw: (rows, row_bytes) uint8 blocks -> float32 array of `shape`."""
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    if qtype == GGMLType.F32:
        flat[:] = raw.view("<f4").reshape(-1)
    elif qtype == GGMLType.F16:
        _core.f16_to_f32(np.ascontiguousarray(raw).view(np.uint16).reshape(-1), flat)
    elif qtype == GGMLType.BF16:
        _core.bf16_to_f32(np.ascontiguousarray(raw).view(np.uint16).reshape(-1), flat)
    else:
        from .._native import _quant  # built from csrc/quant*.c
        _quant.dequantize(np.ascontiguousarray(raw).reshape(-1), int(qtype), flat)
    return out
