"""The CUDA kernels as files: which .cu files there are and the kernels each defines, how
their source is found (the installed package's ellm/cuda/ or the checkout's csrc/cuda/)
and cut into units NVRTC compiles side by side, CuPy's import with a clear error where a
GPU or CuPy is missing, and the row layout the quantized kernels read (rows_split).

ops/cuda.py's CudaOps compiles and launches them; tests/test_cuda_compile.py checks every
file with nvcc and every name here against its PTX, without a GPU.
"""
from __future__ import annotations

import importlib.resources
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..formats.ggml_types import BLOCK_LAYOUT, GGMLType

# The kernel files, in the order they are compiled, and the kernels each must define
# (tests/test_cuda_compile.py checks every name against nvcc's PTX).
WEIGHT_TYPES: dict[GGMLType, str] = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q8_0: "q8_0",
    GGMLType.Q4_K: "q4_k", GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
}
# mmv.cu's types with four-tile kernels (MMV_X4_ABOVE below): the others' would spill registers
MMV_X4_TYPES = frozenset((GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0))
KERNELS: dict[str, tuple[str, ...]] = {
    "linear.cu": tuple(f"{op}_{t}" for op in ("gemv", "gemv3", "gemm", "embed", "nmv3", "glu", "gemv_add",
                                              "qkv_rope", "dequant_bf16") for t in WEIGHT_TYPES.values()),
    "elementwise.cu": ("rmsnorm_f32", "add_rmsnorm_f32", "norm_add_f32", "swiglu_f32", "geglu_f32",
                       "softcap_f32", "scale_f32", "add_f32", "gather_rows_f32", "scatter_rows_f32",
                       "scatter_add_rows_f32", "to_bf16_f32", "add_bias_rows_f32", "moe_route_f32",
                       "moe_combine_f32"),
    "attention.cu": ("rope_kv_write", "attn_partial", "attn_combine", "attn_decode",
                     "rope_kv_write_bf16", "attn_partial_bf16", "attn_decode_bf16",
                     "qk_norm_rope_kv_write", "qk_norm_rope_kv_write_bf16",
                     "attn_prefill", "attn_prefill_bf16", "attn_prefill_wide", "attn_prefill_wide_bf16",
                     "attn_prefill_w1", "attn_prefill_w1_bf16"),
    "sample.cu": ("sample_rows", "argmax_rows", "logprob_rows"),
    "lora.cu": ("lora_shrink_f32", "lora_expand_f32"),
    "mmv.cu": tuple(f"{op}{rt}_{t}" for op in ("mmv3", "mmv_glu", "mmv_qkv_rope") for rt in ("", "x2", "x4")
                    for q, t in WEIGHT_TYPES.items()
                    if q != GGMLType.F32 and (rt != "x4" or q in MMV_X4_TYPES)),
    # mmv.cu's products with the expert chosen on the device (includes mmv.cu)
    "moe.cu": tuple(f"{op}_{t}" for op in ("moe_glu", "moe_down") for q, t in WEIGHT_TYPES.items()
                    if q != GGMLType.F32),
}
HEADER = "common.cuh"
# Given to NVRTC through CuPy, which adds the architecture and -ftz=true (denormals flush
# to zero); tests/test_cuda_compile.py compiles with the same.
NVRTC_OPTIONS: tuple[str, ...] = ()

INSTALL_HINT = ("pip install 'ellm-engine[gpu]' (CuPy for CUDA 12) or 'ellm-engine[gpu-cuda13]' (CuPy for CUDA 13), "
                "matching the CUDA version `nvidia-smi` reports")


class CudaUnavailableError(ValueError, RuntimeError):
    """device="cuda" was asked for, but CuPy or a GPU is missing (the message says which).
    A ValueError, so the CLI and the server report it like any bad option."""


def import_cupy() -> Any:
    """CuPy, with a GPU behind it, or CudaUnavailableError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailableError(
            f"device='cuda' needs CuPy, which is not installed ({e}); {INSTALL_HINT}; "
            "or use device='cpu'") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # CUDARuntimeError: no driver, no device, driver too old
        raise CudaUnavailableError(
            f"CuPy is installed but finds no usable CUDA GPU ({type(e).__name__}: {e}); check "
            "`nvidia-smi` and that the CuPy package matches the driver's CUDA version; "
            "or use device='cpu'") from None
    if n < 1:
        raise CudaUnavailableError("CuPy is installed but no CUDA GPU is visible "
                                   "(CUDA_VISIBLE_DEVICES?); or use device='cpu'")
    return cupy


def kernel_dir() -> Path:
    """The folder holding the .cu files: the installed package's ellm/cuda/, else (an
    editable install or a source checkout) the repository's csrc/cuda/."""
    installed = importlib.resources.files("ellm") / "cuda"
    if installed.is_dir() and (installed / HEADER).is_file():
        return Path(str(installed))
    source = Path(__file__).resolve().parents[3] / "csrc" / "cuda"
    if (source / HEADER).is_file():
        return source
    raise FileNotFoundError(f"the CUDA kernel sources are missing: neither {installed} nor {source} "
                            f"holds {HEADER} (a broken install?)")


def kernel_source(name: str) -> str:
    """The text of csrc/cuda/<name> with each file it #includes (common.cuh; moe.cu's
    mmv.cu) pasted in place, so that NVRTC needs no include path and the source CuPy
    hashes for its cache covers them too."""
    folder = kernel_dir()
    text = (folder / name).read_text()
    return re.sub(r'#include\s+"([\w.]+)"', lambda m: kernel_source(m.group(1)), text)


# the kernel files a load compiles (lora.cu waits for the first adapter, moe.cu for the
# first mixture-of-experts step: one weight type's unit)
LOAD_KERNEL_FILES = tuple(name for name in KERNELS if name not in ("lora.cu", "moe.cu"))
# Files compiled one weight type at a time (common.cuh ELLM_ONLY_TYPE): a unit of
# compilation is (file, the type of its kernels' name suffix), or (file, None) for the
# others. mmv.cu's types take NVRTC ~5 s each where the whole file takes ~40 s, and the
# units of a load compile side by side (compile_kernels).
TYPED_FILES = ("linear.cu", "mmv.cu", "moe.cu")
KernelUnit = tuple[str, "GGMLType | None"]


def _unit_of(file: str, name: str) -> KernelUnit:
    if file not in TYPED_FILES:
        return file, None
    qtype = next((q for q, t in WEIGHT_TYPES.items() if name.endswith("_" + t)), None)
    if qtype is None:
        raise ValueError(f"{file}'s kernel {name!r} names no weight type")
    return file, qtype


KERNEL_UNITS: dict[str, KernelUnit] = {name: _unit_of(file, name) for file, names in KERNELS.items()
                                       for name in names}


def unit_source(unit: KernelUnit) -> str:
    """The text CuPy compiles for a unit: its file (kernel_source), behind the define
    that keeps one weight type's kernels where the unit has one."""
    file, qtype = unit
    text = kernel_source(file)
    return text if qtype is None else f"#define ELLM_ONLY_TYPE {int(qtype)}\n{text}"


def kernel_units(files: Sequence[str] = tuple(KERNELS)) -> list[KernelUnit]:
    """The units of these files, in KERNELS' order."""
    return list(dict.fromkeys(u for u in KERNEL_UNITS.values() if u[0] in files))


# The types whose rows the GPU keeps split (rows_split): a block of 32 weights as numpy
# sees it (its scale fields, then its values; GGML's blocks have no padding). The
# K-quants' blocks of 256 are rearranged by csrc/quant.c ellm_split_rows.
SPLIT_BLOCKS: dict[GGMLType, np.dtype] = {
    GGMLType.Q8_0: np.dtype([("scales", "V2"), ("values", "V32")]),   # f16 d, 32 int8
    GGMLType.Q4_0: np.dtype([("scales", "V2"), ("values", "V16")]),   # f16 d, 32 nibbles
    GGMLType.Q4_1: np.dtype([("scales", "V4"), ("values", "V16")]),   # f16 d, f16 m, 32 nibbles
}
SPLIT_BY_C = frozenset((GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K))
SPLIT_TYPES = frozenset(SPLIT_BLOCKS) | SPLIT_BY_C
# the largest matrix upload_linear rearranges in one reused host buffer (a layer's of an 8B
# model in Q8_0: 62 MB); larger ones (a vocabulary) take memory of their own
SPLIT_BUFFER_MAX = 64 << 20


def rows_split(data: np.ndarray, qtype: GGMLType, buffer: np.ndarray | None = None) -> np.ndarray:
    """Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K rows (N, GGML blocks) as the kernels read them
    (common.cuh deq8_*, mmv.cu WQ*): each row's values of every block, then the blocks'
    scales, the row padded to a multiple of 16 bytes (the device array is a view of the
    first GGML row's bytes, its row stride the padded one). GGML's blocks leave a lane's
    values of a step in two to eight loads; apart, they are one or two. buffer: uint8
    host memory to build it in (reused across a model's matrices: no new pages to fault
    in for each)."""
    n, row = data.shape
    width = ceil_div(row, 16) * 16
    out = (np.empty(n * width, np.uint8) if buffer is None else buffer[:n * width]).reshape(n, width)
    data = np.ascontiguousarray(data)
    if qtype in SPLIT_BY_C:   # blocks of 256: rearranged in C (csrc/quant.c; it zeroes the padding)
        from .._native import _quant
        block_bytes = BLOCK_LAYOUT[qtype][1]
        if row % block_bytes:
            raise ValueError(f"{qtype.name} rows of {row} bytes are not whole {block_bytes}-byte blocks")
        _quant.split_rows(data, int(qtype), row // block_bytes * 256, out)
        return out
    block = SPLIT_BLOCKS[qtype]
    nb = row // block.itemsize
    blocks = data.view(block).reshape(n, nb)
    v, sc = block["values"].itemsize, block["scales"].itemsize
    out[:, :nb * v].view(f"V{v}")[...] = blocks["values"]
    out[:, nb * v:row].view(f"V{sc}")[...] = blocks["scales"]
    out[:, row:] = 0
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
