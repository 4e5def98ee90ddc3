"""Measure the noise bands of `ellm trace`: the largest relative error per op of clean models.

For each model file (the two real GGUFs, their f32 and bf16 Hugging Face folders), a few
prompts are traced against transformers on the same file; the script prints, per weight
type and op, the largest relative error over every layer and prompt, and the margin the
bands in src/ellm/trace/tolerances.py leave over it. Needs ELLM_REF_PYTHON (or
--reference-python). A few minutes on 2 cores:

    ELLM_REF_PYTHON=.venv-ref/bin/python nice python benchmarks/trace_bands.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import ellm
from ellm import hub
from ellm.trace import make_reference, trace
from ellm.trace import tolerances

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
MODELS = ["smollm2-135m-instruct", "gemma-3-270m"]


def sources() -> list[Path]:
    out = []
    for m in MODELS:
        out.append(hub.pull(m))
        for dtype in ("f32", "bf16"):
            folder = hub.hf_cache_dir() / f"{m}-{dtype}"
            if (folder / "config.json").is_file():
                out.append(folder)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-python", default=None)
    p.add_argument("--json", default=None, help="write the per-file figures here")
    p.add_argument("--only", default="", help="only the files whose path contains this")
    a = p.parse_args()
    worst: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_file = {}
    for path in [s for s in sources() if a.only in str(s)]:
        t0 = time.perf_counter()
        llm = ellm.load(path, progress=False)
        ref = make_reference("transformers", path, a.reference_python)
        prompts = [llm.tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
        ref.prefetch(prompts)
        wclass = tolerances.weight_class(path)
        file_worst: dict[str, float] = defaultdict(float)
        firsts = []
        for ids in prompts:
            res = trace(llm, ids, ref, model_path=path, lens_top_k=0)
            for r in res.rows:
                file_worst[r.op] = max(file_worst[r.op], r.rel)
                worst[wclass][r.op] = max(worst[wclass][r.op], r.rel)
            firsts.append(None if res.first is None else (res.first.layer, res.first.op))
        per_file[str(path)] = {"weight_class": wclass, "worst_rel": dict(file_worst), "first": firsts}
        print(f"{path.name}: {wclass}, first divergence per prompt {firsts} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        print("  " + "  ".join(f"{op} {rel:.1e}" for op, rel in file_worst.items()), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(per_file, indent=1))
    for wclass, ops in worst.items():
        print(f"\n{wclass}: largest relative error per op (band, measured / band)")
        for op, rel in ops.items():
            b = tolerances.band(wclass, op)
            print(f"  {op:<15}{rel:10.2e}   band {b:8.1e}   {rel / b:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
