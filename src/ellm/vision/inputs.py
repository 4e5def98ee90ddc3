"""What an image is once preprocessed: the meeting point of the processors (which make
it) and the engine (which gives its pixels to the model's vision tower)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    # (n_tiles, 3, S, S) float32, already resized, rescaled and normalized as the
    # model's processor does it
    pixel_values: np.ndarray
    # sha256 of the decoded pixels and the processor settings: two requests with the
    # same hash may share prefix-cache blocks that hold this image's tokens
    content_hash: str
    # what else the processor worked out (e.g. the rows and columns of the tile grid)
    meta: dict[str, Any] = field(default_factory=dict)
