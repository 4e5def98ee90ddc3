"""Make the reference data ellm's tests compare against, with Hugging Face transformers.

Run it with a Python that has torch, transformers and gguf (``.venv-ref`` made by
tests/run.sh, or /opt/venvs/gold on the team machine); it never imports ellm's
compiled parts and ellm need not be installed there.

    python tests/goldens/make.py --goldens                 # tests/goldens/<model>.npz + .json
    python tests/goldens/make.py --folders ~/.cache/ellm/hf  # HF folders <model>-f32/, <model>-bf16/

For each model transformers loads the GGUF, dequantizing every tensor to f32. That
f32 model is the reference: the goldens hold, per prompt, the token ids, the top-64
logits at the last position, the full-vocabulary argmax and a 32-step greedy
continuation (no stop at EOS) with the top-1/top-2 margin and top-16 logits of every
step, so tests can compare greedy ids only up to the first step whose margin is
within their arithmetic's error. The short prompt also keeps the top-16 logits of
every position, to check prefill at all positions.

``--folders`` saves the same weights as Hugging Face folders: f32 sharded (>= 2
shards + index, to exercise the sharded path) and bf16 in one file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
GOLDENS_DIR = Path(__file__).resolve().parent
MODELS = ("smollm2-135m-instruct", "gemma-3-270m")

TOP_LAST = 64  # logits kept at the last prompt position
TOP_STEP = 16  # logits kept per greedy step and per prompt position (short prompt)
N_GREEDY = 32
F32_SHARD_SIZE = "200MB"  # small enough that both f32 models split into >= 2 shards


# ---------------------------------------------------------------------------
# Finding the GGUF files without importing compiled ellm
# ---------------------------------------------------------------------------


def load_pure_hub() -> types.ModuleType:
    """Import src/ellm/hub.py (and its relative imports) without running ellm/__init__.py.

    ellm/__init__.py imports the compiled engine, which this Python does not have;
    hub.py and progress.py are pure Python, so they are loaded into a stand-in package.
    """
    pkg = types.ModuleType("_ellm_pure")
    pkg.__path__ = [str(REPO / "src" / "ellm")]
    sys.modules.setdefault("_ellm_pure", pkg)
    return importlib.import_module("_ellm_pure.hub")


def gguf_paths(overrides: list[str], wanted: list[str]) -> dict[str, Path]:
    """``name=path`` pairs from the command line; the rest of the `wanted` models (and
    only those: a machine without network asks for what it carried) pulled through
    ellm.hub."""
    paths: dict[str, Path] = {}
    for item in overrides:
        name, sep, path = item.partition("=")
        if not sep or name not in MODELS:
            raise SystemExit(
                f"--gguf wants NAME=PATH with NAME one of {', '.join(MODELS)}"
            )
        paths[name] = Path(path).expanduser()
    missing = [m for m in wanted if m not in paths]
    if missing:
        hub = load_pure_hub()
        for name in missing:
            paths[name] = hub.pull(name)
    return paths


# ---------------------------------------------------------------------------
# Prompts (deterministic, written here so they never change by accident)
# ---------------------------------------------------------------------------

SHORT = "The capital of France is"

CHAT_MESSAGES = [
    {
        "role": "user",
        "content": "What is the boiling point of water at sea level? Answer in one sentence.",
    }
]

_TOWN = [
    "The river that runs past the old mill town rises in the hills to the north and reaches the sea two days' walk to the south.",
    "Every spring the snow on the hills melts, and the water climbs the stone steps that the millers cut into the bank long ago.",
    "The baker opens her shop before dawn, and the smell of bread drifts across the square while the lamps are still lit.",
    "Children learn to count by the bells of the clock tower, which strike once for each hour and twice at noon.",
    "Traders arrive by barge with salt, wool and iron, and leave with flour, cheese and the blue cloth the weavers are known for.",
    "A wooden bridge with seven arches joins the two halves of the town, and each arch is named after a family that helped build it.",
    "In the library above the town hall, a clerk keeps a ledger of every flood, with the height of the water marked in red ink.",
    "When the autumn fog settles in the valley, the ferryman rings a small bell so that boats can find the landing.",
    "The school teaches reading, arithmetic, music and the history of the valley, and its oldest desk is carved with hundreds of names.",
    "On market days the square fills with stalls, and the mayor walks from one end to the other greeting everyone by name.",
    "Farmers on the western slopes grow apples and pears, while those on the eastern side keep goats and make a sharp white cheese.",
    "At night the mill wheel keeps turning, and its slow creak is the last sound many people hear before they fall asleep.",
]
_ORDINALS = [
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
]


def town_text(tokenizer: Any, target_tokens: int) -> str:
    """An English text of about ``target_tokens`` tokens, built from fixed sentences.

    Each pass over the sentences starts at a different one and closes with its own
    line, so a long text is varied rather than one paragraph copied; it stops at the
    first sentence boundary at or past the target.
    """
    sentences: list[str] = []
    n = len(_TOWN)
    for cycle in range(len(_ORDINALS)):
        order = [_TOWN[(cycle * 5 + i) % n] for i in range(n)]
        if cycle % 2:
            order.reverse()
        order.append(f"So ended the {_ORDINALS[cycle]} year of the town's chronicle.")
        for sentence in order:
            sentences.append(sentence)
            text = _join(sentences)
            if len(tokenizer(text)["input_ids"]) >= target_tokens:
                return text
    raise AssertionError(f"the town text is shorter than {target_tokens} tokens")


def _join(sentences: list[str]) -> str:
    # A paragraph break every four sentences, as prose has.
    paras = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)]
    return "\n\n".join(paras)


def chat_text(model_name: str, tokenizer: Any) -> tuple[str, str]:
    """The chat prompt as text (special tokens written out) and how it was templated."""
    if model_name.startswith("gemma"):
        # The Gemma GGUF carries no chat template: use Gemma's turn format. The
        # tokenizer adds <bos> itself, so it is not written here.
        (msg,) = CHAT_MESSAGES
        text = f"<start_of_turn>user\n{msg['content']}<end_of_turn>\n<start_of_turn>model\n"
        return text, "gemma turn format (bos added by the tokenizer)"
    text = tokenizer.apply_chat_template(
        CHAT_MESSAGES, tokenize=False, add_generation_prompt=True
    )
    return text, "the model's own chat template, add_generation_prompt=True"


def build_prompts(model_name: str, tokenizer: Any) -> dict[str, dict[str, Any]]:
    chat, how = chat_text(model_name, tokenizer)
    prompts: dict[str, dict[str, Any]] = {
        "short": {"text": SHORT},
        "medium": {"text": town_text(tokenizer, 300)},
        "chat": {"text": chat, "messages": CHAT_MESSAGES, "template": how},
    }
    if model_name.startswith("gemma"):
        # Longer than Gemma 3's 512-token sliding window.
        prompts["long"] = {"text": town_text(tokenizer, 700)}
    return prompts


# ---------------------------------------------------------------------------
# Loading and running the reference
# ---------------------------------------------------------------------------


def load_reference(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Eager attention: the plainest implementation, the one to trust as a reference.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model, tok


def run_prompt(
    model: Any, ids: list[int], all_positions: bool
) -> dict[str, np.ndarray]:
    """Prefill ``ids``, then decode N_GREEDY greedy tokens with the KV cache."""
    import torch

    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        res = model(input_ids=torch.tensor([ids]), use_cache=True)
        logits = res.logits[0].float()  # (T, vocab)
        cache = res.cache
        last = logits[-1]
        top = torch.topk(last, TOP_LAST)
        out["last_top_values"] = top.values.numpy().astype(np.float32)
        out["last_top_ids"] = top.indices.numpy().astype(np.int32)
        out["last_argmax"] = np.array(int(torch.argmax(last)), dtype=np.int32)
        out["last_logsumexp"] = np.array(
            float(torch.logsumexp(last, 0)), dtype=np.float32
        )
        if all_positions:
            top_all = torch.topk(logits, TOP_STEP, dim=-1)
            out["all_top_values"] = top_all.values.numpy().astype(np.float32)
            out["all_top_ids"] = top_all.indices.numpy().astype(np.int32)

        greedy, margins, step_vals, step_ids = [], [], [], []
        cur = last
        for step in range(N_GREEDY):
            t = torch.topk(cur, TOP_STEP)
            tok = int(torch.argmax(cur))
            greedy.append(tok)
            margins.append(float(t.values[0] - t.values[1]))
            step_vals.append(t.values.numpy())
            step_ids.append(t.indices.numpy())
            if step + 1 < N_GREEDY:
                res = model(
                    input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True
                )
                cache = res.cache
                cur = res.logits[0, -1].float()
    out["greedy_ids"] = np.array(greedy, dtype=np.int32)
    out["greedy_margins"] = np.array(margins, dtype=np.float32)
    out["step_top_values"] = np.stack(step_vals).astype(
        np.float32
    )  # (N_GREEDY, TOP_STEP)
    out["step_top_ids"] = np.stack(step_ids).astype(np.int32)
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def make_goldens(
    model_name: str, gguf: Path, model: Any, tok: Any, out_dir: Path
) -> None:
    t0 = time.perf_counter()
    prompts = build_prompts(model_name, tok)
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {
        "model": model_name,
        "gguf_file": gguf.name,
        "reference": "transformers, GGUF dequantized to float32, eager attention",
        "versions": versions(),
        "n_greedy": N_GREEDY,
        "greedy_note": f"{N_GREEDY} greedy steps with the KV cache, not stopped at EOS; "
        "step i's top values/ids are the logits that chose greedy_ids[i]",
        "ids_note": "ids = tokenizer(text) with the tokenizer's default special tokens",
        "prompts": {},
    }
    for key, p in prompts.items():
        ids = tok(p["text"])["input_ids"]
        res = run_prompt(model, ids, all_positions=(key == "short"))
        arrays[f"{key}.ids"] = np.array(ids, dtype=np.int32)
        for field, value in res.items():
            arrays[f"{key}.{field}"] = value
        info = {k: v for k, v in p.items()}
        info["n_tokens"] = len(ids)
        info["greedy_text"] = tok.decode(res["greedy_ids"].tolist())
        info["min_margin"] = float(res["greedy_margins"].min())
        meta["prompts"][key] = info
        print(
            f"  {key}: {len(ids)} tokens -> {info['greedy_text'][:60]!r} "
            f"(min margin {info['min_margin']:.4f})",
            flush=True,
        )
    arrays["meta"] = np.array(json.dumps(meta))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{model_name}.npz.tmp"
    with tmp.open("wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, out_dir / f"{model_name}.npz")

    # A readable companion: everything but the per-step top-k tables.
    readable = json.loads(json.dumps(meta))
    for key in prompts:
        r = readable["prompts"][key]
        r["ids"] = arrays[f"{key}.ids"].tolist()
        r["greedy_ids"] = arrays[f"{key}.greedy_ids"].tolist()
        r["greedy_margins"] = [
            round(float(m), 4) for m in arrays[f"{key}.greedy_margins"]
        ]
        r["last_top5"] = [
            [int(i), round(float(v), 4)]
            for i, v in zip(
                arrays[f"{key}.last_top_ids"][:5], arrays[f"{key}.last_top_values"][:5]
            )
        ]
    text = json.dumps(readable, indent=1, ensure_ascii=False)
    # Keep number lists on one line each: the file is for reading.
    text = re.sub(
        r"\[\s+([-0-9.,\s]+?)\s+\]",
        lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]",
        text,
    )
    (out_dir / f"{model_name}.json").write_text(text + "\n")
    print(f"  goldens written in {time.perf_counter() - t0:.1f} s", flush=True)


# ---------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------


def save_folder(model: Any, tok: Any, dest: Path, max_shard_size: str) -> None:
    """save_pretrained into a temporary sibling, then rename: a folder is whole or absent."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tok.save_pretrained(tmp)
        _chat_template_into_config(tmp)
        _make_readable(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    shards = sorted(p.name for p in dest.glob("*.safetensors"))
    print(f"  saved {dest} ({len(shards)} safetensors file(s))", flush=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only files; the cache is shared, so give
    # the folder the permissions an ordinary save would have had under this umask.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _chat_template_into_config(folder: Path) -> None:
    # transformers 5 writes the template to chat_template.jinja only; older loaders
    # (and ellm's tokenizer, by choice) also look in tokenizer_config.json.
    jinja = folder / "chat_template.jinja"
    cfg_path = folder / "tokenizer_config.json"
    if jinja.is_file() and cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = jinja.read_text()
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def plain_copy(model: Any) -> Any:
    """The model as a plain f32 transformers model. A GGUF-loaded one carries the GGUF
    quantizer's marker, and transformers >= 5.17 refuses to save_pretrained it ("quantized
    with GGUF and is not serializable") even though its tensors are plain f32 by now; a
    model built from the same config without quantization_config, given the loaded
    weights, saves on every version."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    if getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None:
        return model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"rebuilding the GGUF model as a plain one: missing {missing}, unexpected {unexpected}")
    return plain.eval()


def make_folders(model_name: str, model: Any, tok: Any, out_dir: Path) -> None:
    import torch

    t0 = time.perf_counter()
    model = plain_copy(model)
    save_folder(model, tok, out_dir / f"{model_name}-f32", F32_SHARD_SIZE)
    model.to(torch.bfloat16)  # last use of the model: converting in place is fine
    save_folder(model, tok, out_dir / f"{model_name}-bf16", "20GB")
    print(f"  folders written in {time.perf_counter() - t0:.1f} s", flush=True)


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--goldens", action="store_true", help="write tests/goldens/<model>.npz/.json"
    )
    ap.add_argument("--goldens-dir", type=Path, default=GOLDENS_DIR)
    ap.add_argument(
        "--folders", type=Path, metavar="OUT_DIR", help="save HF folders under OUT_DIR"
    )
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="use this GGUF instead of pulling NAME through ellm.hub",
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.goldens and not args.folders:
        ap.error("nothing to do: give --goldens and/or --folders OUT_DIR")

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    paths = gguf_paths(args.gguf, args.models)
    for name in args.models:
        t0 = time.perf_counter()
        print(f"{name}: loading {paths[name]}", flush=True)
        model, tok = load_reference(paths[name])
        print(f"  loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.goldens:
            make_goldens(name, paths[name], model, tok, args.goldens_dir)
        if args.folders:
            make_folders(name, model, tok, args.folders.expanduser())
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
