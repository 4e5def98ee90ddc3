"""The lent GPU's own limits, measured on it, for the benchmark's fractions.

The issue's targets are fractions of the GPU's memory bandwidth and of its dense bf16
tensor-core peak. Which GPU is lent varies (an H100 or an H200), so rather than one
machine's constants the check measures both at its start, with torch:

- bandwidth: device-to-device copies of 1 GiB (each reads and writes it: 2 GiB moved),
  timed with CUDA events, the best of a few rounds (how FACTS.md's 4.3 TB/s for the
  H200 was taken);
- peak: 8192^3 bf16 matrix products (cuBLAS), the best of a few rounds.

    python benchmarks/gpu/device_figures.py --out DIR    # writes DIR/device.json

bench.py and step_profile.py read that file (or measure themselves); where torch or a GPU
is missing (a dry run on the CPU) the H200's figures stand in, marked "assumed".
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# What stands in when nothing was measured: the H200's (FACTS.md)
ASSUMED = {"name": "assumed: NVIDIA H200 (not measured)", "hbm_bytes_per_s": 4.3e12,
           "bf16_peak_flops": 790e12, "measured": False}


def measure(torch: Any, device: str = "cuda", copy_bytes: int = 1 << 30, n: int = 8192, rounds: int = 3,
            reps: int = 10) -> dict[str, Any]:
    """{"name", "hbm_bytes_per_s", "bf16_peak_flops", "measured": True} of torch's current
    GPU (device "cpu", with small sizes: the same arithmetic, for the tests)."""
    dev = torch.device(device)

    def best_seconds(fn: Any) -> float:
        fn()   # warm-up (cuBLAS picks its kernel, pages are touched)
        best = float("inf")
        for _ in range(rounds):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                seconds = time.perf_counter() - t0
            best = min(best, seconds / reps)
        return best

    def copy_seconds() -> float:   # its buffers freed on return, before the products' are made
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        return best_seconds(lambda: dst.copy_(src))

    def product_seconds() -> float:
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=dev) for _ in range(2))
        c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
        return best_seconds(lambda: torch.matmul(a, b, out=c))

    copy_s, mm_s = copy_seconds(), product_seconds()
    name = "cpu"
    if device == "cuda":
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(dev)
    return {"name": name, "hbm_bytes_per_s": 2 * copy_bytes / copy_s,
            "bf16_peak_flops": 2.0 * n ** 3 / mm_s, "measured": True}


def figures(path: Path | None = None, torch: Any = None) -> dict[str, Any]:
    """The figures in `path` (device_figures.py --out), else measured with `torch` when it
    has a GPU, else ASSUMED."""
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    if torch is not None and torch.cuda.is_available():
        try:
            return measure(torch)
        except Exception as e:   # the benchmark goes on with the assumed figures, saying why
            return dict(ASSUMED, error=f"{type(e).__name__}: {e}"[:300])
    return dict(ASSUMED)


def describe(fig: dict[str, Any]) -> str:
    how = "measured here" if fig.get("measured") else "assumed, not measured" + (
        f" ({fig['error']})" if "error" in fig else "")
    return (f"Device: {fig['name']}; copies {fig['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 products "
            f"{fig['bf16_peak_flops'] / 1e12:.0f} TFLOP/s ({how}): the HBM and peak fractions are of these.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    fig = figures(None, torch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device.json").write_text(json.dumps(fig, indent=1))
    print(describe(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
