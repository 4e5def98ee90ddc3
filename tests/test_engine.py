"""The engine on the real SmolLM2 / Gemma 3 models: paged KV cache, batching, prefix cache,
preemption, sliding windows, stopping."""
from __future__ import annotations

import numpy as np
import pytest

import ellm
from ellm.engine.engine import EngineConfig, RequestError
from ellm.models.batch import Batch
from ellm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return ellm.load(smollm2_gguf, max_model_len=2048)


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    return ellm.load(gemma3_gguf, max_model_len=2048, max_num_seqs=4)


def _prompt(llm, n: int) -> list[int]:
    from ellm.bench import bench_prompt
    return bench_prompt(llm, n)


def test_cached_decode_equals_full_recompute(smollm2) -> None:
    ids = _prompt(smollm2, 40)
    full = smollm2.logits(ids)                                   # (40, vocab), one prefill
    eng = smollm2.engine
    key = "decode-check"
    assert eng.blocks.allocate(key, len(ids))
    try:
        tables = {w: np.asarray([eng.blocks.table(key, w)], np.int32) for w in eng.kv.windows}
        eng.model.forward(Batch.single(np.asarray(ids[:30]), 0, tables), eng.kv)
        for p in range(30, 40):                                  # then one token at a time
            got = eng.model.forward(Batch.single(np.asarray(ids[p:p + 1]), p, tables), eng.kv)[0]
            np.testing.assert_allclose(got, full[p], atol=2e-3, rtol=0)
    finally:
        eng.blocks.free(key)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_last_layer_on_the_logits_rows_alone(name: str, request: pytest.FixtureRequest,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that wants one row's logits runs its last layer past attention on that
    row alone (Decoder._last_layer_rows): the same bits as the row of a forward that
    gives every row's logits, whose last layer takes every row. Gemma 3 has norms after
    each block and sliding-window layers; the hidden states (hidden_only) likewise."""
    from ellm.models.blocks import Decoder
    llm = request.getfixturevalue(name)
    eng = llm.engine
    ids = _prompt(llm, 70)
    calls = []
    real = Decoder._last_layer_rows
    monkeypatch.setattr(Decoder, "_last_layer_rows", lambda self, *a: calls.append(1) or real(self, *a))
    key = "last-rows-check"
    assert eng.blocks.allocate(key, len(ids))
    try:
        tables = {w: np.asarray([eng.blocks.table(key, w)], np.int32) for w in eng.kv.windows}
        rows = np.array(eng.model.forward(Batch.single(np.asarray(ids), 0, tables, all_logits=True), eng.kv))
        assert not calls   # every row gives logits: the whole last layer
        last = np.array(eng.model.forward(Batch.single(np.asarray(ids), 0, tables), eng.kv))
        assert calls and last.shape == (1, rows.shape[1])
        np.testing.assert_array_equal(last[0], rows[-1])
        hidden_all = np.array(eng.model.forward(Batch.single(np.asarray(ids), 0, tables, all_logits=True), eng.kv,
                                                hidden_only=True))
        hidden = np.array(eng.model.forward(Batch.single(np.asarray(ids), 0, tables), eng.kv, hidden_only=True))
        np.testing.assert_array_equal(hidden[0], hidden_all[-1])
        # a chunk in the middle of a prompt wants no row: its keys and values are still written
        head = Batch.single(np.asarray(ids[:50]), 0, tables)
        head.logits_rows = np.zeros(0, np.int32)
        assert np.array(eng.model.forward(head, eng.kv)).shape == (0, rows.shape[1])
        tail = np.array(eng.model.forward(Batch.single(np.asarray(ids[50:]), 50, tables), eng.kv))
        np.testing.assert_allclose(tail[0], rows[-1], atol=2e-3, rtol=0)
    finally:
        eng.blocks.free(key)


def test_batched_greedy_equals_one_at_a_time(smollm2) -> None:
    prompts = [_prompt(smollm2, n) for n in (5, 23, 61, 140)]
    alone = [smollm2.generate(p, GREEDY).token_ids for p in prompts]
    together = [o.token_ids for o in smollm2.generate(prompts, GREEDY)]
    assert together == alone


def test_prefix_cache_hit_matches_miss(smollm2) -> None:
    eng = smollm2.engine
    eng.blocks.clear_prefix_cache()
    shared = _prompt(smollm2, 100)
    a = smollm2.generate(shared + [504, 3575], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))
    hits_before = eng.blocks.hits
    b = smollm2.generate(shared + [504, 3575], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))
    assert eng.blocks.hits - hits_before == 100 // eng.cfg.block_size
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-3


def test_preemption_when_blocks_run_out(smollm2_gguf) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=512)
    # each prompt ends just short of a block boundary, so decoding needs new blocks at once
    prompts = [_prompt(llm, n) for n in (14, 30, 46, 62)]
    alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
    # 10 blocks of 16 tokens hold the four prompts (1+2+3+4) but not one more token each.
    small = ellm.load(smollm2_gguf, max_model_len=512)
    small.engine.__init__(small.model, small.tokenizer,
                          EngineConfig(max_model_len=512, kv_cache_tokens=10 * 16, max_batch_tokens=64,
                                       enable_prefix_caching=False))
    together = [o.token_ids for o in small.generate(prompts, GREEDY)]
    assert small.engine.scheduler.num_preemptions > 0
    assert together == alone
    assert small.engine.blocks.num_used() == 0


def test_abort_frees_blocks(smollm2) -> None:
    eng = smollm2.engine
    eng.blocks.clear_prefix_cache()
    rid = eng.add_request(_prompt(smollm2, 50), SamplingParams(max_tokens=100))
    eng.step()
    assert eng.blocks.num_used() > 0
    eng.abort(rid)
    eng.blocks.clear_prefix_cache()
    assert eng.blocks.num_used() == 0
    assert not eng.has_unfinished()


def test_finish_reasons_and_stop_strings(smollm2) -> None:
    out = smollm2.generate("The capital of France is", max_tokens=5, temperature=0.0)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    full = smollm2.generate("The capital of France is", max_tokens=20, temperature=0.0, ignore_eos=True).text
    stop = full.strip().split()[2]
    cut = smollm2.generate("The capital of France is", max_tokens=20, temperature=0.0, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.startswith(cut.text)
    chat = smollm2.chat([{"role": "user", "content": "Say hi."}], max_tokens=64, temperature=0.0)
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in smollm2.tokenizer.eos_token_ids


def test_bad_requests_are_refused(smollm2) -> None:
    with pytest.raises(RequestError, match="vocabulary"):
        smollm2.generate([1, 2, 10**9])
    with pytest.raises(RequestError, match="2048"):
        smollm2.generate(list(range(100, 2200)))
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate("")


def test_streaming_pieces_join_to_the_text(smollm2) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    pieces = list(smollm2.stream("Once upon a time", params))
    assert len(pieces) > 3
    assert "".join(pieces) == smollm2.generate("Once upon a time", params).text


def test_sliding_window_bounds_local_layer_blocks(gemma3) -> None:
    eng = gemma3.engine
    window = gemma3.config.sliding_window
    rid = eng.add_request(_prompt(gemma3, 700), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    held = []
    while eng.has_unfinished():
        eng.step()
        if rid in eng.blocks.tables:
            held.append(sum(b >= 0 for b in eng.blocks.table(rid, window)))
    bs = eng.cfg.block_size
    assert held, "the sequence never ran"
    # what a chunk of new tokens can see: the window behind its first token, plus the chunk
    assert max(held) <= -(-window // bs) + -(-eng.cfg.max_batch_tokens // bs) + 1


def test_token_slice_equals_slicing_the_whole_list() -> None:
    """Sequence.token_slice (what a step's batch reads) against slicing prompt + output +
    guesses as one list, for every start and length across the three parts."""
    from ellm.engine.sequence import Sequence
    seq = Sequence(request_id="s", prompt_ids=[10, 11, 12, 13], params=GREEDY, sampler=None, detok=None,
                   stopper=None, arrival=0, eos_ids=frozenset(), output_ids=[20, 21, 22])
    for drafts in ([], [30, 31]):
        seq.draft_ids = drafts
        whole = seq.all_ids + drafts
        for start in range(len(whole) + 1):
            for n in range(len(whole) - start + 2):
                assert seq.token_slice(start, n) == whole[start:start + n], (drafts, start, n)


def test_block_views_follow_the_workspace_when_it_grows(smollm2) -> None:
    """The blocks keep their workspace views between steps; a bigger batch that makes the
    workspace replace its buffers must move them onto the new buffers (and a decode after
    it gives the same logits as before)."""
    eng = smollm2.engine
    key = "views-check"
    ws = eng.runner.workspace
    grown_from = ws._bufs["q"].shape[0] if "q" in ws._bufs else 1
    ids = _prompt(smollm2, grown_from + 40)                      # more rows than any batch before
    assert eng.blocks.allocate(key, len(ids))
    try:
        tables = {w: np.asarray([eng.blocks.table(key, w)], np.int32) for w in eng.kv.windows}
        decode = Batch.single(np.asarray(ids[:1]), 0, tables)
        before = np.array(eng.runner.forward(decode))
        eng.runner.forward(Batch.single(np.asarray(ids), 0, tables))
        assert ws._bufs["q"].shape[0] > grown_from
        after = np.array(eng.runner.forward(decode))
        np.testing.assert_array_equal(after, before)
        names = {"q": 0, "k": 1, "v": 2, "attn": 6}
        for layer in eng.model.layers:
            views = layer.attn._views[(id(ws), 1)][2]
            for name, i in names.items():
                assert views[i].base is ws._bufs[name], name
            gate, up, _ = layer.mlp._views[(id(ws), 1)][2]
            assert gate.base is ws._bufs["gate"] and up.base is ws._bufs["up"]
        # the MLP's activation overwrites gate: no (T, intermediate) buffer of its own
        assert "act" not in ws._bufs
    finally:
        eng.blocks.free(key)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_kept_block_tables_equal_tables_built_anew(name: str, request: pytest.FixtureRequest,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine._block_tables keeps its arrays and rewrites only rows whose tables changed
    (BlockManager.versions): at every step they equal arrays built from the tables anew,
    through growth, sequences finishing, and preemption with re-admission under the same
    request id (SmolLM2, a tight cache) or sliding-window releases (Gemma 3's local
    layers, prompts past its 512-token window)."""
    from ellm.engine.engine import Engine
    llm = request.getfixturevalue(name)
    if name == "smollm2":
        cfg = EngineConfig(max_model_len=512, kv_cache_tokens=12 * 16, max_batch_tokens=64, max_num_seqs=4,
                           enable_prefix_caching=False)
        work = ((14, 40), (30, 60), (46, 25), (20, 70))
    else:
        cfg = EngineConfig(max_model_len=1024, max_batch_tokens=256, max_num_seqs=4, enable_prefix_caching=False)
        work = ((600, 40), (540, 60), (30, 50))
    eng = Engine(llm.engine.model, llm.engine.tokenizer, cfg)
    kept, checked, released = eng._block_tables, [], []

    def compare(seqs, live=None):
        got = kept(seqs, live)
        keys = [s.request_id if live is None or ok else None for s, ok in zip(seqs, live or [True] * len(seqs))]
        want = eng._tables_of(keys)
        assert got.keys() == want.keys()
        for w in want:
            np.testing.assert_array_equal(got[w], want[w])
        checked.append(len(seqs))
        released.append(any(k is not None and got[w][i, 0] == -1 for w in got if w for i, k in enumerate(keys)))
        return got
    monkeypatch.setattr(eng, "_block_tables", compare)
    for n, tokens in work:
        eng.add_request(_prompt(llm, n), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(checked) > 50
    if name == "smollm2":
        assert eng.scheduler.num_preemptions > 0
    else:   # a local layer's first blocks, out of the window, handed back while the sequence ran
        assert any(released)
