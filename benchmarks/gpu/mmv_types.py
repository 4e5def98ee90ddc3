"""A decode product alone, by weight type: the bytes a second it reads on the lent GPU.

    python benchmarks/gpu/mmv_types.py [--n 14336] [--k 4096] [--tokens 1,64] [--out DIR]

One random matrix of Llama-3-8B's gate shape (14336 x 4096) in each type ellm's decode
kernels take (BF16, F16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; random blocks), multiplied by
each `--tokens` count of rows through `CudaOps.linear` (mmv.cu), timed with CUDA events
over many launches: its weight bytes over the time a product takes, and that as a fraction
of the GPU's bandwidth (device.json from device_figures.py, or the H200's assumed figure).
At 1 token a type far below BF16's fraction is bound by something other than memory: the
load instructions a warp makes (docs/gpu.md, on the rows kept split); at 64, a type far
below its 1-token rate is bound by the activations' reads (docs/gpu.md, "A risk at 64
sequences": BF16, Q8_0 and Q4_0 read them a quarter as often as the others). Writes
DIR/mmv_types.md and .json.

On the CPU, with tests/cuda_host on PYTHONPATH and small sizes (`--n 64 --k 256`), it
runs the same code through the host stand-in (its times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TYPES = ("BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


# where each quantized type's f16 scale fields sit in its block (random bytes elsewhere)
SCALE_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_linear(qtype_name: str, n: int, k: int, seed: int = 0):
    """A Linear of n x k random weights in the named type: random blocks whose f16 scales
    are small finite numbers (a product's speed does not depend on the values)."""
    from ellm.formats.ggml_types import BLOCK_LAYOUT, GGMLType, row_bytes
    from ellm.weights import Linear
    qtype, rng = GGMLType[qtype_name], np.random.default_rng(seed)
    if qtype in (GGMLType.BF16, GGMLType.F16):
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        bits = (w.view(np.uint32) >> 16).astype(np.uint16) if qtype == GGMLType.BF16 else \
            w.astype(np.float16).view(np.uint16)
        return Linear(bits, qtype, n, k, f"random-{qtype_name}")
    blk, size = BLOCK_LAYOUT[qtype]
    raw = rng.integers(0, 256, (n, k // blk, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype_name]:
        d = rng.uniform(0.001, 0.05, (n, k // blk)).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, k // blk, 2)
    return Linear(raw.reshape(n, row_bytes(qtype, k)), qtype, n, k, f"random-{qtype_name}")


def measure(ops, dw, tokens: int, reps: int) -> float:
    """Seconds one product of the uploaded dw takes (the mean of reps launches between two
    events)."""
    cp = ops.cp
    x = ops.upload(np.random.default_rng(1).standard_normal((tokens, dw.in_features), dtype=np.float32))
    out = ops.empty((tokens, dw.out_features))
    for _ in range(3):   # compiled, warm
        ops.linear(x, dw, out=out)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(ops.stream)
    for _ in range(reps):
        ops.linear(x, dw, out=out)
    end.record(ops.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--tokens", default="1,64", help="token counts, comma-separated (each <= 64: mmv.cu)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    counts = [int(t) for t in str(args.tokens).split(",")]
    if not all(1 <= t <= 64 for t in counts):
        ap.error(f"--tokens: counts from 1 to 64 (the decode products), got {args.tokens}")
    from ellm.ops import get_ops
    ops = get_ops("cuda")
    device = {"name": "assumed: NVIDIA H200 (not measured)", "hbm_bytes_per_s": 4.3e12}
    if args.out is not None and (args.out / "device.json").exists():
        device = json.loads((args.out / "device.json").read_text())
    rows = []
    for name in TYPES:
        w = random_linear(name, args.n, args.k)
        dw = ops.upload_linear(w)
        for tokens in counts:
            seconds = measure(ops, dw, tokens, args.reps)
            rate = w.nbytes / seconds
            rows.append({"type": name, "tokens": tokens, "bytes": w.nbytes, "us": seconds * 1e6,
                         "bytes_per_s": rate, "hbm": rate / device["hbm_bytes_per_s"]})
        del dw
    lines = [f"{args.n} x {args.k}, {device['name']}", "",
             "| type | tokens | MB | µs a product | GB/s | of HBM |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['type']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | "
              f"{r['bytes_per_s'] / 1e9:.0f} | {r['hbm']:.0%} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mmv_types.md").write_text("\n".join(lines) + "\n")
        (args.out / "mmv_types.json").write_text(json.dumps({"device": device, "n": args.n, "k": args.k,
                                                             "tokens": counts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
