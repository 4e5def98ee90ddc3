"""What LoRA adapters cost a decode step, beside the base alone (ellm/lora.py, csrc/lora.c).

Random rank-16 adapters on all seven projections of SmolLM2-135M are written as PEFT
folders (adapter_config.json + adapter_model.safetensors, written here with NumPy), and
one LLM serves the base and four of them. Alternating base and adapter runs, with medians
of the rounds, it times:

  1. one sequence's decode with one adapter against the base (time per token);
  2. 16 sequences decoding together over 4 adapters (4 each) against 16 of the base.

A decode time is the difference between a generate of 1 + N tokens and one of 1 token
(the prompt's prefill cancels out).

    python benchmarks/bench_lora.py --threads 2 --rounds 7

The machine these figures come from may be shared: the load average is printed beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import ellm

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: an 8-byte header length, the JSON header, the data."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def write_adapter(folder: Path, llm: ellm.LLM, rank: int, seed: int) -> None:
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
    write_safetensors(folder / "adapter_model.safetensors", tensors)


def decode_seconds(llm: ellm.LLM, prompts: list[list[int]], adapters: list[str | None], n: int) -> float:
    """Seconds of n decode steps of the prompts together, each with its adapter."""
    async def run(tokens: int) -> float:
        params = ellm.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        await asyncio.gather(*(llm.agenerate(p, params, adapter=a) for p, a in zip(prompts, adapters)))
        return time.perf_counter() - t0
    return asyncio.run(run(1 + n)) - asyncio.run(run(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48, help="decode steps timed per run")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = ellm.load(args.model, threads=args.threads, progress=False)
        folders = {f"a{i}": Path(tmp) / f"a{i}" for i in range(4)}
        for i, folder in enumerate(folders.values()):
            write_adapter(folder, base, args.rank, seed=i)
        base.close()
        llm = ellm.load(args.model, threads=args.threads, progress=False, lora_adapters=folders)
        llm.engine.blocks.enable_prefix_caching = False   # every run prefills its prompt
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 20000, 24).tolist() for _ in range(16)]
        cases = {
            "1 sequence": ([prompts[0]], [None], [prompts[0]], ["a0"]),
            "16 sequences": (prompts, [None] * 16, prompts, [f"a{i % 4}" for i in range(16)]),
        }
        decode_seconds(llm, prompts[:2], [None, "a0"], 4)   # warm-up: workspaces, stacks
        for label, (bp, ba, ap_, aa) in cases.items():
            ratios, tb, ta = [], [], []
            for _ in range(args.rounds):
                b = decode_seconds(llm, bp, ba, args.tokens)
                a = decode_seconds(llm, ap_, aa, args.tokens)
                tb.append(b / args.tokens)
                ta.append(a / args.tokens)
                ratios.append(a / b)
            print(f"{label}: base {statistics.median(tb) * 1e3:.2f} ms/step, adapters "
                  f"{statistics.median(ta) * 1e3:.2f} ms/step, ratio median {statistics.median(ratios):.3f} "
                  f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); load {os.getloadavg()[0]:.2f}")
        llm.close()


if __name__ == "__main__":
    main()
