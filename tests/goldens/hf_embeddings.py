"""Pooled last hidden states from transformers: the reference for ellm's LLM.embed.

Run with a Python that has torch + transformers (tests/run.sh's .venv-ref):
    python tests/goldens/hf_embeddings.py HF_FOLDER IDS_JSON OUT_NPZ
IDS_JSON holds a list of token-id lists. For each, the base model's last_hidden_state
(after the final norm) is pooled three ways and written to OUT_NPZ as `mean`, `last` and
`cls`, each (len(ids), hidden_size) float32, not normalised.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as tf


def main(folder: Path, ids_path: Path, out: Path) -> None:
    prompts = json.loads(ids_path.read_text())
    # One thread: on a shared, busy machine torch's spinning workers make these few short
    # prompts take ten times longer (24 s against 3 s measured).
    torch.set_num_threads(1)
    model = tf.AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    pooled: dict[str, list[np.ndarray]] = {"mean": [], "last": [], "cls": []}
    with torch.no_grad():
        for ids in prompts:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]   # (T, H)
            pooled["mean"].append(h.mean(dim=0).numpy())
            pooled["last"].append(h[-1].numpy())
            pooled["cls"].append(h[0].numpy())
    np.savez(out, **{k: np.stack(v).astype(np.float32) for k, v in pooled.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
