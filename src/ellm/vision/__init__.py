"""Images into a model's prompt: decoding with limits, each processor's preprocessing,
and the prompt expansion that makes room for an image's tokens."""
from __future__ import annotations

from .images import ImageError, ImageLimits, decode_image
from .inputs import ImageInput

__all__ = ["ImageError", "ImageInput", "ImageLimits", "decode_image"]
