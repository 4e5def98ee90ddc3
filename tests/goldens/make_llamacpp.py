"""Greedy continuations from llama.cpp (llama-cpp-python) on the same GGUF files.

Run with a Python that has llama-cpp-python (benchmarks/vs_llamacpp.py --install-llamacpp
builds one in benchmarks/.venv-llamacpp):
    python tests/goldens/make_llamacpp.py SMOLLM2.gguf GEMMA3.gguf
For each golden prompt (the token ids in tests/goldens/<model>.npz) it records llama.cpp's
32 greedy ids, its top-2 margin at each step, and its top-16 logits at the last prompt
position, in tests/goldens/llamacpp-<model>.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

HERE = Path(__file__).resolve().parent
MODELS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-instruct",
          "gemma-3-270m-q4_k_m.gguf": "gemma-3-270m"}


def main(paths: list[str]) -> None:
    for path in paths:
        name = MODELS[Path(path).name]
        golden = np.load(HERE / f"{name}.npz")
        prompts = sorted({k.split(".")[0] for k in golden.files if "." in k})
        llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=2, logits_all=True, verbose=False)
        out = {"model": name, "gguf_file": Path(path).name, "llama_cpp_python": __version__, "prompts": {}}
        for p in prompts:
            ids = [int(t) for t in golden[f"{p}.ids"]]
            llm.reset()
            llm.eval(ids)
            last = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
            top = np.argsort(-last)[:16]
            greedy, margins = [], []
            for _ in range(32):
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                two = np.sort(logits)[-2:]
                tok = int(logits.argmax())
                greedy.append(tok)
                margins.append(round(float(two[1] - two[0]), 4))
                llm.eval([tok])
            out["prompts"][p] = {"greedy_ids": greedy, "greedy_margins": margins,
                                 "last_top_ids": top.tolist(),
                                 "last_top_values": [round(float(v), 5) for v in last[top]]}
            print(name, p, greedy[:8], min(margins))
        (HERE / f"llamacpp-{name}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
