"""Where a decode step's time goes on the GPU: one captured step, timed whole and kernel
by kernel.

    python benchmarks/gpu/step_profile.py time --gguf smollm2=PATH --random llama-1b --work DIR > step_time.md
    ncu --profile-from-start off --graph-profiling node --clock-control none \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum -o DIR/step \\
        python benchmarks/gpu/step_profile.py profile --gguf smollm2=PATH
    ncu --import DIR/step.ncu-rep --csv --page raw --print-units base > DIR/step.csv
    python benchmarks/gpu/step_profile.py summarize DIR/step.csv > step_kernels.md

`time`: per model and batch size, the replay time of the captured decode step (CUDA
events around 50 replays, median of 5), with the captured kernels as programmatic
dependent launches and with plain launches (ops/cuda_pdl.py), the step's kernel count,
and a decode step through `generate` (what the engine's host work, the input copy,
sampling and the copy back add to the replay), with the engine's overlap (step N+1
launched before step N's tokens are read) and without it. `profile`: one replay of each model's
step (`--batch` sequences, default 1) between cudaProfilerStart and cudaProfilerStop,
for Nsight Compute (`--profile-from-start off`) to measure each kernel of it alone.
`summarize`: ncu's CSV as a table per kernel name: launches, microseconds, DRAM bytes
and bandwidth, L2 bytes (what a kernel rereads from L2: mmv.cu reads every activation
once per 16 weight rows, which at 64 sequences is more than the weights), share of the
step. benchmarks/gpu/check.sh runs all three.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_figures import ASSUMED, describe, figures  # noqa: E402
from random_folder import make_random_folder  # noqa: E402

PROMPT_IDS = [ord(c) for c in "The history of the printing press begins"]   # byte tokens


def load(path: Path, batch: int, pdl: bool) -> Any:
    import os
    os.environ["ELLM_CUDA_PDL"] = "1" if pdl else "0"   # read when the backend is made
    import ellm
    return ellm.load(path, device="cuda", kv_cache_dtype="bfloat16", max_model_len=512,
                     max_num_seqs=max(batch, 1), progress=False)


def captured_step(llm: Any, batch: int) -> tuple[Any, Any]:
    """(ops, the captured graph of a `batch`-sequence decode step), after a short run."""
    from ellm.sampling_params import SamplingParams
    from ellm.ops.cuda_graphs import bucket_for
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([PROMPT_IDS] * batch, p)
    executor = llm.engine.runner.executor
    g = executor.graphs.get(bucket_for(batch))
    if g is None:
        raise RuntimeError(f"no graph was captured for {batch} sequences (stats {executor.stats})")
    return executor.ops, g


def replay_us(ops: Any, graph: Any, replays: int = 50, repeats: int = 5) -> float:
    """Median over `repeats` of the mean replay time of `replays` back-to-back replays."""
    cp = ops.cp
    times = []
    graph.graph.launch(ops.stream)
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(ops.stream)
        for _ in range(replays):
            graph.graph.launch(ops.stream)
        end.record(ops.stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / replays)
    return statistics.median(times)


def generate_step_us(llm: Any, batch: int, short: int = 16, long: int = 64) -> float:
    """A decode step end to end (engine, host work, replay, sampling, copy back): the
    difference of two generate lengths, so prefill and start-up cancel."""
    import time
    from ellm.sampling_params import SamplingParams
    times = []
    for n in (short, long, short, long):
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([PROMPT_IDS] * batch, p)
        times.append(time.perf_counter() - t)
    return (min(times[1], times[3]) - min(times[0], times[2])) / (long - short) * 1e6


def sources(args: argparse.Namespace) -> list[tuple[str, Path]]:
    out = [(name, Path(path)) for name, path in (s.split("=", 1) for s in args.gguf)]
    for shape in args.random:
        out.append((shape, make_random_folder(shape, args.work / shape, device=args.torch_device)))
    return out


def cmd_time(args: argparse.Namespace) -> int:
    print("| model | batch | replay µs, dependent launches | replay µs, plain launches | kernels "
          "| generate µs a step | of which not the replay | generate µs a step, no overlap |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, path in sources(args):
        for batch in args.batch:
            row: dict[bool, float] = {}
            kernels, whole, alone, dependent = 0, float("nan"), float("nan"), False
            for pdl in (True, False):
                llm = load(path, batch, pdl)
                try:
                    ops, g = captured_step(llm, batch)
                    row[pdl] = replay_us(ops, g, args.replays)
                    kernels = g.kernels
                    if pdl:
                        whole = generate_step_us(llm, batch)
                        llm.engine.overlap = False   # each step's tokens read before the next launch
                        alone = generate_step_us(llm, batch)
                        dependent = llm.engine.runner.executor.stats["dependent_captures"] > 0
                finally:
                    llm.close()
            # without dependent launches here (no sm_90, no driver entry point) both columns
            # measure plain launches: say so rather than show a difference of noise
            first = f"{row[True]:.1f}" if dependent else f"{row[True]:.1f} (plain: unavailable)"
            print(f"| {name} | {batch} | {first} | {row[False]:.1f} | {kernels or '–'} | {whole:.1f} "
                  f"| {whole - row[True]:.1f} | {alone:.1f} |", flush=True)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    for name, path in sources(args):
        llm = load(path, args.batch, True)
        try:
            ops, g = captured_step(llm, args.batch)
            ops.stream.synchronize()
            ops.cp.cuda.runtime.profilerStart()
            g.graph.launch(ops.stream)
            ops.stream.synchronize()
            ops.cp.cuda.runtime.profilerStop()
            print(f"{name}: one decode step of {args.batch} sequences replayed under the profiler", flush=True)
        finally:
            llm.close()
    return 0


# -- ncu's CSV -------------------------------------------------------------------------------

# ncu scales values to its own units unless told `--print-units base`; both are read
UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
         "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def _number(text: str) -> float:
    """A cell: thousands separators allowed; blank or n/a (a counter this GPU lacks) -> 0."""
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_ncu_csv(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Per profiled kernel launch (in order): its name and its metrics in base units
    (seconds, bytes). Takes ncu's `--page details` CSV (one row per metric) or `--page
    raw` (one row per launch, a units row under the header); lines before the header
    (ncu's own messages) are skipped."""
    rows = list(csv.reader(lines))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        raise ValueError("no ncu CSV header (a 'Kernel Name' column) found")
    cols = rows[head]
    name_at, id_at = cols.index("Kernel Name"), cols.index("ID") if "ID" in cols else None
    launches: dict[str, dict[str, Any]] = {}
    if "Metric Name" in cols:   # details: ID, ..., Kernel Name, ..., Metric Name, Metric Unit, Metric Value
        m_at, u_at, v_at = cols.index("Metric Name"), cols.index("Metric Unit"), cols.index("Metric Value")
        for r in rows[head + 1:]:
            if len(r) != len(cols):
                continue
            key = r[id_at] if id_at is not None else str(len(launches))
            launch = launches.setdefault(key, {"kernel": r[name_at]})
            launch[r[m_at]] = _number(r[v_at]) * UNITS.get(r[u_at], 1.0)
        return list(launches.values())
    units: list[str] = []
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(cols):
            continue
        if id_at is not None and not r[id_at].strip():   # the units row
            units = r
            continue
        launch = {"kernel": r[name_at]}
        for i, c in enumerate(cols):
            if "__" in c:   # a metric column (gpu__time_duration.sum, dram__bytes_read.sum)
                launch[c] = _number(r[i]) * UNITS.get(units[i] if units else "", 1.0)
        out.append(launch)
    return out


def summarize(launches: list[dict[str, Any]], hbm_bytes_per_s: float = ASSUMED["hbm_bytes_per_s"]) -> str:
    """Per kernel name: launches, time, DRAM traffic and its rate (and its fraction of the
    GPU's copy bandwidth, device_figures.py), share of the step."""
    agg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for launch in launches:
        a = agg[launch["kernel"].split("(")[0].strip()]
        a["n"] += 1
        a["s"] += launch.get("gpu__time_duration.sum", 0.0)
        a["bytes"] += launch.get("dram__bytes_read.sum", 0.0) + launch.get("dram__bytes_write.sum", 0.0)
        a["l2"] += launch.get("lts__t_bytes.sum", 0.0)
    total = sum(a["s"] for a in agg.values()) or float("nan")
    lines = ["| kernel | launches | µs | µs each | DRAM MB | GB/s | % of HBM | L2 MB | % of step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["s"]):
        rate = a["bytes"] / a["s"] if a["s"] else 0.0
        lines.append(f"| {name} | {a['n']:.0f} | {a['s'] * 1e6:.1f} | {a['s'] * 1e6 / a['n']:.2f} | "
                     f"{a['bytes'] / 1e6:.2f} | {rate / 1e9:,.0f} | {rate / hbm_bytes_per_s:.0%} | "
                     f"{a['l2'] / 1e6:.2f} | {a['s'] / total:.0%} |")
    n = sum(a["n"] for a in agg.values())
    moved = sum(a["bytes"] for a in agg.values())
    l2 = sum(a["l2"] for a in agg.values())
    lines.append(f"| **all** | {n:.0f} | {total * 1e6:.1f} | | {moved / 1e6:.2f} | {moved / total / 1e9:,.0f} | "
                 f"{moved / total / hbm_bytes_per_s:.0%} | {l2 / 1e6:.2f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("time", "profile"):
        p = sub.add_parser(cmd)
        p.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH")
        p.add_argument("--random", action="append", default=[], metavar="SHAPE",
                       help="a random bf16 folder of this shape (random_folder.py), made with torch")
        p.add_argument("--work", type=Path, default=Path("/tmp/ellm-gpu/random"))
        p.add_argument("--torch-device", default="cuda")
        if cmd == "time":
            p.add_argument("--batch", type=int, action="append", default=None)
            p.add_argument("--replays", type=int, default=50)
        else:
            p.add_argument("--batch", type=int, default=1)
    p = sub.add_parser("summarize")
    p.add_argument("csv", type=Path)
    p.add_argument("--device-figures", type=Path, default=None, help="device.json of device_figures.py")
    args = ap.parse_args(argv)
    if args.cmd == "summarize":
        fig = figures(args.device_figures)
        print(describe(fig) + "\n")
        print(summarize(read_ncu_csv(args.csv.read_text().splitlines()), fig["hbm_bytes_per_s"]))
        return 0
    if args.cmd == "time":
        args.batch = args.batch or [1, 64]
        return cmd_time(args)
    return cmd_profile(args)


if __name__ == "__main__":
    sys.exit(main())
