"""What LoRA adapters cost a decode step, beside the base alone (ellm/lora.py, csrc/lora.c).

Random rank-16 adapters on all seven projections of SmolLM2-135M are written as PEFT
folders (adapter_config.json + adapter_model.safetensors, written here with NumPy), and
one LLM serves the base and four of them. Alternating base and adapter runs, with medians
of the rounds, it times:

  1. one sequence's decode step with one adapter against the base's;
  2. 16 sequences' decode step over 4 adapters (4 each) against 16 of the base.

A step is the model runner's forward of one token per sequence (64 tokens of context in
the KV cache), on the same model and cache either way: only the rows' adapter slots
differ. Each round times `--steps` steps of each side and keeps their median; the ratio's
median over the rounds is the figure, with the ratio of the fastest steps beside it
(the least disturbed by other load).

    python benchmarks/bench_lora.py --threads 2 --rounds 9
    python benchmarks/bench_lora.py --threads 2 --rounds 9 --alternate   # a busy machine

The machine these figures come from may be shared: the load average is printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import ellm

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """The safetensors format: an 8-byte header length, the JSON header, the data, each
    tensor in `dtype` ("F32", or "BF16": the top half of each float32, rounded)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        a32 = np.ascontiguousarray(arr, np.float32)
        if dtype == "BF16":   # round to nearest even, then keep the top 16 bits
            bits = a32.view(np.uint32)
            data = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype("<u2").tobytes()
        else:
            data = a32.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def write_adapter(folder: Path, llm: ellm.LLM, rank: int, seed: int, dtype: str) -> None:
    """A random PEFT adapter of `rank` on all seven projections of every layer."""
    from ellm.lora import base_projections
    rng = np.random.default_rng(seed)
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    tensors = {}
    for i, mats in enumerate(base_projections(llm.model)):
        for p, m in mats.items():
            key = f"base_model.model.model.layers.{i}.{names[p]}"
            tensors[key + ".lora_A.weight"] = rng.normal(0, 0.02, (rank, m.in_features))
            tensors[key + ".lora_B.weight"] = rng.normal(0, 0.02, (m.out_features, rank))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ALL}))
    write_safetensors(folder / "adapter_model.safetensors", tensors, dtype)


class DecodeStep:
    """B sequences of `context` tokens prefilled into a runner's KV cache, and a decode
    step of all of them (their next position) that can be run again and again."""

    def __init__(self, llm: ellm.LLM, B: int, context: int = 64) -> None:
        from ellm.engine.engine import EngineConfig
        from ellm.engine.kv_cache import BlockManager
        from ellm.engine.runner import ModelRunner
        from ellm.models.batch import Batch
        self.runner = ModelRunner(llm.model, EngineConfig(kv_cache_tokens=B * (context + 16), max_num_seqs=B))
        blocks = BlockManager(self.runner.kv, enable_prefix_caching=False)
        rng = np.random.default_rng(B)
        for b in range(B):
            assert blocks.allocate(b, context + 1)
        tables = {w: np.asarray([blocks.table(b, w) for b in range(B)], np.int32) for w in self.runner.kv.windows}
        ids = rng.integers(100, 20000, (B, context)).astype(np.int32)
        self.runner.forward(Batch(ids.ravel(), np.tile(np.arange(context, dtype=np.int32), B),
                                  np.repeat(np.arange(B, dtype=np.int32), context), tables,
                                  np.arange(B, dtype=np.int32) * context + context - 1))
        self.batch = Batch(ids[:, -1].copy(), np.full(B, context, np.int32), np.arange(B, dtype=np.int32), tables,
                           np.arange(B, dtype=np.int32))

    def seconds(self, slots: np.ndarray | None, clock=time.perf_counter) -> float:
        """One decode step's time on `clock`, each row with its adapter slot (None: the base)."""
        self.batch.adapter_slots = slots
        t0 = clock()
        self.runner.execute(self.batch)
        return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per round and side")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=["BF16", "F32"], default="BF16",
                    help="the adapters' tensor type (PEFT saves a bf16 model's adapters in BF16)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the process's CPU seconds, not the wall clock (with --threads 1: the work "
                         "itself, whatever else the machine runs)")
    ap.add_argument("--alternate", action="store_true",
                    help="alternate base and adapter step by step within each round (not --steps of one side, "
                         "then of the other): load that drifts on a shared machine falls on both sides alike")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        base = ellm.load(args.model, threads=args.threads, progress=False)
        folders = {f"a{i}": Path(tmp) / f"a{i}" for i in range(4)}
        for i, folder in enumerate(folders.values()):
            write_adapter(folder, base, args.rank, seed=i, dtype=args.dtype)
        base.close()
        llm = ellm.load(args.model, threads=args.threads, progress=False, lora_adapters=folders)
        print(f"{args.model}, {args.dtype} rank-{args.rank} adapters on all seven projections, {args.threads} "
              f"threads, {'CPU' if args.cpu_time else 'wall'} time")
        cases = {"1 sequence, 1 adapter": (1, np.zeros(1, np.int32)),
                 "16 sequences over 4 adapters": (16, np.arange(16, dtype=np.int32) % 4)}
        for label, (B, slots) in cases.items():
            step = DecodeStep(llm, B)
            for _ in range(3):   # warm-up: workspaces, layer stacks
                step.seconds(None, clock), step.seconds(slots, clock)
            ratios, tb, ta = [], [], []
            for _ in range(args.rounds):   # alternating sides; per side the median of its steps
                if args.alternate:
                    pairs = [(step.seconds(None, clock), step.seconds(slots, clock)) for _ in range(args.steps)]
                    b, a = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
                else:
                    b = statistics.median(step.seconds(None, clock) for _ in range(args.steps))
                    a = statistics.median(step.seconds(slots, clock) for _ in range(args.steps))
                tb.append(b)
                ta.append(a)
                ratios.append(a / b)
            print(f"{label}: base {statistics.median(tb) * 1e3:.2f} ms/step (min {min(tb) * 1e3:.2f}), "
                  f"with adapters {statistics.median(ta) * 1e3:.2f} ms/step (min {min(ta) * 1e3:.2f}); "
                  f"ratio median {statistics.median(ratios):.3f}, of the minima {min(ta) / min(tb):.3f} "
                  f"(rounds {' '.join(f'{r:.2f}' for r in ratios)}); load average {os.getloadavg()[0]:.2f}",
                  flush=True)
        llm.close()


if __name__ == "__main__":
    main()
