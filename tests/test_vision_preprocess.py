"""ellm's image preprocessing and prompt expansion against transformers' processors.

Pixel values: Idefics3ImageProcessorPil (SmolVLM's is the same code) and
Gemma3ImageProcessorPil, run by the reference Python on the same files, on real photos
(scikit-image's data) and on Pillow-made images of awkward sizes and modes; they must
agree within 1e-6. Prompt ids: Idefics3Processor and Gemma3Processor built over the real
SmolLM2 and Gemma 3 tokenizers (image tokens added) and saved to folders; ellm reads the
same folders and must give identical ids, for raw text with placeholders and through the
chat template.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL", reason="the vision tests need Pillow (pip install 'ellm-engine[vision]')")
from PIL import Image  # noqa: E402

from ellm.tokenizer import Tokenizer  # noqa: E402
from ellm.vision.images import decode_image  # noqa: E402
from ellm.vision.preprocess import (Gemma3Processing, Idefics3Processing, Normalization,  # noqa: E402
                                    expand_prompt, load_processing)
from vision_data import PHOTOS, run_ref, skimage_photos  # noqa: E402


def _made_images(folder: Path) -> dict[str, Path]:
    """Pillow-made images: odd and extreme sizes, every common mode, EXIF orientation."""
    rng = np.random.default_rng(16)
    out: dict[str, Path] = {}

    def save(name: str, img: Image.Image, fmt: str = "PNG", **kw) -> None:
        path = folder / name
        img.save(path, fmt, **kw)
        out[name] = path

    def noise(w: int, h: int, c: int = 3) -> np.ndarray:
        return rng.integers(0, 256, (h, w, c), dtype=np.uint8)

    save("odd_37x53.png", Image.fromarray(noise(37, 53)))
    save("wide_2000x61.png", Image.fromarray(noise(2000, 61)))
    save("tall_45x1333.png", Image.fromarray(noise(45, 1333)))
    save("tiny_1x1.png", Image.fromarray(noise(1, 1)))
    save("tiny_3x2.png", Image.fromarray(noise(3, 2)))
    save("exact_728x364.png", Image.fromarray(noise(728, 364)))
    save("gray_301x199.png", Image.fromarray(noise(301, 199, 1)[..., 0], mode="L"))
    rgba = noise(250, 170, 4)
    rgba[..., 3] = np.linspace(0, 255, 250, dtype=np.uint8)[None, :]
    save("rgba_250x170.png", Image.fromarray(rgba, mode="RGBA"))
    save("la_120x90.png", Image.fromarray(noise(120, 90, 2), mode="LA"))
    pal = Image.fromarray(noise(160, 100)).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    save("palette_160x100.png", pal)
    save("palette_transparent_160x100.png", pal, transparency=3)
    save("cmyk_140x90.jpg", Image.fromarray(noise(140, 90, 4), mode="CMYK"), "JPEG", quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6   # orientation: rotate 90 degrees clockwise to view
    save("exif_rotated_300x180.jpg", Image.fromarray(noise(300, 180)), "JPEG", exif=exif, quality=92)
    frames = [Image.fromarray(noise(90, 70)).convert("P") for _ in range(3)]
    path = folder / "animated_90x70.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50)
    out[path.name] = path
    return out


# (family, HF image processor kwargs, ellm's equivalent)
SETTINGS = {
    "idefics3-728": ("idefics3", {"size": {"longest_edge": 728}, "max_image_size": {"longest_edge": 364}},
                     Idefics3Processing(tile=364, size=728, image_seq_len=9)),
    "idefics3-default": ("idefics3", {}, Idefics3Processing()),
    "idefics3-nosplit": ("idefics3", {"size": {"longest_edge": 512}, "max_image_size": {"longest_edge": 224},
                                      "do_image_splitting": False,
                                      "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                      "image_std": [0.26862954, 0.26130258, 0.27577711]},
                         Idefics3Processing(tile=224, size=512, do_image_splitting=False, image_seq_len=9,
                                            normalize=Normalization(image_mean=(0.48145466, 0.4578275, 0.40821073),
                                                                 image_std=(0.26862954, 0.26130258, 0.27577711)))),
    "gemma3": ("gemma3", {"size": {"height": 896, "width": 896}}, Gemma3Processing()),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    photos = skimage_photos()
    made = _made_images(tmp_path_factory.mktemp("made"))
    return {**{name: photos / name for name in PHOTOS}, **made}


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> dict[str, np.ndarray]:
    tmp = tmp_path_factory.mktemp("ref")
    cases = []
    for setting, (family, kwargs, _) in SETTINGS.items():
        names = list(images) if setting in ("idefics3-728", "gemma3") else ["chelsea.png", "rocket.jpg",
                                                                          "wide_2000x61.png", "tiny_3x2.png"]
        cases += [{"name": f"{setting}:{n}", "path": str(images[n]), "family": family, "kwargs": kwargs}
                  for n in names]
    (tmp / "job.json").write_text(json.dumps({"cases": cases}))
    run_ref("pixels", str(tmp / "job.json"), str(tmp / "out.npz"))
    with np.load(tmp / "out.npz") as z:
        return {k: z[k] for k in z.files}


def test_pixel_values_equal_transformers(images, reference):
    compared = 0
    for key in sorted({k.rsplit("/", 1)[0] for k in reference}):
        setting, name = key.split(":", 1)
        processing = SETTINGS[setting][2]
        got = processing.preprocess(decode_image(images[name]))
        want = reference[f"{key}/pixel_values"]
        assert got.pixel_values.dtype == np.float32
        assert got.pixel_values.shape == want.shape, key
        err = float(np.max(np.abs(got.pixel_values - want)))
        assert err <= 1e-6, f"{key}: max abs difference {err}"
        assert [got.meta["rows"], got.meta["cols"]] == reference[f"{key}/rows_cols"].tolist(), key
        compared += 1
    assert compared == 2 * 21 + 2 * 4


def test_tiles_of_a_landscape_photo(images):
    # chelsea is 451x300: longest edge to 728 -> 728x484, then up to whole tiles: 2 x 2 + global
    out = SETTINGS["idefics3-728"][2].preprocess(decode_image(images["chelsea.png"]))
    assert out.pixel_values.shape == (5, 3, 364, 364)
    assert (out.meta["rows"], out.meta["cols"]) == (2, 2)


def test_content_hash_follows_pixels_and_settings(images):
    a = decode_image(images["chelsea.png"])
    b = decode_image(images["chelsea.png"].read_bytes())
    p, q = SETTINGS["idefics3-728"][2], SETTINGS["idefics3-default"][2]
    assert p.preprocess(a).content_hash == p.preprocess(b).content_hash
    assert p.preprocess(a).content_hash != q.preprocess(a).content_hash
    flipped = a.image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert p.preprocess(decode_image(flipped)).content_hash != p.preprocess(a).content_hash


# ---------------------------------------------------------------------------------------
# prompt expansion
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def processor_folders(tmp_path_factory, smollm2_hf_f32, gemma3_hf_f32) -> Path:
    out = tmp_path_factory.mktemp("processors")
    run_ref("processors", str(out), str(smollm2_hf_f32), str(gemma3_hf_f32))
    return out


def _ellm_ids(folder: Path, images_: list[Path], *, text: str | None = None,
              messages: list | None = None) -> list[int]:
    tok = Tokenizer.from_folder(folder)
    processing = load_processing(folder)
    assert processing is not None
    inputs = [processing.preprocess(decode_image(p)) for p in images_]
    if messages is not None:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        return tok.encode(expand_prompt(prompt, processing, inputs), add_special_tokens=False)
    return tok.encode(expand_prompt(text, processing, inputs), add_special_tokens=True)


def test_expanded_prompt_ids_equal_transformers(processor_folders, images, tmp_path):
    two = [str(images["chelsea.png"]), str(images["tall_45x1333.png"])]
    cases = [
        {"name": "idefics3-text", "folder": "idefics3", "text": "Look: <image> and <image>. Which?",
         "images": two},
        {"name": "idefics3-single", "folder": "idefics3", "text": "<image>What is it?",
         "images": [str(images["tiny_3x2.png"])]},
        {"name": "idefics3-chat", "folder": "idefics3", "images": two + [str(images["wide_2000x61.png"])],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
                      {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image"},
                                                   {"type": "image"}]}]},
        {"name": "gemma3-text", "folder": "gemma3", "text": "<start_of_image> What is this?",
         "images": [str(images["coffee.png"])]},
        {"name": "gemma3-chat", "folder": "gemma3", "images": two,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                                   {"type": "text", "text": " with "}, {"type": "image"}]}]},
    ]
    for c in cases:
        c["folder"] = str(processor_folders / c["folder"])
    (tmp_path / "job.json").write_text(json.dumps({"cases": cases}))
    run_ref("expand", str(tmp_path / "job.json"), str(tmp_path / "out.json"))
    want = json.loads((tmp_path / "out.json").read_text())
    for c in cases:
        got = _ellm_ids(Path(c["folder"]), [Path(p) for p in c["images"]], text=c.get("text"),
                        messages=c.get("messages"))
        assert got == want[c["name"]], c["name"]
    # the image tokens are really there: 9 per tile, (2x2 + 1) + (2x1 + 1) tiles for the two images
    tok = Tokenizer.from_folder(processor_folders / "idefics3")
    image_id = tok.encode("<image>", add_special_tokens=False)
    assert len(image_id) == 1
    assert want["idefics3-text"].count(image_id[0]) == 9 * (5 + 3)
    soft = Tokenizer.from_folder(processor_folders / "gemma3").encode("<image_soft_token>", add_special_tokens=False)
    assert len(soft) == 1 and want["gemma3-text"].count(soft[0]) == 256


def test_placeholder_count_must_match(processor_folders, images):
    processing = load_processing(processor_folders / "idefics3")
    one = processing.preprocess(decode_image(images["tiny_1x1.png"]))
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_prompt("<image><image>", processing, [one])
    with pytest.raises(ValueError, match="0 image placeholder"):
        expand_prompt("no image here", processing, [one])


def test_text_only_folder_has_no_processing(smollm2_hf_f32):
    assert load_processing(smollm2_hf_f32) is None


def test_processing_from_bytes_equals_path(images):
    p = SETTINGS["gemma3"][2]
    data = images["rocket.jpg"].read_bytes()
    a = p.preprocess(decode_image(images["rocket.jpg"]))
    b = p.preprocess(decode_image(io.BytesIO(data).getvalue()))
    np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
