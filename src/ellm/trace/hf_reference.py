"""Named intermediates from Hugging Face transformers: the reference side of `ellm trace`.

Run as a script by a Python that has torch and transformers (`--reference-python` or
ELLM_REF_PYTHON); it imports nothing from ellm, so ellm need not be installed there:

    python -c "import runpy,sys; sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \
        hf_reference.py --model FOLDER [--gguf-file NAME] [--adapter PEFT_FOLDER] --ids 1,2,3 --out ref.npz

The model is loaded in float32 with eager attention (a GGUF through gguf_file=, which
dequantizes every tensor), run once over the ids, and observed only through transformers'
own module hooks, plus a wrapper around the modeling module's apply_rotary_pos_emb that
keeps what it returns. With --adapter, peft puts a LoRA adapter's layers into the model
first (the hooked projections' outputs then include the adapter's products). Every array is
saved in transformers' layout, one row per position: (T, features) float32 under
"<layer>.<op>" (layer "-" for embed / final_norm / logits), with op names as in
ellm/trace/recorder.py; attn_probs rows are (nh * T).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _rows(t: Any) -> np.ndarray:
    """(1, T, ...) -> (T, features) float32 numpy."""
    a = t.detach().float().cpu().numpy()
    return a.reshape(a.shape[-2], -1) if a.ndim == 3 else a.reshape(a.shape[0], -1)


def _heads_rows(t: Any) -> np.ndarray:
    """(1, n_heads, T, hd) -> (T, n_heads * hd)."""
    a = t.detach().float().cpu().numpy()[0]
    return np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(a.shape[1], -1)


class Capture:
    """Hooks on one model; `store` maps "<layer>.<op>" to (T, features) arrays."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.store: dict[str, np.ndarray] = {}
        self.current_layer: int | None = None
        self.handles: list[Any] = []
        self.restore: list[Callable[[], None]] = []
        self.notes: list[str] = []
        self.tokens = 0   # T of the pass being recorded

    def put(self, layer: int | None, op: str, arr: np.ndarray) -> None:
        self.store[f"{'-' if layer is None else layer}.{op}"] = np.ascontiguousarray(arr, np.float32)

    def out_hook(self, module: Any, layer: int | None, op: str, convert: Callable = _rows) -> None:
        def hook(_m: Any, _inp: Any, out: Any) -> None:
            self.put(layer, op, convert(out[0] if isinstance(out, tuple) else out))
        self.handles.append(module.register_forward_hook(hook))

    def in_hook(self, module: Any, layer: int, op: str) -> None:
        def hook(_m: Any, inp: Any) -> None:
            self.put(layer, op, _rows(inp[0]))
        self.handles.append(module.register_forward_pre_hook(hook))

    def norm_hook(self, module: Any, layer: int, op: str) -> None:
        """q_norm / k_norm: over the whole projection (1, T, n*hd), or per head on either
        (1, T, n, hd) (normed before the transpose: Qwen 3) or (1, n, T, hd) (after it:
        Gemma 3). A transposed input is not contiguous, which tells the two apart."""
        def hook(_m: Any, inp: Any, out: Any) -> None:
            a = out.detach().float().cpu().numpy()
            heads_first = out.dim() == 4 and (a.shape[1] != self.tokens if a.shape[1] != a.shape[2]
                                              else not inp[0].is_contiguous())
            self.put(layer, op, _heads_rows(out) if heads_first else a.reshape(self.tokens, -1))
        self.handles.append(module.register_forward_hook(hook))

    def split_hook(self, module: Any, layer: int, ops: list[tuple[str, int]]) -> None:
        """A fused projection (qkv_proj, gate_up_proj): its output split into named parts."""
        def hook(_m: Any, _inp: Any, out: Any) -> None:
            a = _rows(out)
            lo = 0
            for op, width in ops:
                self.put(layer, op, a[:, lo:lo + width])
                lo += width
        self.handles.append(module.register_forward_hook(hook))

    def attach(self) -> None:
        m = self.model
        cfg = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
        inner = m.model if hasattr(m, "model") else m
        if hasattr(inner, "language_model"):
            inner = inner.language_model
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", nh) or nh
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        # the residual stream entering layer 0: the embeddings with any scale or multiplier
        # the model applies after the embedding module (Gemma's is inside it, Granite's not)
        self.handles.append(inner.layers[0].register_forward_pre_hook(self._embed, with_kwargs=True))
        self.out_hook(inner.norm, None, "final_norm")
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.handles.append(attn.register_forward_pre_hook(self._enter(i)))
            if hasattr(layer, "input_layernorm"):   # OLMo 2 has none: the residual goes in
                self.out_hook(layer.input_layernorm, i, "attn_norm")
            if hasattr(attn, "qkv_proj"):
                self.split_hook(attn.qkv_proj, i, [("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)])
            else:
                for op in ("q", "k", "v"):
                    self.out_hook(getattr(attn, f"{op}_proj"), i, op)
            for op in ("q_norm", "k_norm"):
                if hasattr(attn, op):
                    self.norm_hook(getattr(attn, op), i, op)
            # (attn_output, attn_weights): eager attention returns the weights (1, nh, T, T)
            self.handles.append(attn.register_forward_hook(self._weights(i)))
            self.in_hook(attn.o_proj, i, "attn")
            self.out_hook(attn.o_proj, i, "o_proj")
            if hasattr(layer, "pre_feedforward_layernorm"):   # Gemma 2/3: four norms a layer
                self.out_hook(layer.post_attention_layernorm, i, "post_attn_norm")
                mlp_norm = layer.pre_feedforward_layernorm
            elif not hasattr(layer, "input_layernorm"):       # OLMo 2: post-norms only
                self.out_hook(layer.post_attention_layernorm, i, "post_attn_norm")
                mlp_norm = None
            else:
                mlp_norm = layer.post_attention_layernorm
            if mlp_norm is None:
                self.in_hook(mlp, i, "resid_attn")
            else:
                self.in_hook(mlp_norm, i, "resid_attn")
                self.out_hook(mlp_norm, i, "mlp_norm")
            if not hasattr(mlp, "down_proj"):   # a sparse MoE block: only its output
                self.out_hook(mlp, i, "down")
            elif hasattr(mlp, "gate_up_proj"):
                f = cfg.intermediate_size
                self.split_hook(mlp.gate_up_proj, i, [("gate", f), ("up", f)])
            else:
                self.out_hook(mlp.gate_proj, i, "gate")
                self.out_hook(mlp.up_proj, i, "up")
            if hasattr(mlp, "down_proj"):
                self.in_hook(mlp.down_proj, i, "act")
                self.out_hook(mlp.down_proj, i, "down")
            if hasattr(layer, "post_feedforward_layernorm"):
                self.out_hook(layer.post_feedforward_layernorm, i, "post_mlp_norm")
            self.out_hook(layer, i, "resid_mlp")
        self._wrap_rope(type(inner.layers[0].self_attn).__module__)

    def _embed(self, _m: Any, args: Any, kwargs: Any) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        self.put(None, "embed", _rows(x))

    def _enter(self, i: int) -> Callable:
        def hook(_m: Any, _inp: Any) -> None:
            self.current_layer = i
        return hook

    def _weights(self, i: int) -> Callable:
        def hook(_m: Any, _inp: Any, out: Any) -> None:
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if w is None:
                self.notes.append(f"layer {i}: the attention returned no weights")
                return
            a = w.detach().float().cpu().numpy()[0]                  # (nh, T, T)
            self.put(i, "attn_probs", np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(a.shape[1], -1))
        return hook

    def _wrap_rope(self, module_name: str) -> None:
        """Keeps q and k as transformers' own apply_rotary_pos_emb returns them."""
        mod = importlib.import_module(module_name)
        original = getattr(mod, "apply_rotary_pos_emb", None)
        if original is None:
            self.notes.append(f"{module_name} has no apply_rotary_pos_emb: q_rope/k_rope not recorded")
            return

        def recording(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            q2, k2 = original(q, k, *args, **kwargs)
            self.put(self.current_layer, "q_rope", _heads_rows(q2))
            self.put(self.current_layer, "k_rope", _heads_rows(k2))
            return q2, k2

        setattr(mod, "apply_rotary_pos_emb", recording)
        self.restore.append(lambda: setattr(mod, "apply_rotary_pos_emb", original))


def load(model_path: str, gguf_file: str | None, adapter: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if adapter:
        try:
            from peft import PeftModel
        except ImportError:
            raise SystemExit("error: tracing with a LoRA adapter needs peft in the reference Python") from None
        # peft swaps the adapted projections for its LoRA layers inside the model itself;
        # the model (not the wrapper) is what the hooks look into
        model = PeftModel.from_pretrained(model, adapter).get_base_model()
    model.eval()
    return model


def run(model: Any, ids: list[int]) -> tuple[dict[str, np.ndarray], dict]:
    """One forward pass over ids with the hooks on; the hooks are removed after it."""
    import torch
    import transformers

    cap = Capture(model)
    cap.tokens = len(ids)
    cap.attach()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
        cap.put(None, "logits", _rows(out.logits))
    finally:
        for h in cap.handles:
            h.remove()
        for undo in cap.restore:
            undo()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "class": type(model).__name__, "forward_s": round(time.perf_counter() - t0, 3),
            "notes": cap.notes}
    return cap.store, meta


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"error: --ids must be comma-separated integers, got {text[:80]!r}") from None
    if not ids:
        raise SystemExit("error: an --ids list is empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face folder (or the folder of --gguf-file)")
    p.add_argument("--gguf-file", default=None, help="a GGUF file name inside --model")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA folder to run the model with")
    p.add_argument("--ids", action="append", default=[],
                   help="comma-separated token ids; repeat with --out for several prompts")
    p.add_argument("--out", action="append", default=[], help="the .npz to write, one per --ids")
    p.add_argument("--jobs", default=None, metavar="JSON",
                   help='instead of the above: a file [{"model", "gguf_file", "adapter", "ids": [...], "out"}, ...] '
                        "(several models in one process: torch and transformers load once)")
    a = p.parse_args(argv)
    if a.jobs:
        jobs = json.loads(Path(a.jobs).read_text())
    else:
        if not a.model:
            p.error("--model (or --jobs) is required")
        if len(a.ids) != len(a.out) or not a.ids:
            p.error(f"give --ids and --out in pairs ({len(a.ids)} --ids, {len(a.out)} --out)")
        jobs = [{"model": a.model, "gguf_file": a.gguf_file, "adapter": a.adapter, "ids": t, "out": o}
                for t, o in zip(a.ids, a.out)]
    models: dict[tuple[str, str | None, str | None], tuple[Any, float]] = {}
    for job in jobs:
        ids = job["ids"] if isinstance(job["ids"], list) else _parse_ids(job["ids"])
        if not ids or not all(isinstance(t, int) for t in ids):
            p.error(f"job for {job['model']}: ids must be a non-empty list of integers")
        key = (job["model"], job.get("gguf_file"), job.get("adapter"))
        if key not in models:
            models.clear()   # one model in memory at a time; jobs come grouped by model
            t0 = time.perf_counter()
            models[key] = (load(*key), round(time.perf_counter() - t0, 3))
        model, load_s = models[key]
        store, meta = run(model, ids)
        meta["load_s"] = load_s
        # (Any: to mypy a name among **arrays could be savez's own allow_pickle)
        arrays: dict[str, Any] = {"__meta__": np.array(json.dumps(meta)), **store}
        np.savez(Path(job["out"]), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
