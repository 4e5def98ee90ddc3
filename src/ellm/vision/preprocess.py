"""Each vision model's image processor, equal to transformers' Pillow path, and the
prompt expansion that goes with it.

A processor turns one DecodedImage into an ImageInput (the tiles' pixel values, rescaled
and normalized) and says what text stands for that image in the prompt:

- Idefics3 / SmolVLM (`Idefics3Processing`): resize so the longest edge is `size`
  (LANCZOS, on uint8 as Pillow does it), then (with `do_image_splitting`) resize up to a
  whole number of `tile` x `tile` tiles, cut them row by row and add the whole image
  squeezed to one tile (the "global" image) last; rescale; normalize. The prompt gets,
  per tile, `<fake_token_around_image><row_r_col_c>` + `<image>` * image_seq_len, a "\n"
  after each row, and then "\n" + the global image's
  `<fake_token_around_image><global-img>` + `<image>` * image_seq_len +
  `<fake_token_around_image>`.
- Gemma 3 (`Gemma3Processing`): resize to `size` x `size` (BILINEAR), rescale,
  normalize; one tile. The prompt gets "\n\n<start_of_image>" + `<image_soft_token>` *
  256 + "<end_of_image>\n\n". Pan-and-scan (extra crops of very wide or tall images) is
  off, as in transformers' Gemma3Processor by default; a config that turns it on is
  refused rather than run differently.

Settings come from a Hugging Face folder (preprocessor_config.json / processor_config.json,
config.json) or from a GGUF mmproj file's `clip.vision.*` metadata. The chat template writes
one placeholder per image (`placeholder`); `expand_prompt` replaces each with that image's
text, so tokenizing the result gives the ids transformers' processor gives.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .images import DecodedImage, ImageError
from .inputs import ImageInput

# transformers' IMAGENET_STANDARD_MEAN / _STD, the processors' defaults
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
# Pillow's resampling filters by their enum values, as preprocessor_config.json stores them
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
# Idefics3's absolute bound on the resized image (transformers' MAX_IMAGE_SIZE)
IDEFICS3_MAX_SIDE = 4096


class ProcessorConfigError(ValueError):
    """A vision processor's settings that cannot be used (names the file and the field)."""


@dataclass(frozen=True)
class Normalization:
    """Rescale then normalize, with transformers' arithmetic: uint8 -> float64 * factor ->
    float32, then (x - mean) / std in float32."""
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = STANDARD_MEAN
    image_std: tuple[float, float, float] = STANDARD_STD

    def __call__(self, tiles: np.ndarray) -> np.ndarray:
        # tiles: (n, S, S, 3) uint8 -> (n, 3, S, S) float32
        x = tiles.astype(np.float64) * self.rescale_factor if self.do_rescale else tiles
        x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, dtype=np.float32)) / np.asarray(self.image_std, dtype=np.float32)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


def _resize(img: Any, width: int, height: int, resample: int) -> Any:
    return img.resize((width, height), resample=resample)


def _hash(settings: str, decoded: DecodedImage) -> str:
    h = hashlib.sha256(b"ellm-image-v1\0")
    h.update(settings.encode())
    h.update(repr(decoded.size).encode())
    h.update(decoded.image.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Idefics3 / SmolVLM
# ---------------------------------------------------------------------------------------

def _fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' two steps: longest edge to `longest` (the other side rounded up to an
    even number), then everything under IDEFICS3_MAX_SIDE."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width = IDEFICS3_MAX_SIDE
        height = int(width / aspect)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        height = IDEFICS3_MAX_SIDE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides up to multiples of the tile, the second one from the first's aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3Processing:
    """Idefics3ImageProcessor (also SmolVLM's) + Idefics3Processor's prompt expansion."""
    tile: int = 364                      # max_image_size.longest_edge: the vision encoder's input side
    size: int | None = 4 * 364           # size.longest_edge (None: do_resize off)
    do_image_splitting: bool = True
    resample: int = 1                    # LANCZOS
    image_seq_len: int = 169             # <image> tokens per tile
    normalize: Normalization = field(default_factory=Normalization)
    image_token: str = "<image>"
    fake_image_token: str = "<fake_token_around_image>"
    global_image_token: str = "<global-img>"
    family: str = "idefics3"

    def __post_init__(self) -> None:
        _check_positive("tile (max_image_size.longest_edge)", self.tile)
        if self.size is not None:
            _check_positive("size.longest_edge", self.size)
        _check_positive("image_seq_len", self.image_seq_len)
        _check_resample(self.resample)

    @property
    def placeholder(self) -> str:
        """What the chat template writes for one image."""
        return self.image_token

    def settings_key(self) -> str:
        return repr(self)

    def preprocess(self, decoded: DecodedImage) -> ImageInput:
        img = decoded.image
        if self.size is not None:
            h, w = _fit_longest_edge(img.height, img.width, self.size)
            img = _resize(img, w, h, self.resample)
        t = self.tile
        rows = cols = 0
        if self.do_image_splitting:
            h, w = _whole_tiles(img.height, img.width, t)
            img = _resize(img, w, h, self.resample)
            arr = np.asarray(img, dtype=np.uint8)
            if h > t or w > t:
                rows, cols = (h - t) // t + 1, (w - t) // t + 1
                # (rows, t, cols, t, 3) -> (rows * cols, t, t, 3), row by row
                crops = arr[:rows * t, :cols * t].reshape(rows, t, cols, t, 3).swapaxes(1, 2).reshape(-1, t, t, 3)
                whole = np.asarray(_resize(img, t, t, self.resample), dtype=np.uint8)
                tiles = np.concatenate([crops, whole[None]], axis=0)
            else:
                tiles = arr[None]
        else:
            tiles = np.asarray(_resize(img, t, t, self.resample), dtype=np.uint8)[None]
        pixel_values = self.normalize(tiles)
        return ImageInput(pixel_values=pixel_values, content_hash=_hash(self.settings_key(), decoded),
                          meta={"family": self.family, "rows": rows, "cols": cols,
                                "tokens": self.count_tokens(rows, cols), "size": decoded.size,
                                "frames": decoded.frames})

    def prompt_text(self, image: ImageInput) -> str:
        rows, cols = int(image.meta["rows"]), int(image.meta["cols"])
        return self._text(rows, cols)

    def _text(self, rows: int, cols: int) -> str:
        tokens = self.image_token * self.image_seq_len
        whole = f"{self.fake_image_token}{self.global_image_token}{tokens}{self.fake_image_token}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{self.fake_image_token}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return grid + "\n" + whole

    def count_tokens(self, rows: int, cols: int) -> int:
        """How many image tokens (runs of image_token) the image fills."""
        return self.image_seq_len * (rows * cols + 1)


# ---------------------------------------------------------------------------------------
# Gemma 3
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gemma3Processing:
    """Gemma3ImageProcessor (pan-and-scan off) + Gemma3Processor's prompt expansion."""
    size: int = 896
    resample: int = 2                    # BILINEAR
    image_seq_len: int = 256             # mm_tokens_per_image
    normalize: Normalization = field(default_factory=Normalization)
    boi_token: str = "<start_of_image>"
    eoi_token: str = "<end_of_image>"
    image_token: str = "<image_soft_token>"
    family: str = "gemma3"

    def __post_init__(self) -> None:
        _check_positive("size", self.size)
        _check_positive("image_seq_length", self.image_seq_len)
        _check_resample(self.resample)

    @property
    def placeholder(self) -> str:
        return self.boi_token

    @property
    def tile(self) -> int:
        return self.size

    def settings_key(self) -> str:
        return repr(self)

    def preprocess(self, decoded: DecodedImage) -> ImageInput:
        img = _resize(decoded.image, self.size, self.size, self.resample)
        pixel_values = self.normalize(np.asarray(img, dtype=np.uint8)[None])
        return ImageInput(pixel_values=pixel_values, content_hash=_hash(self.settings_key(), decoded),
                          meta={"family": self.family, "rows": 0, "cols": 0, "tokens": self.image_seq_len,
                                "size": decoded.size, "frames": decoded.frames})

    def prompt_text(self, image: ImageInput) -> str:
        return f"\n\n{self.boi_token}{self.image_token * self.image_seq_len}{self.eoi_token}\n\n"

    def count_tokens(self, rows: int = 0, cols: int = 0) -> int:
        return self.image_seq_len


Processing = Idefics3Processing | Gemma3Processing


def expand_prompt(text: str, processing: Processing, images: Sequence[ImageInput]) -> str:
    """Replaces the i-th placeholder in `text` with image i's tokens, as the HF processor
    does; the counts must agree."""
    mark = processing.placeholder
    pieces = text.split(mark)
    if len(pieces) - 1 != len(images):
        raise ImageError(f"the prompt has {len(pieces) - 1} image placeholder(s) ({mark!r}) but "
                         f"{len(images)} image(s) were given")
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        out.append(processing.prompt_text(image))
        out.append(piece)
    return "".join(out)


# ---------------------------------------------------------------------------------------
# Settings from files
# ---------------------------------------------------------------------------------------

VISION_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3", "gemma3": "gemma3"}


def _check_positive(name: str, value: Any) -> int:
    """value, once checked to be a positive int."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProcessorConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_resample(value: Any) -> None:
    if value not in RESAMPLE_NAMES:
        raise ProcessorConfigError(f"resample must be one of {sorted(RESAMPLE_NAMES)} (Pillow's filters), "
                                   f"got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProcessorConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ProcessorConfigError(f"{path}: the top level must be an object")
    return data


def _triple(cfg: Mapping[str, Any], key: str, default: tuple[float, float, float],
            where: str) -> tuple[float, float, float]:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, np.ndarray):   # a GGUF array
        v = v.tolist()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v] * 3
    if (not isinstance(v, (list, tuple)) or len(v) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
        raise ProcessorConfigError(f"{where}: {key} must be 3 finite numbers, got {v!r}")
    if key == "image_std" and any(x == 0 for x in v):
        raise ProcessorConfigError(f"{where}: image_std has a zero")
    return (float(v[0]), float(v[1]), float(v[2]))


def _normalize_from(cfg: Mapping[str, Any], where: str) -> Normalization:
    factor = cfg.get("rescale_factor", 1 / 255)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor):
        raise ProcessorConfigError(f"{where}: rescale_factor must be a finite number, got {factor!r}")
    return Normalization(do_rescale=bool(cfg.get("do_rescale", True)), rescale_factor=float(factor),
                      do_normalize=bool(cfg.get("do_normalize", True)),
                      image_mean=_triple(cfg, "image_mean", STANDARD_MEAN, where),
                      image_std=_triple(cfg, "image_std", STANDARD_STD, where))


def _edge(cfg: Mapping[str, Any], key: str, where: str, default: int) -> int:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, Mapping):
        if "longest_edge" in v:
            return v["longest_edge"]
        if "height" in v and "width" in v and v["height"] == v["width"]:
            return v["height"]
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise ProcessorConfigError(f"{where}: {key} must be {{'longest_edge': N}} or a square {{'height', 'width'}}, "
                               f"got {v!r}")


def load_processing(folder: str | Path, model_config: Mapping[str, Any] | None = None,
                    tokenizer_config: Mapping[str, Any] | None = None) -> Processing | None:
    """The processor of a Hugging Face model folder, or None for a text-only model."""
    folder = Path(folder)
    cfg = dict(model_config) if model_config is not None else _read_json(folder / "config.json")
    family = VISION_MODEL_TYPES.get(str(cfg.get("model_type", "")))
    if family is None or "vision_config" not in cfg:
        return None
    proc = _read_json(folder / "processor_config.json")
    pre_path = folder / "preprocessor_config.json"
    pre = _read_json(pre_path)
    if not pre and isinstance(proc.get("image_processor"), dict):   # transformers 5 nests it
        pre, pre_path = proc["image_processor"], folder / "processor_config.json"
    where = str(pre_path)
    tok = dict(tokenizer_config) if tokenizer_config is not None else _read_json(folder / "tokenizer_config.json")
    extra = tok.get("extra_special_tokens")
    if not isinstance(extra, dict):
        extra = {}

    def token(name: str, default: str) -> str:
        v = tok.get(name, extra.get(name, default))
        return v if isinstance(v, str) and v else default

    vision = cfg.get("vision_config") or {}
    resample = pre.get("resample")
    if family == "idefics3":
        seq = proc.get("image_seq_len")
        if seq is None:
            image_size, patch = vision.get("image_size", 364), vision.get("patch_size", 14)
            scale = cfg.get("scale_factor", 2)
            seq = int((image_size // patch) ** 2 / scale ** 2)
        return Idefics3Processing(
            tile=_edge(pre, "max_image_size", where, vision.get("image_size", 364)),
            size=_edge(pre, "size", where, 4 * 364) if pre.get("do_resize", True) else None,
            do_image_splitting=bool(pre.get("do_image_splitting", True)),
            resample=1 if resample is None else resample, image_seq_len=seq,
            normalize=_normalize_from(pre, where),
            image_token=token("image_token", "<image>"),
            fake_image_token=token("fake_image_token", "<fake_token_around_image>"),
            global_image_token=token("global_image_token", "<global-img>"),
            family=str(cfg["model_type"]))
    if pre.get("do_pan_and_scan"):
        raise ProcessorConfigError(f"{where}: do_pan_and_scan is on; ellm runs Gemma 3 images without "
                                   f"pan-and-scan (transformers' default), so it refuses this setting")
    seq = proc.get("image_seq_length", cfg.get("mm_tokens_per_image", 256))
    return Gemma3Processing(
        size=_edge(pre, "size", where, vision.get("image_size", 896)),
        resample=2 if resample is None else resample, image_seq_len=seq,
        normalize=_normalize_from(pre, where),
        boi_token=token("boi_token", "<start_of_image>"), eoi_token=token("eoi_token", "<end_of_image>"),
        image_token=token("image_token", "<image_soft_token>"))


def processing_from_mmproj(meta: Mapping[str, Any], *, where: str = "mmproj") -> Processing:
    """The processor described by a GGUF mmproj file's metadata (llama.cpp's converter
    writes clip.projector_type, clip.vision.image_size, .preproc_image_size, .patch_size,
    .image_mean, .image_std, .projector.scale_factor). The resampling filter and the
    token strings are not stored there: the HF processor's defaults are used."""
    ptype = meta.get("clip.projector_type")
    norm = Normalization(image_mean=_triple(meta, "clip.vision.image_mean", STANDARD_MEAN, where),
                      image_std=_triple(meta, "clip.vision.image_std", STANDARD_STD, where))
    image_size = _check_positive(f"{where}: clip.vision.image_size", meta.get("clip.vision.image_size"))
    patch = _check_positive(f"{where}: clip.vision.patch_size", meta.get("clip.vision.patch_size"))
    if ptype == "idefics3":
        scale = _check_positive(f"{where}: clip.vision.projector.scale_factor",
                                meta.get("clip.vision.projector.scale_factor", 2))
        return Idefics3Processing(tile=image_size, size=meta.get("clip.vision.preproc_image_size", 4 * image_size),
                                  image_seq_len=int((image_size // patch) ** 2 / scale ** 2), normalize=norm)
    if ptype == "gemma3":
        # Gemma 3's projector average-pools the patch grid by scale_factor (llama.cpp's
        # default 4: 896 / 14 = 64 patches a side -> 16 x 16 = 256 tokens)
        pool = _check_positive(f"{where}: clip.vision.projector.scale_factor",
                               meta.get("clip.vision.projector.scale_factor", 4))
        side = image_size // patch // pool
        _check_positive(f"{where}: image tokens a side (image_size / patch_size / scale_factor)", side)
        return Gemma3Processing(size=image_size, normalize=norm, image_seq_len=side * side)
    raise ProcessorConfigError(f"{where}: clip.projector_type {ptype!r} is not supported "
                               f"(ellm reads 'idefics3' and 'gemma3')")
