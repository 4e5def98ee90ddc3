"""GPU benchmark: ellm's CUDA backend beside transformers on the same GPU.

For each model: batch-1 decode tok/s, prefill tok/s of a 512-token prompt, aggregate
decode tok/s of 16 and 64 sequences, ellm with and without CUDA graphs, and the fraction
of HBM bandwidth the decode steps use (bytes of weights read per second / 4.8 TB/s, the
H200's figure; one full read of the weights per step). Decode rates come from the
difference of two runs of different lengths, so prefill and start-up cancel out.

    python benchmarks/gpu/bench.py --gguf smollm2=PATH --folder smollm2=PATH ... --out DIR

Run by benchmarks/gpu/check.sh on the lent GPU machine (docs/gpu.md); prints Markdown
tables and writes DIR/gpu_bench.md and DIR/gpu_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HBM_BYTES_PER_S = 4.8e12
SHORT, LONG = 32, 160          # decode lengths whose difference gives the decode rate
PROMPT = "The history of the printing press begins"


def median_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every matrix once (the head included, so a tied
    embedding counts once), the embedding table's own rows not (a step reads B rows)."""
    from ellm.weights import Linear
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, Linear):
            seen[id(x.data)] = int(x.data.nbytes)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                walk(getattr(x, f))
    walk(model.layers)
    walk(model.lm_head)
    return sum(seen.values())


# -- ellm ----------------------------------------------------------------------------------

def bench_ellm(path: Path, graphs: bool) -> dict[str, float]:
    import ellm
    from ellm.sampling_params import SamplingParams
    llm = ellm.load(path, device="cuda", max_model_len=1024, max_num_seqs=64, max_batch_tokens=512,
                    progress=False)
    try:
        executor = llm.engine.runner.executor
        executor.use_graphs = graphs
        ids = llm.encode_prompt(PROMPT)

        def run(n_seqs: int, n_tokens: int) -> None:
            p = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
            llm.generate([ids] * n_seqs, p)

        out: dict[str, float] = {}
        run(1, 8)   # compile, capture
        for n in (1, 16, 64):
            run(n, SHORT)
            t_short = median_time(lambda: run(n, SHORT))
            t_long = median_time(lambda: run(n, LONG))
            out[f"decode_{n}"] = n * (LONG - SHORT) / max(t_long - t_short, 1e-9)
        long_ids = (ids * (512 // len(ids) + 1))[:512]
        p1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([long_ids], p1)
        out["prefill_512"] = 512 / median_time(lambda: llm.generate([long_ids], p1))
        wb = weight_bytes(llm.engine.model)
        out["weight_bytes"] = wb
        for n in (1, 16, 64):
            out[f"hbm_{n}"] = out[f"decode_{n}"] / n * wb / HBM_BYTES_PER_S
        out["graph_replays"] = float(executor.stats.get("replays", 0))
        return out
    finally:
        llm.close()


# -- transformers --------------------------------------------------------------------------

def bench_transformers(folder: Path) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids.cuda()

    def run(n_seqs: int, n_tokens: int) -> None:
        with torch.no_grad():
            model.generate(ids.repeat(n_seqs, 1), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                           do_sample=False, pad_token_id=tok.eos_token_id)
        torch.cuda.synchronize()

    out: dict[str, float] = {}
    run(1, 8)
    for n in (1, 16, 64):
        t_short = median_time(lambda: run(n, SHORT))
        t_long = median_time(lambda: run(n, LONG))
        out[f"decode_{n}"] = n * (LONG - SHORT) / max(t_long - t_short, 1e-9)
    long_ids = ids.repeat(1, 512 // ids.shape[1] + 1)[:, :512]

    def prefill() -> None:
        with torch.no_grad():
            model(long_ids)
        torch.cuda.synchronize()
    prefill()
    out["prefill_512"] = 512 / median_time(prefill)
    wb = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        wb += model.get_input_embeddings().weight.numel() * 2
    out["weight_bytes"] = wb
    for n in (1, 16, 64):
        out[f"hbm_{n}"] = out[f"decode_{n}"] / n * wb / HBM_BYTES_PER_S
    del model
    torch.cuda.empty_cache()
    return out


# -- report --------------------------------------------------------------------------------

def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | weights | engine | decode b=1 tok/s | prefill@512 tok/s | decode b=16 tok/s "
            "| decode b=64 tok/s | HBM b=1 / 16 / 64 |\n|---|---|---|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        m = r["result"]
        if "error" in m:
            lines.append(f"| {r['model']} | {r['weights']} | {r['engine']} | error: {m['error']} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['weights']} | {r['engine']} | {m['decode_1']:,.0f} | "
                     f"{m['prefill_512']:,.0f} | {m['decode_16']:,.0f} | {m['decode_64']:,.0f} | "
                     f"{m['hbm_1']:.1%} / {m['hbm_16']:.1%} / {m['hbm_64']:.1%} |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> str:
    """The targets of issue 14 per model: ellm's best batch-1 decode (graphs; >= 2,000 tok/s
    for SmolLM2), ellm on the bf16 folder against transformers on the same folder (>= 10x),
    and the best batch-64 HBM fraction (>= 50%)."""
    out = ["", "| model | ellm b=1 best (weights) | ellm bf16 b=1 / transformers b=1 | ellm b=64 HBM best | "
           "targets |", "|---|---:|---:|---:|---|"]
    for model in sorted({r["model"] for r in rows}):
        ours = [r for r in rows if r["model"] == model and r["engine"].startswith("ellm")
                and "error" not in r["result"]]
        theirs = [r["result"] for r in rows if r["model"] == model and r["engine"] == "transformers"
                  and "error" not in r["result"]]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["result"]["decode_1"])
        hbm = max(r["result"]["hbm_64"] for r in ours)
        same = [r["result"]["decode_1"] for r in ours if r["weights"] == "bf16 folder"]
        ratio = max(same) / theirs[0]["decode_1"] if same and theirs else float("nan")
        met = [f"b=1 >= 2,000: {'met' if best['result']['decode_1'] >= 2000 else 'NOT met'}"] if model == "smollm2" else []
        met += [f">= 10x: {'met' if ratio >= 10 else 'NOT met'}", f">= 50% HBM: {'met' if hbm >= 0.5 else 'NOT met'}"]
        out.append(f"| {model} | {best['result']['decode_1']:,.0f} ({best['weights']}, {best['engine']}) | "
                   f"{ratio:.1f}x | {hbm:.1%} | {'; '.join(met)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH of a GGUF file")
    ap.add_argument("--folder", action="append", default=[], help="NAME=PATH of a bf16 Hugging Face folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def record(model: str, weights: str, engine: str, fn: Callable[[], dict[str, float]]) -> None:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:   # one failing configuration must not hide the others' numbers
            result = {"error": f"{type(e).__name__}: {e}"[:300]}
        result["seconds"] = time.perf_counter() - t0
        rows.append({"model": model, "weights": weights, "engine": engine, "result": result})
        print(json.dumps(rows[-1]), flush=True)
        write()   # after every row, so a run cut short by its time limit still leaves its tables

    def write() -> str:
        report = table(rows) + "\n" + ratios(rows) + "\n"
        (args.out / "gpu_bench.md").write_text(report)
        (args.out / "gpu_bench.json").write_text(json.dumps(rows, indent=1))
        return report

    sources = [(spec.split("=", 1), "gguf") for spec in args.gguf] + \
              [(spec.split("=", 1), "bf16 folder") for spec in args.folder]
    for (name, path), kind in sources:
        for graphs in (True, False):
            record(name, kind, "ellm cuda graphs" if graphs else "ellm cuda eager",
                   lambda: bench_ellm(Path(path), graphs))
        if kind == "bf16 folder" and not args.no_transformers:
            record(name, "bf16 folder", "transformers", lambda: bench_transformers(Path(path)))
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
