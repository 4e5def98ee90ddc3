"""Continuous batching policy: who runs in the next step, with how many tokens.

Pure Python, no arrays. Each step has a token budget. Sequences already decoding get one
token each first (so streams never stall behind a long prompt), then prompts are
prefilled in chunks with what is left, then waiting requests are admitted. When the KV
cache runs out of blocks, the most recently admitted sequence not yet in this step's plan
is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later. A sequence already planned is never the victim (its blocks are about to
be read by the step's forward); when only planned sequences are left, the one asking for
room steps aside itself.
"""
from __future__ import annotations

from collections import deque

from .kv_cache import BlockManager
from .sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, n_tokens: int, planned: set[int]) -> bool | None:
        """Gets blocks for seq to hold n_tokens, preempting later arrivals if needed.
        -> True (it has them), False (it cannot fit even alone) or None (it was preempted
        itself, every other running sequence being already planned for this step).
        planned: id() of the sequences in this step's plan, which are never victims."""
        while not self.blocks.allocate(seq.request_id, n_tokens):
            victims = [s for s in self.running if s is not seq and id(s) not in planned]
            if victims:
                self._preempt(max(victims, key=lambda s: s.arrival))
                continue
            if len(self.running) > 1:
                self._preempt(seq)
                return None
            return False
        return True

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """-> ([(sequence, tokens to compute)], [sequences that can never fit])."""
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        too_big: list[Sequence] = []
        planned: set[int] = set()
        preempted_before = self.num_preemptions
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget == 0:
                break
            # preempted while growing another (a list scan, so only once someone was)
            if self.num_preemptions != preempted_before and seq not in self.running:
                continue
            n = 1 if not seq.in_prefill else _chunk(seq, budget)
            if n == 0:   # [vision] the next image does not fit in what is left of this step
                continue
            grown = self._grow(seq, seq.num_computed + n, planned)
            if grown is None:
                continue
            if not grown:
                too_big.append(seq)
                continue
            plan.append((seq, n))
            planned.add(id(seq))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_id not in self.blocks.tables:
                seq.num_computed = self.blocks.match_prefix(seq.request_id, seq.prefix_keys,  # [vision] keys
                                                             seq.prefix_salt)   # [lora]
                seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
            n = _chunk(seq, budget)
            if n == 0:   # [vision] its next image waits for a step with room for all of it
                break
            if not self.blocks.allocate(seq.request_id, seq.num_computed + n):
                if not self.running and not plan:
                    self.waiting.popleft()
                    too_big.append(seq)
                    continue
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan, too_big


def _chunk(seq: Sequence, budget: int) -> int:
    """Tokens of seq to prefill now, at most budget. [vision] A chunk never ends inside a
    run of image tokens that attend to each other (seq.image_spans): it stops before the
    run, or, starting at or inside it, reaches its end or waits (0)."""
    start = seq.num_computed
    n = min(seq.num_tokens - start, budget)
    end = start + n
    for s, e in seq.image_spans or ():
        if s < end < e:
            if start < s:
                return s - start
            return e - start if e - start <= budget else 0
    return n
