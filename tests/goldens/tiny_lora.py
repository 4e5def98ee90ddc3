"""Makes tiny random bases with random PEFT LoRA adapters, and transformers + peft's
logits for each adapter.

Run with a Python that has torch + transformers + peft (tests/run.sh's .venv-ref):
    python tests/goldens/tiny_lora.py OUT_DIR
For each base family (llama; qwen2, whose q/k/v have biases; phi3, whose q/k/v and
gate/up are fused matrices) it writes OUT_DIR/<arch>/
(the base folder as tests/goldens/tiny_models.py makes it, ids.npy, logits.npy and
greedy.npy of the base) and OUT_DIR/<arch>/adapters/<name>/ (a PEFT adapter folder, and
logits.npy / greedy.npy of the base with that adapter, and for llama and qwen2 the same
adapter as a llama.cpp LoRA GGUF, adapter.gguf). PEFT starts B at zero; here A and
B are both drawn at random, so every adapter changes the logits.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import CONFIGS, GREEDY_TOKENS, make_tokenizer, _randomize, _set_tokenizer_class  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (r, lora_alpha, use_rslora, target modules)
ADAPTERS = {
    "llama": {
        "qv4": (4, 8, False, ["q_proj", "v_proj"]),
        "all16": (16, 24, False, ALL),
        "mlp8rs": (8, 4, True, ["o_proj", "gate_proj", "down_proj"]),
    },
    "qwen2": {
        "qkv4": (4, 12, False, ["q_proj", "k_proj", "v_proj"]),
        "all16rs": (16, 8, True, ALL),
        "ud8": (8, 16, False, ["up_proj", "down_proj", "k_proj"]),
    },
    # fused projections: one A for q/k/v (gate/up), B's rows split between them
    "phi3": {
        "fused8": (8, 12, False, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    },
}


def _run(model: torch.nn.Module, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].numpy()
        greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                min_new_tokens=GREEDY_TOKENS, do_sample=False)[0, ids.shape[1]:]
    return logits.astype(np.float32), greedy.numpy().astype(np.int32)


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's order of a Llama GGUF's q/k rows (RoPE pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(path: Path, arch: str, peft_model: torch.nn.Module, r: int, alpha: float,
                       rslora: bool, config) -> None:
    """The adapter as a llama.cpp LoRA GGUF (the layout of its convert_lora_to_gguf.py,
    written with its gguf package): blk.N.<tensor>.weight.lora_a (r, in) and .lora_b
    (out, r), Llama's q/k rows of B permuted as the base's; adapter.lora.alpha is the
    alpha whose alpha / r is the adapter's scale (rsLoRA's too)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha / np.sqrt(r) * r if rslora else alpha))
    for name, p in peft_model.named_parameters():
        if "lora_A" not in name and "lora_B" not in name:
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        module = parts[parts.index("lora_A" if "lora_A" in name else "lora_B") - 1]
        arr = p.detach().numpy().astype(np.float32)
        if "lora_B" in name and arch == "llama" and module in ("q_proj", "k_proj"):
            arr = _permute(arr, config.num_attention_heads if module == "q_proj" else config.num_key_value_heads)
        suffix = "lora_a" if "lora_A" in name else "lora_b"
        w.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.{suffix}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(out: Path) -> None:
    import transformers as tf
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    tokenizer = make_tokenizer(320)
    for arch, adapters in ADAPTERS.items():
        config = CONFIGS[arch]()
        config._attn_implementation = "eager"
        base = tf.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        _randomize(arch, base)
        folder = out / arch
        base.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        if arch == "phi3":   # as tiny_models.py: llama.cpp's converter then reads the BPE
            _set_tokenizer_class(folder, "GPT2Tokenizer")
        np.save(folder / "ids.npy", ids[0].numpy().astype(np.int32))
        logits, greedy = _run(base, ids)
        np.save(folder / "logits.npy", logits)
        np.save(folder / "greedy.npy", greedy)
        for name, (r, alpha, rslora, targets) in adapters.items():
            cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
            peft_model = get_peft_model(base, cfg, adapter_name="default")
            with torch.no_grad():
                for pname, p in peft_model.named_parameters():
                    if "lora_A" in pname or "lora_B" in pname:
                        p.normal_(0.0, 0.3)
            peft_model.eval()
            adir = folder / "adapters" / name
            peft_model.save_pretrained(adir, safe_serialization=True)
            logits, greedy = _run(peft_model, ids)
            np.save(adir / "logits.npy", logits)
            np.save(adir / "greedy.npy", greedy)
            if arch in ("llama", "qwen2"):
                write_gguf_adapter(adir / "adapter.gguf", arch, peft_model, r, alpha, rslora, config)
            base = peft_model.unload()   # the base without the adapter's layers, for the next one
            print(arch, name, logits.shape, greedy.tolist())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
