"""Op backends. A model calls only these ops; `get_ops(device)` picks the backend.

Every backend implements the methods of `ops.reference.ReferenceOps` with the same
shapes and semantics (reference.py is the specification).
"""
from __future__ import annotations

from typing import Any


ACTIVATIONS = ("int8", "f32")


def get_ops(device: str = "cpu", activations: str = "int8") -> Any:
    """activations: "int8" rounds a quantized matmul's input to 8-bit blocks (integer
    dot products, fastest); "f32" multiplies the dequantized weights by it as it is."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; expected one of {list(ACTIVATIONS)}")
    if device == "cpu":
        from .cpu import CpuOps
        return CpuOps(activations=activations)
    if device == "reference":  # f32 throughout, whatever `activations` says
        from .reference import ReferenceOps
        return ReferenceOps()
    if device in ("cuda", "gpu"):
        raise ValueError("device='cuda' is not available in this build yet; use device='cpu'")
    raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
