"""SmolVLM / SmolVLM2 and Idefics3: a SigLIP vision tower, a pixel-shuffle connector, and a
Llama text model (SmolLM2 in SmolVLM) that reads the image as rows of its prompt.

The processor cuts an image into tiles of image_size (plus the whole image shrunk to one
tile) and writes, per tile, `tokens_per_tile` copies of the `<image>` token into the
prompt. Here each tile goes through the tower (n_tiles, patches, D); the connector folds
every scale_factor x scale_factor block of neighbouring patches into one row of
D * scale_factor^2 features (pixel shuffle) and projects it to the text width, so a tile
gives patches / scale_factor^2 rows, in the order of the `<image>` tokens. The engine
puts those rows where the `<image>` tokens' embeddings would be; the text model is
Llama's, unchanged.

Weights: `model.vision_model.*` (the tower), `model.connector.modality_projection.proj`
(no bias), `model.text_model.*` (read as Llama's `model.*`), `lm_head`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError
from ..weights import WeightSource
from . import llama
from .blocks import load_linear
from .siglip import SiglipEncoder, VisionConfig

GGUF_TENSORS = llama.GGUF_TENSORS
TOWER = "model.vision_model."


def sanitize(name: str) -> str:
    """The text model's weights under the names Llama's loader reads."""
    return "model." + name[len("model.text_model."):] if name.startswith("model.text_model.") else name


@dataclass
class Args(llama.Args):
    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    scale_factor: int = 2

    gguf_architectures = ()   # a SmolVLM GGUF is a llama text file plus an mmproj file

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vision_config is None or self.image_token_id is None:
            raise ConfigError(f"{self.model_type}: config.json needs vision_config and image_token_id")
        self.vision = VisionConfig.from_dict(self.vision_config)
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ConfigError(f"image_token_id {self.image_token_id} is outside the vocabulary ({self.vocab_size})")
        g = self.vision.patches_per_side
        if not 0 < self.scale_factor <= g or g % self.scale_factor:
            raise ConfigError(f"scale_factor {self.scale_factor} does not divide the {g} x {g} patch grid")

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.num_patches // self.scale_factor ** 2

    def describe(self) -> dict[str, Any]:
        v = self.vision
        return {**super().describe(), "vision": f"SigLIP {v.num_hidden_layers} layers x {v.hidden_size}, "
                f"{v.image_size}px tiles, {self.tokens_per_tile} tokens per tile"}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "Args":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{raw.get('model_type')}: config.json needs a text_config object")
        merged = {**text, "model_type": raw["model_type"],
                  **{k: raw[k] for k in ("vision_config", "image_token_id", "scale_factor") if k in raw}}
        if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
            merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return super().from_dict(merged, generation)  # type: ignore[return-value]


class Model(llama.Model):
    """Llama's forward pass, with `encode_images` for the engine to splice the image rows."""
    config: Args   # Decoder's, typed as this family's

    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        super().__init__(config, weights, ops)
        self.takes_images = True
        v, s = config.vision, config.scale_factor
        self.tower = SiglipEncoder(v, weights, ops, TOWER)
        self.projection = load_linear(weights, "model.connector.modality_projection.proj",
                                      config.hidden_size, v.hidden_size * s * s)

    def image_token_count(self, image: Any) -> int:
        """How many image tokens the prompt must hold for this ImageInput (its pixels checked)."""
        return len(self.tower.check_pixels(image.pixel_values)) * self.config.tokens_per_tile

    def encode_images(self, images: list[Any]) -> np.ndarray:
        """ImageInputs -> (sum of their image tokens, hidden_size) f32 rows, image after
        image, tile after tile, in the order of the prompt's `<image>` tokens."""
        if not images:
            return np.empty((0, self.config.hidden_size), np.float32)
        pixels = np.concatenate([self.tower.check_pixels(im.pixel_values) for im in images])
        feats = self.tower(pixels)                                      # (n, N, D)
        shuffled = pixel_shuffle(feats, self.config.scale_factor)     # (n, N / s^2, D s^2)
        n, m, d = shuffled.shape
        return self.ops.linear(np.ascontiguousarray(shuffled.reshape(n * m, d)), self.projection,
                               out=np.empty((n * m, self.config.hidden_size), np.float32))


def pixel_shuffle(x: np.ndarray, s: int) -> np.ndarray:
    """(n, g*g, D) -> (n, (g/s)^2, D s^2), the rows and features in the order transformers'
    Idefics3 / SmolVLM connector gives them."""
    n, seq, D = x.shape
    g = int(round(seq ** 0.5))
    x = x.reshape(n, g, g // s, D * s).transpose(0, 2, 1, 3)
    x = x.reshape(n, g // s, g // s, D * s * s).transpose(0, 2, 1, 3)
    return x.reshape(n, seq // (s * s), D * s * s)
