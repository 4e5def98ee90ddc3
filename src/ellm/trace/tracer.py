"""`ellm trace`: run ellm and a reference on the same ids, diff every named op, name the first
one that goes wrong.

    result = trace(llm, ids, make_reference("transformers", path, ref_python), model_path=path)
    print(result.table()); json.dump(result.as_json(), f)

With a LoRA adapter ([lora]): ellm loaded with lora_adapters={NAME: PATH}, traced with
adapter=NAME, against make_reference(..., adapter=PATH) (transformers + peft, or the
reference ops with the same adapter).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from . import tolerances
from .align import to_transformers_layout
from .capture import Recording, record
from .diff import OpDiff, compare, first_divergence, select_positions
from .references import OpsReference, ReferenceError, TransformersReference


@dataclass
class TraceResult:
    model: str
    reference: str
    ids: list[int]
    tokens: list[str]
    positions: list[int]
    weight_class: str
    rows: list[OpDiff]
    first: OpDiff | None
    lens: dict[str, Any] = field(default_factory=dict)
    attention: dict[int, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    position_errors: list[float] = field(default_factory=list)  # the first divergence's, per kept position
    adapter: str | None = None   # [lora] the LoRA adapter the pass ran with (None: the base alone)

    def as_json(self) -> dict[str, Any]:
        first = None
        if self.first is not None:
            first = {**self.first.as_json(), "position_errors": self.position_errors}
        return {
            "model": self.model, "adapter": self.adapter, "reference": self.reference, "ids": self.ids,
            "tokens": self.tokens,
            "positions": self.positions, "weight_class": self.weight_class,
            "band_measured": tolerances.is_measured(self.weight_class),
            "first_divergence": first,
            "ops": [r.as_json() for r in self.rows],
            "logit_lens": {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in self.lens.items()},
            "attention": {str(k): v.tolist() for k, v in self.attention.items()},
            "notes": self.notes, "seconds": self.seconds,
        }

    def table(self) -> str:
        model = self.model if self.adapter is None else f"{self.model} + adapter {self.adapter}"
        lines = [f"ellm trace: {model} vs {self.reference} ({self.weight_class} weights), "
                 f"{len(self.ids)} tokens, positions {_ranges(self.positions)}",
                 f"{'layer':>5}  {'op':<15}{'max_abs':>11}{'rel':>11}{'cos':>11}{'tol':>9}"]
        for r in self.rows:
            mark = ""
            if r is self.first:
                mark = "  <-- first divergence"
            elif r.over:
                mark = "  over"
            layer = "-" if r.layer is None else str(r.layer)
            lines.append(f"{layer:>5}  {r.op:<15}{r.max_abs:11.3e}{r.rel:11.3e}{r.cos:11.6f}{r.tol:9.1e}{mark}")
        if self.first is None:
            lines.append(f"no divergence: every op is within its tolerance ({len(self.rows)} ops compared)")
        else:
            f = self.first
            where = "model" if f.layer is None else f"layer {f.layer}"
            lines.append(f"first divergence: {where}, op {f.op} (rel {f.rel:.3e} > tol {f.tol:.1e})")
        if self.lens:
            tops = " | ".join(f"{i}:{layer[-1][0]!r}" for i, layer in enumerate(self.lens["tokens"]))
            lines.append(f"logit lens, top token at position {self.positions[-1]} per layer: {tops}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _ranges(ps: Sequence[int]) -> str:
    if len(ps) and list(ps) == list(range(ps[0], ps[-1] + 1)):
        return f"{ps[0]}..{ps[-1]}"
    return ",".join(str(p) for p in ps)



def make_reference(spec: str, model_path: Path, ref_python: str | None = None,
                   adapter: str | Path | None = None) -> Any:
    """'transformers' (on model_path), 'reference' (ellm's reference ops on model_path), or a
    folder / GGUF file for transformers to run; adapter: [lora] the LoRA adapter's path, run
    by the reference too (transformers takes a PEFT folder, through peft)."""
    if spec == "transformers":
        ref = TransformersReference(model_path, ref_python, adapter=adapter)
        ref.label = "transformers" + ("" if adapter is None else " + peft")
        return ref
    if spec == "reference":
        return OpsReference(model_path, adapter)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ReferenceError(f"--reference {spec!r}: expected 'transformers', 'reference' or the path of "
                             "a Hugging Face folder or GGUF file (no such path)")
    return TransformersReference(path, ref_python, adapter=adapter)


def trace(llm: Any, ids: Sequence[int], reference: Any, *, model_path: Path,
          positions: Iterable[int] | None = None, lens_top_k: int = 5,
          attention_layers: Iterable[int] = (), adapter: str | None = None) -> TraceResult:
    """Diff `llm` (any backend) against `reference` (make_reference()) on ids.

    model_path: the files llm was loaded from (they tell the weight type, hence the bands).
    adapter: [lora] the name of one of llm's LoRA adapters to run ellm with; the reference
    must have been made with that adapter's path (and without one when adapter is None)."""
    if (adapter is None) != (getattr(reference, "adapter", None) is None):
        have = "the base alone" if adapter is None else f"adapter {adapter!r}"
        raise ReferenceError(f"ellm runs {have} but the reference runs "
                             f"{'an adapter' if adapter is None else 'the base alone'}: give both the adapter "
                             "(make_reference(..., adapter=PATH)) or neither")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    mine = record(llm, ids, positions, lens_top_k=lens_top_k, adapter=adapter)
    seconds["ellm"] = round(time.perf_counter() - t0, 3)
    cfg = llm.model.config
    notes: list[str] = []
    wclass = tolerances.weight_class(model_path)
    if not tolerances.is_measured(wclass):
        notes.append(f"no noise band was measured for {wclass} weights; using {tolerances.UNMEASURED}")
    t0 = time.perf_counter()
    if isinstance(reference, OpsReference):
        theirs = reference.record(mine.ids, mine.positions.tolist()).arrays
        ours = mine.arrays
    else:
        full = reference.intermediates(mine.ids)
        notes += reference.meta.get("notes", [])
        theirs = select_positions(full, mine.positions, cfg.num_attention_heads)
        ours = to_transformers_layout(mine.arrays, cfg)
    seconds["reference"] = round(time.perf_counter() - t0, 3)
    rows = compare(ours, theirs, cfg.num_hidden_layers, lambda op: tolerances.band(wclass, op))
    missing = sorted({k[1] for k in mine.arrays} - {r.op for r in rows})
    if missing:
        notes.append(f"the reference did not record: {', '.join(missing)}")
    first = first_divergence(rows)
    pos_err: list[float] = []
    if first is not None:
        a, b = ours[(first.layer, first.op)], theirs[(first.layer, first.op)]
        pos_err = [float(np.linalg.norm(a[i] - b[i]) / max(np.linalg.norm(b[i]), 1e-30)) for i in range(len(a))]
    tok = llm.tokenizer
    lens: dict[str, Any] = dict(mine.lens or {})
    if lens:
        lens["tokens"] = [[[tok.decode([int(i)]) for i in cell] for cell in layer] for layer in lens["ids"]]
    return TraceResult(
        model=str(model_path), reference=reference.label, ids=list(mine.ids),
        tokens=[tok.decode([t]) for t in mine.ids], positions=mine.positions.tolist(),
        weight_class=wclass, rows=rows, first=first, lens=lens,
        attention={int(i): mine.arrays[(int(i), "attn_probs")] for i in attention_layers},
        notes=notes, seconds=seconds, position_errors=pos_err, adapter=adapter)


__all__ = ["TraceResult", "trace", "make_reference", "Recording"]
