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

from pathlib import Path

import numpy as np
import pytest

import ellm
from ellm._native import _kernels
from ellm.config import ConfigError
from ellm.engine.engine import Engine, EngineConfig, RequestError
from ellm.engine.kv_cache import BlockManager, KVCache
from ellm.formats.safetensors import SafetensorsFolder
from ellm.models import build_model, config_from_folder
from ellm.models.batch import Batch
from ellm.ops import get_ops
from ellm.ops import reference as R
from ellm.sampling_params import SamplingParams
from ellm.tokenizer import Tokenizer
from ellm.vision.inputs import ImageInput
from ellm.weights import SafetensorsWeights
from test_kernels import simd  # noqa: F401  (the fixture: every SIMD level, both modules)

MODELS = ["smolvlm", "gemma3"]


@pytest.fixture(scope="session")
def vision_dir(tiny_vision_dir: Path) -> Path:
    """tests/goldens/tiny_vision_models.py's folders (conftest.py makes them once for the session)."""
    return tiny_vision_dir


def _images(folder: Path, salt: str = "") -> list[ImageInput]:
    """The images the goldens were made with, as a processor would hand them over."""
    pixels, tiles = np.load(folder / "pixel_values.npy"), np.load(folder / "tiles.npy")
    out, start = [], 0
    for n in tiles:
        out.append(ImageInput(np.ascontiguousarray(pixels[start:start + n]), f"image-{start}{salt}"))
        start += int(n)
    return out


def _model(folder: Path, device: str):
    config = config_from_folder(folder)
    return build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), get_ops(device))


def _image_runs(ids: np.ndarray, image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive image tokens (transformers' image groups)."""
    is_image = np.concatenate([[0], (ids == image_token).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(is_image))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _key_limit(ids: np.ndarray, image_token: int, start: int, n: int) -> np.ndarray:
    """Batch.key_limit for tokens start..start+n-1: an image token sees its whole run."""
    limit = np.arange(start, start + n, dtype=np.int32)
    for a, b in _image_runs(ids, image_token):
        lo, hi = max(a, start), min(b, start + n)
        if lo < hi:
            assert a >= start and b <= start + n, "a chunk must hold a whole image"
            limit[lo - start:hi - start] = b - 1
    return limit


def _forward(model, ids: np.ndarray, images: list[ImageInput] | None, chunks: list[int],
             bidirectional: bool | None = None) -> np.ndarray:
    """Logits at every position, the prompt fed in the given chunk sizes, image rows
    spliced where the image tokens are (none when images is None); an image's tokens
    see each other both ways when bidirectional (default: as the model declares)."""
    config = model.config
    rows = model.encode_images(images) if images else None
    slots = np.flatnonzero(ids == config.image_token_id)
    if bidirectional is None:
        bidirectional = getattr(model, "bidirectional_images", False)
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
        if bidirectional and inside.any():
            batch.key_limit = _key_limit(ids, config.image_token_id, start, n)
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


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_gemma3_image_tokens_attend_both_ways(vision_dir, device) -> None:
    """Gemma 3 is compared with transformers given the processor's token_type_ids (an
    image's tokens see each other both ways); attending causally instead matches
    transformers run without them, and is far from the processor path. SmolVLM (Idefics3)
    stays causal."""
    folder = vision_dir / "gemma3"
    model = _model(folder, device)
    assert model.bidirectional_images and not _model(vision_dir / "smolvlm", device).bidirectional_images
    ids, want, causal = (np.load(folder / f) for f in ("ids.npy", "logits.npy", "logits_causal.npy"))
    both_ways = _forward(model, ids, _images(folder), [len(ids)])
    one_way = _forward(model, ids, _images(folder), [len(ids)], bidirectional=False)
    _assert_close_relative(both_ways, want)
    _assert_close_relative(one_way, causal)
    first = int(np.flatnonzero(ids == model.config.image_token_id)[0])
    assert np.abs(one_way - want).max() > 0.05 * float(np.abs(want).max())
    np.testing.assert_array_equal(both_ways[:first], one_way[:first])   # the text before the image


@pytest.mark.parametrize("name", MODELS)
def test_chunk_boundaries_inside_images(vision_dir, name) -> None:
    """Prefill in chunks that cut through the images: the logits of one pass."""
    folder = vision_dir / name
    model = _model(folder, "cpu")
    ids, want = np.load(folder / "ids.npy"), np.load(folder / "logits.npy")
    if model.bidirectional_images:   # Gemma 3: chunks end before, at and after an image, not inside
        (a, b), (c, _) = _image_runs(ids, model.config.image_token_id)
        chunks = [5, a - 5, b - a, 3, c - b - 3]
    else:
        chunks = [5, 9, 3]
    full = _forward(model, ids, _images(folder), [len(ids)])
    got = _forward(model, ids, _images(folder), chunks + [len(ids) - sum(chunks)])
    _assert_close_relative(got, want)
    np.testing.assert_array_equal(got, full)   # batch invariance: chunking changes no bit


# -- GGUF text file + llama.cpp's mmproj file -------------------------------------------

@pytest.fixture(scope="session")
def vision_ggufs(tiny_vision_ggufs: Path) -> Path:
    """Both folders converted by llama.cpp's converter at f32 (conftest.py, once for the
    session): <name>-f32.gguf (the text model) and mmproj-<name>-f32.gguf (the tower and
    projector)."""
    return tiny_vision_ggufs


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
    assert llm.engine.model.config.image_token_id == config_from_folder(folder).image_token_id
    _assert_close_relative(_forward(llm.engine.model, ids, _images(folder), [len(ids)]), want)


def test_mmproj_mismatches_are_refused(vision_dir, vision_ggufs) -> None:
    with pytest.raises(ConfigError, match="idefics3 projector goes with a llama text model"):
        ellm.load(vision_ggufs / "gemma3-f32.gguf", mmproj=vision_ggufs / "mmproj-smolvlm-f32.gguf", progress=False)
    with pytest.raises(ConfigError, match="not an mmproj file"):
        ellm.load(vision_ggufs / "gemma3-f32.gguf", mmproj=vision_ggufs / "gemma3-f32.gguf", progress=False)
    with pytest.raises(ValueError, match="mmproj= goes with a .gguf text model"):
        ellm.load(vision_dir / "smolvlm", mmproj=vision_ggufs / "mmproj-smolvlm-f32.gguf", progress=False)


# -- the ops at every SIMD level ---------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 32, 37, 1152])
def test_layernorm_and_gelu_match_reference(simd, n) -> None:
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
def test_full_attention_matches_reference(simd, seq_len, heads, hd) -> None:
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


# -- Gemma 3: a prefill chunk holds a whole image ------------------------------------------

@pytest.fixture(scope="module")
def gemma3(vision_dir):
    folder = vision_dir / "gemma3"
    return _model(folder, "cpu"), Tokenizer.from_folder(folder), folder


@pytest.mark.parametrize("chunk", [4, 5, 7, 16])
def test_chunks_never_split_a_gemma3_image(gemma3, chunk) -> None:
    """With chunks of 4..16 tokens (an image is 4), every step ends outside the images and
    the first token's logprob is transformers' (processor path, token_type_ids)."""
    model, _, folder = gemma3
    ids, want = np.load(folder / "ids.npy").tolist(), np.load(folder / "logits.npy")
    runs = _image_runs(np.asarray(ids), model.config.image_token_id)
    engine = _engine(gemma3, max_batch_tokens=chunk)
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), images=_images(folder))
    seq, ends, outs = engine.seqs[rid], [], []
    while engine.has_unfinished():
        outs += engine.step()
        ends.append(seq.num_computed)
    assert not [e for e in ends for a, b in runs if a < e < b], (ends, runs)
    assert len(ends) >= len(ids) // chunk   # it was chunked
    ref = want[-1].astype(np.float64)
    lp = outs[-1].new_logprobs[0]
    assert lp.token_id == int(ref.argmax())
    assert abs(lp.logprob - (ref.max() - (ref.max() + np.log(np.exp(ref - ref.max()).sum())))) < 1e-3 * np.abs(ref).max()


def test_gemma3_image_longer_than_a_chunk_is_refused(gemma3) -> None:
    _, _, folder = gemma3
    ids = np.load(folder / "ids.npy").tolist()
    with pytest.raises(RequestError, match="an image of 4 tokens must be prefilled in one chunk, but "
                                           "max_batch_tokens is 3"):
        _engine(gemma3, max_batch_tokens=3).add_request(ids, SamplingParams(max_tokens=1), images=_images(folder))


def test_gemma3_prefix_hit_inside_an_image(gemma3) -> None:
    """A second prompt shares the first up to inside an image's last block: the cache hit
    ends mid-image, the chunk from there reaches the image's end, and the result is the
    bits of a run without the cache."""
    model, _, folder = gemma3
    ids = np.load(folder / "ids.npy").tolist()
    (a, b), _ = _image_runs(np.asarray(ids), model.config.image_token_id)
    # blocks of 4: the hit covers whole blocks up to the one holding the image's end
    cut = (b - 1) // 4 * 4
    assert a < cut < b
    second = ids[:b + 1] + [ids[-1]] * 3 + ids[b + 1:]
    engine = _engine(gemma3, max_batch_tokens=64)
    _run(engine, [(ids, _images(folder))])
    cached = _run(engine, [(second, _images(folder))])[0]
    assert cached[2] == cut
    fresh = _run(_engine(gemma3, max_batch_tokens=64, enable_prefix_caching=False), [(second, _images(folder))])[0]
    assert cached[:2] == fresh[:2]
