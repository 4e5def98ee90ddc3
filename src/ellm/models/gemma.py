"""The Gemma family (Gemma 1, 2 and 3 text models).

What sets it apart from Llama: embeddings scaled by sqrt(hidden_size); RMSNorm weights
used as (1 + w); GeGLU (tanh GELU) MLP; attention scaled by query_pre_attn_scalar;
Gemma 2/3 add a norm after attention and after the MLP, interleave sliding-window and
global layers with their own RoPE bases, and soft-cap logits (Gemma 2); Gemma 3 normalises
q and k per head. The switches come from the config and from which weights exist.

GGUF files (llama.cpp) carry no chat template for Gemma, and its turn format is fixed and
documented, so CHAT_TEMPLATE ships it: each turn is
`<start_of_turn>{user|model}\\n{text}<end_of_turn>\\n` after a leading `<bos>`, the
assistant role is called "model", turns alternate starting with the user, and as Gemma
has no system role a system message opens the first user turn, followed by a blank line.
Turn text is stripped of surrounding whitespace; system text is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import (ConfigError, GGUFMeta, ModelConfig, check_layer_types, check_window, layer_types_window,
                      rope_inv_freq)
from ..weights import WeightSource
from .blocks import (Decoder, DecoderLayer, embedding_and_head, load_attention, load_mlp, load_norm,
                     maybe_norm)
from .siglip import SiglipEncoder, VisionConfig, f32_linear

# Gemma 2/3 have four norms per layer; llama.cpp's ffn_norm is the one before the MLP
# (Gemma 1's single post_attention_layernorm is read as that norm, which it is).
GGUF_TENSORS = [
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
]

# llama.cpp writes Gemma's whitespace-run tokens with real spaces (tokenization/gguf_vocab.py)
GGUF_VOCAB_STYLE = "gemma"


# Gemma3ForConditionalGeneration folders keep the text model under model.language_model
# (or language_model.model, as transformers 5.24 saves it), and the vision tower and
# projector under vision_tower / multi_modal_projector, with or without a leading model.
_PREFIXES = [("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
             ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector.")]
VISION_TOWER = "vision_tower."
PROJECTOR = "multi_modal_projector."


def sanitize(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass
class Args(ModelConfig):
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None   # "sliding_attention" | "full_attention" per layer
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # [vision] Gemma3ForConditionalGeneration: the SigLIP tower's settings, the image
    # token, and how many tokens an image becomes (its patches average-pooled)
    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    mm_tokens_per_image: int = 256

    gguf_architectures = ("gemma", "gemma2", "gemma3")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.sliding_window)
        check_layer_types(self.layer_types, self.num_hidden_layers)
        self.vision = None if self.vision_config is None else VisionConfig.from_dict(self.vision_config)
        if self.vision is not None:
            if self.image_token_id is None or not 0 <= self.image_token_id < self.vocab_size:
                raise ConfigError(f"image_token_index {self.image_token_id} is outside the vocabulary "
                                  f"({self.vocab_size})")
            side, g = int(round(self.mm_tokens_per_image ** 0.5)), self.vision.patches_per_side
            if side * side != self.mm_tokens_per_image or not 0 < side <= g or g % side:
                raise ConfigError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square that "
                                  f"pools the {g} x {g} patch grid evenly")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        return layer_types_window(layer, self.layer_types, self.sliding_window)

    def inv_freq(self, layer: int) -> np.ndarray:
        if self.layer_window(layer):   # local layers: their own base, never scaled
            return rope_inv_freq(self.rope_local_base_freq or self.rope_theta, self.head_dim, None)
        return super().inv_freq(layer)

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "norm": "(1 + w)", "mlp": "GeGLU",
               "softcap": (self.attn_logit_softcapping, self.final_logit_softcapping)}
        if self.vision is not None:   # [vision]
            v = self.vision
            out["vision"] = (f"SigLIP {v.num_hidden_layers} layers x {v.hidden_size}, {v.image_size}px, "
                             f"{self.mm_tokens_per_image} tokens per image")
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "Args":
        if raw.get("model_type") == "gemma3" and isinstance(raw.get("text_config"), dict):  # multimodal wrapper
            image = {"vision_config": raw.get("vision_config"),
                     "image_token_id": raw.get("image_token_index", raw.get("image_token_id")),
                     "mm_tokens_per_image": raw.get("mm_tokens_per_image")}
            raw = {**raw["text_config"], "model_type": "gemma3_text",
                   **{k: v for k, v in image.items() if v is not None}}
        return super().from_dict(raw, generation)  # type: ignore[return-value]

    @classmethod
    def gguf_model_type(cls, arch: str) -> str:
        return "gemma3_text" if arch == "gemma3" else arch

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        kwargs["hidden_act"] = "gelu_pytorch_tanh"
        if meta.raw("attention.sliding_window"):
            kwargs["sliding_window"] = meta.int("attention.sliding_window")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if meta.raw(key):
                kwargs[key] = meta.float(key)

    @classmethod
    def prepare(cls, kwargs: dict[str, Any], raw: dict[str, Any]) -> None:
        """Gemma values that GGUF files (and some configs) leave out: the published defaults."""
        if "hidden_activation" in raw:
            kwargs["hidden_act"] = raw["hidden_activation"]
        mt = kwargs.get("model_type")
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("hidden_act", "gelu_pytorch_tanh")
        n = kwargs.get("num_hidden_layers")
        if mt == "gemma3_text":
            kwargs.setdefault("query_pre_attn_scalar", kwargs.get("head_dim") or 256)
            kwargs.setdefault("rope_local_base_freq", 10000.0)
            kwargs.setdefault("sliding_window", 512)
            if not kwargs.get("layer_types") and isinstance(n, int) and 0 < n <= 1024:
                pattern = 6  # every sixth layer is global
                kwargs["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(n)]
        elif mt == "gemma2":
            kwargs.setdefault("query_pre_attn_scalar", kwargs.get("head_dim") or 256)
            kwargs.setdefault("sliding_window", 4096)
            kwargs.setdefault("final_logit_softcapping", 30.0)
            kwargs.setdefault("attn_logit_softcapping", 50.0)
            if not kwargs.get("layer_types") and isinstance(n, int) and 0 < n <= 1024:
                kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


class Model(Decoder):
    config: Args   # Decoder's, typed as this family's

    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c, H, hd = config, config.hidden_size, config.head_dim
        embed, lm_head = embedding_and_head(weights, c)
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            has_pre_ffn = p + "pre_feedforward_layernorm.weight" in weights
            layers.append(DecoderLayer(
                attn=load_attention(weights, c, i, softcap=c.attn_logit_softcapping or 0.0,
                                    q_norm=maybe_norm(weights, p + "self_attn.q_norm.weight", hd, True),
                                    k_norm=maybe_norm(weights, p + "self_attn.k_norm.weight", hd, True)),
                mlp=load_mlp(weights, c, p + "mlp."),
                input_norm=load_norm(weights, p + "input_layernorm.weight", H, True),
                # Gemma 1 has one norm before the MLP, named post_attention_layernorm.
                pre_mlp_norm=load_norm(weights, p + ("pre_feedforward_layernorm.weight" if has_pre_ffn
                                                     else "post_attention_layernorm.weight"), H, True),
                post_attn_norm=maybe_norm(weights, p + "post_attention_layernorm.weight", H, True)
                if has_pre_ffn else None,
                post_mlp_norm=maybe_norm(weights, p + "post_feedforward_layernorm.weight", H, True)))
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", H, True),
                         embed_scale=float(np.float32(H ** 0.5)), final_softcap=c.final_logit_softcapping or 0.0)
        # [vision] Gemma 3's SigLIP tower and projector, when the file has them
        v = c.vision
        self.takes_images = v is not None and VISION_TOWER + "post_layernorm.weight" in weights
        # an image's tokens attend to each other both ways (transformers' token_type_ids
        # mask, llama.cpp): the engine gives them Batch.key_limit
        self.bidirectional_images = self.takes_images
        if v is not None and self.takes_images:
            self.tower = SiglipEncoder(v, weights, ops, VISION_TOWER)
            self.soft_norm = load_norm(weights, PROJECTOR + "mm_soft_emb_norm.weight", v.hidden_size, True)
            w = weights.vector(PROJECTOR + "mm_input_projection_weight")        # (D, H)
            if w.shape != (v.hidden_size, H):
                raise ValueError(f"{PROJECTOR}mm_input_projection_weight has shape {w.shape}, "
                                 f"expected ({v.hidden_size}, {H})")
            self.projection = f32_linear(w.T, PROJECTOR + "mm_input_projection_weight")

    def image_token_count(self, image: Any) -> int:
        """[vision] An image (one tile) becomes mm_tokens_per_image tokens."""
        pixels = self.tower.check_pixels(image.pixel_values)
        if len(pixels) != 1:
            raise ValueError(f"Gemma 3 takes one {self.tower.config.image_size}px tile per image, got {len(pixels)}")
        return self.config.mm_tokens_per_image

    def encode_images(self, images: list[Any]) -> np.ndarray:
        """[vision] ImageInputs -> (n_images * mm_tokens_per_image, hidden_size) f32: the
        tower's patches average-pooled to a side x side grid (row-major), RMSNorm'd (1 + w),
        projected to the text width."""
        c, v = self.config, self.tower.config
        feats = self.tower(np.concatenate([self.tower.check_pixels(im.pixel_values) for im in images]))
        n, g, D = len(feats), v.patches_per_side, v.hidden_size
        side = int(round(c.mm_tokens_per_image ** 0.5))
        k = g // side
        pooled = feats.reshape(n, side, k, side, k, D).mean(axis=(2, 4), dtype=np.float32)
        rows = np.ascontiguousarray(pooled.reshape(n * side * side, D))
        self.ops.rmsnorm(rows, self.soft_norm, v.layer_norm_eps, out=rows)
        return self.ops.linear(rows, self.projection, out=np.empty((len(rows), c.hidden_size), np.float32))


CHAT_TEMPLATE = """\
{#- Gemma: no system role, so the system text opens the first user turn. -#}
{%- set state = namespace(lead='', skip=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set sys = messages[0]['content'] -%}
    {%- set state.lead = (sys if sys is string else sys[0]['text']) ~ '\\n\\n' -%}
    {%- set state.skip = 1 -%}
{%- endif -%}
{{- bos_token -}}
{%- for turn in messages[state.skip:] -%}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Gemma expects turns to alternate user / assistant, starting with the user') -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if turn['role'] == 'assistant' else turn['role']) ~ '\\n' -}}
    {%- if loop.first -%}{{- state.lead -}}{%- endif -%}
    {%- set body = turn['content'] -%}
    {%- if body is string -%}
        {{- body | trim -}}
    {%- elif body is iterable -%}
        {%- for part in body -%}
            {%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}
            {%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('a Gemma turn needs text or a list of parts') -}}
    {%- endif -%}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

