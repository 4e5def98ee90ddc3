"""LoRA adapters over one base (ellm/lora.py, csrc/lora.c).

Tiny random bases of three families (llama; qwen2, whose q/k/v have biases; phi3, whose
projections are fused) with random PEFT adapters made by peft (tests/goldens/tiny_lora.py:
ranks 4, 8 and 16, different target sets, lora_alpha != r, rsLoRA; A and B both random):
each adapter's logits against
transformers + peft's at every position on the reference ops and the C kernels, its
greedy ids through ellm.load(lora_adapters=...); a batch mixing the base and three
adapters, bit for bit each row as alone; the C kernel against the NumPy specification;
the prefix cache keeping adapters apart; and every bad adapter refused by name.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ellm
from ellm.engine.engine import EngineConfig, RequestError
from ellm.engine.kv_cache import BlockManager
from ellm.engine.runner import ModelRunner
from ellm.formats.errors import FormatError
from ellm.formats.safetensors import SafetensorsFolder
from ellm.lora import LoraFactors, LoraProjection, attach_adapters
from ellm.models import build_model, config_from_folder, config_from_gguf, gguf_weights
from ellm.models.batch import Batch
from ellm.ops import reference
from ellm.sampling_params import SamplingParams
from ellm.weights import SafetensorsWeights
from conftest import ops_or_skip
from golden_cache import cached_folder, ref_versions
from ref_python import ref_python

SCRIPT = Path(__file__).parent / "goldens" / "tiny_lora.py"
ADAPTERS = {"llama": ["qv4", "all16", "mlp8rs"], "qwen2": ["qkv4", "all16rs", "ud8"], "phi3": ["fused8"]}
CASES = [(arch, name) for arch, names in ADAPTERS.items() for name in names]
MIXED = ["llama", "qwen2"]   # the bases with three adapters each
GGUF_CASES = [c for c in CASES if c[0] in MIXED]   # (llama.cpp ignores Phi-3's window)
CHUNKS = [13, 7, 10] + [1] * 10   # chunked prefill, then decode: 40 tokens


@pytest.fixture(scope="session")
def tiny_lora() -> Path:
    """The script's folder, made once per change of the script or the reference packages
    (golden_cache.py): it is a minute of torch and peft."""
    ref = ref_python()

    def make(out: Path) -> None:
        out.mkdir(parents=True)
        subprocess.run([ref, str(SCRIPT), str(out)], check=True, capture_output=True, text=True)
    return cached_folder("tiny_lora", [SCRIPT, ref_versions(ref)], make)


def _model(folder: Path, device: str, adapters: dict[str, Path]):
    config = config_from_folder(folder)
    model = build_model(config, SafetensorsWeights(SafetensorsFolder(folder)), ops_or_skip(device))
    attach_adapters(model, adapters)
    return model


def _forward(model, rows: list[tuple[list[int], int]], chunks: list[int] | None = None) -> list[np.ndarray]:
    """Every position's logits of each (ids, adapter slot) sequence, all in one batch per
    step: the sequences' chunks side by side (chunks None: each whole in one step)."""
    runner = ModelRunner(model, EngineConfig(kv_cache_tokens=512, block_size=4, max_num_seqs=8))
    blocks = BlockManager(runner.kv, enable_prefix_caching=False)
    for b, (ids, _) in enumerate(rows):
        assert blocks.allocate(b, len(ids))
    length = len(rows[0][0])
    assert all(len(ids) == length for ids, _ in rows)
    outs: list[list[np.ndarray]] = [[] for _ in rows]
    start = 0
    for n in chunks or [length]:
        tables = {w: np.asarray([blocks.table(b, w) for b in range(len(rows))], np.int32) for w in runner.kv.windows}
        token_ids = np.concatenate([np.asarray(ids[start:start + n], np.int32) for ids, _ in rows])
        positions = np.tile(np.arange(start, start + n, dtype=np.int32), len(rows))
        seq_ids = np.repeat(np.arange(len(rows), dtype=np.int32), n)
        batch = Batch(token_ids, positions, seq_ids, tables, np.arange(len(token_ids), dtype=np.int32))
        slots = np.repeat(np.asarray([s for _, s in rows], np.int32), n)
        batch.adapter_slots = slots if (slots >= 0).any() else None
        logits = runner.forward(batch)
        for b in range(len(rows)):
            outs[b].append(np.array(logits[b * n:(b + 1) * n]))
        start += n
    return [np.concatenate(o) for o in outs]


def _assert_close_relative(got: np.ndarray, want: np.ndarray) -> None:
    """max |got - want| <= 1e-3 x the largest |logit|, at every position."""
    bound = 1e-3 * float(np.abs(want).max())
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= bound, f"max error {err.max():.3g} at position {int(err.argmax())} > {bound:.3g}"


@pytest.mark.parametrize("device", ["cpu", "reference", "cuda"])
@pytest.mark.parametrize("arch,name", CASES)
def test_adapter_logits_match_peft(tiny_lora, arch, name, device) -> None:
    folder = tiny_lora / arch
    want = np.load(folder / "adapters" / name / "logits.npy")
    base = np.load(folder / "logits.npy")
    assert np.abs(want - base).max() > 0.05 * np.abs(base).max(), "the adapter hardly changes the logits"
    model = _model(folder, device, {name: folder / "adapters" / name})
    ids = np.load(folder / "ids.npy").tolist()
    got = _forward(model, [(ids, 0)], CHUNKS if device == "cpu" else None)[0]
    _assert_close_relative(got, want)
    # and the base rows of the same model are still the base's
    _assert_close_relative(_forward(model, [(ids, -1)])[0], base)


@pytest.mark.parametrize("arch", MIXED)
def test_mixed_batch_is_each_row_alone_bit_for_bit(tiny_lora, arch) -> None:
    """The base and three adapters in one batch (prefill chunks, then decode): every row's
    logits are the bits it gets alone, whatever its neighbours' adapters."""
    folder = tiny_lora / arch
    names = ADAPTERS[arch]
    model = _model(folder, "cpu", {n: folder / "adapters" / n for n in names})
    ids = np.load(folder / "ids.npy").tolist()
    rng = np.random.default_rng(3)
    seqs = [(ids, -1), (rng.integers(3, 320, 40).tolist(), 0), (ids, 1), (ids[::-1], 2), (ids, 2)]
    together = _forward(model, seqs, CHUNKS)
    for (s, slot), got in zip(seqs, together):
        alone = _forward(model, [(s, slot)], CHUNKS)[0]
        assert got.tobytes() == alone.tobytes(), f"slot {slot}: logits depend on the batch"


def test_adapters_use_only_ops_and_the_stack_gives_their_bits(tiny_lora) -> None:
    """A mixed batch on a backend whose arrays NumPy cannot read (tests/opaque_ops.py: op
    by op, no layer stack) gives the cpu backend's bits (its layer stack, LoRA inside)."""
    from opaque_ops import OpaqueOps
    from ellm.ops import get_ops
    folder = tiny_lora / "qwen2"
    names = ADAPTERS["qwen2"]
    ids = np.load(folder / "ids.npy").tolist()
    seqs = [(ids, 0), (ids[::-1], -1), (ids, 2), (ids, 1)]
    outs = []
    for ops in (OpaqueOps(get_ops("cpu")), get_ops("cpu")):
        model = build_model(config_from_folder(folder), SafetensorsWeights(SafetensorsFolder(folder)), ops)
        attach_adapters(model, {n: folder / "adapters" / n for n in names})
        outs.append(_forward(model, seqs, CHUNKS))
    for got, want in zip(*outs):
        assert got.tobytes() == want.tobytes()


@pytest.fixture(scope="module")
def lora_llms(tiny_lora) -> dict:
    llms = {arch: ellm.load(str(tiny_lora / arch), max_model_len=256, progress=False,
                            lora_adapters={n: str(tiny_lora / arch / "adapters" / n) for n in names})
            for arch, names in ADAPTERS.items()}
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.mark.parametrize("arch,name", CASES)
def test_greedy_ids_match_peft(tiny_lora, lora_llms, arch, name) -> None:
    folder = tiny_lora / arch
    ids = np.load(folder / "ids.npy").tolist()
    want = np.load(folder / "adapters" / name / "greedy.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True)
    assert lora_llms[arch].generate(ids, params, adapter=name).token_ids == want


def test_adapter_requests_keep_their_adapter_with_the_overlap_on(tiny_lora, lora_llms) -> None:
    """Decode steps launched ahead carry no adapter slots, so a request with an adapter
    never runs ahead: with the engine's overlap forced on, its ids are peft's still."""
    arch, name = CASES[0]
    llm, folder = lora_llms[arch], tiny_lora / arch
    ids = np.load(folder / "ids.npy").tolist()
    want = np.load(folder / "adapters" / name / "greedy.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True)
    llm.engine.overlap = True
    try:
        assert llm.generate(ids, params, adapter=name).token_ids == want
        assert llm.generate(ids, params).token_ids == np.load(folder / "greedy.npy").tolist()[:len(want)]
        assert llm.engine.stats["overlapped_steps"] > 0   # the base request ran ahead
    finally:
        llm.engine.overlap = False


@pytest.mark.parametrize("arch", MIXED)
def test_requests_of_the_base_and_three_adapters_batch_as_alone(tiny_lora, lora_llms, arch) -> None:
    """Through the engine, asyncio tasks of the base and three adapters run together:
    each gets the ids it gets alone (and the base and adapter ids of the goldens)."""
    llm, folder = lora_llms[arch], tiny_lora / arch
    ids = np.load(folder / "ids.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    adapters = [None] + ADAPTERS[arch]

    async def together() -> list[list[int]]:
        outs = await asyncio.gather(*(llm.agenerate(ids, params, adapter=a) for a in adapters))
        return [o.token_ids for o in outs]
    got = asyncio.run(together())
    alone = [llm.generate(ids, params, adapter=a).token_ids for a in adapters]
    assert got == alone
    assert got[0] == np.load(folder / "greedy.npy").tolist()
    assert got[1:] == [np.load(folder / "adapters" / a / "greedy.npy").tolist() for a in ADAPTERS[arch]]
    # stream and chat take the adapter too
    assert "".join(llm.stream(ids, params, adapter=adapters[1])) == llm.tokenizer.decode(got[1])


def test_prefix_cache_keeps_adapters_apart(tiny_lora, lora_llms) -> None:
    """A prompt cached by the base is not served to an adapter (its K/V differ), and one
    cached by an adapter is served to the same adapter."""
    llm = lora_llms["llama"]
    prompt = np.random.default_rng(11).integers(3, 320, 60).tolist()   # a prompt no other test sends
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = llm.engine
    base = llm.generate(prompt, params)
    hits = engine.blocks.hits
    first = llm.generate(prompt, params, adapter="all16")
    assert engine.blocks.hits == hits, "the adapter took the base's cached blocks"
    again = llm.generate(prompt, params, adapter="all16")
    assert engine.blocks.hits > hits, "the adapter's own blocks were not reused"
    assert again.token_ids == first.token_ids != base.token_ids


def test_unknown_adapter_is_refused(lora_llms) -> None:
    llm = lora_llms["llama"]
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'.*'qv4'"):
        llm.generate([1, 2, 3], max_tokens=2, adapter="nope")
    with pytest.raises(RequestError, match="unknown LoRA adapter"):
        llm.stream([1, 2, 3], max_tokens=2, adapter="nope")


# -- ellm trace / inspect with an adapter --------------------------------------------------

def test_trace_runs_the_adapter_against_transformers_and_peft(tiny_lora, lora_llms, tmp_path) -> None:
    """`ellm trace` with an adapter: every op of ellm + the adapter within its band of
    transformers + peft's, the traced logits the peft golden's, and not the base's."""
    from ellm.cli import main as cli_main
    from ellm.trace import make_reference, record, trace
    from ellm.trace.references import ReferenceError
    folder, name = tiny_lora / "llama", "all16"
    path = folder / "adapters" / name
    llm = lora_llms["llama"]
    ids = np.load(folder / "ids.npy").tolist()
    result = trace(llm, ids, make_reference("transformers", folder, ref_python(), adapter=path),
                   model_path=folder, adapter=name)
    assert result.first is None, result.table()
    assert result.adapter == name and "adapter all16" in result.table()
    traced = record(llm, ids, adapter=name).logits
    _assert_close_relative(traced, np.load(path / "logits.npy"))
    base = record(llm, ids).logits
    _assert_close_relative(base, np.load(folder / "logits.npy"))
    assert np.abs(traced - base).max() > 0.05 * np.abs(base).max()
    # the reference ops run the same adapter; a reference without it is refused, not diffed
    ops_result = trace(llm, ids, make_reference("reference", folder, adapter=path), model_path=folder, adapter=name)
    assert ops_result.first is None, ops_result.table()
    with pytest.raises(ReferenceError, match="reference runs the base alone"):
        trace(llm, ids, make_reference("reference", folder), model_path=folder, adapter=name)
    # the command line: --lora-modules NAME=PATH (the only one: traced), and --adapter
    # (against the reference ops here: transformers + peft ran above)
    out = tmp_path / "trace.json"
    args = ["trace", str(folder), "hello world", "--lora-modules", f"{name}={path}", "--json", str(out),
            "--reference", "reference", "--quiet"]
    assert cli_main(args) == 0
    got = json.loads(out.read_text())
    assert got["adapter"] == name and got["first_divergence"] is None and str(path) in got["reference"]
    assert cli_main([*args, "--adapter", "other"]) == 2
    assert cli_main([*args[:4], f"{name}={path}", f"two={path}", *args[5:]]) == 2   # which one?


def test_inspect_page_traces_an_adapter(tiny_lora, lora_llms) -> None:
    pytest.importorskip("starlette")
    from ellm.trace.inspect.app import BadRequest, Inspector
    llm = lora_llms["llama"]
    page = Inspector(llm, "tiny-llama")
    assert page.model_info()["adapters"] == ADAPTERS["llama"]
    ids = np.load(tiny_lora / "llama" / "ids.npy").tolist()[:12]
    base, adapted = page.trace(ids), page.trace(ids, page.adapter_of({"ids": ids, "adapter": "all16"}))
    assert adapted["adapter"] == "all16" and base["adapter"] is None
    assert adapted["norms"] != base["norms"]
    with pytest.raises(BadRequest, match="unknown adapter 'nope'"):
        page.adapter_of({"ids": ids, "adapter": "nope"})


# -- the kernel against its specification ------------------------------------------------

def _in_dtype(m: np.ndarray, dtype: str) -> np.ndarray:
    """m's values rounded to those `dtype` holds, as float32."""
    if dtype == "f16":
        return m.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (m.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return m


def _projection(rng, n: int, k: int, ranks: list[int | None], dtype: str = "f32") -> LoraProjection:
    slots = tuple(None if r is None else LoraFactors(_in_dtype(rng.standard_normal((r, k), np.float32), dtype),
                                                     _in_dtype(rng.standard_normal((n, r), np.float32), dtype),
                                                     float(rng.uniform(0.1, 2)), dtype)
                  for r in ranks)
    return LoraProjection(n, k, slots)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_kernel_matches_reference_and_is_row_invariant(T, dtype) -> None:
    """Ranks below, at and above the kernel's chunk of 16, outputs not a whole number of
    its blocks of 64, slots without factors, the factors in each type an adapter file
    holds: the NumPy specification's values, and each row alone gives the same bits."""
    cpu = ops_or_skip("cpu")
    rng = np.random.default_rng(T)
    K = 75
    projs = [_projection(rng, 140, K, [4, None, 16, 3], dtype), _projection(rng, 17, K, [None, 8, 1, 40], dtype)]
    x = rng.standard_normal((T, K), np.float32)
    slots = rng.integers(-1, 4, T).astype(np.int32)
    base = [rng.standard_normal((T, 150), np.float32) for _ in projs]
    ys = [b.copy() for b in base]
    tables = [cpu.prepare_lora(p) for p in projs]
    cpu.lora(x, slots, [(tab, y[:, :p.out_features]) for tab, p, y in zip(tables, projs, ys)])
    for tab, p, b, y in zip(tables, projs, base, ys):
        want = reference.lora_add(x, slots, p.slots, b.copy())
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
        assert np.array_equal(y[:, p.out_features:], b[:, p.out_features:]), "wrote past N"
        for t in range(T):
            alone = b[t:t + 1].copy()
            cpu.lora(x[t:t + 1], slots[t:t + 1], [(tab, alone[:, :p.out_features])])
            assert alone.tobytes() == y[t:t + 1].tobytes()


def test_cpu_tables_pack_the_factors_in_one_buffer_in_the_order_made() -> None:
    """The CPU backend copies each table's factors (A^T, then B^T, slot by slot) one after
    the other into one large buffer (_lora.FactorArena: a decode step's reads in a run of
    huge pages), each on a 64-byte line, and the products are the same bits as from the
    tables' own arrays."""
    ops_or_skip("cpu")
    from ellm._native import _lora
    from ellm.ops.cpu import CpuOps, _lora_bits
    cpu = CpuOps()   # its own arena, empty
    rng = np.random.default_rng(11)
    projs = [_projection(rng, 140, 75, [16, None, 3], "bf16"), _projection(rng, 17, 75, [None, 8, 1], "bf16")]
    tables = [cpu.prepare_lora(p) for p in projs]
    factors = [f for p in projs for f in p.slots if f is not None]
    arena = cpu._lora_arena
    assert isinstance(arena, _lora.FactorArena)
    start = arena._buf.ctypes.data + -arena._buf.ctypes.data % (2 << 20)   # on a 2 MiB boundary
    placed = [arena.place(m) for m in (np.arange(5, dtype=np.uint16), np.ones((3, 7), np.float32))]
    assert placed[0].tolist() == list(range(5)) and placed[1].tolist() == np.ones((3, 7)).tolist()
    assert all(a.ctypes.data % 64 == 0 for a in placed) and placed[0].ctypes.data < placed[1].ctypes.data
    # the tables' 4 pairs and these two lie in one buffer, in that order
    used = placed[1].ctypes.data + placed[1].nbytes - start
    packed = sum((f.a.size + (f.b.shape[0] + 7) // 8 * 8 * f.rank) * 2 for f in factors)
    assert packed <= used <= packed + 64 * (2 * len(factors) + 2)
    x = rng.standard_normal((6, 75), np.float32)
    slots = np.asarray([0, 1, 2, -1, 2, 0], np.int32)
    for p, tab in zip(projs, tables):
        own = _lora.LoraTable([None if f is None else (_lora_bits(f.a.T, f.dtype), _lora_bits(f.b.T, f.dtype),
                                                        f.scale, f.dtype) for f in p.slots],
                              p.out_features, p.in_features)
        y, y_own = np.ones((6, p.out_features), np.float32), np.ones((6, p.out_features), np.float32)
        cpu.lora(x, slots, [(tab, y)])
        cpu.lora(x, slots, [(own, y_own)])
        assert y.tobytes() == y_own.tobytes()


def test_kernel_gives_the_same_bits_at_every_simd_level() -> None:
    from ellm._native import _core
    cpu = ops_or_skip("cpu")
    rng = np.random.default_rng(5)
    p = _projection(rng, 100, 96, [16, 5], "bf16")
    x = rng.standard_normal((9, 96), np.float32)
    slots = np.asarray([0, 1, -1, 0, 1, 1, 0, 0, 1], np.int32)
    results = {}
    start = _core.simd_level()
    try:
        for level in _core.supported_simd_levels():
            _core.set_simd_level(level)
            y = np.ones((9, 100), np.float32)
            cpu.lora(x, slots, [(cpu.prepare_lora(p), y)])
            results[level] = y.tobytes()
    finally:
        _core.set_simd_level(start)
    assert len(set(results.values())) == 1, f"levels {list(results)} disagree"


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_kernel_gives_the_same_bits_at_every_simd_level_odd_k(dtype) -> None:
    """The SIMD variants' own shrink and expand (lora_avx2.c: intrinsics) against the
    baseline's loops: an odd K, ranks that are and are not whole chunks of 16 (8 and the
    last 8 of 24: their own kernel), rows that share an adapter, in each type an adapter
    file holds."""
    from ellm._native import _core
    cpu = ops_or_skip("cpu")
    rng = np.random.default_rng(11)
    p = _projection(rng, 203, 75, [16, 5, 32, 8, 24], dtype)
    x = rng.standard_normal((11, 75), np.float32)
    slots = np.asarray([0, 2, 3, 0, 1, -1, 4, 3, 0, 2, 4], np.int32)
    results = {}
    start = _core.simd_level()
    try:
        for level in _core.supported_simd_levels():
            _core.set_simd_level(level)
            y = np.ones((11, 203), np.float32)
            cpu.lora(x, slots, [(cpu.prepare_lora(p), y)])
            results[level] = y.tobytes()
    finally:
        _core.set_simd_level(start)
    assert len(set(results.values())) == 1, f"levels {list(results)} disagree"


def test_layer_stack_gives_the_ops_bits_at_every_simd_level(tiny_lora) -> None:
    """At each SIMD level, a mixed batch through the layer stack (the expand inside the
    base product's blocks, four rows of an adapter at once) gives the bits of the same
    model run op by op (ops.lora after each linear)."""
    from opaque_ops import OpaqueOps
    from ellm._native import _core
    from ellm.ops import get_ops
    folder = tiny_lora / "llama"
    names = ADAPTERS["llama"]
    ids = np.load(folder / "ids.npy").tolist()
    seqs = [(ids, 0), (ids[::-1], 1), (ids, 1), (ids, -1), (ids[1:] + ids[:1], 2)]
    models = []
    for ops in (OpaqueOps(get_ops("cpu")), get_ops("cpu")):
        model = build_model(config_from_folder(folder), SafetensorsWeights(SafetensorsFolder(folder)), ops)
        attach_adapters(model, {n: folder / "adapters" / n for n in names})
        models.append(model)
    start = _core.simd_level()
    try:
        for level in _core.supported_simd_levels():
            _core.set_simd_level(level)
            by_ops, by_stack = (_forward(m, seqs, CHUNKS) for m in models)
            for a, b in zip(by_ops, by_stack):
                assert a.tobytes() == b.tobytes(), f"level {level}: the stack's bits differ"
    finally:
        _core.set_simd_level(start)


def test_kernel_refuses_a_slot_out_of_range() -> None:
    cpu = ops_or_skip("cpu")
    rng = np.random.default_rng(0)
    table = cpu.prepare_lora(_projection(rng, 8, 16, [4, 2]))
    x, y = rng.standard_normal((3, 16), np.float32), np.zeros((3, 8), np.float32)
    for bad in (2, -2):
        with pytest.raises(IndexError, match="lora apply"):
            cpu.lora(x, np.asarray([0, bad, 1], np.int32), [(table, y)])
        assert not y.any(), "a refused call wrote"
    with pytest.raises(ValueError, match="inputs"):
        cpu.lora(x[:, :8].copy(), np.zeros(3, np.int32), [(table, y)])


# -- bad adapters ------------------------------------------------------------------------

def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 tensors in the safetensors layout: header length, JSON header, data."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def _edited_copy(tmp_path: Path, src: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the PEFT folder src with config keys replaced and tensors replaced
    (name -> array, None: dropped)."""
    from ellm.formats.safetensors import SafetensorsFile
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    if config:
        cfg = json.loads((src / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        st = SafetensorsFile(src / "adapter_model.safetensors")
        data = {k: np.array(st.array(k)) for k in st.tensors}
        for k, v in tensors.items():
            if v is None:
                data.pop(k)
            else:
                data[k] = v
        _write_safetensors(out / "adapter_model.safetensors", data)
    return out


Q = "base_model.model.model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("edit,message", [
    (dict(config={"r": 8}), r"q_proj\.lora_A\.weight \[4, 64\].*rank 4/4, the config says r=8"),
    (dict(tensors={Q + ".lora_B.weight": None}), r"q_proj\.lora_B\.weight is missing"),
    (dict(tensors={Q + ".lora_A.weight": np.ones((4, 32), np.float32)}), r"q_proj: lora_A \[4, 32\].*do not fit"),
    (dict(tensors={"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": np.ones((4, 64), np.float32),
                   "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": np.ones((64, 4), np.float32)}),
     r"layers\.9\.self_attn\.q_proj: layer 9: the base has 4 layers"),
    (dict(tensors={"base_model.model.lm_head.lora_A.weight": np.ones((4, 64), np.float32)}),
     r"tensor base_model\.model\.lm_head\.lora_A\.weight: not a LoRA factor"),
    (dict(config={"use_dora": True}), r"adapter_config\.json.*use_dora=True is not supported"),
    (dict(config={"peft_type": "IA3"}), r"peft_type 'IA3'"),
])
def test_bad_adapter_is_refused_naming_file_and_tensor(tiny_lora, tmp_path, edit, message) -> None:
    folder = tiny_lora / "llama"
    bad = _edited_copy(tmp_path, folder / "adapters" / "qv4", **edit)
    with pytest.raises(FormatError, match=message):
        _model(folder, "reference", {"bad": bad})


def test_missing_adapter_and_bad_names(tiny_lora, tmp_path) -> None:
    folder = tiny_lora / "llama"
    with pytest.raises(FileNotFoundError, match="'x'"):
        _model(folder, "reference", {"x": tmp_path / "nothing"})
    with pytest.raises(ValueError, match="name"):
        _model(folder, "reference", {"": folder / "adapters" / "qv4"})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError, match="no adapter_config.json"):
        _model(folder, "reference", {"e": empty})


# -- GGUF bases (llama.cpp's converter) and GGUF adapters ----------------------------------

@pytest.fixture(scope="session")
def lora_ggufs(tiny_lora) -> Path:
    """The tiny bases converted to f32 GGUF by llama.cpp's own converter."""
    from ref_python import llama_cpp_dir
    converter = llama_cpp_dir()
    ref, script = ref_python(), Path(__file__).parent / "goldens" / "convert_tiny.py"

    def make(out: Path) -> None:
        subprocess.run([ref, str(script), converter, str(out), *(str(tiny_lora / a) for a in MIXED),
                        "--outtypes", "f32"], check=True, capture_output=True, text=True)
    return cached_folder("tiny_lora_gguf", [tiny_lora.name, script, converter, Path(converter) / "convert_hf_to_gguf.py",
                                            ref_versions(ref), *MIXED], make)


@pytest.mark.parametrize("kind", ["peft", "gguf"])
@pytest.mark.parametrize("arch,name", GGUF_CASES)
def test_adapter_on_a_gguf_base_matches_peft(tiny_lora, lora_ggufs, arch, name, kind) -> None:
    """The PEFT folder (its q/k rows reordered as the converter reorders Llama's) and the
    same adapter as a llama.cpp LoRA GGUF, on the GGUF of the base. (Qwen2's GGUF drops
    the sliding window: compared on the positions the window of 8 does not cut.)"""
    from ellm.formats.gguf import GGUFFile
    folder = tiny_lora / arch
    adapter = folder / "adapters" / name
    gguf = lora_ggufs / f"{arch}-f32.gguf"
    model = build_model(config_from_gguf(GGUFFile(gguf)), gguf_weights(GGUFFile(gguf)), ops_or_skip("cpu"))
    attach_adapters(model, {name: adapter if kind == "peft" else adapter / "adapter.gguf"})
    ids = np.load(folder / "ids.npy").tolist()
    n = 8 if arch == "qwen2" else len(ids)
    got = _forward(model, [(ids[:n], 0)])[0]
    _assert_close_relative(got, np.load(adapter / "logits.npy")[:n])


def test_gguf_adapter_is_refused_on_another_family(tiny_lora) -> None:
    folder = tiny_lora / "llama"
    with pytest.raises(FormatError, match="another family"):
        _model(folder, "reference", {"x": tiny_lora / "qwen2" / "adapters" / "qkv4" / "adapter.gguf"})


# -- the server (ellm serve --lora-modules), through the openai client --------------------

@pytest.fixture(scope="module")
def lora_server(tiny_lora, tmp_path_factory) -> Any:
    from served import serve_process
    folder = tiny_lora / "llama"
    args = [str(folder), "--served-model-name", "base", "--max-model-len", "256", "--log-level", "warning",
            "--lora-modules", *(f"{n}={folder / 'adapters' / n}" for n in ADAPTERS["llama"])]
    with serve_process(args, tmp_path_factory.mktemp("lora_serve") / "server.log", up_within=120, poll=0.2,
                       check_exit=False) as url:
        yield url


def test_server_lists_picks_and_refuses_adapters(tiny_lora, lora_llms, lora_server) -> None:
    """GET /v1/models lists the adapters with their parent; "model" picks one (the same
    text as in process, and the adapter's name in the answer), the base's name the base;
    an unknown name is a 404."""
    import openai
    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="x", max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["base", *ADAPTERS["llama"]]
    assert all(cards[n].model_extra.get("parent") == "base" for n in ADAPTERS["llama"])
    assert cards["base"].model_extra.get("parent") is None
    ids = np.load(tiny_lora / "llama" / "ids.npy").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for model, adapter in [("base", None), *((n, n) for n in ADAPTERS["llama"])]:
        got = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.model == model
        assert got.choices[0].text == lora_llms["llama"].generate(ids, params, adapter=adapter).text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=ids, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        client.embeddings.create(model="qv4", input="hello")


@pytest.mark.parametrize("items,message", [(["noequals"], "NAME=PATH items"), (["a=x", "a=y"], "names 'a' twice")])
def test_serve_refuses_bad_lora_modules(tmp_path, items, message) -> None:
    import sys
    proc = subprocess.run([sys.executable, "-m", "ellm", "serve", str(tmp_path), "--lora-modules", *items],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
