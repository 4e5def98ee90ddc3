"""Makes tiny random models of every supported architecture with transformers.

Run with a Python that has torch + transformers (tests/run.sh's .venv-ref):
    python tests/goldens/tiny_models.py OUT_DIR
For each architecture it writes OUT_DIR/<arch>/ (config.json + model.safetensors in
f32) and OUT_DIR/<arch>/logits.npy: transformers' logits for ids.npy, every position.
Small windows and caps make the sliding-window and soft-capping paths matter.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import transformers as tf

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "gemma": lambda: tf.GemmaConfig(**{**COMMON, "tie_word_embeddings": True}, head_dim=32),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                      final_logit_softcapping=5.0, attn_logit_softcapping=3.0),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=32,
                                               query_pre_attn_scalar=32, sliding_window=8),
}
CLASSES = {"gemma3_text": tf.Gemma3ForCausalLM}


def main(out: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    for arch, make in CONFIGS.items():
        config = make()
        config._attn_implementation = "eager"
        cls = CLASSES.get(arch, tf.AutoModelForCausalLM)
        model = cls.from_config(config) if cls is tf.AutoModelForCausalLM else cls(config)
        model = model.to(torch.float32).eval()
        with torch.no_grad():  # random norms, so the (1 + w) convention and q/k norms matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        folder = out / arch
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits[0].numpy()
        np.save(folder / "ids.npy", ids[0].numpy().astype(np.int32))
        np.save(folder / "logits.npy", logits.astype(np.float32))
        print(arch, logits.shape)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
