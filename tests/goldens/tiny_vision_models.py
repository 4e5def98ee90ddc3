"""Makes tiny random vision-language models with transformers, and their logits.

Run with a Python that has torch + transformers (tests/run.sh's .venv-ref):
    python tests/goldens/tiny_vision_models.py OUT_DIR
It writes, for each of `smolvlm` (SmolVLMForConditionalGeneration: a SigLIP tower with
4 x 4 patches per 32 x 32 tile, pixel shuffle by 2, so 4 image tokens per tile, and a
Llama text model) and `gemma3` (Gemma3ForConditionalGeneration: a SigLIP tower with 4 x 4
patches, pooled to 4 tokens per image, and a Gemma 3 text model), OUT_DIR/<name>/: the
Hugging Face folder (f32 safetensors, config.json, a tokenizer carrying the image tokens),
and beside it pixel_values.npy (the tiles of every image, (n_tiles, 3, 32, 32) f32, as a
processor would hand them over), tiles.npy (how many tiles each image has), ids.npy (a
prompt with the expanded image tokens) and logits.npy (transformers' logits at every
position of that prompt).

The weights are drawn wide (initializer_range 0.15, random norms and biases) and Gemma 3's
multi-modal projector, which transformers starts at zero, is filled, so the image changes
the logits. No image processor runs here (SmolVLMProcessor needs torchvision): the pixel
values are random numbers in the normalized range; visionio's tests compare ellm's
preprocessing with the processors. Everything is deterministic.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tokenizer  # noqa: E402  (the 320-token BPE of the text models)

BASE_VOCAB = 320
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=8, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GRID = (2, 2)   # the SmolVLM prompt's first image: 2 x 2 tiles + the global image

# SmolVLM / Idefics3's prompt tokens; rows and columns up to 4 x 4
SMOLVLM_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + \
    [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def _tokenizer(extra: list[str]) -> tf.PreTrainedTokenizerFast:
    tok = make_tokenizer(BASE_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _widen(model: torch.nn.Module) -> None:
    """Random norms and biases (layernorms around 1, biases around 0), and Gemma 3's
    projector filled, so every weight matters to the logits."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mm_input_projection_weight" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (0.0 if "language_model" in name and
                                                                  "gemma" in type(model).__name__.lower() else 1.0))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "vision" in name and p.dim() >= 2:   # the tower's default init is narrow
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def smolvlm_prompt(tok: tf.PreTrainedTokenizerFast, grid: tuple[int, int], tokens_per_tile: int,
                   text: str) -> list[int]:
    """Idefics3's expansion for one image of rows x cols tiles and its global image, then text."""
    def t(s: str) -> int:
        return tok.convert_tokens_to_ids(s)
    fake, img, glob = t("<fake_token_around_image>"), t("<image>"), t("<global-img>")
    ids: list[int] = [tok.bos_token_id]
    rows, cols = grid
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            ids += [fake, t(f"<row_{r}_col_{c}>")] + [img] * tokens_per_tile
    ids += [fake, glob] + [img] * tokens_per_tile + [fake]
    return ids + tok(text, add_special_tokens=False)["input_ids"]


def make_smolvlm(out: Path) -> None:
    tok = _tokenizer(SMOLVLM_TOKENS)
    vocab = len(tok)
    config = tf.SmolVLMConfig(
        vision_config=dict(VISION, initializer_range=0.15),
        text_config=dict(TEXT, model_type="llama", vocab_size=vocab, tie_word_embeddings=False),
        image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.SmolVLMForConditionalGeneration(config).to(torch.float32).eval()
    _widen(model)
    tokens_per_tile = (VISION["image_size"] // VISION["patch_size"]) ** 2 // 4
    # two images: a 2 x 2 grid with its global image, and a single tile (no grid)
    ids = smolvlm_prompt(tok, GRID, tokens_per_tile, " The small model reads")
    fake, glob, img = (tok.convert_tokens_to_ids(s) for s in ("<fake_token_around_image>", "<global-img>", "<image>"))
    ids += [fake, glob] + [img] * tokens_per_tile + [fake] + tok(" a prompt", add_special_tokens=False)["input_ids"]
    tiles = [GRID[0] * GRID[1] + 1, 1]
    _save(out / "smolvlm", model, tok, ids, tiles,
          lambda pv: dict(pixel_values=pv[None]))


def make_gemma3(out: Path) -> None:
    tok = _tokenizer(GEMMA3_TOKENS)
    vocab = len(tok)
    # six layers, the sixth global: Gemma 3's own pattern, which a GGUF file implies
    text = tf.Gemma3TextConfig(**dict(TEXT, num_hidden_layers=6), vocab_size=vocab, head_dim=32,
                               query_pre_attn_scalar=32, sliding_window=8)
    config = tf.Gemma3Config(text_config=text, vision_config=tf.SiglipVisionConfig(**VISION),
                             mm_tokens_per_image=4, image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
                             boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                             eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    _widen(model)
    boi, soft, eoi = (tok.convert_tokens_to_ids(s) for s in GEMMA3_TOKENS)
    words = tok(" The small model reads", add_special_tokens=False)["input_ids"]
    ids = [tok.bos_token_id] + words + [boi] + [soft] * 4 + [eoi] + words + [boi] + [soft] * 4 + [eoi] + words
    # no token_type_ids: transformers attends causally over the image tokens too (what
    # ellm does; with token_type_ids an image's tokens would see each other both ways)
    _save(out / "gemma3", model, tok, ids, [1, 1], lambda pv: dict(pixel_values=pv))


# What the processors would be configured with (written by hand: transformers' image
# processors need Pillow / torchvision, which the reference venv lacks); llama.cpp's
# mmproj converter reads the mean and std from here.
PREPROCESSOR = {
    "smolvlm": {"image_processor_type": "SmolVLMImageProcessor", "do_resize": True, "do_rescale": True,
                "do_normalize": True, "do_image_splitting": True, "do_pad": True, "do_convert_rgb": True,
                "resample": 1, "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "size": {"longest_edge": 2 * VISION["image_size"]},
                "max_image_size": {"longest_edge": VISION["image_size"]}},
    "gemma3": {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "do_rescale": True,
               "do_normalize": True, "do_convert_rgb": True, "resample": 2, "rescale_factor": 1 / 255,
               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
               "size": {"height": VISION["image_size"], "width": VISION["image_size"]}, "image_seq_length": 4},
}


def _save(folder: Path, model: torch.nn.Module, tok: tf.PreTrainedTokenizerFast, ids: list[int],
          tiles: list[int], pixel_kwargs) -> None:
    g = torch.Generator().manual_seed(5)
    pv = torch.rand((sum(tiles), 3, VISION["image_size"], VISION["image_size"]), generator=g) * 2 - 1
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[folder.name], indent=2))
    if folder.name == "gemma3":   # the tower under vision_tower.vision_model, as in the published checkpoints
        from safetensors.torch import load_file, save_file
        path = folder / "model.safetensors"
        tensors = load_file(path)
        save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.")
                    and not k.startswith("vision_tower.vision_model.") else k): v for k, v in tensors.items()},
                  path, metadata={"format": "pt"})
    if folder.name == "smolvlm":   # as the published SmolVLM configs: llama.cpp reads the text model by it
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **pixel_kwargs(pv)).logits[0].numpy()
    np.save(folder / "ids.npy", np.asarray(ids, np.int32))
    np.save(folder / "pixel_values.npy", pv.numpy().astype(np.float32))
    np.save(folder / "tiles.npy", np.asarray(tiles, np.int32))
    np.save(folder / "logits.npy", logits.astype(np.float32))
    print(folder.name, logits.shape, len(ids))


def main(out: Path) -> None:
    make_smolvlm(out)
    make_gemma3(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
