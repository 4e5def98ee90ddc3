"""Images inside chat messages: finding them, decoding and preprocessing them, and turning
the conversation into prompt ids with every image's tokens in place.

A message's content may be a list of parts. Image parts come in the shapes people send:
- {"type": "image", "image": <Pillow image | path | bytes | data: URL>} (also "path" / "url"
  keys, as transformers' chat templates accept them);
- {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} (OpenAI's).
Each becomes {"type": "image"} for the chat template, which writes the model's placeholder
for it; `expand_prompt` then gives each placeholder its image's tokens.

http(s) URLs are not fetched here: the server fetches them when started with
--allow-image-urls (ellm.vision.fetch) and hands the bytes on.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .images import DEFAULT_LIMITS, ImageError, ImageLimits, ImageSource, decode_image
from .inputs import ImageInput
from .preprocess import Processing

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def image_source(part: dict[str, Any], where: str) -> ImageSource:
    """The image a content part carries (not yet decoded)."""
    kind = part.get("type")
    if kind == "image":
        for key in ("image", "path", "url"):
            if part.get(key) is not None:
                return part[key]
        raise ImageError(f"{where} is an image part without 'image' (a Pillow image, a path, bytes "
                         f"or a data: URL)", param=where)
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageError(f"{where}.image_url must hold a 'url' string", param=f"{where}.image_url")
    return value


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
               for m in messages)


def prepare_messages(messages: Sequence[dict[str, Any]], processing: Processing | None,
                     limits: ImageLimits = DEFAULT_LIMITS,
                     fetch: Callable[[str, str], bytes] | None = None,
                     model_name: str = "this model") -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """-> (the messages as the chat template reads them, the images in order).

    fetch(url, where) gets the bytes of an http(s) URL; without it such URLs are refused."""
    out: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if processing is None:
                raise ImageError(f"{where} is an image, but {model_name} takes no images (it has no "
                                 f"vision tower); send text only or load a vision model", param=where)
            source = image_source(part, where)
            if isinstance(source, str) and source.startswith(("http://", "https://")):
                if fetch is None:
                    raise ImageError(f"{where}: http(s) image URLs are not fetched here; pass the image "
                                     f"itself (bytes, a path or a data: URL), or start the server with "
                                     f"--allow-image-urls", param=where)
                source = fetch(source, where)
            try:
                decoded = decode_image(source, limits, what=where)
            except ImageError as e:
                e.param = e.param or where
                raise
            images.append(processing.preprocess(decoded))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
