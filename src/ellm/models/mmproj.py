"""A vision tower from llama.cpp's separate `mmproj` GGUF file, joined to a text GGUF.

llama.cpp's converter writes a vision-language model as two files: the text model (a
plain `llama` or `gemma3` GGUF, its vocabulary holding the image tokens) and, with
`--mmproj`, a `clip` GGUF holding the tower (`v.*`) and the projector (`mm.*`) with the
settings under `clip.vision.*` and `clip.projector_type`. `attach_mmproj` reads the second
file, checks that it fits the first, and returns the vision family's config and one
weight source holding both files' tensors under the Hugging Face names the family reads
(so the model is built exactly as from a folder).

Projector types read: `idefics3` (SmolVLM / Idefics3: pixel shuffle + linear, on a llama
text file) and `gemma3` (average pool + RMSNorm + projection, on a gemma3 text file). The
image token is found by name in the text file's vocabulary (`<image>` /
`<image_soft_token>`): llama.cpp itself never needs it (it embeds images apart from the
prompt), so the converter does not record it.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config import ConfigError, GGUFMeta, ModelConfig
from ..formats.gguf import GGUFFile
from ..weights import GGUFWeights, Linear, WeightSource

# the tower's tensors, shared by both projector types; {tower} is the family's prefix
_TOWER = [
    (r"v\.patch_embd\.weight", "{tower}embeddings.patch_embedding.weight"),
    (r"v\.patch_embd\.bias", "{tower}embeddings.patch_embedding.bias"),
    (r"v\.position_embd\.weight", "{tower}embeddings.position_embedding.weight"),
    (r"v\.post_ln\.weight", "{tower}post_layernorm.weight"),
    (r"v\.post_ln\.bias", "{tower}post_layernorm.bias"),
] + [(rf"v\.blk\.(\d+)\.{gg}\.{kind}", "{tower}encoder.layers.{i}." + f"{hf}.{kind}")
     for gg, hf in (("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("attn_q", "self_attn.q_proj"),
                    ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                    ("attn_out", "self_attn.out_proj"), ("ffn_up", "mlp.fc1"), ("ffn_down", "mlp.fc2"))
     for kind in ("weight", "bias")]

# projector type -> (text architecture, model_type, image token, tower prefix, projector tensors)
PROJECTORS: dict[str, tuple[str, str, str, str, list[tuple[str, str]]]] = {
    "idefics3": ("llama", "smolvlm", "<image>", "model.vision_model.",
                 [(r"mm\.model\.fc\.weight", "model.connector.modality_projection.proj.weight")]),
    "gemma3": ("gemma3", "gemma3_text", "<image_soft_token>", "vision_tower.",
               [(r"mm\.input_projection\.weight", "multi_modal_projector.mm_input_projection_weight"),
                (r"mm\.soft_emb_norm\.weight", "multi_modal_projector.mm_soft_emb_norm.weight")]),
}
GEMMA3_DEFAULT_POOL = 4   # llama.cpp's value when the file has no clip.vision.projector.scale_factor


class JoinedWeights(WeightSource):
    """The text file's tensors and the mmproj file's, under one set of names."""

    def __init__(self, text: WeightSource, vision: WeightSource) -> None:
        clash = set(text.names()) & set(vision.names())
        if clash:
            raise ConfigError(f"{vision.path}: tensors also in the text file: {sorted(clash)[:3]}")
        super().__init__(text.path, {n: n for n in text.names() + vision.names()})
        self._owner = {**{n: text for n in text.names()}, **{n: vision for n in vision.names()}}
        self._text, self._vision = text, vision
        # both are GGUF files: llama.cpp's converter added Gemma's +1 to the text norms
        # and to the projector's soft_emb_norm alike
        self.norm_weights_include_one = text.norm_weights_include_one

    def fingerprints(self) -> list[Any]:
        return self._text.fingerprints() + self._vision.fingerprints()

    def linear(self, name: str) -> Linear:
        self.require(name)
        return self._owner[name].linear(name)

    def vector(self, name: str) -> Any:
        self.require(name)
        return self._owner[name].vector(name)


def attach_mmproj(config: ModelConfig, weights: WeightSource, tokenizer: Any,
                  path: str | Path) -> tuple[ModelConfig, WeightSource]:
    """The text GGUF's (config, weights) with the mmproj file's tower joined to them; a
    ConfigError naming the file and what does not fit."""
    gguf = GGUFFile(Path(path))
    meta = GGUFMeta(gguf)
    if meta.arch != "clip" or not gguf.metadata.get("clip.has_vision_encoder"):
        raise ConfigError(f"{path}: not an mmproj file with a vision encoder "
                          f"(general.architecture {meta.arch!r})")
    kind = str(gguf.metadata.get("clip.projector_type", ""))
    if kind not in PROJECTORS:
        raise ConfigError(f"{path}: clip.projector_type {kind!r} is not supported ({', '.join(PROJECTORS)})")
    text_arch, model_type, token, tower, projector = PROJECTORS[kind]
    if config.model_type != {"llama": "llama", "gemma3": "gemma3_text"}[text_arch]:
        raise ConfigError(f"{path}: a {kind} projector goes with a {text_arch} text model, "
                          f"not {config.model_type}")

    def vision(key: str, default: Any = None) -> Any:
        return meta.int(f"vision.{key}", default) if key != "attention.layer_norm_epsilon" \
            else meta.float(f"vision.{key}", default)
    vision_config = {
        "hidden_size": vision("embedding_length"), "intermediate_size": vision("feed_forward_length"),
        "num_hidden_layers": vision("block_count"), "num_attention_heads": vision("attention.head_count"),
        "image_size": vision("image_size"), "patch_size": vision("patch_size"),
        "layer_norm_eps": vision("attention.layer_norm_epsilon", 1e-6)}
    if vision("projection_dim", config.hidden_size) != config.hidden_size:
        raise ConfigError(f"{path}: clip.vision.projection_dim is {vision('projection_dim')}, the text "
                          f"model's width is {config.hidden_size}")
    image_token = tokenizer.token_to_id(token)
    if image_token is None:
        raise ConfigError(f"{gguf.path}: the text model's vocabulary has no {token} token for the images")
    extra: dict[str, Any] = {"vision_config": vision_config, "image_token_id": image_token,
                             "model_type": model_type}
    scale = meta.int("vision.projector.scale_factor", 0, lo=0, hi=1 << 10)
    if kind == "idefics3":
        extra["scale_factor"] = scale or 2
    else:
        side = vision_config["image_size"] // vision_config["patch_size"] // (scale or GEMMA3_DEFAULT_POOL)
        extra["mm_tokens_per_image"] = side * side
    from . import family_for_model_type
    args = family_for_model_type(model_type).Args
    base = {f.name: getattr(config, f.name) for f in fields(config) if f.name in {g.name for g in fields(args)}}
    new_config = args(**{**base, **extra})
    table = [(pattern, name.replace("{tower}", tower)) for pattern, name in _TOWER + projector]
    vision_weights = GGUFWeights(gguf, table)
    return new_config, JoinedWeights(weights, vision_weights)
