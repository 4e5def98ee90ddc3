"""Hostile images: each is refused with an ImageError that names what is wrong, and none
costs more memory than its limits allow.

The decoding runs in a child process under an address-space cap (RLIMIT_AS), as
tests/test_hostile_config.py does for model files: a bomb that got past the header
checks would die there instead of passing.
"""
from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from capped_child import run_capped

pytest.importorskip("PIL", reason="the vision tests need Pillow (pip install 'ellm-engine[vision]')")
from PIL import Image  # noqa: E402

from ellm.vision.images import ImageError, ImageLimits, decode_image, parse_data_url  # noqa: E402

# The child decodes under a cap of what it has mapped after import + this much. A
# 50-megapixel RGB picture (the default limit) needs 150 MB, so 600 MB is room for one
# legal image and nowhere near what the bombs below would need (>= 1.2 GB).
CAP_MB = 600

_CHILD = r"""
import json, resource, sys
from ellm.vision.images import decode_image
import PIL.Image, PIL.PngImagePlugin, PIL.JpegImagePlugin, PIL.GifImagePlugin, PIL.TiffImagePlugin
import PIL.WebPImagePlugin, PIL.BmpImagePlugin
PIL.Image.init()
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY))
for path in sys.argv[2:]:
    try:
        d = decode_image(path)
        print(json.dumps({"path": path, "ok": True, "size": d.size}), flush=True)
    except BaseException as e:
        print(json.dumps({"path": path, "ok": False, "type": type(e).__name__,
                          "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)[:2000]}), flush=True)
"""


def _decode_in_child(paths: list[Path]) -> dict[str, dict]:
    return run_capped(_CHILD, [str(CAP_MB)], paths, timeout=300)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT (a bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def _png_zeros(width: int, height: int) -> bytes:
    """A real PNG of width x height black pixels: megabytes of pixels in kilobytes."""
    row = b"\0" + b"\0" * (3 * width)
    comp = zlib.compressobj(9)
    body = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _photo(fmt: str = "PNG", size: tuple[int, int] = (200, 150)) -> bytes:
    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def _gif_header(width: int, height: int) -> bytes:
    # GIF89a logical screen of width x height, one 1x1 frame
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)
            + b"," + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00;")


HOSTILE = {
    # name: (bytes, words the message must contain)
    "truncated.png": (_photo("PNG")[:1500], "could not be decoded"),
    "truncated.jpg": (_photo("JPEG")[:900], "could not be decoded"),
    "huge_side.png": (_png_header_only(100_000, 10), "each side may be at most 16384"),
    "huge_area.png": (_png_header_only(16_000, 16_000), "too large to decode (at most 50000000"),
    "area_over_limit.png": (_png_header_only(10_000, 8_000), "10000x8000 = 80000000 pixels; at most 50000000"),
    "huge_gif.gif": (_gif_header(65_535, 65_535), "too large to decode"),
    "wide_gif.gif": (_gif_header(20_000, 2), "each side may be at most"),
    "bomb_9000.png": (_png_zeros(9000, 9000), "9000x9000 = 81000000 pixels"),
    "drawing.svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "an SVG drawing"),
    "xml.svg": (b'<?xml version="1.0"?><svg/>', "XML"),
    "doc.pdf": (b"%PDF-1.7\n1 0 obj<<>>endobj\n", "a PDF document"),
    "doc.eps": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "PostScript"),
    "noise.bin": (bytes(range(256)) * 4, "not an image in a supported format"),
    "empty.png": (b"", "is empty"),
    "bad_crc.png": (_png_header_only(10, 10)[:29] + b"\0\0\0\0" + _png_header_only(10, 10)[33:], "corrupt"),
    "text.txt": (b"hello, I am not an image\n", "not an image in a supported format"),
}


def test_hostile_files_are_refused_in_bounded_memory(tmp_path):
    paths = []
    for name, (data, _) in HOSTILE.items():
        p = tmp_path / name
        p.write_bytes(data)
        paths.append(p)
    legal = tmp_path / "legal.png"        # a 7000x7000 black picture: 147 MB decoded, within the limits
    legal.write_bytes(_png_zeros(7000, 7000))
    got = _decode_in_child(paths + [legal])
    for name, (_, words) in HOSTILE.items():
        rec = got[str(tmp_path / name)]
        assert not rec["ok"], name
        assert rec["type"] == "ImageError" and "ValueError" in rec["mro"], (name, rec)
        assert words in rec["message"], (name, rec["message"])
    assert got[str(legal)] == {"ok": True, "size": [7000, 7000]}


def test_pillow_bomb_check_is_also_an_image_error():
    # Limits raised past Pillow's own (2 x 89 megapixels): Pillow's DecompressionBombError
    # becomes an ImageError too, still before any pixel is decoded.
    limits = ImageLimits(max_pixels=10**9, max_side=10**6)
    with pytest.raises(ImageError, match="too large"):
        decode_image(_png_header_only(20_000, 20_000), limits)


def test_size_limits_on_files_bytes_and_data_urls(tmp_path):
    limits = ImageLimits(max_bytes=1000)
    data = _photo("PNG")
    assert len(data) > 1000
    p = tmp_path / "big.png"
    p.write_bytes(data)
    with pytest.raises(ImageError, match="at most 1000"):
        decode_image(p, limits)
    with pytest.raises(ImageError, match="at most 1000"):
        decode_image(data, limits)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with pytest.raises(ImageError, match="at most 1000"):
        decode_image(url, limits)
    # an oversize data URL is refused from its length, before decoding
    with pytest.raises(ImageError, match="at most"):
        parse_data_url("data:image/png;base64," + "A" * 40_000_000)


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@notbase64@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),             # bad padding
    ("data:text/plain;base64,aGVsbG8=", "an image/* type is needed"),
    ("data:image/png,rawbytes", "without ';base64'"),
    ("data:image/png;base64,", "empty"),
    ("data:", "not a valid data: URL"),
    ("data:image/png;base64" + "x" * 10, "not a valid data: URL"),
])
def test_bad_data_urls(url, words):
    with pytest.raises(ImageError, match=words.replace("*", r"\*").replace("(", r"\(")):
        decode_image(url)


def test_bad_sources(tmp_path):
    with pytest.raises(ImageError, match="no such file"):
        decode_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="not a file"):
        decode_image(tmp_path)
    with pytest.raises(ImageError, match="does not fetch"):
        decode_image("https://example.invalid/cat.png")
    with pytest.raises(ImageError, match="not int"):
        decode_image(42)   # type: ignore[arg-type]
    with pytest.raises(ImageError, match="each side"):
        decode_image(Image.new("L", (20_000, 1)))


def test_good_images_decode(tmp_path):
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        d = decode_image(_photo(fmt, (33, 21)))
        assert d.size == (33, 21) and d.image.mode == "RGB", fmt
        assert d.array().shape == (21, 33, 3)
    # an animated GIF gives its first frame and says how many there were
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    d = decode_image(buf.getvalue())
    assert d.frames == 2 and d.array()[0, 0].tolist() == [255, 0, 0]
    # transparency goes onto white, as transformers' convert_to_rgb does
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert decode_image(clear).array()[0, 0].tolist() == [255, 255, 255]
