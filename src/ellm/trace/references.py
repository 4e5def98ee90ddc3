"""The references a trace compares ellm against.

- transformers: hf_reference.py run as a script by another Python (one with torch), on
  a Hugging Face folder or on a GGUF that transformers loads and dequantizes;
- ellm's own NumPy reference ops (ops/reference.py) on the same weights, recorded by the
  same forward pass with the same Recorder.

Either may run the model with a LoRA adapter ([lora], `adapter=`): transformers through
peft on a PEFT folder, the reference ops through ellm's own loader (a PEFT folder or a
llama.cpp LoRA GGUF).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .recorder import Key

HF_SCRIPT = Path(__file__).with_name("hf_reference.py")
REF_PYTHON_ENV = "ELLM_REF_PYTHON"


class ReferenceError(RuntimeError):
    """The reference could not be run; the message says why and what to change."""


def reference_python(explicit: str | None) -> str:
    """The interpreter that runs transformers: --reference-python, else $ELLM_REF_PYTHON."""
    py = explicit or os.environ.get(REF_PYTHON_ENV)
    if not py:
        raise ReferenceError("--reference transformers needs a Python with torch and transformers: "
                             f"pass --reference-python PATH or set {REF_PYTHON_ENV}")
    if not Path(py).exists():
        raise ReferenceError(f"reference Python {py!r} does not exist")
    return py


def peft_folder(adapter: str | Path) -> Path:
    """A LoRA adapter transformers can run (through peft): a PEFT folder; a llama.cpp LoRA
    GGUF is refused here, naming the reference that reads it."""
    p = Path(adapter).expanduser()
    if p.is_file() and p.name == "adapter_config.json":
        p = p.parent
    if not (p / "adapter_config.json").is_file():
        what = "a llama.cpp LoRA GGUF" if p.suffix == ".gguf" else "not a PEFT folder (no adapter_config.json)"
        raise ReferenceError(f"the adapter {p} is {what}: transformers runs PEFT folders only "
                             "(trace it with --reference reference, ellm's NumPy ops)")
    return p


class TransformersReference:
    """transformers on a folder or GGUF file; results kept per ids (one run serves many traces).
    adapter: [lora] a PEFT folder that peft applies to the model (None: the base alone)."""

    def __init__(self, path: Path, python: str | None = None, timeout_s: float = 900.0,
                 adapter: str | Path | None = None) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file() and not (self.path / "config.json").is_file():
            raise ReferenceError(f"{self.path} is neither a GGUF file nor a Hugging Face folder")
        self.adapter = None if adapter is None else peft_folder(adapter)
        self.python = reference_python(python)
        self.timeout_s = timeout_s
        self.label = f"transformers on {self.path}" + ("" if self.adapter is None else f" + peft {self.adapter}")
        self.meta: dict[str, Any] = {}
        self._runs: dict[tuple[int, ...], dict[Key, np.ndarray]] = {}

    def intermediates(self, ids: Sequence[int]) -> dict[Key, np.ndarray]:
        """{(layer, op): (T, features)} at every position, in transformers' layout."""
        key = tuple(int(t) for t in ids)
        if key not in self._runs:
            self.prefetch([key])
        return self._runs[key]

    def prefetch(self, prompts: Sequence[Sequence[int]]) -> None:
        """Runs several prompts in one transformers process (the model loads once)."""
        prefetch_together([(self, prompts)])


def prefetch_together(work: Sequence[tuple[TransformersReference, Sequence[Sequence[int]]]]) -> None:
    """Several references' prompts in one transformers process (torch imports once); the
    references must share one Python."""
    jobs: list[dict[str, Any]] = []
    owners: list[tuple[TransformersReference, tuple[int, ...]]] = []
    for ref, prompts in work:
        for ids in dict.fromkeys(tuple(int(t) for t in p) for p in prompts):
            if ids not in ref._runs:
                jobs.append({"model": str(ref.path.parent if ref.path.is_file() else ref.path),
                             "gguf_file": ref.path.name if ref.path.is_file() else None,
                             "adapter": None if ref.adapter is None else str(ref.adapter), "ids": list(ids)})
                owners.append((ref, ids))
    if not jobs:
        return
    python, timeout_s = work[0][0].python, sum(ref.timeout_s for ref, _ in work)
    if any(ref.python != python for ref, _ in work):
        raise ReferenceError("references run together must use the same Python")
    with tempfile.TemporaryDirectory(prefix="ellm-trace-") as tmp:
        for i, job in enumerate(jobs):
            job["out"] = str(Path(tmp) / f"ref{i}.npz")
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        # Run the file without putting its folder on sys.path (its neighbours, such as the
        # inspect/ package, would shadow modules of the same name), from an empty cwd.
        launcher = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        cmd = [python, "-c", launcher, str(HF_SCRIPT), "--jobs", str(Path(tmp) / "jobs.json")]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise ReferenceError(f"transformers did not finish within {timeout_s:.0f} s") from None
        if proc.returncode != 0 or not all(Path(j["out"]).is_file() for j in jobs):
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            names = ", ".join(sorted({str(ref.path) for ref, _ in owners}))
            raise ReferenceError(f"transformers failed (exit {proc.returncode}) on {names}:\n{tail}")
        for job, (ref, ids) in zip(jobs, owners):
            with np.load(job["out"], allow_pickle=False) as npz:
                ref.meta = json.loads(str(npz["__meta__"]))
                ref._runs[ids] = {_key(k): npz[k] for k in npz.files if k != "__meta__"}


def _key(name: str) -> Key:
    layer, op = name.split(".", 1)
    return (None if layer == "-" else int(layer), op)


class OpsReference:
    """ellm's forward pass on ops/reference.py (NumPy, f32 on dequantized weights), with
    adapter ([lora]: a PEFT folder or llama.cpp LoRA GGUF) when one is given."""

    def __init__(self, source: str | Path, adapter: str | Path | None = None) -> None:
        self.source = source
        self.adapter = adapter
        self.label = "ellm reference ops" + ("" if adapter is None else f" + {adapter}")
        self._llm: Any = None

    def record(self, ids: Sequence[int], positions: Iterable[int] | None) -> Any:
        import ellm
        from .capture import record
        if self._llm is None:
            adapters = None if self.adapter is None else {"traced": self.adapter}
            self._llm = ellm.load(self.source, device="reference", max_num_seqs=1, progress=False,
                                  lora_adapters=adapters)
        return record(self._llm, ids, positions, adapter=None if self.adapter is None else "traced")
