"""Op backends. A model calls only these ops; `get_ops(device)` picks the backend.

Every backend implements the methods of `ops.reference.ReferenceOps` with the same
shapes and semantics (reference.py is the specification).
"""
from __future__ import annotations

from typing import Any


def get_ops(device: str = "cpu") -> Any:
    if device == "cpu":
        from .cpu import CpuOps
        return CpuOps()
    if device == "reference":
        from .reference import ReferenceOps
        return ReferenceOps()
    if device in ("cuda", "gpu"):
        raise ValueError("device='cuda' is not available in this build yet; use device='cpu'")
    raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
