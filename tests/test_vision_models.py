"""Vision-language models on tiny random models made by transformers
(tests/goldens/tiny_vision_models.py): SmolVLM (SigLIP, pixel-shuffle connector, Llama
text model) and Gemma 3 (SigLIP, average-pooled RMSNorm projector, Gemma 3 text model).

- ellm's logits for an image+text prompt match transformers' (fed the same pixel values)
  within 1e-3 of the largest logit, on the C kernels and on the reference ops, and the
  image rows matter (the logits without them are far off);
- the vision ops (layernorm with bias, GELU, attention without a mask) match the NumPy
  reference at every SIMD level this CPU has, and do not depend on the thread count;
- the engine splices the image rows into the prompt: prefill chunks that end inside an
  image give the logits of one pass; two requests with different images batched together
  equal each alone, bit for bit; the same image twice hits the prefix cache, a different
  image behind the same ids does not; bad requests are refused with a RequestError;
- the folders converted by llama.cpp's converter (text GGUF + `--mmproj` GGUF) and loaded
  with `ellm.load(text, mmproj=...)` give the same logits.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm._native import _core, _kernels
from ellm.config import ConfigError, ModelConfig
from ellm.engine.engine import Engine, EngineConfig, RequestError
from ellm.engine.kv_cache import BlockManager, KVCache
from ellm.formats.safetensors import SafetensorsFolder
from ellm.models import build_model
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.ops import reference as R
from ellm.sampling_params import SamplingParams
from ellm.tokenizer import Tokenizer
from ellm.vision.inputs import ImageInput
from ellm.weights import SafetensorsWeights

GOLDENS = Path(__file__).parent / "goldens"
MODELS = ["smolvlm", "gemma3"]


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory) -> Path:
    ref = os.environ.get("ELLM_REF_PYTHON")
    if not ref:
        pytest.fail("ELLM_REF_PYTHON is not set: run the tests through `bash tests/run.sh`, or point it at a "
                    "Python with torch and transformers", pytrace=False)
    out = tmp_path_factory.mktemp("tiny-vision")
    subprocess.run([ref, str(GOLDENS / "tiny_vision_models.py"), str(out)], check=True, capture_output=True,
                   text=True)
    return out


def _images(folder: Path, salt: str = "") -> list[ImageInput]:
    """The images the goldens were made with, as a processor would hand them over."""
    pixels, tiles = np.load(folder / "pixel_values.npy"), np.load(folder / "tiles.npy")
    out, start = [], 0
    for n in tiles:
        out.append(ImageInput(np.ascontiguousarray(pixels[start:start + n]), f"image-{start}{salt}"))
        start += int(n)
    return out


def _model(folder: Path, device: str):
    config = ModelConfig.from_folder(folder)
    return build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), get_ops(device))


def _forward(model, ids: np.ndarray, images: list[ImageInput] | None, chunks: list[int]) -> np.ndarray:
    """Logits at every position, the prompt fed in the given chunk sizes, image rows
    spliced where the image tokens are (none when images is None)."""
    config = model.config
    rows = model.encode_images(images) if images else None
    slots = np.flatnonzero(ids == config.image_token_id)
    kv = KVCache(config, num_blocks=32, block_size=4)
    blocks = BlockManager(kv, enable_prefix_caching=False)
    assert blocks.allocate("s", len(ids))
    out, start = [], 0
    for n in chunks:
        blocks.release_out_of_window("s", start)
        tables = {w: np.asarray([blocks.table("s", w)], np.int32) for w in kv.windows}
        batch = Batch.single(ids[start:start + n], start, tables, all_logits=True)
        inside = (slots >= start) & (slots < start + n)
        if rows is not None and inside.any():
            batch.embed_rows = (slots[inside] - start).astype(np.int32)
            batch.embed_values = rows[inside]
        out.append(model.forward(batch, kv).copy())
        start += n
    assert start == len(ids)
    return np.concatenate(out)


def _assert_close_relative(got: np.ndarray, want: np.ndarray) -> float:
    bound = 1e-3 * float(np.abs(want).max())
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= bound, f"max error {err.max():.3g} at position {int(err.argmax())} > {bound:.3g}"
    return float(err.max())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_image_prompt_logits_match_transformers(vision_dir, name, device) -> None:
    folder = vision_dir / name
    model = _model(folder, device)
    ids, want = np.load(folder / "ids.npy"), np.load(folder / "logits.npy")
    _assert_close_relative(_forward(model, ids, _images(folder), [len(ids)]), want)
    # the image rows carry the image: without them the logits after the first image are far off
    blind = _forward(model, ids, None, [len(ids)])
    first = int(np.flatnonzero(ids == model.config.image_token_id)[0])
    assert np.abs(blind[first:] - want[first:]).max() > 0.05 * float(np.abs(want).max())


@pytest.mark.parametrize("name", MODELS)
def test_chunk_boundaries_inside_images(vision_dir, name) -> None:
    """Prefill in chunks that cut through the images: the logits of one pass."""
    folder = vision_dir / name
    model = _model(folder, "cpu")
    ids, want = np.load(folder / "ids.npy"), np.load(folder / "logits.npy")
    rest = len(ids) - 5 - 9 - 3
    _assert_close_relative(_forward(model, ids, _images(folder), [5, 9, 3, rest]), want)


# -- GGUF text file + llama.cpp's mmproj file -------------------------------------------

@pytest.fixture(scope="session")
def vision_ggufs(vision_dir) -> Path:
    """Both folders converted by llama.cpp's converter at f32: <name>-f32.gguf (the text
    model) and mmproj-<name>-f32.gguf (the tower and projector)."""
    llama_cpp = os.environ.get("ELLM_LLAMA_CPP_DIR")
    if not llama_cpp or not (Path(llama_cpp) / "convert_hf_to_gguf.py").is_file():
        pytest.fail("ELLM_LLAMA_CPP_DIR does not hold llama.cpp's convert_hf_to_gguf.py: run the tests through "
                    "`bash tests/run.sh`", pytrace=False)
    out = vision_dir / "gguf"
    subprocess.run([os.environ["ELLM_REF_PYTHON"], str(GOLDENS / "convert_tiny.py"), llama_cpp, str(out),
                    *(str(vision_dir / m) for m in MODELS), "--outtypes", "f32", "--mmproj"],
                   check=True, capture_output=True, text=True)
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_gguf_with_mmproj_matches_transformers(vision_dir, vision_ggufs, name, device) -> None:
    """The text GGUF + mmproj GGUF give the folder's logits (the converter stores Gemma 3's
    input projection in f16, the rest in f32: measured 3e-4 of the max logit there, 2e-6
    for SmolVLM)."""
    llm = ellm.load(vision_ggufs / f"{name}-f32.gguf", mmproj=vision_ggufs / f"mmproj-{name}-f32.gguf",
                    device=device, progress=False)
    folder = vision_dir / name
    ids, want = np.load(folder / "ids.npy"), np.load(folder / "logits.npy")
    assert llm.engine.model.config.image_token_id == ModelConfig.from_folder(folder).image_token_id
    _assert_close_relative(_forward(llm.engine.model, ids, _images(folder), [len(ids)]), want)


def test_mmproj_mismatches_are_refused(vision_dir, vision_ggufs) -> None:
    with pytest.raises(ConfigError, match="idefics3 projector goes with a llama text model"):
        ellm.load(vision_ggufs / "gemma3-f32.gguf", mmproj=vision_ggufs / "mmproj-smolvlm-f32.gguf", progress=False)
    with pytest.raises(ConfigError, match="not an mmproj file"):
        ellm.load(vision_ggufs / "gemma3-f32.gguf", mmproj=vision_ggufs / "gemma3-f32.gguf", progress=False)
    with pytest.raises(ValueError, match="mmproj= goes with a .gguf text model"):
        ellm.load(vision_dir / "smolvlm", mmproj=vision_ggufs / "mmproj-smolvlm-f32.gguf", progress=False)


# -- the ops at every SIMD level ---------------------------------------------------------

@pytest.fixture(params=_core.supported_simd_levels())
def simd_level(request):
    before = _kernels.simd_level()
    _core.set_simd_level(request.param)
    _kernels.set_simd_level(request.param)
    yield request.param
    _core.set_simd_level(before)
    _kernels.set_simd_level(before)


@pytest.mark.parametrize("n", [1, 7, 32, 37, 1152])
def test_layernorm_and_gelu_match_reference(simd_level, n) -> None:
    rng = np.random.default_rng(n)
    cpu = get_ops("cpu")
    x = (rng.standard_normal((9, n)) * 3 + 1.5).astype(np.float32)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    np.testing.assert_allclose(cpu.layernorm(x, w, b, 1e-6), R.layernorm(x, w, b, 1e-6), rtol=2e-5, atol=2e-5)
    g = (rng.standard_normal((9, n)) * 4).astype(np.float32)
    np.testing.assert_allclose(cpu.gelu_tanh(g), R.gelu_tanh(g), rtol=1e-5, atol=1e-6)
    # in place, and a column slice of a wider buffer (a row stride)
    wide = np.concatenate([x, x], axis=1)
    np.testing.assert_array_equal(cpu.layernorm(wide[:, :n], w, b, 1e-6), cpu.layernorm(x, w, b, 1e-6))
    y = g.copy()
    cpu.gelu_tanh(y, out=y)
    np.testing.assert_array_equal(y, cpu.gelu_tanh(g))


@pytest.mark.parametrize("seq_len,heads,hd", [(1, 1, 4), (6, 1, 8), (16, 2, 16), (37, 3, 24), (300, 2, 64),
                                             (70, 1, 256)])
def test_full_attention_matches_reference(simd_level, seq_len, heads, hd) -> None:
    """Query rows go 32 at a time and keys 64 at a time: short last groups of both, and
    sequences longer than one key block (the online softmax)."""
    rng = np.random.default_rng(seq_len)
    q, k, v = (rng.standard_normal((3 * seq_len, heads, hd)).astype(np.float32) * 2 for _ in range(3))
    got = get_ops("cpu").full_attention(q, k, v, seq_len, hd ** -0.5)
    np.testing.assert_allclose(got, R.full_attention(q, k, v, seq_len, hd ** -0.5), rtol=1e-4, atol=2e-5)


def test_vision_ops_do_not_depend_on_threads() -> None:
    rng = np.random.default_rng(0)
    cpu = get_ops("cpu")
    x = rng.standard_normal((700, 96)).astype(np.float32)
    w, b = rng.standard_normal(96).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    q, k, v = (rng.standard_normal((2 * 200, 4, 32)).astype(np.float32) for _ in range(3))
    before = _kernels.num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            _kernels.set_num_threads(threads)
            results.append((cpu.layernorm(x, w, b, 1e-6), cpu.gelu_tanh(x), cpu.full_attention(q, k, v, 200, 0.2)))
    finally:
        _kernels.set_num_threads(before)
    for other in results[1:]:
        for a, b_ in zip(results[0], other):
            np.testing.assert_array_equal(a, b_)


def test_vision_ops_refuse_bad_arguments() -> None:
    cpu = get_ops("cpu")
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        cpu.layernorm(x, np.ones(7, np.float32), np.zeros(8, np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        cpu.gelu_tanh(x.astype(np.float64))
    q = np.zeros((10, 2, 4), np.float32)
    with pytest.raises(ValueError, match="whole number of sequences"):
        cpu.full_attention(q, q, q, 4, 1.0)
    with pytest.raises(ValueError, match="overlap"):
        cpu.full_attention(q, q, q, 5, 1.0, out=q)
    wide = np.zeros((2, 1, 264), np.float32)
    with pytest.raises(ValueError, match="head_dim 264 is above the 256"):
        cpu.full_attention(wide, wide, wide, 2, 1.0)


# -- through the engine ------------------------------------------------------------------

@pytest.fixture(scope="module", params=MODELS)
def vlm(vision_dir, request):
    folder = vision_dir / request.param
    return _model(folder, "cpu"), Tokenizer.from_folder(folder), folder


def _engine(vlm, **cfg) -> Engine:
    model, tokenizer, _ = vlm
    return Engine(model, tokenizer, EngineConfig(max_model_len=256, block_size=4, **cfg))


def _run(engine: Engine, requests: list[tuple[list[int], list[ImageInput]]], max_tokens: int = 6) -> list:
    """Adds every request, steps until all are done -> [(token ids, logprobs, cached tokens)]."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    rids = [engine.add_request(ids, params, images=images) for ids, images in requests]
    done: dict[str, tuple] = {}
    logprobs: dict[str, list] = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
            if out.finished:
                done[out.request_id] = (out.token_ids, logprobs[out.request_id], out.num_cached_tokens)
    return [done[r] for r in rids]


def test_engine_first_token_matches_transformers(vlm) -> None:
    model, _, folder = vlm
    ids, want = np.load(folder / "ids.npy").tolist(), np.load(folder / "logits.npy")
    # chunks of 7 tokens: boundaries fall inside the images
    (tokens, logprobs, _), = _run(_engine(vlm, max_batch_tokens=7), [(ids, _images(folder))], max_tokens=1)
    assert tokens == [int(want[-1].argmax())]
    ref = want[-1].astype(np.float64)
    ref_lp = ref[tokens[0]] - (ref.max() + np.log(np.exp(ref - ref.max()).sum()))
    assert abs(logprobs[0][1] - ref_lp) < 1e-3 * float(np.abs(want).max())


def _other_images(folder: Path) -> list[ImageInput]:
    rng = np.random.default_rng(11)
    return [ImageInput((rng.random(im.pixel_values.shape, dtype=np.float32) * 2 - 1), f"other-{i}")
            for i, im in enumerate(_images(folder))]


def test_batched_images_equal_each_alone(vlm) -> None:
    _, _, folder = vlm
    ids = np.load(folder / "ids.npy").tolist()
    a, b = (ids, _images(folder)), (ids[:-2], _other_images(folder))
    alone = [_run(_engine(vlm, max_batch_tokens=11, enable_prefix_caching=False), [r])[0] for r in (a, b)]
    together = _run(_engine(vlm, max_batch_tokens=11, enable_prefix_caching=False), [a, b])
    assert together == alone   # ids and every logprob, bit for bit
    assert alone[0][0] != alone[1][0] or alone[0][1] != alone[1][1]


def test_prefix_cache_keys_include_the_image(vlm) -> None:
    _, _, folder = vlm
    ids = np.load(folder / "ids.npy").tolist()
    engine = _engine(vlm, max_batch_tokens=64)
    first = _run(engine, [(ids, _images(folder))])[0]
    again = _run(engine, [(ids, _images(folder, salt=""))])[0]
    assert again[2] >= len(ids) - 4 and again[:2] == first[:2]   # all but the last block from the cache
    # the same ids with other pixels: nothing from the first image's block on is reused
    other = _run(engine, [(ids, _other_images(folder))])[0]
    first_image_token = ids.index(engine.model.config.image_token_id)
    assert other[2] <= first_image_token
    fresh = _run(_engine(vlm, max_batch_tokens=64), [(ids, _other_images(folder))])[0]
    assert other[:2] == fresh[:2]


def test_bad_image_requests_are_refused(vlm) -> None:
    _, _, folder = vlm
    ids = np.load(folder / "ids.npy").tolist()
    engine = _engine(vlm)
    images = _images(folder)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(RequestError, match="image tokens"):
        engine.add_request(ids, params, images=images[:1])
    with pytest.raises(RequestError, match="no images were given|image tokens"):
        engine.add_request(ids, params)
    bad = ImageInput(images[1].pixel_values[:, :, :16], "x")
    with pytest.raises(RequestError, match="image 1: pixel_values has shape"):
        engine.add_request(ids, params, images=[images[0], bad])
    nan = images[1].pixel_values.copy()
    nan[0, 0, 0, 0] = np.nan
    with pytest.raises(RequestError, match="NaN"):
        engine.add_request(ids, params, images=[images[0], ImageInput(nan, "y")])
    assert not engine.has_unfinished()
