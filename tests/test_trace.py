"""`ellm trace` against transformers: clean models trace clean, broken ones are caught where
they break.

Broken models are copies of the f32 Hugging Face folders with one tensor of one layer
changed (the other shards are symlinks), traced against transformers on the untouched
folder; a broken op is ellm's NumPy reference backend with RoPE's pairs swapped in one
layer, traced against transformers on the same folder. transformers runs in the
reference Python (ELLM_REF_PYTHON), each folder's reference once per session.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import ellm
from ellm.cli import main as cli_main
from ellm.formats.safetensors import SafetensorsFolder
from ellm.ops.reference import ReferenceOps
from ellm.trace import make_reference, record, trace
from ellm.trace.align import deinterleave_heads
from ellm.trace.diff import metrics
from ref_python import ref_python

PROMPT = "The capital of France is Paris, and the capital of Italy is"
BROKEN_LAYER = 7


@pytest.fixture(scope="session")
def smollm2_f32_ref(smollm2_hf_f32: Path):
    """transformers on the f32 SmolLM2 folder, run once for PROMPT's ids."""
    ref = make_reference(str(smollm2_hf_f32), smollm2_hf_f32, ref_python())
    llm = ellm.load(smollm2_hf_f32, progress=False)
    ref.prefetch([llm.encode_prompt(PROMPT)])
    return ref


def broken_copy(folder: Path, dest: Path, tensor: str, change: Callable[[np.ndarray], None]) -> Path:
    """dest/: folder's files as symlinks, except the shard holding `tensor`, copied and
    changed in place by change(view of the tensor)."""
    dest.mkdir()
    info = SafetensorsFolder(folder).info(tensor)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][tensor]
    for f in folder.iterdir():
        if f.name == shard:
            shutil.copyfile(f, dest / f.name)
        else:
            (dest / f.name).symlink_to(f)
    assert info.dtype == "F32"
    view = np.memmap(dest / shard, dtype=np.float32, mode="r+", offset=info.offset, shape=info.shape)
    change(view)
    view.flush()
    del view
    return dest


def run_cli(*args: str) -> tuple[int, dict]:
    out = Path(args[args.index("--json") + 1])
    code = cli_main(["trace", *args, "--reference-python", ref_python(), "--quiet"])
    return code, json.loads(out.read_text())


def scale(factor: float) -> Callable[[np.ndarray], None]:
    def change(w: np.ndarray) -> None:
        w *= np.float32(factor)
    return change


def zero(w: np.ndarray) -> None:
    w[...] = 0.0


# -- broken weights --------------------------------------------------------------------


def test_scaled_o_proj_is_the_first_divergence(smollm2_hf_f32: Path, smollm2_f32_ref,
                                               tmp_path: Path) -> None:
    """layer 7's o_proj x 1.01, traced against transformers on the untouched folder (what
    `ellm trace BROKEN PROMPT --reference ORIGINAL` does) stops at (7, o_proj)."""
    broken = broken_copy(smollm2_hf_f32, tmp_path / "broken",
                         f"model.layers.{BROKEN_LAYER}.self_attn.o_proj.weight", scale(1.01))
    llm = ellm.load(broken, progress=False)
    report = trace(llm, llm.encode_prompt(PROMPT), smollm2_f32_ref, model_path=broken).as_json()
    first = report["first_divergence"]
    assert (first["layer"], first["op"]) == (BROKEN_LAYER, "o_proj"), first
    # a 1% scale is a 1% relative error at that op
    assert first["rel"] == pytest.approx(0.01, rel=0.05)
    rel = {(r["layer"], r["op"]): r["rel"] for r in report["ops"]}
    assert rel[(BROKEN_LAYER, "attn")] < 1e-5          # its input is still clean
    assert rel[(BROKEN_LAYER, "resid_attn")] > 1e-4    # and the error flows on from there
    assert rel[(None, "logits")] > 1e-4


def test_zeroed_norm_weight_is_the_first_divergence(smollm2_hf_f32: Path, smollm2_f32_ref,
                                                    tmp_path: Path) -> None:
    broken = broken_copy(smollm2_hf_f32, tmp_path / "broken",
                         f"model.layers.{BROKEN_LAYER}.post_attention_layernorm.weight", zero)
    llm = ellm.load(broken, progress=False)
    res = trace(llm, llm.encode_prompt(PROMPT), smollm2_f32_ref, model_path=broken)
    assert res.first is not None
    assert (res.first.layer, res.first.op) == (BROKEN_LAYER, "mlp_norm")
    assert res.first.rel == pytest.approx(1.0, abs=1e-6)   # ellm's output is all zeros there


# -- a broken op ------------------------------------------------------------------------


class SwappedRopeOps(ReferenceOps):
    """The NumPy reference backend with RoPE pairing the wrong dimensions in one layer."""

    def __init__(self, broken_k_cache: np.ndarray) -> None:
        self.broken_k_cache = broken_k_cache

    def rope_attention(self, q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                       inv_freq, interleaved, *args, **kwargs):
        if k_cache is self.broken_k_cache:
            interleaved = not interleaved   # pairs (2i, 2i+1) instead of (i, i + hd/2)
        return super().rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                                      inv_freq, interleaved, *args, **kwargs)


def test_swapped_rope_pairs_in_one_layer_are_named(smollm2_hf_f32: Path, smollm2_f32_ref) -> None:
    llm = ellm.load(smollm2_hf_f32, device="reference", max_num_seqs=1, progress=False)
    llm.model.ops = SwappedRopeOps(llm.engine.kv.layer(BROKEN_LAYER)[0])
    res = trace(llm, llm.encode_prompt(PROMPT), smollm2_f32_ref, model_path=smollm2_hf_f32)
    assert res.first is not None
    # q after RoPE is rebuilt by the recorder (the fused kernel keeps it); k after RoPE is
    # read back from the KV cache the op wrote, so the swap shows there.
    assert (res.first.layer, res.first.op) == (BROKEN_LAYER, "k_rope")
    # position 0 is not rotated at all: only later positions are off
    assert res.position_errors[0] < 1e-5 < res.position_errors[-1]


# -- clean models ---------------------------------------------------------------------


def test_smollm2_f32_traces_clean(smollm2_hf_f32: Path, smollm2_f32_ref) -> None:
    llm = ellm.load(smollm2_hf_f32, progress=False)
    res = trace(llm, llm.encode_prompt(PROMPT), smollm2_f32_ref, model_path=smollm2_hf_f32)
    assert res.first is None, res.table()
    n = llm.config.num_hidden_layers
    per_layer = {"attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn", "o_proj",
                 "resid_attn", "mlp_norm", "gate", "up", "act", "down", "resid_mlp"}
    assert {(r.layer, r.op) for r in res.rows} == \
        {(i, op) for i in range(n) for op in per_layer} | {(None, "embed"), (None, "final_norm"), (None, "logits")}
    assert max(r.rel for r in res.rows) < 1e-4       # f32 on both sides: only summation order differs


def test_gemma3_f32_traces_clean_via_cli(gemma3_hf_f32: Path, tmp_path: Path) -> None:
    code, report = run_cli(str(gemma3_hf_f32), PROMPT, "--json", str(tmp_path / "t.json"))
    assert report["first_divergence"] is None and code == 0
    ops = {r["op"] for r in report["ops"]}
    assert {"q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "attn_probs"} <= ops
    assert len(report["ops"]) == 18 * 20 + 3


def test_smollm2_gguf_traces_clean_with_qk_rows_aligned(smollm2_gguf: Path) -> None:
    """Q4_1 GGUF vs transformers' dequantized load: q/k rows come back in HF order."""
    llm = ellm.load(smollm2_gguf, progress=False)
    res = trace(llm, llm.encode_prompt(PROMPT), make_reference("transformers", smollm2_gguf, ref_python()),
                model_path=smollm2_gguf)
    assert res.weight_class == "Q4_1"
    assert res.first is None, res.table()
    q = {r.layer: r for r in res.rows if r.op == "q"}
    assert q[0].cos > 0.99   # unaligned rows would give a cosine near 0


# -- every family's recording points against transformers' hooks ----------------------

TINY_SCRIPT = Path(__file__).parent / "goldens" / "tiny_models.py"
# the families whose layers differ from Llama's in what is recorded or how transformers lays it out
TINY = ["gemma2", "qwen2", "qwen3", "olmo2", "granite", "phi3", "qwen3_moe"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_models_dir: Path) -> Path:
    """The folders of TINY_SCRIPT (conftest.py makes them once for the session)."""
    return tiny_models_dir


def tiny_ids(folder: Path) -> list[int]:
    return [int(t) for t in np.load(folder / "ids.npy")][:12]


@pytest.fixture(scope="module")
def tiny_refs(tiny_dir: Path) -> dict:
    """transformers on every tiny family, all in one process."""
    from ellm.trace.references import prefetch_together
    refs = {arch: make_reference("transformers", tiny_dir / arch, ref_python()) for arch in TINY}
    prefetch_together([(ref, [tiny_ids(tiny_dir / arch)]) for arch, ref in refs.items()])
    return refs


@pytest.mark.parametrize("arch", TINY)
def test_tiny_family_traces_clean(tiny_dir: Path, tiny_refs: dict, arch: str) -> None:
    """Random tiny models: fused projections split (phi3), q/k norms before (qwen3) or after
    (gemma2: none; olmo2: whole projection) the head transpose, biases (qwen2), multipliers
    (granite), MoE blocks (qwen3_moe) -- every op both sides record agrees."""
    folder = tiny_dir / arch
    llm = ellm.load(folder, max_num_seqs=1, progress=False)
    res = trace(llm, tiny_ids(folder), tiny_refs[arch], model_path=folder, lens_top_k=0)
    assert res.first is None, res.table()
    recorded = {r.op for r in res.rows}
    assert {"q_rope", "k_rope", "attn_probs", "attn", "o_proj", "resid_attn", "down", "resid_mlp",
            "logits"} <= recorded, recorded
    assert not [n for n in res.notes if "did not record" in n], res.notes


# -- ellm's reference ops as the reference, the recording itself ------------------------


def test_reference_ops_as_the_reference(smollm2_hf_f32: Path) -> None:
    """--reference reference: the C kernels against ellm's NumPy ops on the same weights."""
    llm = ellm.load(smollm2_hf_f32, progress=False)
    ids = llm.encode_prompt(PROMPT)[:6]
    reference = make_reference("reference", smollm2_hf_f32)
    res = trace(llm, ids, reference, model_path=smollm2_hf_f32, lens_top_k=0)
    assert res.reference == "ellm reference ops"
    assert res.first is None, res.table()
    assert max(r.rel for r in res.rows) < 1e-4
    broken = ellm.load(smollm2_hf_f32, progress=False)
    broken.model.ops = SwappedRopeOps(broken.engine.kv.layer(3)[0])
    res = trace(broken, ids, reference, model_path=smollm2_hf_f32, lens_top_k=0)
    assert (res.first.layer, res.first.op) == (3, "k_rope")


def test_attention_weights_reproduce_the_kernel_output(gemma3_gguf: Path) -> None:
    """The recorder's attention weights (rebuilt from q and the cached k) applied to v give
    the fused kernel's own attention output."""
    llm = ellm.load(gemma3_gguf, progress=False)
    c = llm.config
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ids = llm.encode_prompt(PROMPT)
    rec = record(llm, ids)
    T = len(ids)
    for layer in (0, 5):   # a sliding and a global layer
        probs = rec.arrays[(layer, "attn_probs")].reshape(T, nh, T)
        assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
        assert (np.triu(probs.transpose(1, 0, 2)[0], 1) == 0).all()          # causal
        v = rec.arrays[(layer, "v")].reshape(T, nkv, hd)
        v_heads = np.repeat(v, nh // nkv, axis=1)                           # (T, nh, hd)
        mine = np.einsum("rhl,lhd->rhd", probs, v_heads)
        kernel = rec.arrays[(layer, "attn")].reshape(T, nh, hd)
        _, rel, _ = metrics(mine, kernel)
        assert rel < 1e-5


def test_logit_lens_of_the_last_layer_is_the_output(smollm2_gguf: Path) -> None:
    llm = ellm.load(smollm2_gguf, progress=False)
    ids = llm.encode_prompt(PROMPT)
    rec = record(llm, ids, lens_top_k=3)
    lens = rec.lens
    n = llm.config.num_hidden_layers
    assert lens["ids"].shape == (n, len(ids), 3)
    assert (lens["ids"][-1, :, 0] == rec.logits.argmax(-1)).all()
    assert (np.diff(lens["probs"], axis=-1) <= 0).all()
    # the model's own logits through the engine give the same argmax
    assert (llm.logits(ids).argmax(-1) == rec.logits.argmax(-1)).all()


def test_deinterleave_matches_the_converter_permutation() -> None:
    """llama.cpp's converter writes HF row s*hd/2 + i of a head as row 2i + s."""
    nh, hd = 3, 8
    hf = np.arange(nh * hd, dtype=np.float32)[None]
    gguf = hf.reshape(1, nh, 2, hd // 2).transpose(0, 1, 3, 2).reshape(1, -1)
    assert (deinterleave_heads(gguf, nh, hd) == hf).all()


def test_metrics_against_numpy() -> None:
    rng = np.random.default_rng(0)
    b = rng.standard_normal((4, 16)).astype(np.float32)
    a = b + np.float32(1e-3) * rng.standard_normal((4, 16)).astype(np.float32)
    max_abs, rel, cos = metrics(a, b)
    assert max_abs == pytest.approx(float(np.abs(a - b).max()))
    assert rel == pytest.approx(float(np.linalg.norm(a - b) / np.linalg.norm(b)), rel=1e-6)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert cos == pytest.approx(float((a64 * b64).sum() / np.linalg.norm(a64) / np.linalg.norm(b64)), rel=1e-12)


# -- bad input --------------------------------------------------------------------------


def test_bad_reference_and_positions_are_clear_errors(smollm2_gguf: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["trace", str(smollm2_gguf), "hi", "--reference", str(tmp_path / "nope")]) == 2
    assert "expected 'transformers', 'reference'" in capsys.readouterr().err
    assert cli_main(["trace", str(smollm2_gguf), "hi", "--reference", "reference", "--positions", "99"]) == 2
    assert "position 99 is outside the prompt" in capsys.readouterr().err
    env = os.environ.pop("ELLM_REF_PYTHON", None)
    try:
        assert cli_main(["trace", str(smollm2_gguf), "hi"]) == 2
        assert "--reference-python" in capsys.readouterr().err
    finally:
        if env is not None:
            os.environ["ELLM_REF_PYTHON"] = env


def test_a_recorder_not_started_says_so_at_attention_too() -> None:
    # attention() read the batch and kept rows unchecked: without start() it failed on None
    from ellm.trace import Recorder
    x = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(RuntimeError, match=r"start\(batch\) was not called"):
        Recorder().attention(0, x, x[None], x[None], np.zeros((1, 1), np.int32), np.ones(2, np.float32), False, 1.0)


# -- tracing off ------------------------------------------------------------------------


def test_decode_allocates_nothing_with_tracing_off(smollm2_gguf: Path) -> None:
    """With model.recorder = None a decode step allocates nothing that grows with the model
    (numpy reports its buffers to tracemalloc); with a recorder set it copies every op."""
    import tracemalloc

    from ellm.models.batch import Batch
    from ellm.trace import Recorder
    llm = ellm.load(smollm2_gguf, max_num_seqs=1, progress=False)
    model, engine = llm.model, llm.engine
    assert model.recorder is None
    assert engine.blocks.allocate("alloc", 8)
    tables = {w: np.asarray([engine.blocks.table("alloc", w)], np.int32) for w in engine.kv.windows}
    batch = Batch.single(np.array([504], np.int32), 3, tables)

    def peak_of_five_steps() -> int:
        engine.runner.forward(batch)             # buffers sized before measuring
        tracemalloc.start()
        try:
            for _ in range(5):
                engine.runner.forward(batch)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    try:
        off = peak_of_five_steps()
        rec = Recorder()
        rec.start(batch)
        model.recorder = rec
        on = peak_of_five_steps()
    finally:
        model.recorder = None
        engine.blocks.free("alloc")
    per_layer_copy = 4 * llm.config.hidden_size * llm.config.num_hidden_layers
    assert off < 16 * 1024 < per_layer_copy          # not even one vector per layer
    assert on > 10 * per_layer_copy


def test_inspect_command_defaults_to_loopback_and_checks_its_port(capsys: pytest.CaptureFixture) -> None:
    from ellm.cli import build_parser
    args = build_parser().parse_args(["inspect", "some-model"])
    assert args.host == "127.0.0.1"
    assert cli_main(["inspect", "smollm2-135m-instruct", "--port", "70000"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err


def test_a_float16_cache_is_read_back_as_float32_values(smollm2_gguf: Path) -> None:
    """k after RoPE comes from the KV cache: a float16 cache's rows are widened to float32
    like every other recorded op, and match a float32 cache's within f16 rounding (the
    cuda rows of tests/test_cuda.py do the same for a bfloat16 cache's bits)."""
    ids = None
    recs = {}
    for kv in ("float32", "float16"):
        llm = ellm.load(smollm2_gguf, progress=False, kv_cache_dtype=kv)
        try:
            ids = ids or llm.encode_prompt(PROMPT)
            recs[kv] = record(llm, ids)
        finally:
            llm.close()
    for layer, tol in ((0, 2.0 ** -10), (7, 5e-2)):   # past layer 0 the f16 cache changed the inputs too
        a, b = recs["float32"].arrays[(layer, "k_rope")], recs["float16"].arrays[(layer, "k_rope")]
        assert b.dtype == np.float32
        assert np.max(np.abs(b - a)) <= tol * np.max(np.abs(a)), layer
        probs = recs["float16"].arrays[(layer, "attn_probs")].reshape(len(ids), -1, len(ids))
        assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
