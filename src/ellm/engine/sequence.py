"""One request's state as the engine runs it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from ..sampling_params import SamplingParams

# why a sequence ended (server.responses.FinishReason adds the API's "tool_calls")
FinishReason = Literal["stop", "length", "abort", "error"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), plus its totals so far."""
    request_id: str
    new_text: str
    new_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None             # why, when finish_reason is "error"


# eq=False: a sequence is itself, not its field values (the scheduler's `in` and remove()
# on its lists then compare identities instead of building two tuples of every field)
@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Any
    detok: Any
    stopper: Any
    arrival: int
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0        # tokens whose K/V are in the cache
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # False: the caller reads only the end (generate()): no output until the sequence
    # finishes, whose deltas then hold all of it (taking the totals every step is O(length))
    deltas: bool = True
    grammar: Any = None          # a structured.GrammarState when the output is constrained
    error: str | None = None     # why the sequence finished with reason "error"
    draft_ids: list[int] = field(default_factory=list)  # [spec] guesses checked this step
    # [vision] the request's images, where their tokens sit in the prompt ((M,) int32,
    # ascending), their rows once encoded ((M, H) f32, dropped when the prompt is done),
    # and the prompt as the prefix cache sees it (image tokens keyed by image content)
    images: list[Any] = field(default_factory=list)
    image_positions: Any = None
    image_rows: Any = None
    image_keys: list[Any] | None = None
    # [vision] models with bidirectional images (Gemma 3): each image token's last visible
    # position ((M,) int32, the end of its run of image tokens), and those runs as
    # [start, end) positions, which a prefill chunk must not cut; None otherwise
    image_limits: Any = None
    image_spans: list[tuple[int, int]] | None = None
    # [lora] the LoRA adapter's slot in model.lora (-1: the base alone), and what its
    # prefix-cache hash chain starts from (0 for the base: blocks of different adapters
    # hold different K/V and are never shared)
    adapter_slot: int = -1
    prefix_salt: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """(all_ids + draft_ids)[start:start + n], without building the whole list."""
        p, o, end = len(self.prompt_ids), len(self.output_ids), start + n
        if end <= p:
            return self.prompt_ids[start:end]
        ids = self.prompt_ids[start:] if start < p else []
        ids = ids + self.output_ids[max(start - p, 0):end - p]
        if end > p + o and self.draft_ids:   # [spec]
            ids += self.draft_ids[max(start - p - o, 0):end - p - o]
        return ids

    @property
    def prefix_keys(self) -> list[Any]:
        """What the prefix cache hashes: the ids, an image token as (id, image hash, index)."""
        return (self.image_keys or self.prompt_ids) + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def take_output(self) -> RequestOutput:
        out = RequestOutput(self.request_id, self.pending_text, self.pending_ids, self.text,
                            list(self.output_ids), self.status is SeqStatus.FINISHED,
                            self.finish_reason, self.prompt_ids, self.pending_logprobs,
                            self.num_cached_tokens, self.error)
        self.pending_text, self.pending_ids, self.pending_logprobs = "", [], []
        return out
