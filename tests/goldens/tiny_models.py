"""Makes tiny random models of every supported architecture with transformers.

Run with a Python that has torch + transformers (tests/run.sh's .venv-ref):
    python tests/goldens/tiny_models.py OUT_DIR
For each architecture it writes OUT_DIR/<arch>/ (config.json + model.safetensors in
f32, and a 320-token byte-level BPE tokenizer so the folder loads like a real model and
llama.cpp's converter can read it), OUT_DIR/<arch>/logits.npy: transformers' logits for
ids.npy at every position, and greedy.npy: transformers' greedy continuation of ids.npy.
Small windows and caps make the sliding-window and soft-capping paths matter; the newer
families draw weights wider than the default init (initializer_range 0.15), random biases
and norms, so the logits are far from uniform.
Everything here is deterministic: the same transformers version gives the same bytes.
"""
from __future__ import annotations

import sys
import json
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
# The newer families: wide weights, and special-token ids inside the tiny vocabulary.
WIDE = dict(COMMON, initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "gemma": lambda: tf.GemmaConfig(**{**COMMON, "tie_word_embeddings": True}, head_dim=32),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                      final_logit_softcapping=5.0, attn_logit_softcapping=3.0),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=32,
                                               query_pre_attn_scalar=32, sliding_window=8),
    # the layers from max_window_layers on slide
    "qwen2": lambda: tf.Qwen2Config(**WIDE, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "qwen3": lambda: tf.Qwen3Config(**WIDE, head_dim=24),      # head_dim != hidden / heads
    "mistral": lambda: tf.MistralConfig(**WIDE, sliding_window=8),   # every layer slides
    "smollm3": lambda: tf.SmolLM3Config(**WIDE, no_rope_layer_interval=2),   # layers 1 and 3: NoPE
    "olmo2": lambda: tf.Olmo2Config(**WIDE),
    "granite": lambda: tf.GraniteConfig(**WIDE, embedding_multiplier=3.0, residual_multiplier=0.5,
                                        attention_multiplier=0.2, logits_scaling=2.5),
    # 12 of 16 dims per head rotate; LongRoPE with the attention factor of 1024 / 256
    # positions (every test stays below 256, where transformers takes the short factors, as
    # llama.cpp does with a context of 256, the least it pads to); a window shorter than
    # the prompt (which llama.cpp does not apply to Phi-3)
    "phi3": lambda: tf.Phi3Config(**{**WIDE, "max_position_embeddings": 1024}, original_max_position_embeddings=256,
                                  sliding_window=24,
                                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                       partial_rotary_factor=0.75,
                                                       short_factor=[1.0, 1.3, 1.9, 2.6, 3.1, 4.2],
                                                       long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 12.0],
                                                       original_max_position_embeddings=256)),
    # 3 of 8 experts per token, renormalised
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**WIDE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                           norm_topk_prob=True),
    # the same with a dense MLP on layer 2 and no renormalisation (llama.cpp's converter
    # cannot write a dense layer into a qwen3moe GGUF); experts 64 wide, which the GPU's
    # decode kernels take (a multiple of 32: tests/test_cuda.py)
    "qwen3_moe_mixed": lambda: tf.Qwen3MoeConfig(**WIDE, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=64, mlp_only_layers=[2]),
}
CLASSES = {"gemma3_text": tf.Gemma3ForCausalLM}
NEW_FAMILIES = ("qwen2", "qwen3", "mistral", "smollm3", "olmo2", "granite", "phi3", "qwen3_moe",
                "qwen3_moe_mixed")
GREEDY_TOKENS = 8

# Text to learn the tokenizer's merges from (written for this file).
CORPUS = """\
The small model reads a prompt, one token at a time, and writes the next token.
Every layer mixes the tokens it has seen with attention, then changes each one with a
feed-forward network. A window limits how far back a layer may look; a layer without
rotary positions sees the tokens as a set. The numbers here are random, so the text the
model writes means nothing, but the arithmetic is the same as in a real model, and two
programs that agree on it agree on the real thing too. 0123456789 + - * / = ( ) [ ] { }
"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(vocab_size: int) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 pre-tokenizer) of exactly vocab_size tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} tokens, not {vocab_size}: grow CORPUS")
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                      pad_token=SPECIALS[0], unk_token=None)


def _randomize(arch: str, model: torch.nn.Module) -> None:
    with torch.no_grad():  # random norms, so the (1 + w) convention and q/k norms matter
        for name, p in model.named_parameters():
            if arch in NEW_FAMILIES:
                if "norm" in name:
                    p.normal_(1.0, 0.4)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(0.0, 0.3)


def _set_tokenizer_class(folder: Path, name: str) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = name
    path.write_text(json.dumps(config, indent=2))


def main(out: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    tokenizer = make_tokenizer(COMMON["vocab_size"])
    for arch, make in CONFIGS.items():
        config = make()
        config._attn_implementation = "eager"
        cls = CLASSES.get(arch, tf.AutoModelForCausalLM)
        model = cls.from_config(config) if cls is tf.AutoModelForCausalLM else cls(config)
        model = model.to(torch.float32).eval()
        _randomize(arch, model)
        folder = out / arch
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        if arch == "phi3":  # as Phi-4-mini's: llama.cpp's converter then reads the BPE, not a tokenizer.model
            _set_tokenizer_class(folder, "GPT2Tokenizer")
        with torch.no_grad():
            logits = model(ids).logits[0].numpy()
            greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                    min_new_tokens=GREEDY_TOKENS, do_sample=False)[0, ids.shape[1]:]
        np.save(folder / "ids.npy", ids[0].numpy().astype(np.int32))
        np.save(folder / "logits.npy", logits.astype(np.float32))
        np.save(folder / "greedy.npy", greedy.numpy().astype(np.int32))
        print(arch, logits.shape)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
