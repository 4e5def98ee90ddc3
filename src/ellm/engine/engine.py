"""The engine: requests in, one batched forward per step(), text out.

Engine.step() = schedule -> build one Batch for all scheduled sequences -> the model
runner (engine/runner.py: the backend's KV cache, workspace and step executor) -> sample
the sequences whose logits are due -> detokenize, check stops, finish. On a device
backend, a run of decode steps overlaps the host with the device instead
(see `_step_ahead`): step N+1 is launched before step N's tokens are read. Every
user-facing call (generate, stream, chat, the server) is a loop over step(), run by one
AsyncEngine thread (engine/async_engine.py): the Engine itself is not thread-safe.
logits() and embed() run whole prompts through the model outside the scheduler, between
two steps, on blocks they free before returning.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..models.batch import Batch
from ..sampling_params import SamplingParams, check_token_ids
from .kv_cache import BlockManager
from .runner import ModelRunner, PendingTokens
from .sampler import SampleResult, SequenceSampler, sample_batch
from .scheduler import Scheduler
from .sequence import FinishReason, RequestOutput, Sequence, SeqStatus, TokenLogprob
from .stop import StopStringMatcher


# How embed() reduces a prompt's hidden states to one vector: the mean over its tokens,
# its last token, or its first token (the BERT-style [CLS] position).
POOLINGS = ("mean", "last", "cls")


class RequestError(ValueError):
    """A request the engine cannot run (too long, bad ids); the message says why."""


class ModelFileChanged(RequestError):
    """The model's file was rewritten on disk while mapped: no request can be trusted to
    run on it any more (the server answers 503); the message names the file."""


class SequenceError(RuntimeError):
    """A request failed while it ran (its sampling or detokenizing raised); it alone was
    finished, with finish_reason "error", and the other requests went on."""


@dataclass
class EngineConfig:
    max_model_len: int = 8192        # prompt + output tokens per sequence
    max_num_seqs: int = 64           # sequences decoding at once
    max_batch_tokens: int = 512      # tokens per forward (prefill chunk size)
    block_size: int = 16
    kv_cache_tokens: int = 0         # 0: max(max_model_len, 16384)
    kv_cache_dtype: str = "float32"  # or "float16" (cpu) / "bfloat16" (cuda): K and V stored rounded
    enable_prefix_caching: bool = True
    speculative: Any = None          # [spec] a speculative.SpeculativeConfig, or None (off)
    # launch decode steps one ahead of reading their tokens (Engine._step_ahead);
    # None: where the backend gains from it (a GPU replaying captured steps)
    overlap_decode: bool | None = None


def _row_result(batched: list[SampleResult | Exception] | None, b: int, sampler: SequenceSampler,
                logits: Any, masks: Any) -> SampleResult:
    """Row b's token: from the batched sampling (an error there is row b's alone, raised
    again here), else sampled alone (its failure its own)."""
    if batched is not None:
        got = batched[b]
        if isinstance(got, Exception):
            raise got
        return got
    return sample_batch([sampler], logits[b:b + 1], None if masks is None else [masks[b]])[0]


def _launched_result(token: int, error: Exception | None,
                     logprobs: tuple[float, list[tuple[int, float]]] | None) -> SampleResult:
    """A launched step's token for one row (with its logprobs, where it asked), or what
    its sampling raised, raised again."""
    if error is not None:
        raise error
    if logprobs is not None:
        return SampleResult(token, *logprobs)
    return SampleResult(token, math.nan, None)


@dataclass
class _Ahead:
    """A decode step launched and not yet read: its sequences, in row order, and its ids."""
    seqs: list[Sequence]
    pending: PendingTokens


class Engine:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 draft_model: Any = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cfg = cfg = config or EngineConfig()
        mc = model.config
        cfg.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.runner = ModelRunner(model, cfg)   # [runner] owns the KV cache and workspace on the backend
        self.kv = self.runner.kv
        self.blocks = BlockManager(self.kv, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_batch_tokens)
        self.seqs: dict[str, Sequence] = {}
        # _block_tables' arrays of the last call: (row keys, their table versions, arrays)
        self._tables_memo: tuple[list[Any], list[int | None], dict[int, np.ndarray]] | None = None
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(mc.eos_token_id)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "overlapped_steps": 0,
                      "padding_rows": 0}
        self.overlap = self.runner.overlaps if cfg.overlap_decode is None else bool(cfg.overlap_decode)
        self._ahead: _Ahead | None = None   # a decode step launched, its tokens not read yet
        self._masks: Any = None  # structured.MaskFiller, made on the first constrained request
        self.loop_owner: Any = None   # the AsyncEngine whose thread steps this engine
        self.spec: Any = None  # [spec] a speculative.Speculator when speculative decoding is on
        if cfg.speculative is not None:
            from .speculative import make_speculator
            self.spec = make_speculator(cfg, model, draft_model)
            self.stats.update(spec_proposed_tokens=0, spec_accepted_tokens=0, spec_checks=0)

    # -- requests -----------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def adapter_slot(self, adapter: str | None) -> int:
        """[lora] The slot of a LoRA adapter by name (None: the base, -1); an unknown name
        is a RequestError listing the ones attached."""
        if adapter is None:
            return -1
        lora = getattr(self.model, "lora", None)
        if not isinstance(adapter, str):
            raise RequestError(f"adapter must be a name (str) or None, got {type(adapter).__name__}")
        if lora is None or adapter not in lora.names:
            have = ", ".join(map(repr, lora.names)) if lora is not None else "none were loaded"
            raise RequestError(f"unknown LoRA adapter {adapter!r} (attached: {have})")
        return lora.slot(adapter)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, images: list[Any] | None = None,
                    adapter: str | None = None, deltas: bool = True) -> str:
        """images: [vision] ImageInputs whose rows fill the prompt's image tokens, in order.
        adapter: [lora] the name of an attached LoRA adapter to run the request with.
        deltas: False when the caller reads only the end: step() then returns the
        request's output once, finished, with all its text, ids and logprobs as deltas."""
        slot = self.adapter_slot(adapter)
        request_id = request_id or self.new_request_id()
        self.check_model_files()
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already running")
        vocab = self.model.config.vocab_size
        try:
            prompt_ids = check_token_ids(prompt_ids, vocab)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not prompt_ids:
            raise RequestError("the prompt is empty (no tokens)")
        limit = self.cfg.max_model_len
        if len(prompt_ids) >= limit:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context allows "
                               f"{limit} (prompt + output), so at most {limit - 1} prompt tokens")
        image_positions, image_keys, counts = self._image_slots(prompt_ids, images)   # [vision]
        image_spans = self._bidirectional_spans(image_positions, counts)          # [vision]
        grammar = self._grammar_state(params)  # [structured] one matcher per constrained sequence
        seq = Sequence(
            request_id=request_id, prompt_ids=prompt_ids, params=params, grammar=grammar,
            sampler=SequenceSampler(params, prompt_ids, vocab),
            detok=self.tokenizer.incremental(prompt_ids, skip_special_tokens=params.skip_special_tokens),
            stopper=StopStringMatcher(params.stop or [], params.include_stop_str_in_output),
            arrival=next(self._arrivals),
            eos_ids=frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_ids),
            deltas=deltas,
        )
        if slot >= 0:   # [lora] its own prefix-cache chain: K/V differ from the base's
            seq.adapter_slot, seq.prefix_salt = slot, hash(("lora", slot, adapter))
        if images:   # [vision]
            seq.images, seq.image_positions, seq.image_keys = list(images), image_positions, image_keys
            if image_spans:
                seq.image_spans = image_spans
                seq.image_limits = np.concatenate([np.full(e - s, e - 1, np.int32) for s, e in image_spans])
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_ids)
        return request_id

    def check_model_files(self) -> None:
        """Raises ModelFileChanged when a file the weights are mapped from was rewritten in
        place since loading (a stat() per file: done for every request)."""
        from ..formats.files import MappedFileChanged, check_unchanged
        try:
            check_unchanged(getattr(self.model, "source_files", ()))
        except MappedFileChanged as e:
            raise ModelFileChanged(str(e)) from None

    def abort(self, request_id: str) -> None:
        """Stops a request now and returns its blocks to the pool."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        if self.spec is not None:  # [spec]
            self.spec.release(request_id)

    def has_unfinished(self) -> bool:
        """Work left: a request, or a step launched ahead whose tokens nobody will read (its
        sequences stopped): the next step() lets it finish, so that once this says False
        nothing is in flight on the engine's buffers."""
        return self._ahead is not None or self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._ahead is not None:
            outputs = self._step_ahead()
            if outputs or self._ahead is not None:
                return outputs
        plan, too_big = self.scheduler.schedule()
        outputs = []
        for seq in too_big:  # cannot fit in the KV cache even alone
            self._finish(seq, "length")
            outputs.append(seq.take_output())
        if not plan:
            return outputs
        if self.spec is not None:  # [spec] decoding sequences may add guesses to check
            plan = self._add_guesses(plan)
        batch, sampled = self._build_batch(plan)
        if self.overlap and not too_big and self._overlappable(plan, sampled):
            pending = self.runner.launch_decode(batch, [s.sampler for s in sampled])
            if pending is not None:
                self.stats["steps"] += 1
                for seq, _ in plan:
                    seq.num_computed += 1
                self._ahead = _Ahead(sampled, pending)
                return self._step_ahead()
        # [structured] grammar masks are filled in a worker thread while the forward runs
        pending = self._masks.start([s.grammar for s in sampled]) if self._masks else None
        try:
            logits = self.runner.execute(batch)      # [runner] (len(sampled), vocab), the backend's array
        finally:
            masks = pending.wait() if pending else None
        self.stats["steps"] += 1
        for seq, n in plan:
            seq.num_computed += n
            # the step that completes the prompt records its blocks (later steps would find
            # them all recorded already)
            if seq.num_computed >= len(seq.prompt_ids) > seq.num_computed - n:
                self.blocks.cache_prefix(seq.request_id, seq.image_keys or seq.prompt_ids,  # [vision] keys
                                         seq.num_computed, seq.prefix_salt)   # [lora]
                seq.image_rows = None   # [vision] the prompt is in the cache now
        if self.spec is not None and any(seq.draft_ids for seq in sampled):  # [spec] rows of guesses
            self._sample_checked(sampled, logits, masks, outputs)
            return outputs
        # [runner] a device backend may choose the tokens itself, grammars' masks applied
        # there too (only ids and logprobs cross the bus)
        batched: list[Any] | None = self.runner.sample(logits, [s.sampler for s in sampled], masks)
        if batched is None:
            logits = self.runner.to_host(logits)   # [runner]
        if masks is not None:  # [structured]
            sampled, logits, masks, batched = self._drop_failed_grammars(sampled, logits, masks, outputs, batched)
        # The error boundary of one request: whatever its sampler or detokenizer raises (a
        # value no check foresaw, a NaN row) finishes that sequence with an error; the
        # others in the batch go on. When every row is a bare argmax (nothing per request
        # can fail there) one batched argmax serves them; otherwise rows are sampled one by
        # one, so a failure cannot cost a neighbour its random draw (seeded requests stay
        # batch-invariant).
        samplers = [seq.sampler for seq in sampled]
        if batched is None and all(s.plain_greedy for s in samplers):
            batched = sample_batch(samplers, logits, masks)
        for b, seq in enumerate(sampled):
            self._append_guarded(seq, outputs, _row_result, batched, b, seq.sampler, logits, masks)
        return outputs

    def _append_guarded(self, seq: Sequence, outputs: list[RequestOutput],
                        result: Callable[..., SampleResult], *args: Any) -> None:
        """Appends the token result(*args) gives to seq, inside the request's error
        boundary: whatever it raises finishes seq alone, with the error; then seq's
        output, if it has one, goes to outputs."""
        try:
            self._append(seq, result(*args))
        except Exception as e:  # noqa: BLE001 - the request's failure, reported on it
            seq.error = f"sampling failed: {type(e).__name__}: {e}"
            self._finish(seq, "error")
        if seq.status is SeqStatus.FINISHED or (seq.pending_ids and seq.deltas):
            outputs.append(seq.take_output())

    # -- overlapped greedy decoding ----------------------------------------------------

    def _overlappable(self, plan: list[tuple[Sequence, int]], sampled: list[Sequence]) -> bool:
        """A step that may run ahead: one token per sequence, each sampled without looking
        at the tokens so far (no penalties, unless the device counts the tokens it has
        not handed back yet: runner.penalties_ahead), without logprobs unless the device
        takes them (runner.logprobs_ahead), no grammar, no guesses, no adapter (the next
        steps' batches carry none), nobody waiting to be admitted."""
        penalties, logprobs = self.runner.penalties_ahead, self.runner.logprobs_ahead
        return (self.spec is None and not self.scheduler.waiting and len(sampled) == len(plan)
                and all(n == 1 and seq is s and s.grammar is None and s.adapter_slot < 0
                        and (s.sampler.history_free or penalties)
                        and (logprobs or s.params.logprobs is None)
                        for (seq, n), s in zip(plan, sampled)))

    def _step_ahead(self) -> list[RequestOutput]:
        """Step N was launched (and sampled) and its tokens are unread: launch step N+1
        for the same sequences with N's tokens taken on the device, then read N's tokens
        and run the host's part (detokenizing, stops) while N+1 computes. A sequence
        that stops on a token of step N (EOS, a stop string, its length) already has a
        row in step N+1: that row's token is dropped, and the K/V it wrote lies past the
        sequence's end, in blocks freed with it; in the steps after, its row is padding.
        Where N+1 cannot follow (someone waiting, half the rows padding, no block for the
        next token) N's tokens are read alone and the next step() schedules anew."""
        ahead = self._ahead
        assert ahead is not None
        seqs = ahead.seqs
        live = [seq.status is SeqStatus.RUNNING for seq in seqs]
        nxt = None
        if self._can_follow(ahead, live):
            batch, padding = self._ahead_batch(seqs, live)
            nxt = self.runner.launch_decode(batch, [s.sampler for s in seqs], ahead.pending, padding)
            if nxt is not None:
                self.stats["steps"] += 1
                self.stats["overlapped_steps"] += 1
                if padding is not None:
                    self.stats["padding_rows"] += int(padding.sum())
                for seq in seqs:
                    seq.num_computed += 1
        self._ahead = _Ahead(seqs, nxt) if nxt is not None else None
        if not any(live):   # nobody left to read these tokens for (all stopped or aborted)
            ahead.pending.wait()   # still let the step finish: no work left in flight on the engine's buffers
            return []
        ids = ahead.pending.wait()
        errors, logprobs = ahead.pending.errors, ahead.pending.logprobs
        outputs: list[RequestOutput] = []
        for b, (seq, tok) in enumerate(zip(seqs, ids.tolist())):
            if seq.status is SeqStatus.FINISHED:   # stopped on the step before, or aborted
                continue
            error = errors[b] if errors else None   # its row could not be sampled
            self._append_guarded(seq, outputs, _launched_result, tok, error, logprobs[b] if logprobs else None)
        return outputs

    def _can_follow(self, ahead: _Ahead, live: list[bool]) -> bool:
        """Whether step N+1 may be launched before step N's tokens are known: overlap on,
        nobody waiting, N's ids still on the device, more than half of the rows' sequences
        still running (a finished one keeps its row as padding, so that the rows and N's
        ids still line up), and a KV slot for N+1's token in every running sequence's
        tables (also for one whose length runs out on N's token: its row is dropped).
        live: per row, whether its sequence is still running."""
        if not self.overlap or self.scheduler.waiting or not ahead.pending.feeds_next:
            return False
        running = [seq for seq, ok in zip(ahead.seqs, live) if ok]
        if 2 * len(running) <= len(ahead.seqs):   # half the rows padding: schedule a smaller batch
            return False
        if all(self._at_length(seq, pending=1) for seq in running):   # N+1's tokens would all be dropped
            return False
        # num_computed counts N's token already: N+1's K/V go to position num_computed, in
        # the block of N's unless that one ended at N's position
        bs = self.blocks.block_size
        return all(seq.num_computed % bs or self.blocks.allocate(seq.request_id, seq.num_computed + 1)
                   for seq in running)

    def _at_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether seq has reached its length limit (max_tokens, or the context) once its
        `pending` tokens still being computed are appended."""
        return (seq.params.max_tokens is not None and len(seq.output_ids) + pending >= seq.params.max_tokens) \
            or seq.num_tokens + pending >= self.cfg.max_model_len

    def _ahead_batch(self, seqs: list[Sequence], live: list[bool]) -> tuple[Batch, np.ndarray | None]:
        """The decode batch of step N+1 -> (batch, which rows are padding, None for none):
        positions and tables; its tokens (placeholders here) come from step N's ids on the
        device. A finished sequence's row is padding (position 0, tables of -1: it writes
        no cache slot and reads no key)."""
        B = len(seqs)
        positions = np.array([seq.num_computed if ok else 0 for seq, ok in zip(seqs, live)], np.int32)
        if any(w for w in self.blocks.windows):   # (step N's tables are on their way already)
            for seq, ok in zip(seqs, live):
                if ok:
                    self.blocks.release_out_of_window(seq.request_id, seq.num_computed)
        everyone = all(live)
        tables = self._block_tables(seqs, None if everyone else live)
        return (Batch(np.zeros(B, np.int32), positions, np.arange(B, dtype=np.int32), tables,
                      np.arange(B, dtype=np.int32)), None if everyone else ~np.asarray(live, bool))

    def _build_batch(self, plan: list[tuple[Sequence, int]]) -> tuple[Batch, list[Sequence]]:
        if all(n == 1 and not seq.draft_ids and not seq.images for seq, n in plan):
            return self._build_decode_batch(plan)
        total = sum(n for _, n in plan)
        token_ids = np.empty(total, np.int32)
        positions = np.empty(total, np.int32)
        seq_ids = np.empty(total, np.int32)
        rows: list[int] = []
        sampled: list[Sequence] = []
        spliced: list[tuple[np.ndarray, np.ndarray]] = []   # [vision] (batch rows, image rows)
        limits: list[tuple[np.ndarray, np.ndarray]] = []    # [vision] (batch rows, last key seen)
        t = 0
        for b, (seq, n) in enumerate(plan):
            start = seq.num_computed
            if seq.images:   # [vision]
                spliced += self._image_rows_in(seq, start, n, t)
                if seq.image_limits is not None:
                    limits += self._image_rows_in(seq, start, n, t, seq.image_limits)
            token_ids[t:t + n] = seq.token_slice(start, n)   # [spec] the guesses follow the tokens
            positions[t:t + n] = np.arange(start, start + n, dtype=np.int32)
            seq_ids[t:t + n] = b
            self.blocks.release_out_of_window(seq.request_id, start)
            if start + n == seq.num_tokens + len(seq.draft_ids):
                rows.extend(range(t + n - 1 - len(seq.draft_ids), t + n))  # [spec] a row per guess
                sampled.append(seq)
            t += n
        tables = self._block_tables([seq for seq, _ in plan])
        batch = Batch(token_ids, positions, seq_ids, tables, np.asarray(rows, np.int32))
        if any(seq.adapter_slot >= 0 for seq, _ in plan):   # [lora] each row's adapter
            batch.adapter_slots = np.repeat(np.asarray([seq.adapter_slot for seq, _ in plan], np.int32),
                                            [n for _, n in plan])
        if spliced:   # [vision]
            batch.embed_rows = np.concatenate([r for r, _ in spliced])
            batch.embed_values = np.concatenate([v for _, v in spliced])
        if limits:   # [vision] an image's tokens see the whole image (the chunk holds all of it)
            batch.key_limit = positions.copy()
            for r, lim in limits:
                batch.key_limit[r] = lim
        return batch, sampled

    def _build_decode_batch(self, plan: list[tuple[Sequence, int]]) -> tuple[Batch, list[Sequence]]:
        """_build_batch for a step of one token per sequence, none with guesses or images
        (every plain decode step): the same Batch from short lists, without the slicing
        per sequence."""
        token_ids, positions, rows, sampled = [], [], [], []
        sliding = any(w for w in self.blocks.windows)
        for b, (seq, _) in enumerate(plan):
            start = seq.num_computed
            p = len(seq.prompt_ids)
            token_ids.append(seq.output_ids[start - p] if start >= p else seq.prompt_ids[start])
            positions.append(start)
            if sliding:
                self.blocks.release_out_of_window(seq.request_id, start)
            if start + 1 == seq.num_tokens:
                rows.append(b)
                sampled.append(seq)
        B = len(plan)
        tables = self._block_tables([seq for seq, _ in plan])
        batch = Batch(np.asarray(token_ids, np.int32), np.asarray(positions, np.int32),
                      np.arange(B, dtype=np.int32), tables, np.asarray(rows, np.int32))
        if any(seq.adapter_slot >= 0 for seq, _ in plan):   # [lora] each row's adapter
            batch.adapter_slots = np.asarray([seq.adapter_slot for seq, _ in plan], np.int32)
        return batch, sampled

    def _block_tables(self, seqs: list[Sequence], live: list[bool] | None = None) -> dict[int, np.ndarray]:
        """Per window, the (B, widest) block tables of the step's sequences, -1 padded;
        live: False for a row that is padding (a table of -1 alone). The arrays are kept
        for the next call: a decode step of the same rows rewrites only the rows whose
        tables changed (BlockManager.versions), as turning every table into an array
        again cost ~100 µs a step at 64 sequences of ~900 tokens. Valid until the next call."""
        keys: list[Any] = ([seq.request_id for seq in seqs] if live is None
                           else [seq.request_id if ok else None for seq, ok in zip(seqs, live)])
        versions = [None if k is None else self.blocks.versions.get(k) for k in keys]
        memo = self._tables_memo
        if memo is not None and memo[0] == keys:
            changed = [i for i, (a, b) in enumerate(zip(memo[1], versions)) if a != b]
            tables = memo[2]
            if not changed or self._rewrite_rows(tables, keys, changed):
                self._tables_memo = (keys, versions, tables)
                return tables
        tables = self._tables_of(keys)
        self._tables_memo = (keys, versions, tables)
        return tables

    def _rewrite_rows(self, tables: dict[int, np.ndarray], keys: list[Any], rows: list[int]) -> bool:
        """Rewrites these rows of the kept tables in place; False where one no longer fits
        (a table grew past the width: the caller builds them anew)."""
        for w, arr in tables.items():
            for i in rows:
                if keys[i] is not None and len(self.blocks.table(keys[i], w)) > arr.shape[1]:
                    return False
        for w, arr in tables.items():
            for i in rows:
                row = [] if keys[i] is None else self.blocks.table(keys[i], w)
                arr[i, :len(row)] = row
                arr[i, len(row):] = -1
        return True

    def _tables_of(self, keys: list[Any]) -> dict[int, np.ndarray]:
        tables = {}
        for w in self.kv.windows:
            rows = [[] if k is None else self.blocks.table(k, w) for k in keys]
            width = max(map(len, rows))
            if all(len(r) == width for r in rows):
                tables[w] = np.asarray(rows, np.int32).reshape(len(rows), width)
                continue
            # rows of several lengths: one scatter through a mask, not one copy per row
            lens = np.fromiter(map(len, rows), np.intp, len(rows))
            arr = np.full((len(keys), width), -1, np.int32)
            arr[np.arange(width) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), np.int32,
                                                                int(lens.sum()))
            tables[w] = arr
        return tables

    # -- [vision] images in the prompt ----------------------------------------------

    def _image_slots(self, prompt_ids: list[int], images: list[Any] | None) -> tuple[Any, Any, list[int]]:
        """Checks that the prompt's image tokens and the images' token counts agree; ->
        (positions of the image tokens, the prompt keyed for the prefix cache, each image's
        token count), or (None, None, []) for a prompt without images."""
        image_token = getattr(self.model.config, "image_token_id", None)
        if image_token is None or not getattr(self.model, "takes_images", False):
            if images:
                raise RequestError("this model takes no images (it has no vision tower)")
            return None, None, []
        ids = np.asarray(prompt_ids, np.int64)
        positions = np.flatnonzero(ids == image_token).astype(np.int32)
        images = list(images or [])
        counts = []
        for i, image in enumerate(images):
            try:
                counts.append(self.model.image_token_count(image))
                if not isinstance(image.content_hash, str) or not image.content_hash:
                    raise ValueError("its content_hash must be a non-empty string")
            except (AttributeError, ValueError) as e:
                raise RequestError(f"image {i}: {e}") from None
        if len(positions) != sum(counts):
            raise RequestError(f"the prompt holds {len(positions)} image tokens (id {image_token}), the "
                               f"{len(images)} image(s) need {sum(counts)} ({'+'.join(map(str, counts)) or '0'})")
        if not images:
            return None, None, []
        keys: list[Any] = list(prompt_ids)
        k = 0
        for image, count in zip(images, counts):
            for j in range(count):
                keys[positions[k]] = (image_token, image.content_hash, j)
                k += 1
        return positions, keys, counts

    def _bidirectional_spans(self, positions: Any, counts: list[int]) -> list[tuple[int, int]] | None:
        """For a model whose image tokens attend to their whole image (Gemma 3, as
        transformers with token_type_ids and llama.cpp): the [start, end) runs of
        consecutive image tokens of each image, which a prefill chunk must hold whole."""
        if positions is None or not getattr(self.model, "bidirectional_images", False):
            return None
        spans: list[tuple[int, int]] = []
        k = 0
        for count in counts:
            pos = positions[k:k + count]
            k += count
            cuts = np.flatnonzero(np.diff(pos) != 1) + 1
            for run in np.split(pos, cuts):
                if len(run):
                    spans.append((int(run[0]), int(run[-1]) + 1))
        longest = max((e - s for s, e in spans), default=0)
        if longest > self.cfg.max_batch_tokens:
            raise RequestError(f"an image of {longest} tokens must be prefilled in one chunk, but "
                               f"max_batch_tokens is {self.cfg.max_batch_tokens}; raise it to at least {longest}")
        return spans

    def _image_rows_in(self, seq: Sequence, start: int, n: int, offset: int,
                       per_token: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The image rows for seq's tokens start..start+n-1, placed at batch rows offset+...;
        the images are encoded once, at the first chunk that needs them. per_token: those
        tokens' entries of this (M,) array instead of the image rows."""
        pos = seq.image_positions
        lo, hi = np.searchsorted(pos, start), np.searchsorted(pos, start + n)
        if lo == hi:
            return []
        rows = (pos[lo:hi] - start + offset).astype(np.int32)
        if per_token is not None:
            return [(rows, per_token[lo:hi])]
        if seq.image_rows is None:
            seq.image_rows = self.model.encode_images(seq.images)
        return [(rows, seq.image_rows[lo:hi])]

    def _append(self, seq: Sequence, res: Any) -> None:
        tok = int(res.token_id)
        seq.sampler.append(tok)
        seq.output_ids.append(tok)
        seq.pending_ids.append(tok)
        self.stats["generation_tokens"] += 1
        if seq.params.logprobs is not None:
            seq.pending_logprobs.append(TokenLogprob(tok, float(res.logprob), res.top_logprobs))
        if seq.grammar is not None:  # [structured] the matcher follows every sampled token
            seq.grammar.advance(tok)
        if tok in seq.eos_ids:
            self._emit(seq, seq.stopper.push(seq.detok.flush())[0] + seq.stopper.flush())
            self._finish(seq, "stop")
            return
        piece = seq.detok.push(tok)
        text, stopped = seq.stopper.push(piece)
        self._emit(seq, text)
        if stopped:
            self._finish(seq, "stop")
        elif seq.grammar is not None and seq.grammar.done:  # [structured] nothing can follow
            self._emit(seq, seq.stopper.push(seq.detok.flush())[0] + seq.stopper.flush())
            self._finish(seq, "stop")
        elif self._at_length(seq):
            self._emit(seq, seq.stopper.push(seq.detok.flush())[0] + seq.stopper.flush())
            self._finish(seq, "length")

    # -- [spec] speculative decoding (ellm.engine.speculative) ------------------------

    def _add_guesses(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Gives the decoding sequences the proposer's guesses to check in this step's
        forward (within the token budget, the output and context limits and the free
        KV blocks; never by preempting anyone). Constrained sequences do not guess: their
        grammar mask is one row per step."""
        cfg = self.cfg
        room = cfg.max_batch_tokens - sum(n for _, n in plan)
        cands = []
        for seq, n in plan:
            seq.draft_ids = []   # none left over from a step that raised
            if n != 1 or seq.num_computed != seq.num_tokens - 1 or seq.grammar is not None:
                continue
            cap = min(room, cfg.max_model_len - 1 - seq.num_tokens)
            if seq.params.max_tokens is not None:
                cap = min(cap, seq.params.max_tokens - len(seq.output_ids) - 1)
            if cap > 0:
                cands.append((seq, cap))
        if not cands:
            return plan
        n_out = sum(1 for seq, n in plan if seq.num_computed + n == seq.num_tokens)
        guesses = self.spec.propose(cands, n_out, sum(n for _, n in plan))
        out = []
        for seq, n in plan:
            g = guesses.get(seq.request_id)
            if g and room > 0:
                g = g[:room]
                if self.blocks.allocate(seq.request_id, seq.num_computed + 1 + len(g)):
                    seq.draft_ids = g
                    room -= len(g)
                    n += len(g)
            if g and not seq.draft_ids:  # guessed but not checked: the proposer forgets the guesses
                self.spec.verified(seq.request_id, 0, 0, seq.num_tokens - 1)
            out.append((seq, n))
        return out

    def _sample_checked(self, sampled: list[Sequence], logits: Any, masks: list[Any] | None,
                        outputs: list[RequestOutput]) -> None:
        """Sampling for a step in which some sequences check guesses: each sequence's rows
        in order, its own sampler drawing from each (so penalties count the tokens kept
        so far, and one random draw is used per output token, as without guesses); a
        guess is kept while the drawn token equals it (exact: see speculative.py). Then
        the computed count moves back to the kept tokens and blocks past them are freed.

        logits: the runner's. A device backend chooses the tokens where the rest of the
        step's sampling happens, so a seeded request draws from the same generator as
        without guesses, and only ids (and logprob records) cross the bus: in rounds, row
        i of every sequence still checking after the tokens kept before it, or, when
        every row's token is its argmax (no draw, no state), every row in one round."""
        guesses = [seq.draft_ids for seq in sampled]
        starts = list(itertools.accumulate((1 + len(g) for g in guesses[:-1]), initial=0))
        kept = [0] * len(sampled)
        live: list[int] = []
        for b, seq in enumerate(sampled):
            seq.draft_ids = []
            st = seq.grammar
            if st is not None and masks is not None and (st.error is not None or not masks[b].any()):  # [structured]
                seq.error = st.error or "the grammar allows no token here"
                self._finish(seq, "error")
            else:
                live.append(b)
        host = logits if type(logits) is np.ndarray else None   # a host backend's (no rows gathered for it)

        def on_device(rows: list[int], bs: list[int]) -> list[SampleResult | Exception] | None:
            """The tokens of logits' rows (row r by sequence bs[r]'s sampler) chosen by a
            device backend, or None: the host samples them (the logits copied back once)."""
            nonlocal host
            if host is not None:
                return None
            every_row = rows == list(range(int(logits.shape[0])))
            got = self.runner.sample(logits, [sampled[b].sampler for b in bs],   # [runner]
                                     None if masks is None else [masks[b] for b in bs], None if every_row else rows)
            if got is None:
                host = self.runner.to_host(logits)
            return got

        every: dict[int, SampleResult | Exception] | None = None
        if masks is None and all(sampled[b].sampler.argmax_choice for b in live):
            rows = [starts[b] + i for b in live for i in range(1 + len(guesses[b]))]
            got = on_device(rows, [b for b in live for _ in range(1 + len(guesses[b]))])
            every = None if got is None else dict(zip(rows, got))
        i, active = 0, live
        while active:
            rows = [starts[b] + i for b in active]
            got = [every[r] for r in rows] if every is not None else on_device(rows, active)
            going: list[int] = []
            for k, b in enumerate(active):
                seq = sampled[b]
                try:
                    if got is None:
                        assert host is not None   # on_device declined and copied the logits back
                        res = seq.sampler.sample(host[rows[k]], None if masks is None else masks[b])
                    else:
                        res = _row_result(got, k, seq.sampler, None, None)
                    self._append(seq, res)
                except Exception as e:  # noqa: BLE001 - the request's failure, reported on it
                    seq.error = f"sampling failed: {type(e).__name__}: {e}"
                    self._finish(seq, "error")
                    continue
                if seq.status is SeqStatus.FINISHED or i == len(guesses[b]) or int(res.token_id) != guesses[b][i]:
                    continue
                kept[b] += 1
                going.append(b)
            i, active = i + 1, going
        for b, seq in enumerate(sampled):
            if guesses[b]:
                self.stats["spec_checks"] += 1
                self.stats["spec_proposed_tokens"] += len(guesses[b])
                self.stats["spec_accepted_tokens"] += kept[b]
            if seq.status is not SeqStatus.FINISHED:
                seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
                self.blocks.truncate(seq.request_id, seq.num_tokens)
                if guesses[b]:
                    self.spec.verified(seq.request_id, len(guesses[b]), kept[b], seq.num_tokens - 1)
            if seq.status is SeqStatus.FINISHED or (seq.pending_ids and seq.deltas):
                outputs.append(seq.take_output())

    # -- [structured] constrained decoding (ellm.engine.structured) -------------------

    def prepare_constraints(self, params: SamplingParams | None = None) -> None:
        """Builds llguidance's view of the tokenizer now (any thread may call this), so the
        first constrained request does not pay for it (seconds for a 262k vocabulary) on
        the engine thread while other requests wait; with params, the matcher of their
        constraint too (the engine thread then only copies it). A constraint this
        tokenizer cannot use is a RequestError."""
        from . import structured

        tok = structured.llg_tokenizer(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
        if params is not None and params.constraint is not None:
            try:
                structured.prepare_matcher(tok, params.constraint[1])
            except ValueError as e:
                raise RequestError(f"{params.constraint[0]}: {e}") from None

    def _grammar_state(self, params: SamplingParams) -> Any:
        """A fresh matcher for a constrained request, else None."""
        if params.constraint is None:
            return None
        from . import structured  # llguidance loads only once a constraint is used

        vocab = self.model.config.vocab_size
        tok = structured.llg_tokenizer(self.tokenizer, vocab, self.eos_ids)
        try:
            state = structured.GrammarState(tok, params.constraint[1])
        except ValueError as e:
            raise RequestError(f"{params.constraint[0]}: {e}") from None
        if self._masks is None:
            self._masks = structured.MaskFiller(vocab)
        return state

    def _drop_failed_grammars(self, sampled: list[Sequence], logits: Any, masks: list[Any],
                              outputs: list[RequestOutput], batched: list[Any] | None
                              ) -> tuple[list[Sequence], Any, list[Any], list[Any] | None]:
        """Finishes (reason "error") the sequences whose matcher failed (a grammar past
        llguidance's limits) or allows no token; the rest of the batch goes on. batched:
        the device's tokens, if it sampled (then logits stay on the device, unsliced)."""
        keep = []
        for b, seq in enumerate(sampled):
            st = seq.grammar
            if st is not None and (st.error is not None or not masks[b].any()):
                seq.error = st.error or "the grammar allows no token here"
                self._finish(seq, "error")
                outputs.append(seq.take_output())
            else:
                keep.append(b)
        if len(keep) == len(sampled):
            return sampled, logits, masks, batched
        if batched is not None:
            return [sampled[b] for b in keep], logits, [masks[b] for b in keep], [batched[b] for b in keep]
        return [sampled[b] for b in keep], logits[keep], [masks[b] for b in keep], None

    def _emit(self, seq: Sequence, text: str) -> None:
        seq.text += text
        seq.pending_text += text

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if self.spec is not None:  # [spec]
            self.spec.release(seq.request_id)

    # -- direct model access ----------------------------------------------------------

    def _check_ids(self, ids: list[int], what: str) -> None:
        n = len(ids)
        if n == 0:
            raise RequestError(f"{what} needs at least one token")
        if n > self.cfg.max_model_len:
            raise RequestError(f"{n} tokens exceed the context of {self.cfg.max_model_len}")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")

    def _prefill_rows(self, ids: list[int], width: int, hidden_only: bool) -> np.ndarray:
        """Every position's logits (or final hidden states) of one prompt, in prefill chunks,
        on blocks of its own that are freed before returning."""
        key = ("direct", next(self._ids))
        n = len(ids)
        out = np.empty((n, width), np.float32)
        try:
            if not self.blocks.allocate(key, n):
                raise RequestError(f"{n} tokens do not fit in the KV cache")
            chunk = self.cfg.max_batch_tokens
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                self.blocks.release_out_of_window(key, s)
                tables = {w: np.asarray([self.blocks.table(key, w)], np.int32) for w in self.kv.windows}
                batch = Batch.single(np.asarray(ids[s:e], np.int32), s, tables, all_logits=True)
                out[s:e] = self.runner.forward(batch, hidden_only=hidden_only)   # [runner]
        finally:
            self.blocks.free(key)
        return out

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of ids (vocab per row), computed in prefill chunks."""
        ids = [int(t) for t in ids]
        self._check_ids(ids, "logits()")
        return self._prefill_rows(ids, self.model.config.vocab_size, hidden_only=False)

    def embed(self, prompts: list[list[int]], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """One vector per prompt, (len(prompts), hidden_size) float32: the final-normed hidden
        states of its tokens pooled (POOLINGS), L2-normalised when normalize. Prompts that
        fit in one forward (max_batch_tokens) together run as one batch; a longer one runs
        alone in chunks. A prompt's vector does not depend on the others (batch invariance)."""
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(prompts):
            try:
                self._check_ids(p, "an embedding input")
            except RequestError as e:
                raise RequestError(f"input {i}: {e}") from None
        hidden = self.model.config.hidden_size
        out = np.empty((len(prompts), hidden), np.float32)
        budget = self.cfg.max_batch_tokens
        i = 0
        while i < len(prompts):
            j, size = i, 0
            while j < len(prompts) and (j == i or size + len(prompts[j]) <= budget):
                size += len(prompts[j])
                j += 1
            if size > budget:   # one long prompt: chunked prefill
                out[i] = _pool(self._prefill_rows(prompts[i], hidden, hidden_only=True), pooling)
            else:
                for k, rows in enumerate(self._hidden_batch(prompts[i:j])):
                    out[i + k] = _pool(rows, pooling)
            i = j
        if normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            np.divide(out, np.maximum(norms, np.float32(1e-12)), out=out)
        return out

    def _hidden_batch(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Final hidden states of every token of several short prompts, in one forward."""
        keys = [("direct", next(self._ids)) for _ in prompts]
        try:
            for key, p in zip(keys, prompts):
                if not self.blocks.allocate(key, len(p)):
                    raise RequestError(f"{sum(map(len, prompts))} tokens do not fit in the KV cache now")
            token_ids = np.concatenate([np.asarray(p, np.int32) for p in prompts])
            positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
            seq_ids = np.concatenate([np.full(len(p), b, np.int32) for b, p in enumerate(prompts)])
            tables = {}
            for w in self.kv.windows:
                rows = [self.blocks.table(key, w) for key in keys]
                arr = np.full((len(keys), max(map(len, rows))), -1, np.int32)
                for b, tbl in enumerate(rows):
                    arr[b, :len(tbl)] = tbl
                tables[w] = arr
            batch = Batch(token_ids, positions, seq_ids, tables, np.arange(len(token_ids), dtype=np.int32))
            h = self.runner.forward(batch, hidden_only=True)   # [runner]
            bounds = np.cumsum([0] + [len(p) for p in prompts])
            return [np.array(h[bounds[b]:bounds[b + 1]]) for b in range(len(prompts))]
        finally:
            for key in keys:
                self.blocks.free(key)


def _pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "mean":
        return rows.mean(axis=0, dtype=np.float64).astype(np.float32)
    return rows[-1] if pooling == "last" else rows[0]
