"""What the model runner costs per decode step: ModelRunner.forward against model.forward.

One process, one model, one KV cache: a batch-1 decode step (one token at position 16)
run alternately through `engine.runner.forward(batch)` (step executor, batch upload,
to_host: the engine's path) and straight through `model.forward(batch, kv)` (the path
the engine took before the runner), so machine load hits both alike. Prints the median
milliseconds of each and their ratio.

    python benchmarks/bench_runner.py [--model smollm2-135m-instruct] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ellm
from ellm.models.batch import Batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    llm = ellm.load(args.model, max_num_seqs=1, progress=False)
    engine, model = llm.engine, llm.model

    def run(engine) -> dict[str, list[float]]:
        assert engine.blocks.allocate("bench", 32)
        try:
            tables = {w: np.asarray([engine.blocks.table("bench", w)], np.int32) for w in engine.kv.windows}
            batch = Batch.single(np.array([504], np.int32), 16, tables)
            paths = {"runner": lambda: engine.runner.forward(batch),
                     "model.forward": lambda: model.forward(batch, engine.kv)}
            for fn in paths.values():   # warm: buffers sized, weights paged in
                fn()
            times: dict[str, list[float]] = {k: [] for k in paths}
            for s in range(args.steps):
                order = list(paths) if s % 2 else list(paths)[::-1]
                for name in order:
                    t0 = time.perf_counter()
                    paths[name]()
                    times[name].append(time.perf_counter() - t0)
            return times
        finally:
            engine.blocks.free("bench")

    times = run(engine)   # no loop thread was started: this thread owns the engine
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:14s} {v:.3f} ms/step (median of {args.steps})")
    print(f"runner / model.forward: {med['runner'] / med['model.forward']:.3f}")


if __name__ == "__main__":
    main()
