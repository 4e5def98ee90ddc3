"""One layer of a long prefill, part by part: where a prompt's time goes on the lent GPU.

    python benchmarks/gpu/prefill_parts.py [--tokens 2048] [--out DIR]

A layer of Llama-3-8B's shape (hidden 4096, 32 heads of 128 over 8 KV heads, MLP 14336)
taking `--tokens` tokens of one prompt, each part alone through `CudaOps` as a prefill
step runs it, timed with CUDA events: the four products (bf16 weights, cuBLAS:
q/k/v, o, gate + up, down) and the causal attention over the prompt's own keys with a
float32 and a bfloat16 KV cache (`attn_prefill`: blocks of 4 warps sharing each step's keys
and values), then the same with blocks of one warp each reading its own (as until
2026-12-06: what the sharing gains). Then a Gemma-shaped attention (8 heads of 256 over 4
KV heads) on the kernel for head_dim above 128 (`attn_prefill_wide`) and on the
split-over-keys kernels it replaced (`attn_partial` + `attn_combine`). Per part: µs, the
multiply-adds' TFLOP/s (2 x each; attention's causal half only), the fraction of the
measured bf16 peak (device.json from device_figures.py, or the H200's assumed figure) and,
for the 8B layer, the share of the layer. The bench's `prefill_2048_peak` (issue 30's
40% target) is this layer's sum 32 times over plus what lies between the parts
(norms, RoPE and the cache write, the bf16 rounding of activations). Writes
DIR/prefill_parts.md and .json.

On the CPU, with tests/cuda_host on PYTHONPATH and small sizes (`--tokens 80 --small`), it
runs the same code through the host stand-in (its times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# name: (hidden, heads, kv heads, head_dim, MLP width); --small's stand-in shapes keep head_dim
SHAPES = {"llama-8b": (4096, 32, 8, 128, 14336), "gemma": (2560, 8, 4, 256, 10240)}
SMALL = {"llama-8b": (256, 4, 2, 128, 512), "gemma": (256, 2, 1, 256, 512)}


def timed(ops: Any, fn: Callable[[], Any], reps: int) -> float:
    """Seconds one call of fn takes on the stream (the mean of reps between two events)."""
    cp = ops.cp
    for _ in range(2):   # compiled, warm
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(ops.stream)
    for _ in range(reps):
        fn()
    end.record(ops.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def bf16_linear(n: int, k: int, seed: int) -> Any:
    from ellm.formats.ggml_types import GGMLType
    from ellm.weights import Linear
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.02
    return Linear((w.view(np.uint32) >> 16).astype(np.uint16), GGMLType.BF16, n, k, f"random-{n}x{k}")


def product_call(ops: Any, x: Any, w: Any, out: Any) -> Callable[[], Any]:
    return lambda: ops.linear(x, w, out=out)


def attention_call(ops: Any, tokens: int, heads: int, kv_heads: int, head_dim: int, kv_dtype: str,
                   seed: int) -> Callable[[], Any]:
    """paged_attention of one prompt of `tokens` tokens over its own keys (causal), the
    cache already holding them."""
    from ellm.ops import reference as R
    rng, bs = np.random.default_rng(seed), 16
    blocks = -(-tokens // bs)
    shape = (blocks, bs, kv_heads, head_dim)
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    if kv_dtype == "bfloat16":
        kd, vd = ops.kv_zeros(shape, R.KV_BF16), ops.kv_zeros(shape, R.KV_BF16)
        kd.set(R.to_bf16_bits(k))
        vd.set(R.to_bf16_bits(v))
    else:
        kd, vd = ops.upload(k), ops.upload(v)
    up = ops.upload
    q = up(rng.standard_normal((tokens, heads, head_dim), dtype=np.float32))
    pos, sid = up(np.arange(tokens, dtype=np.int32)), up(np.zeros(tokens, np.int32))
    tables = up(np.arange(blocks, dtype=np.int32)[None, :])
    out = ops.empty((tokens, heads, head_dim))
    return lambda: ops.paged_attention(q, pos, sid, tables, kd, vd, head_dim ** -0.5, out=out)


def attention_flops(tokens: int, heads: int, head_dim: int) -> float:
    return 2.0 * 2 * heads * head_dim * tokens * (tokens + 1) / 2   # q.k and p.v over the causal half


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small widths (the CPU stand-in)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from ellm.ops import cuda as cuda_ops
    from ellm.ops import get_ops
    ops = get_ops("cuda")
    device: dict[str, Any] = {"name": "assumed: NVIDIA H200 (not measured)", "bf16_peak_flops": 790e12}
    if args.out is not None and (args.out / "device.json").exists():
        device = json.loads((args.out / "device.json").read_text())
    shapes, T = SMALL if args.small else SHAPES, args.tokens
    if T <= cuda_ops.GEMM_MIN_TOKENS:
        ap.error(f"--tokens must be above {cuda_ops.GEMM_MIN_TOKENS} (a prefill step)")
    hidden, heads, kv_heads, hd, mlp = shapes["llama-8b"]
    x = ops.upload(np.random.default_rng(1).standard_normal((T, hidden), dtype=np.float32))
    a = ops.upload(np.random.default_rng(2).standard_normal((T, heads * hd), dtype=np.float32))
    h = ops.upload(np.random.default_rng(3).standard_normal((T, mlp), dtype=np.float32))
    rows: list[dict[str, Any]] = []

    def add(part: str, fn: Callable[[], Any], flops: float) -> None:
        s = timed(ops, fn, args.reps)
        rows.append({"part": part, "us": s * 1e6, "tflops": flops / s / 1e12,
                     "peak": flops / s / device["bf16_peak_flops"]})

    for part, n, k, inp in (("q/k/v", (heads + 2 * kv_heads) * hd, hidden, x), ("o", hidden, heads * hd, a),
                            ("gate + up", 2 * mlp, hidden, x), ("down", hidden, mlp, h)):
        w = ops.upload_linear(bf16_linear(n, k, seed=n + k))
        out = ops.empty((T, n))
        add(part, product_call(ops, inp, w, out), 2.0 * T * n * k)
    for kv in ("float32", "bfloat16"):
        add(f"attention, {kv} cache", attention_call(ops, T, heads, kv_heads, hd, kv, seed=3),
            attention_flops(T, heads, hd))
    layer = rows[:4] + rows[5:6]   # the products and the bf16 cache's attention (the bench's)
    total = sum(r["us"] for r in layer)
    for r in layer:
        r["share"] = r["us"] / total
    g_hidden, g_heads, g_kv, g_hd, _ = shapes["gemma"]
    wide_max = cuda_ops.FA_HEAD_DIM_MAX
    for kernel, limit in (("attn_prefill_wide", wide_max), ("attn_partial + attn_combine", 128)):
        cuda_ops.FA_HEAD_DIM_MAX = limit
        try:
            add(f"Gemma-shaped attention (head_dim {g_hd}), bf16 cache: {kernel}",
                attention_call(ops, T, g_heads, g_kv, g_hd, "bfloat16", seed=4), attention_flops(T, g_heads, g_hd))
        finally:
            cuda_ops.FA_HEAD_DIM_MAX = wide_max
    ops.fa_warps = 1   # ELLM_CUDA_FA_WARPS=1
    try:
        for kv in ("float32", "bfloat16"):
            add(f"attention, {kv} cache: a warp a block", attention_call(ops, T, heads, kv_heads, hd, kv, seed=3),
                attention_flops(T, heads, hd))
    finally:
        ops.fa_warps = cuda_ops.FA_WARPS
    name = "llama-8b" if not args.small else "small stand-in"
    lines = [f"one layer of a {T}-token prefill, {name} shape, {device['name']}", "",
             "| part | µs | TFLOP/s | of bf16 peak | of the layer |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['part']} | {r['us']:.1f} | {r['tflops']:.1f} | {r['peak']:.1%} | "
              f"{r['share']:.0%} |" if "share" in r else
              f"| {r['part']} | {r['us']:.1f} | {r['tflops']:.1f} | {r['peak']:.1%} | |" for r in rows]
    lines += ["", f"the layer's products and attention (bf16 cache): {total:.0f} µs; 32 such layers: "
              f"{32 * total / 1e3:.1f} ms"]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_parts.md").write_text("\n".join(lines) + "\n")
        (args.out / "prefill_parts.json").write_text(json.dumps({"device": device, "tokens": T, "rows": rows},
                                                                indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
