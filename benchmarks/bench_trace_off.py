"""Tracing off costs nothing: decode tok/s with the recording points in the forward pass
(model.recorder = None) against the same model code without them.

The code without them is the models' source at a git revision (default `main`, where the
recording points are not merged): those modules are loaded from `git show REV:path` beside
the installed ones, and the loaded model's objects are switched between the two classes
of the same name, so both runs use the same weights, KV cache and process. Rounds
alternate (A B A B ...) and the figures are medians; on a shared machine read the ratio.

    python benchmarks/bench_trace_off.py [MODEL] [--rounds 7] [--tokens 64] [--steps 300] [--baseline main]

Two figures: single-token decode forwards alternating step by step (medians; the finer
the alternation, the less a neighbour's load biases one side), and whole greedy
generations of --tokens tokens alternating by round.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import ellm

REPO = Path(__file__).resolve().parents[1]


def baseline_module(name: str, rev: str) -> ModuleType:
    """Module `name` (e.g. ellm.models.blocks) as it is at git revision rev."""
    rel = "src/" + name.replace(".", "/") + ".py"
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"], capture_output=True,
                            text=True, check=True).stdout
    pkg = name.rpartition(".")[0]
    spec = importlib.util.spec_from_loader(f"{pkg}._baseline_{name.rpartition('.')[2]}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = pkg       # its relative imports resolve to the installed package
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    exec(compile(source, f"{rev}:{rel}", "exec"), mod.__dict__)
    return mod


def model_objects(model: Any) -> list[Any]:
    """The model and every object of an ellm.models class it holds (layers, blocks)."""
    seen, out = set(), []

    def visit(obj: Any) -> None:
        if id(obj) in seen or not type(obj).__module__.startswith("ellm.models"):
            return
        seen.add(id(obj))
        out.append(obj)
        for value in vars(obj).values():
            for item in (value if isinstance(value, list) else [value]):
                visit(item)
    visit(model)
    return out


def swap_plan(model: Any, rev: str) -> list[tuple[Any, type, type]]:
    """(object, its class now, the baseline class) for every model object whose class (or a
    base) runs code: the baseline is rev's version of the class that defines forward or
    __call__ (e.g. blocks.Decoder for a family's Model(Decoder))."""
    modules: dict[str, ModuleType] = {}
    plan = []
    for obj in model_objects(model):
        cls = type(obj)
        runner = next((c for c in cls.__mro__ if c.__module__.startswith("ellm.models")
                       and ("forward" in vars(c) or "__call__" in vars(c))), None)
        if runner is None:
            continue
        mod = modules.get(runner.__module__) or modules.setdefault(
            runner.__module__, baseline_module(runner.__module__, rev))
        plan.append((obj, cls, getattr(mod, runner.__name__)))
    return plan


def step_times(llm: Any, plan: list[tuple[Any, type, type]], steps: int) -> dict[str, list[float]]:
    """Seconds of single-token decode forwards, the two versions alternating step by step
    (so a neighbour's load falls on both alike), on the engine thread."""
    import numpy as np

    from ellm.models.batch import Batch

    def run(engine: Any) -> dict[str, list[float]]:
        assert engine.blocks.allocate("bench", 32)
        try:
            tables = {w: np.asarray([engine.blocks.table("bench", w)], np.int32) for w in engine.kv.windows}
            batch = Batch.single(np.array([504], np.int32), 16, tables)
            out: dict[str, list[float]] = {"hooks": [], "baseline": []}
            for s in range(steps):
                for label, idx in ((("hooks", 1), ("baseline", 2)) if s % 2 else (("baseline", 2), ("hooks", 1))):
                    for obj, *classes in plan:
                        obj.__class__ = classes[idx - 1]
                    t0 = time.perf_counter()
                    llm.model.forward(batch, engine.kv)
                    out[label].append(time.perf_counter() - t0)
            return out
        finally:
            engine.blocks.free("bench")
    return llm.async_engine.call(run).result()


def decode_rate(llm: Any, ids: list[int], tokens: int) -> float:
    t0 = time.perf_counter()
    out = llm.generate(ids, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    dt = time.perf_counter() - t0
    assert len(out.token_ids) == tokens
    return tokens / dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="forward passes per version, alternating")
    p.add_argument("--baseline", default="main", help="git revision of the code without recording points")
    a = p.parse_args()
    llm = ellm.load(a.model, max_num_seqs=1, progress=False)
    if getattr(llm.model, "recorder", "absent") is not None:
        print("this checkout's model has no recording points (model.recorder)", file=sys.stderr)
        return 2
    plan = swap_plan(llm.model, a.baseline)
    if any("recorder" in base.forward.__code__.co_names for _, _, base in plan if hasattr(base, "forward")):
        print(f"{a.baseline}'s models have the recording points too: pass --baseline with a revision "
              "from before them (e.g. the merge base of this branch)", file=sys.stderr)
        return 2
    ids = llm.encode_prompt("The history of the town begins with a mill by the river, and")
    outs = {}
    for label, idx in (("hooks", 1), ("baseline", 2)):   # same greedy tokens either way
        for obj, *classes in plan:
            obj.__class__ = classes[idx - 1]
        outs[label] = llm.generate(ids, max_tokens=16, temperature=0.0, ignore_eos=True).token_ids
    assert outs["hooks"] == outs["baseline"], "the two versions disagree"
    rates: dict[str, list[float]] = {"hooks": [], "baseline": []}
    for _ in range(a.rounds):
        for label, idx in (("hooks", 1), ("baseline", 2)):
            for obj, *classes in plan:
                obj.__class__ = classes[idx - 1]
            rates[label].append(decode_rate(llm, ids, a.tokens))
    steps = step_times(llm, plan, a.steps)
    for obj, cls, _ in plan:
        obj.__class__ = cls
    per_step = {k: statistics.median(v) for k, v in steps.items()}
    print(f"{a.model}: single-token decode forward, {a.steps} steps each, alternating step by step")
    for k, v in per_step.items():
        print(f"  {k:<9} median {v * 1e3:7.3f} ms  = {1 / v:7.1f} tok/s")
    print(f"  ratio hooks/baseline (tok/s) {per_step['baseline'] / per_step['hooks']:.3f}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{a.model}: decode tok/s, {a.rounds} alternating rounds of {a.tokens} tokens "
          f"({len(plan)} objects swapped to {a.baseline}'s classes)")
    for k, v in rates.items():
        print(f"  {k:<9} median {med[k]:7.1f}   runs {' '.join(f'{x:.1f}' for x in v)}")
    print(f"  ratio hooks/baseline {med['hooks'] / med['baseline']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
