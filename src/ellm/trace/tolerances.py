"""How far ellm may be from its reference before an op counts as diverged.

Quantized weights are compared with the dequantized reference (transformers loads a GGUF
and dequantizes it; ellm's reference ops do the same), so the weights are equal on both
sides and what is left is arithmetic: f32 accumulation order for float weights, and for
quantized weights ellm's kernels quantizing activations to 8 bits. That noise grows along
the layers; each band comes from the largest relative error any op showed on the clean
real models, with a margin (benchmarks/trace_bands.py measures them).

weight_class() names the band of a model: the most common type of its layers' matrices.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

# weight class -> (default band, {op: band} where an op's noise is above the rest).
# Measured (benchmarks/trace_bands.py, 2026-12-01; SmolLM2-135M and Gemma 3 270M, 3 prompts
# of 6-20 tokens each, every layer), largest relative error of any op:
#   F32 folders 4.4e-6, BF16 folders 4.4e-6 (ellm keeps activations in f32 for both);
#   SmolLM2 Q4_1: 5.9e-2 (logits), attn 9.1e-2, o_proj 8.4e-2;
#   Gemma 3 Q4_K_M (its layers are mostly Q5_0): 8.3e-2 (attn), post_attn_norm 1.25e-1.
# Float bands are ~10x the worst seen (summation order only; a 1% change in one tensor is
# 1e-2); quantized bands are 2x the worst seen, so on quantized weights only errors above
# the quantization noise are named: trace the f32 folder to find small ones.
BANDS: dict[str, tuple[float, dict[str, float]]] = {
    "F32": (5e-5, {}),
    "BF16": (5e-5, {}),
    "Q4_1": (0.12, {"attn": 0.2, "o_proj": 0.2}),
    "Q5_0": (0.17, {"post_attn_norm": 0.25}),
}
UNMEASURED = 0.25   # a type with no measured band (F16, Q8_0, Q4_K, ...): loose, and the report says so


def band(weight_class: str, op: str) -> float:
    default, per_op = BANDS.get(weight_class, (UNMEASURED, {}))
    return per_op.get(op, default)


def is_measured(weight_class: str) -> bool:
    return weight_class in BANDS


def weight_class(path: Path) -> str:
    """The most common type among a model's layer matrices ("F32", "BF16", "Q4_1", ...)."""
    path = Path(path)
    counts: Counter[str] = Counter()
    if path.is_file():
        from ..formats.gguf import GGUFFile
        g = GGUFFile(path)
        for name, info in g.tensors.items():
            if name.startswith("blk.") and len(info.shape) == 2:
                counts[info.qtype.name] += 1
    else:
        from ..formats.safetensors import SafetensorsFolder
        st = SafetensorsFolder(path)
        for name in st.names():
            st_info = st.info(name)
            if ".layers." in name and len(st_info.shape) == 2:
                counts[st_info.dtype] += 1
    if not counts:
        raise ValueError(f"{path}: no layer matrices found to tell the weight type")
    return counts.most_common(1)[0][0]
