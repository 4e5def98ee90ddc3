"""See inside a forward pass: named intermediates, a diff against a reference that names the
first op to go wrong (`ellm trace`), logit lens and attention data, and a live page
(`ellm inspect`, in inspect/).

recorder.py   the Recorder a model's forward calls (zero cost when model.recorder is None)
capture.py    one traced prefill pass of an LLM -> Recording
references.py transformers in another Python (hf_reference.py) / ellm's NumPy reference ops
align.py      ellm's layout -> transformers' (GGUF Q/K row order)
diff.py       per-op max abs / relative error / cosine; the first divergence
tolerances.py the noise band per weight type, measured on the real models
lens.py       logit lens and attention maps from a Recording
tracer.py     trace(): all of the above; TraceResult.table() / .as_json()
"""
from __future__ import annotations

from .capture import Recording, record
from .recorder import Recorder
from .tracer import TraceResult, make_reference, trace

__all__ = ["Recorder", "Recording", "TraceResult", "make_reference", "record", "trace"]
