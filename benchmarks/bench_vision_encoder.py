"""The SigLIP tower of SmolVLM-256M / 500M (768 wide, 12 layers, 12 heads, 512 px tiles of
16 px patches: 1024 patches a tile) on ellm's C kernels, beside transformers.

    ELLM_REF_PYTHON=.venv-ref/bin/python python benchmarks/bench_vision_encoder.py [--tiles 2] [--rounds 3]

The weights are random (timing does not depend on them); both engines run f32 on the
threads this process may use (torch is given the same count). The rounds alternate the
two engines; medians are printed with the ratio. transformers runs in ELLM_REF_PYTHON (a
Python with torch and transformers); without it only ellm is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

CONFIG = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=512, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")

PEER = """
import json, sys, time, torch, transformers as tf
cfg, tiles, threads = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
tower = tf.SmolVLMVisionTransformer(tf.SmolVLMVisionConfig(**cfg)).eval()
x = torch.rand(tiles, 3, cfg["image_size"], cfg["image_size"])
with torch.no_grad():
    tower(pixel_values=x)
    t = time.perf_counter(); tower(pixel_values=x); print(time.perf_counter() - t)
"""


class RandomWeights:
    """A WeightSource of random f32 tensors under the SigLIP names (built lazily)."""

    def __init__(self) -> None:
        from ellm.weights import WeightSource
        D, F, P = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["patch_size"]
        rng = np.random.default_rng(0)
        arrays = {"embeddings.patch_embedding.weight": (D, 3, P, P), "embeddings.patch_embedding.bias": (D,),
                  "embeddings.position_embedding.weight": ((CONFIG["image_size"] // P) ** 2, D),
                  "post_layernorm.weight": (D,), "post_layernorm.bias": (D,)}
        for i in range(CONFIG["num_hidden_layers"]):
            p = f"encoder.layers.{i}."
            for n in ("layer_norm1", "layer_norm2"):
                arrays[p + n + ".weight"], arrays[p + n + ".bias"] = (D,), (D,)
            for n, shape in (("self_attn.q_proj", (D, D)), ("self_attn.k_proj", (D, D)),
                             ("self_attn.v_proj", (D, D)), ("self_attn.out_proj", (D, D)),
                             ("mlp.fc1", (F, D)), ("mlp.fc2", (D, F))):
                arrays[p + n + ".weight"], arrays[p + n + ".bias"] = shape, shape[:1]
        self.arrays = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in arrays.items()}
        self.source = type("Arrays", (WeightSource,), {
            "linear": lambda s, name: self._linear(name), "vector": lambda s, name: self.arrays[name]})(
            "random", {k: k for k in self.arrays})

    def _linear(self, name: str):
        from ellm.formats.ggml_types import GGMLType
        from ellm.weights import Linear
        a = self.arrays[name]
        return Linear(a, GGMLType.F32, a.shape[0], a.shape[1], name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from ellm._native import _kernels
    from ellm.models.siglip import SiglipEncoder, VisionConfig
    from ellm.ops import get_ops
    threads = _kernels.num_threads()
    tower = SiglipEncoder(VisionConfig(**CONFIG), RandomWeights().source, get_ops("cpu"), "")
    x = np.random.default_rng(1).random((args.tiles, 3, 512, 512), dtype=np.float32)
    tower(x)   # warm
    ref = os.environ.get("ELLM_REF_PYTHON")
    ours, theirs = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        tower(x)
        ours.append(time.perf_counter() - t)
        if ref:
            out = subprocess.run([ref, "-c", PEER, json.dumps(CONFIG), str(args.tiles), str(threads)],
                                 check=True, capture_output=True, text=True).stdout
            theirs.append(float(out.strip().splitlines()[-1]))
    a = statistics.median(ours)
    print(f"SigLIP 768x12, {args.tiles} tiles of 1024 patches, {threads} threads, median of {args.rounds}")
    print(f"  ellm (C kernels, f32)     {a * 1e3:8.1f} ms   {args.tiles / a:6.2f} tiles/s")
    if theirs:
        b = statistics.median(theirs)
        print(f"  transformers 5.24 (f32)   {b * 1e3:8.1f} ms   {args.tiles / b:6.2f} tiles/s   ellm / transformers "
              f"speed {b / a:.2f}x")
    else:
        print("  (set ELLM_REF_PYTHON to time transformers beside it)", file=sys.stderr)


if __name__ == "__main__":
    main()
