"""GPU benchmark: ellm's CUDA backend beside transformers on the same GPU.

Per model: batch-1 decode tok/s, prefill tok/s of a 512-token prompt (and of 2,048 on
the 8B shape, with the TFLOP/s it reaches and its fraction of the bf16 tensor-core
peak), aggregate decode tok/s of 16 and 64 sequences, and the fraction of HBM bandwidth
the decode steps use (bytes of weights read per second / what device copies reach on
this GPU, measured at the start by device_figures.py, as is the bf16 peak; one full read
of the weights per step, so a quantized model is measured against its own bytes). Decode
rates come from the difference of two runs of different lengths, so prefill and start-up
cancel out.

    python benchmarks/gpu/bench.py --out DIR [--gguf smollm2=PATH] [--folder smollm2=PATH]
        [--random llama-1b] [--random llama-8b] [--quantize llama-8b=q8_0] [--budget 300]
    python benchmarks/gpu/bench.py --dry-run --out DIR     # on a CPU: the whole harness, tiny shapes

Engines: `ellm cuda graphs` (fused decode kernels, tensor-core decode products, bf16 KV
cache, the captured kernels as programmatic dependent launches on sm_90+), `ellm cuda
graphs plain launches` (the same without them: ELLM_CUDA_PDL=0), `ellm cuda graphs no
overlap` (each greedy step's tokens read before the next step is launched: the engine's
overlap off), `ellm cuda graphs no group loop` (one mmv3 or mmv_glu block a row group, as many
blocks as groups: ELLM_CUDA_MMV_LOOP=0), `ellm cuda graphs two tiles` (mmv.cu's blocks
of two tiles above 32 tokens too: ELLM_CUDA_MMV_X4=0), `ellm cuda graphs one tile`
(one-tile blocks at 17-64 tokens too: ELLM_CUDA_MMV_X2=0), `ellm cuda graphs logprobs`
(every request asking for 5 top logprobs, taken on the device), `ellm cuda graphs
logprobs on the host` (the same sampled on the host: ELLM_CUDA_LOGPROBS=0), `ellm cuda graphs
sampled` (every request drawing its tokens at temperature 0.8 with top_k 40 and top_p
0.95: sample.cu's filters, where the others take the greedy argmax), `ellm cuda graphs f32
gemv` (the same with linear.cu's f32 decode products: ELLM_CUDA_MMV=0), `ellm cuda
graphs unfused` (one kernel per op), `ellm cuda eager`, `transformers` (bf16,
`generate(..., cache_implementation="static")`: compiled, CUDA graphs) and `transformers
eager` (plain `generate`). Rows run in priority order (the issue's targets first) and a
row that would start after --budget seconds is written as skipped, so a run cut short
still leaves its tables. --random folders are made here with torch (random_folder.py).
Run by benchmarks/gpu/check.sh (docs/gpu.md); writes DIR/gpu_bench.md and gpu_bench.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_figures import ASSUMED, describe, figures  # noqa: E402
from random_folder import SHAPES, make_random_folder  # noqa: E402

# The GPU's copy bandwidth and bf16 peak (device_figures.py): main() measures them
LIMITS: dict[str, Any] = dict(ASSUMED)
PROMPT = "The history of the printing press begins"
RANDOM_PROMPT = [ord(c) for c in "The history of the printing press begins"]   # byte tokens


@dataclass
class Plan:
    """How long a model's measurements run: decode lengths whose difference gives the
    rate, repeats (median), batch sizes, prefill lengths."""
    short: int = 32
    long: int = 160
    repeats: int = 3
    batches: tuple[int, ...] = (1, 16, 64)
    prefills: tuple[int, ...] = (512,)
    max_model_len: int = 1024

    @staticmethod
    def for_model(name: str, dry_run: bool) -> "Plan":
        if dry_run:
            return Plan(short=2, long=6, repeats=1, batches=(1, 16, 64), prefills=(512, 2048), max_model_len=2560)
        if name == "llama-8b":
            return Plan(short=16, long=64, repeats=2, prefills=(512, 2048), max_model_len=2560)
        if name == "llama-1b":
            return Plan(short=16, long=96, repeats=2)
        return Plan()


@dataclass
class Source:
    name: str                   # smollm2, llama-1b, llama-8b
    weights: str                # "gguf", "bf16 folder", "bf16 folder, q8_0 at load"
    path: Path
    quantize: str | None = None
    random_ids: bool = False    # a random folder: byte tokens, no real text
    extra: dict[str, Any] = field(default_factory=dict)


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


def prefill_flops(c: Any, n: int) -> float:
    """2 x the multiply-adds of a prefill of n tokens (a Llama-shaped config): every layer
    matrix for every token, the causal attention's q.k and p.v products, the head for the
    last token only."""
    qo = 2 * c.hidden_size * c.num_attention_heads * c.head_dim
    kv = 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    layers = c.num_hidden_layers * (qo + kv + mlp)
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n * (n + 1) / 2
    return 2.0 * (layers * n + attn + c.vocab_size * c.hidden_size)


def decode_rate(n: int, plan: Plan, t_short: float, t_long: float) -> float:
    """Tokens a second of n sequences from the two runs' difference; where noise makes the
    difference vanish (a loaded CPU in a dry run), the longer run's plain rate."""
    if t_long - t_short > 0.05 * t_long:
        return n * (plan.long - plan.short) / (t_long - t_short)
    return n * plan.long / t_long


def add_rates(out: dict[str, float], wb: float, batches: tuple[int, ...]) -> None:
    out["weight_bytes"] = wb
    for n in batches:
        if f"decode_{n}" in out:
            out[f"hbm_{n}"] = out[f"decode_{n}"] / n * wb / LIMITS["hbm_bytes_per_s"]


# -- ellm ----------------------------------------------------------------------------------

def bench_ellm(src: Source, plan: Plan, device: str, graphs: bool, fused: bool,
               deadline: float, mmv: bool = True, pdl: bool = True, tiles: int = 4,
               overlap: bool = True, loop: bool = True, logprobs: int | None = None,
               device_logprobs: bool = True, sampled: bool = False) -> dict[str, float]:
    os.environ["ELLM_CUDA_FUSED"] = "1" if fused else "0"   # all read when the backend is made
    os.environ["ELLM_CUDA_MMV"] = "1" if mmv else "0"
    os.environ["ELLM_CUDA_PDL"] = "1" if pdl else "0"
    os.environ["ELLM_CUDA_MMV_X2"] = "1" if tiles >= 2 else "0"   # mmv.cu's tiles a block at most
    os.environ["ELLM_CUDA_MMV_X4"] = "1" if tiles >= 4 else "0"
    os.environ["ELLM_CUDA_MMV_LOOP"] = "1" if loop else "0"   # mmv3's grid capped at what is resident
    os.environ["ELLM_CUDA_LOGPROBS"] = "1" if device_logprobs else "0"   # logprobs sampled on the device
    import ellm
    from ellm.sampling_params import SamplingParams
    options: dict[str, Any] = dict(max_model_len=plan.max_model_len, max_num_seqs=max(plan.batches),
                                   max_batch_tokens=max(512, *plan.prefills), progress=False)
    if device == "cuda":
        options["kv_cache_dtype"] = "bfloat16"
    if src.quantize:
        options["quantize"] = src.quantize
    t0 = time.perf_counter()
    llm = ellm.load(src.path, device=device, **options)
    out: dict[str, float] = {"load_s": time.perf_counter() - t0}
    try:
        executor = llm.engine.runner.executor
        if hasattr(executor, "use_graphs"):
            executor.use_graphs = graphs
        llm.engine.overlap = overlap and llm.engine.runner.overlaps
        ids = list(RANDOM_PROMPT) if src.random_ids else llm.encode_prompt(PROMPT)

        def run(n_seqs: int, n_tokens: int) -> None:
            draw = dict(temperature=0.8, top_k=40, top_p=0.95, seed=1) if sampled else dict(temperature=0.0)
            p = SamplingParams(max_tokens=n_tokens, ignore_eos=True, logprobs=logprobs, **draw)
            llm.generate([ids] * n_seqs, p)

        run(1, 4)   # compile, capture
        first = [n for n in (1, 64) if n in plan.batches] + [n for n in plan.batches if n not in (1, 64)]
        for n in first:
            if time.perf_counter() > deadline:
                out["cut_short"] = 1.0
                break
            run(n, plan.short)
            t_short = median_time(lambda: run(n, plan.short), plan.repeats)
            t_long = median_time(lambda: run(n, plan.long), plan.repeats)
            out[f"decode_{n}"] = decode_rate(n, plan, t_short, t_long)
        wb = weight_bytes(llm.engine.model)
        for n_prompt in plan.prefills:
            if time.perf_counter() > deadline:
                out["cut_short"] = 1.0
                break
            long_ids = (ids * (n_prompt // len(ids) + 1))[:n_prompt]
            p1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            llm.generate([long_ids], p1)
            t = median_time(lambda: llm.generate([long_ids], p1), plan.repeats)
            out[f"prefill_{n_prompt}"] = n_prompt / t
            if n_prompt >= 2048:
                flops = prefill_flops(llm.engine.model.config, n_prompt)
                out[f"prefill_{n_prompt}_tflops"] = flops / t / 1e12
                out[f"prefill_{n_prompt}_peak"] = flops / t / LIMITS["bf16_peak_flops"]
        add_rates(out, wb, plan.batches)
        stats = getattr(executor, "stats", {})
        out["graph_replays"] = float(stats.get("replays", 0))
        out["dependent_captures"] = float(stats.get("dependent_captures", 0))   # ops/cuda_pdl.py
        captured = getattr(executor, "graphs", {})
        if 1 in captured:   # ellm's kernel launches in a batch-1 decode step (5 a layer + 3 when fused)
            out["kernels_1"] = float(captured[1].kernels)
        return out
    finally:
        llm.close()
        llm = None  # the engine's last reference (the closures above share the name), before collecting
        gc.collect()
        _free_cupy()


def _free_cupy() -> None:
    try:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:   # no CuPy (a dry run): nothing to free
        pass


# -- transformers --------------------------------------------------------------------------

def bench_transformers(src: Source, plan: Plan, device: str, static: bool, deadline: float) -> dict[str, float]:
    """bf16 on `device`. static: generate(..., cache_implementation="static"), which
    transformers compiles (CUDA graphs) on a GPU; its first call per batch size compiles,
    so each batch size is warmed up before it is timed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.bfloat16).to(device).eval()
    out: dict[str, float] = {"load_s": time.perf_counter() - t0}
    if src.random_ids:
        ids = torch.tensor([RANDOM_PROMPT], device=device)
        pad = model.config.eos_token_id
    else:
        tok = AutoTokenizer.from_pretrained(src.path)
        ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)
        pad = tok.eos_token_id
    extra: dict[str, Any] = {"cache_implementation": "static"} if static else {}
    if static and device != "cuda":
        extra["disable_compile"] = True   # a dry run on a CPU checks the call, not the compiler

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def run(n_seqs: int, n_tokens: int) -> None:
        with torch.no_grad():
            model.generate(ids.repeat(n_seqs, 1), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                           do_sample=False, pad_token_id=pad, **extra)
        sync()

    try:
        first = [n for n in (1, 64) if n in plan.batches] + [n for n in plan.batches if n not in (1, 64)]
        for n in first:
            if time.perf_counter() > deadline:
                out["cut_short"] = 1.0
                break
            tw = time.perf_counter()
            run(n, plan.long)   # warm-up: compiles and captures at this batch size and the longer length
            out[f"warmup_{n}_s"] = time.perf_counter() - tw
            t_short = median_time(lambda: run(n, plan.short), plan.repeats)
            t_long = median_time(lambda: run(n, plan.long), plan.repeats)
            out[f"decode_{n}"] = decode_rate(n, plan, t_short, t_long)
        for n_prompt in plan.prefills:
            if time.perf_counter() > deadline:
                out["cut_short"] = 1.0
                break
            long_ids = ids.repeat(1, n_prompt // ids.shape[1] + 1)[:, :n_prompt]

            def prefill() -> None:
                with torch.no_grad():
                    model(long_ids, use_cache=False, logits_to_keep=1)
                sync()
            prefill()
            t = median_time(prefill, plan.repeats)
            out[f"prefill_{n_prompt}"] = n_prompt / t
        wb = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        if model.config.tie_word_embeddings:
            wb += model.get_input_embeddings().weight.numel() * 2
        add_rates(out, wb, plan.batches)
        return out
    finally:
        model = None  # the model's last reference (the closures above share the name), before collecting
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


# -- report --------------------------------------------------------------------------------

def _num(m: dict[str, Any], key: str, fmt: str = "{:,.0f}") -> str:
    return fmt.format(m[key]) if key in m else "–"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | weights | engine | decode b=1 tok/s | prefill@512 tok/s | decode b=16 tok/s "
            "| decode b=64 tok/s | HBM b=1 / 16 / 64 | prefill@2048 tok/s (TFLOP/s, % of peak) |\n"
            "|---|---|---|---:|---:|---:|---:|---|---|")
    lines = [head]
    for r in rows:
        m = r["result"]
        if "error" in m or "skipped" in m:
            why = f"error: {m['error']}" if "error" in m else f"skipped: {m['skipped']}"
            lines.append(f"| {r['model']} | {r['weights']} | {r['engine']} | {why} | | | | | |")
            continue
        hbm = " / ".join(_num(m, f"hbm_{n}", "{:.1%}") for n in (1, 16, 64))
        p2k = ""
        if "prefill_2048" in m:
            p2k = f"{m['prefill_2048']:,.0f}"
            if "prefill_2048_tflops" in m:
                p2k += f" ({m['prefill_2048_tflops']:.0f}, {m['prefill_2048_peak']:.1%})"
        lines.append(f"| {r['model']} | {r['weights']} | {r['engine']} | {_num(m, 'decode_1')} | "
                     f"{_num(m, 'prefill_512')} | {_num(m, 'decode_16')} | {_num(m, 'decode_64')} | {hbm} | {p2k} |")
    return "\n".join(lines)


def _ok(m: dict[str, Any]) -> bool:
    return "error" not in m and "skipped" not in m


def targets(rows: list[dict[str, Any]]) -> str:
    """Issue 30's targets, each met / NOT met / unmeasured, from this run's rows."""
    def best(model: str, key: str, weights: str | None = None, engine: str = "ellm") -> float | None:
        vals = [r["result"][key] for r in rows if r["model"] == model and r["engine"].startswith(engine)
                and (weights is None or r["weights"] == weights) and _ok(r["result"]) and key in r["result"]]
        return max(vals) if vals else None

    def theirs(model: str, key: str) -> float | None:
        vals = [r["result"][key] for r in rows if r["model"] == model and r["engine"] == "transformers"
                and _ok(r["result"]) and key in r["result"]]
        return vals[0] if vals else None

    out = ["", "| target | measured | verdict |", "|---|---:|---|"]

    def line(what: str, value: float | None, goal: float, fmt: str) -> None:
        verdict = "unmeasured" if value is None else ("met" if value >= goal else "NOT met")
        out.append(f"| {what} | {'–' if value is None else fmt.format(value)} | {verdict} |")
    line("smollm2 Q4_1 b=1 >= 2,000 tok/s", best("smollm2", "decode_1", "gguf"), 2000, "{:,.0f}")
    line("llama-1b bf16 b=1 >= 80% HBM", best("llama-1b", "hbm_1", "bf16 folder"), 0.8, "{:.1%}")
    line("llama-8b bf16 b=1 >= 80% HBM", best("llama-8b", "hbm_1", "bf16 folder"), 0.8, "{:.1%}")
    q = [r["result"]["hbm_1"] for r in rows if r["model"] == "llama-8b" and "at load" in r["weights"]
         and r["engine"].startswith("ellm") and _ok(r["result"]) and "hbm_1" in r["result"]]
    line("llama-8b quantized at load b=1 >= 70% of its bytes' limit", max(q) if q else None, 0.7, "{:.1%}")
    for model in ("llama-1b", "llama-8b"):
        ours, ref = best(model, "decode_64", "bf16 folder"), theirs(model, "decode_64")
        line(f"{model} b=64 >= 2x compiled transformers", None if ours is None or ref is None else ours / ref,
             2.0, "{:.2f}x")
    line("llama-8b prefill@2048 >= 40% of bf16 peak", best("llama-8b", "prefill_2048_peak", "bf16 folder"),
         0.4, "{:.1%}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH of a GGUF file")
    ap.add_argument("--folder", action="append", default=[], help="NAME=PATH of a bf16 Hugging Face folder")
    ap.add_argument("--random", action="append", default=[], choices=sorted(set(SHAPES) - {"tiny"}),
                    help="a random-weight bf16 folder of this shape, made here (random_folder.py)")
    ap.add_argument("--quantize", action="append", default=[], metavar="NAME=TYPE",
                    help="also run ellm on NAME's folder quantized at load (q8_0, q4_0, ...)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ellm-gpu/random"), help="where random folders go")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds: rows that would start later are skipped")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--device-figures", type=Path, default=None,
                    help="device.json of device_figures.py (default: measured here)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: a tiny random folder through every engine row (checks the harness)")
    ap.add_argument("--ellm-device", choices=("cpu", "cuda"),
                    help="ellm's device (default: cuda, cpu with --dry-run); a dry run with cuda and "
                         "tests/cuda_host on PYTHONPATH runs ellm's rows through the CUDA kernels on the CPU")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"        # transformers' and the random folders'
    ellm_device = args.ellm_device or device
    rows: list[dict[str, Any]] = []
    if not args.dry_run:
        import torch
        LIMITS.update(figures(args.device_figures, torch))
    (args.out / "device.json").write_text(json.dumps(LIMITS, indent=1))
    print(describe(LIMITS), flush=True)

    def write() -> str:
        report = describe(LIMITS) + "\n\n" + table(rows) + "\n" + targets(rows) + "\n"
        (args.out / "gpu_bench.md").write_text(report)
        (args.out / "gpu_bench.json").write_text(json.dumps(rows, indent=1))
        return report

    def record(src: Source, engine: str, fn: Callable[[float], dict[str, float]], share: float) -> None:
        """Runs one row unless the budget is spent; the row may use `share` of what is left."""
        now = time.perf_counter()
        left = args.budget - (now - t_start)
        if left < 15:
            result: dict[str, Any] = {"skipped": f"time budget of {args.budget:.0f} s spent"}
        else:
            try:
                result = fn(now + left * share)
            except Exception as e:   # one failing configuration must not hide the others' numbers
                result = {"error": f"{type(e).__name__}: {e}"[:300]}
        result["seconds"] = time.perf_counter() - now
        rows.append({"model": src.name, "weights": src.weights, "engine": engine, "result": result})
        print(json.dumps(rows[-1]), flush=True)
        write()   # after every row, so a run cut short by its time limit still leaves its tables

    sources: list[Source] = []
    for spec in args.gguf:
        name, path = spec.split("=", 1)
        sources.append(Source(name, "gguf", Path(path)))
    for spec in args.folder:
        name, path = spec.split("=", 1)
        sources.append(Source(name, "bf16 folder", Path(path)))
    shapes = ["tiny"] if args.dry_run else args.random
    for shape in shapes:
        t0 = time.perf_counter()
        try:
            folder = make_random_folder(shape, args.work / shape, device=device)
        except Exception as e:
            rows.append({"model": shape, "weights": "bf16 folder", "engine": "random folder",
                         "result": {"error": f"{type(e).__name__}: {e}"[:300]}})
            write()
            continue
        print(f"random folder {shape}: {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
        sources.append(Source(shape, "bf16 folder", folder, random_ids=True))
        for spec in args.quantize + (["tiny=q8_0"] if args.dry_run else []):
            name, qtype = spec.split("=", 1)
            if name == shape:
                sources.append(Source(shape, f"bf16 folder, {qtype} at load", folder, quantize=qtype,
                                      random_ids=True))

    # Priority order: ellm's fused graphs for every source (the targets), then compiled
    # transformers on the folders (the comparison), then the rest.
    plans = {s.name: Plan.for_model(s.name, args.dry_run) for s in sources}
    folders = [s for s in sources if s.weights == "bf16 folder"]
    for s in sources:
        record(s, f"ellm {ellm_device} graphs",
               lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d), 0.3)
    if not args.no_transformers:
        for s in folders:
            record(s, "transformers", lambda d, s=s: bench_transformers(s, plans[s.name], device, True, d), 0.4)
    for s in sources:   # the same graphs with plain launches (ELLM_CUDA_PDL=0): what PDL gains
        if (s.name, s.weights) in (("smollm2", "gguf"), ("tiny", "bf16 folder")):   # step_profile.py: 1B
            record(s, f"ellm {ellm_device} graphs plain launches",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, pdl=False), 0.3)
    for s in sources:   # step N's tokens read before step N+1 is launched: what the overlap gains
        if (s.name, s.weights) in (("smollm2", "gguf"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs no overlap",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, overlap=False), 0.3)
    for s in sources:   # one block a row group (ELLM_CUDA_MMV_LOOP=0): what walking the head's, gate/up's groups gains
        if (s.name, s.weights) in (("smollm2", "gguf"), ("llama-1b", "bf16 folder"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs no group loop",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, loop=False), 0.3)
    for s in sources:   # two mmv.cu tiles a block at most (ELLM_CUDA_MMV_X4=0): what x4 gains
        if (s.name, s.weights) in (("llama-1b", "bf16 folder"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs two tiles",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, tiles=2), 0.3)
    for s in sources:   # one mmv.cu tile a block at 32-64 tokens too (ELLM_CUDA_MMV_X2=0): what x2 gains
        if (s.name, s.weights) in (("llama-1b", "bf16 folder"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs one tile",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, tiles=1), 0.3)
    for s in sources:   # every request asking for logprobs (sample.cu logprob_rows): what they cost
        if (s.name, s.weights) in (("smollm2", "gguf"), ("llama-1b", "bf16 folder"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs logprobs",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, logprobs=5), 0.3)
            record(s, f"ellm {ellm_device} graphs logprobs on the host",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, logprobs=5,
                                             device_logprobs=False), 0.3)
    for s in sources:   # every request drawing its tokens (sample.cu's filters) instead of the argmax
        if (s.name, s.weights) in (("smollm2", "gguf"), ("llama-1b", "bf16 folder"), ("tiny", "bf16 folder")):
            record(s, f"ellm {ellm_device} graphs sampled",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, sampled=True), 0.3)
    for s in sources:   # round two's f32 decode kernels (ELLM_CUDA_MMV=0) against mmv.cu's
        if not s.quantize:
            record(s, f"ellm {ellm_device} graphs f32 gemv",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, True, d, mmv=False), 0.3)
    for s in sources:
        if not s.quantize:
            record(s, f"ellm {ellm_device} graphs unfused",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, True, False, d), 0.3)
    for s in sources:
        if not s.quantize:
            record(s, f"ellm {ellm_device} eager",
                   lambda d, s=s: bench_ellm(s, plans[s.name], ellm_device, False, True, d), 0.3)
    if not args.no_transformers:
        for s in folders:
            record(s, "transformers eager",
                   lambda d, s=s: bench_transformers(s, plans[s.name], device, False, d), 0.3)
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
