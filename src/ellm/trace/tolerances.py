"""How far ellm may be from its reference before an op counts as diverged.

Quantized weights are compared with the dequantized reference (transformers loads a GGUF
and dequantizes it; ellm's reference ops do the same), so the weights are equal on both
sides and what is left is arithmetic: f32 accumulation order for float weights, and for
quantized weights ellm's kernels quantizing activations to 8 bits. That noise grows along
the layers; each band below is the largest relative error any op showed on the clean real
models (both models, three prompts each, every layer), times a margin, rounded up
(benchmarks/trace_bands.py prints the measured figures).

weight_class() names the band of a model: the most common type of its layers' matrices.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

# weight class -> (default band, {op: band} where an op's noise differs from the rest)
BANDS: dict[str, tuple[float, dict[str, float]]] = {
    "F32": (1e-3, {}),
    "BF16": (1e-3, {}),
    "F16": (1e-3, {}),
    "Q8_0": (0.05, {}),
    "Q4_1": (0.15, {}),
    "Q4_K": (0.15, {}),
}
UNMEASURED = 0.25   # a type with no measured band: loose, and the report says so


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
            info = st.info(name)
            if ".layers." in name and len(info.shape) == 2:
                counts[info.dtype] += 1
    if not counts:
        raise ValueError(f"{path}: no layer matrices found to tell the weight type")
    return counts.most_common(1)[0][0]
