"""Random-weight bf16 Hugging Face folders of real models' shapes, made where they run.

Decode and prefill speed do not depend on the weights' values, so the GPU benchmark
needs no carried weights for Llama-3.2-1B or Llama-3-8B: this writes config.json, a
byte-level tokenizer (tokenizer.json: the 256 bytes, no merges) and model.safetensors
of normal(0, 0.02) matrices and unit norms, drawn with torch on `device` (seconds on a
GPU). transformers and ellm both load the folder.

    python benchmarks/gpu/random_folder.py llama-1b DEST [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Shapes of the public configs (Llama-3.2-1B, Meta-Llama-3-8B); "tiny" is for --dry-run.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                     max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                 max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
BOS, EOS = 256, 257   # the tokenizer's two special tokens, after the 256 bytes


def config_json(shape: str) -> dict[str, Any]:
    s = dict(SHAPES[shape])
    rope = s.pop("rope_parameters")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               attention_bias=False, mlp_bias=False, bos_token_id=BOS, eos_token_id=EOS,
               torch_dtype="bfloat16", dtype="bfloat16", rope_theta=rope["rope_theta"], **s)
    cfg["rope_parameters"] = rope   # transformers 5's name
    if rope["rope_type"] != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}   # older readers
    return cfg


def tokenizer_json() -> str:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok.to_str()


def weight_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    s = SHAPES[shape]
    H, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not s["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, H)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                    p + "mlp.down_proj.weight": (H, F)})
    return out


def make_random_folder(shape: str, dest: Path, device: str = "cuda", seed: int = 0) -> Path:
    """Writes the folder (whole or not at all: built beside dest, then renamed) -> dest."""
    import os
    import shutil

    import torch
    from safetensors.torch import save_file
    if (dest / "model.safetensors").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shp in weight_shapes(shape).items():
        if len(shp) == 1:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shp, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        tensors[name] = t.contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config_json(shape), indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    (tmp / "tokenizer.json").write_text(tokenizer_json())
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("dest", type=Path)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    print(make_random_folder(args.shape, args.dest, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
