"""Decoding an image a caller gave us (a Pillow image, a path, bytes or a `data:` URL)
into an upright RGB picture, trusting nothing about it.

What is checked, and when:
- the encoded size, before anything is read or decoded (`ImageLimits.max_bytes`);
- the format, from the file's own signature: only the raster formats Pillow decodes
  safely (PNG, JPEG, WebP, GIF, BMP, TIFF) are opened; an SVG, a PDF or anything else is
  refused by name;
- the width, height and pixel count, from the header, BEFORE the pixels are decoded, so a
  decompression bomb (a small file that claims a huge picture) costs nothing;
- truncated or corrupt data, which Pillow reports while decoding.

Then, as transformers does it: the EXIF orientation is applied (its `load_image` calls
`ImageOps.exif_transpose`), and the picture becomes RGB with any transparency composited
onto white (the image processors' `convert_to_rgb`). An animated image (GIF, APNG, WebP,
multi-page TIFF) gives its first frame, as the processors (which call `np.array` on the
image) and llama.cpp do; `DecodedImage.frames` says how many there were.

Every failure is an ImageError (a ValueError) naming what is wrong; the server answers it
with a 400.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

if TYPE_CHECKING:
    import PIL.Image   # imported where an image is opened: Pillow is the [vision] extra


class ImageError(ValueError):
    """An image that cannot be used; the message names what is wrong with it, `param`
    where it was (e.g. "messages[0].content[1]") when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# What callers may hand us as one image.
ImageSource = Union["PIL.Image.Image", str, os.PathLike, bytes, bytearray, memoryview]

# Pillow's names of the formats we open. Pillow is told to try only these, so its other
# plugins (EPS through Ghostscript, PDF-like and exotic formats) never see hostile bytes.
# (A phone's multi-picture JPEG is opened by the JPEG plugin, which names it "MPO".)
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

# Signatures of common things that are not raster images, for a message better than
# "cannot identify".
_NOT_RASTER = ((b"%PDF", "a PDF document"), (b"<svg", "an SVG drawing"), (b"<?xml", "an XML (SVG?) document"),
               (b"%!PS", "a PostScript document"), (b"PK\x03\x04", "a ZIP archive"),
               (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000 image"), (b"<!DOCTYPE", "an HTML page"),
               (b"<html", "an HTML page"))


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one image. The defaults take a 48-megapixel phone photo and a long
    panorama; the decoded RGB picture then needs at most max_pixels * 3 bytes."""
    max_bytes: int = 20 * 1024 * 1024     # encoded size (a data URL's base64 is 4/3 of it)
    max_pixels: int = 50_000_000          # width * height from the header
    max_side: int = 16384                 # width or height from the header

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_side"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class DecodedImage:
    """An upright RGB picture, as the processors want it."""
    image: Any              # PIL.Image.Image, mode "RGB"
    format: str | None      # Pillow's name of the encoded format; None for a caller's Pillow image
    frames: int             # frames in the source; only the first is used

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in Pillow's order."""
        return self.image.size

    def array(self) -> np.ndarray:
        """(height, width, 3) uint8."""
        return np.asarray(self.image, dtype=np.uint8)


def _pil() -> Any:
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError:
        raise ImportError("images need Pillow: pip install 'ellm-engine[vision]' (or pip install pillow)") from None
    return PIL


def decode_image(source: ImageSource, limits: ImageLimits = DEFAULT_LIMITS, *,
                 what: str = "the image") -> DecodedImage:
    """Any accepted source -> DecodedImage; `what` names the image in error messages
    (e.g. "messages[0].content[1].image_url")."""
    pil = _pil()
    if isinstance(source, pil.Image.Image):
        return _from_pil(source, None, limits, what)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_bytes(bytes(source), limits, what=what)
    if isinstance(source, str) and source.startswith("data:"):
        return decode_bytes(parse_data_url(source, limits, what=what), limits, what=what)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError(f"{what} is an http(s) URL; ellm does not fetch images itself (the server does "
                         f"with --allow-image-urls): pass the bytes, a path or a data: URL", param=what)
    if isinstance(source, (str, os.PathLike)):
        return decode_bytes(_read_file(Path(source), limits, what), limits, what=what)
    raise ImageError(f"{what} must be a Pillow image, a path, bytes or a data: URL, "
                     f"not {type(source).__name__}")


def _read_file(path: Path, limits: ImageLimits, what: str) -> bytes:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageError(f"{what}: {str(path)!r} is not a file")
        if size > limits.max_bytes:
            raise ImageError(f"{what}: {str(path)!r} has {size} bytes; at most {limits.max_bytes} are accepted")
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)   # the file may have grown since stat
    except FileNotFoundError:
        raise ImageError(f"{what}: no such file {str(path)!r}") from None
    except OSError as e:
        raise ImageError(f"{what}: cannot read {str(path)!r}: {e.strerror or e}") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what}: {str(path)!r} has more than {limits.max_bytes} bytes")
    return data


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


def parse_data_url(url: str, limits: ImageLimits = DEFAULT_LIMITS, *, what: str = "the image") -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URL, size-checked before decoding."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(f"{what} is not a valid data: URL (want data:image/<type>;base64,<data>)")
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise ImageError(f"{what} is a data: URL of type {mime or 'text/plain'!r}; an image/* type is needed")
    if not m.group("b64"):
        raise ImageError(f"{what} is a data: URL without ';base64'; images must be base64-encoded")
    payload = url[m.end():]
    # base64 makes 3 bytes of 4 characters: refuse what would decode too large before decoding.
    if len(payload) > (limits.max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"{what} holds about {len(payload) * 3 // 4} bytes of image; "
                         f"at most {limits.max_bytes} are accepted")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what} is not valid base64 ({e})") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} has {len(data)} bytes; at most {limits.max_bytes} are accepted")
    if not data:
        raise ImageError(f"{what} is an empty data: URL")
    return data


def decode_bytes(data: bytes, limits: ImageLimits = DEFAULT_LIMITS, *, what: str = "the image") -> DecodedImage:
    """Encoded bytes -> DecodedImage (format and dimensions checked before decoding)."""
    pil = _pil()
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} has {len(data)} bytes; at most {limits.max_bytes} are accepted")
    if not data:
        raise ImageError(f"{what} is empty (0 bytes)")
    head = data[:64].lstrip()
    for magic, name in _NOT_RASTER:
        if head[:len(magic)].lower() == magic.lower():
            raise ImageError(f"{what} is {name}, not a raster image; supported formats: "
                             f"{', '.join(SUPPORTED_FORMATS)}")
    try:
        # open() reads only the header; the pixels are decoded by load() in _from_pil,
        # after the dimensions were checked.
        img = pil.Image.open(io.BytesIO(data), formats=list(SUPPORTED_FORMATS))
    except pil.Image.DecompressionBombError as e:   # Pillow's own bound (2 x 89 megapixels) came first
        raise ImageError(f"{what} is too large to decode (at most {limits.max_pixels} pixels are "
                         f"accepted): {e}") from None
    except pil.UnidentifiedImageError:
        fmt = _signature(data)
        if fmt is not None:   # the right magic, but the plugin refused the header (e.g. a bad CRC)
            raise ImageError(f"{what} is a corrupt {fmt} file (its header does not parse)") from None
        raise ImageError(f"{what} is not an image in a supported format ({', '.join(SUPPORTED_FORMATS)}); "
                         f"it starts with {data[:8]!r}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:   # Pillow's ways of saying "corrupt header"
        raise ImageError(f"{what} has a corrupt header: {e}") from None
    return _from_pil(img, img.format, limits, what)


def _signature(data: bytes) -> str | None:
    """The supported format whose magic bytes `data` starts with."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith((b"II*\0", b"MM\0*")):
        return "TIFF"
    if data.startswith(b"BM"):
        return "BMP"
    return None


def _from_pil(img: Any, fmt: str | None, limits: ImageLimits, what: str) -> DecodedImage:
    pil = _pil()
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(f"{what} is {width}x{height} pixels: empty")
    if width > limits.max_side or height > limits.max_side:
        raise ImageError(f"{what} is {width}x{height} pixels; each side may be at most {limits.max_side}")
    if width * height > limits.max_pixels:
        raise ImageError(f"{what} is {width}x{height} = {width * height} pixels; "
                         f"at most {limits.max_pixels} are accepted")
    frames = int(getattr(img, "n_frames", 1) or 1)
    try:
        if frames > 1:
            img.seek(0)
        img.load()
        img = pil.ImageOps.exif_transpose(img)
        rgb = to_rgb(img)
    except pil.Image.DecompressionBombError as e:
        raise ImageError(f"{what} is too large to decode: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        # "image file is truncated", "broken data stream", bad EXIF, bad palette ...
        raise ImageError(f"{what} could not be decoded ({fmt or 'image'}): {e}") from None
    return DecodedImage(image=rgb, format=fmt, frames=frames)


def to_rgb(img: Any) -> Any:
    """RGB, with transparency composited onto white: what transformers' image processors
    do to a Pillow image (`convert_to_rgb`)."""
    pil = _pil()
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = pil.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return pil.Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
