"""Op backends. A model calls only these ops; `get_ops(device)` picks the backend.

Every backend implements the methods of `ops.reference.ReferenceOps` with the same
shapes and semantics (reference.py is the specification of the compute ops,
ops/memory.py HostMemory of the memory ones). A backend is one module here: reference,
cpu, and cuda (imported only when asked for, so CuPy is never needed otherwise).
"""
from __future__ import annotations

import importlib
from typing import Any


ACTIVATIONS = ("int8", "f32")
DEVICES = ("cpu", "reference", "cuda")


def normalize_device(device: str) -> str:
    """"gpu", "cuda:0" and "gpu:0" -> "cuda"; another ordinal is refused, saying how to
    pick a GPU (ellm uses the first visible one); anything else is returned as it is."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {type(device).__name__}")
    name, _, ordinal = device.partition(":")
    if name not in ("cuda", "gpu") or (ordinal and not ordinal.isdigit()):
        return device
    if ordinal and int(ordinal) != 0:
        raise ValueError(f"device {device!r}: ellm runs a model on one GPU, the first that CUDA_VISIBLE_DEVICES "
                         f"shows; to run on GPU {int(ordinal)}, start the process with "
                         f"CUDA_VISIBLE_DEVICES={int(ordinal)} and pass device='cuda'")
    return "cuda"


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
    device = normalize_device(device)
    if device == "cuda":
        # ops/cuda.py says itself what is missing (CuPy, a GPU) and what to install
        try:
            cuda = importlib.import_module(f"{__name__}.cuda")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.cuda":
                raise
            raise ValueError("device='cuda' is not available in this build (no ellm.ops.cuda); "
                             "use device='cpu'") from None
        return cuda.CudaOps(activations=activations)
    raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
