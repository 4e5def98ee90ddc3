"""llama.cpp's logits on the tiny models' GGUF files, for tests/test_tiny_models.py.

Makes the tiny models (tiny_models.py, in the reference Python), converts each new
family's folder with llama.cpp's converter (convert_tiny.py) at f32 and q8_0, and runs
every file through llama.cpp (llama-cpp-python, this Python) with an f32 KV cache:
    python tests/goldens/make_llamacpp_tiny.py REF_PYTHON LLAMA_CPP_DIR
Writes tests/goldens/llamacpp-tiny.json (each file's sha256, so a test that converts again
knows it has the same file; llama.cpp's greedy ids and margins, its argmax at every
prompt position) and llamacpp-tiny.npz (the f32 files' logits at every position).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

HERE = Path(__file__).resolve().parent
FAMILIES = ("qwen2", "qwen3", "mistral", "smollm3", "olmo2", "granite", "phi3", "qwen3_moe")
# llama.cpp rounds n_ctx up to 256 and takes Phi-3's long LongRoPE factors once n_ctx exceeds
# original_max_position_embeddings, transformers and ellm the short ones below it: the tiny
# Phi-3's original length is 256, so its n_ctx 256 keeps the short factors.
N_CTX = 64
N_CTX_OF = {"phi3": 256}
OUTTYPES = ("f32", "q8_0")
GREEDY_TOKENS = 8
GGML_TYPE_F32 = 0


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_llamacpp(path: Path, ids: list[int], n_ctx: int) -> tuple[np.ndarray, list[int], list[float]]:
    """-> logits (len(ids), vocab) at every prompt position, greedy ids, their top-2 margins."""
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, logits_all=True, verbose=False,
                type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    greedy, margins = [], []
    for _ in range(GREEDY_TOKENS):
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        two = np.sort(last)[-2:]
        greedy.append(int(last.argmax()))
        margins.append(round(float(two[1] - two[0]), 5))
        llm.eval([greedy[-1]])
    return logits, greedy, margins


def main(ref_python: str, llama_cpp: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tiny, ggufs = Path(tmp) / "tiny", Path(tmp) / "gguf"
        subprocess.run([ref_python, str(HERE / "tiny_models.py"), str(tiny)], check=True, capture_output=True)
        subprocess.run([ref_python, str(HERE / "convert_tiny.py"), llama_cpp, str(ggufs),
                        *(str(tiny / f) for f in FAMILIES), "--outtypes", ",".join(OUTTYPES)],
                       check=True, capture_output=True)
        record = {"llama_cpp_python": __version__, "kv_cache": "f32", "files": {}}
        arrays = {}
        for family in FAMILIES:
            ids = np.load(tiny / family / "ids.npy").tolist()
            for outtype in OUTTYPES:
                name = f"{family}-{outtype}"
                logits, greedy, margins = run_llamacpp(ggufs / f"{name}.gguf", ids, N_CTX_OF.get(family, N_CTX))
                top2 = np.sort(logits, axis=1)[:, -2:]
                record["files"][name] = {
                    "sha256": sha256(ggufs / f"{name}.gguf"), "greedy_ids": greedy, "greedy_margins": margins,
                    "argmax": logits.argmax(1).tolist(),
                    "argmax_margins": [round(float(m), 5) for m in top2[:, 1] - top2[:, 0]]}
                if outtype == "f32":
                    arrays[f"{name}.logits"] = logits
                print(name, greedy, min(margins))
    (HERE / "llamacpp-tiny.json").write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(HERE / "llamacpp-tiny.npz", **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
