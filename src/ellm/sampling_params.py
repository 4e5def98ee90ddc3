"""SamplingParams: how one request is decoded (randomness, length, stops, penalties, logprobs).

Field names and meanings follow vLLM and the OpenAI API so that the server can pass a
request's fields straight through. Every field is checked in __post_init__; a bad value is
a ValueError that names the field and the allowed range. The sampler that applies these
lives in ellm.engine.sampler (its module docstring gives the order of operations).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# Below this a temperature is treated as 0 (greedy), as vLLM does: dividing logits by a
# denormal-small temperature would only produce infinities.
GREEDY_EPS = 1e-5
# The most top logprobs a token may return (OpenAI's top_logprobs limit, vLLM's default).
MAX_LOGPROBS = 20
# OpenAI's limit on completions per request (each one is a sequence in the engine).
MAX_N = 128
# OpenAI's ranges for these fields.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Limits of what the float32 sampling kernels can represent (engine/sampler.py):
# - 1 / temperature is passed to C as a float32 scale; above this temperature it is a
#   subnormal and then 0 (float32's smallest normal is 1.18e-38).
MAX_TEMPERATURE = 8.5e37
# - top-p computes 1 - top_p in float64, which rounds to 1 below ~1.1e-16 and leaves an
#   empty nucleus; any top_p this small keeps only the most likely token anyway.
MIN_TOP_P = 1e-9
# - the repetition penalty divides / multiplies float32 logits: within this range every
#   logit a model produces (|x| < 1e32) stays finite, so the sampler never sees inf or NaN.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _is_int(v: Any) -> bool:
    # bool is an int subclass; True as a token count is a bug, not a 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float (a JSON number of 400 digits)
        return False


def check_token_ids(ids: Any, vocab_size: int, what: str = "prompt") -> list[int]:
    """`ids` as a list of Python ints, each in [0, vocab_size); ValueError naming the
    first bad one otherwise. Booleans are refused (True is an int to Python, but a token
    id of True is a bug in the caller); numpy integers are accepted."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{what} token ids must be a list of ints, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{what} token id #{i} is {t!r} ({type(t).__name__}), not an int")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} token id {t} is outside the vocabulary (size {vocab_size})")
        out.append(t)
    return out


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    max_tokens: most tokens to generate (None: until EOS or the context is full); >= 1.
    temperature: in [0, 8.5e37]; 0 (or below 1e-5) is greedy decoding.
    top_p: nucleus mass in [1e-9, 1]; 1 is off.
    top_k: keep the k most likely tokens; 0 or -1 is off.
    min_p: drop tokens whose probability is below min_p * the top probability; [0, 1].
    repetition_penalty: in [1e-6, 1e6]; for every token in the prompt or the output, a positive logit
        is divided by it and a negative one multiplied (HF/vLLM). 1 is off.
    frequency_penalty, presence_penalty: [-2, 2]; subtract penalty * count (frequency) or
        penalty once (presence) for tokens in the generated output only (OpenAI).
    seed: any int; a seeded request draws the same tokens whatever batch it runs in.
    stop: strings that end the output (not included unless include_stop_str_in_output);
        a single string is accepted; normalised to a list.
    stop_token_ids: token ids that end the output besides EOS; normalised to a list.
    ignore_eos: keep going past the model's EOS tokens.
    logit_bias: token id -> bias in [-100, 100] added to its logit. Keys may be decimal
        strings (as OpenAI's JSON sends them); they are normalised to int.
    logprobs: None, or how many top logprobs to return per token, 0..20 (0: only the
        chosen token's logprob).
    n: how many completions per prompt; 1..128.
    skip_special_tokens: leave special tokens out of the text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.

    Constrained decoding (at most one of these; see ellm.engine.structured): the output
    always matches it, and EOS is allowed only where it may end.
    json_schema: a JSON schema (a dict, a JSON string, or a pydantic model class, whose
        model_json_schema() is used); normalised to a dict. {"type": "object"} is any
        JSON object.
    regex: a regular expression the whole output matches (Rust regex syntax: \\d and \\w
        are Unicode-aware, as in Python's re).
    choice: a non-empty list of strings; the output is exactly one of them.
    grammar: a Lark or GBNF (llama.cpp) grammar; its start rule is `start` (Lark) or
        `root` (GBNF).
    An invalid schema, regex or grammar is a ValueError naming the field and the error.
    """

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_schema: dict[str, Any] | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if not (_is_real(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not (_is_real(self.top_p) and MIN_TOP_P <= self.top_p <= 1):
            raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self.min_p = float(self.min_p)
        lo, hi = REPETITION_PENALTY_RANGE
        if not (_is_real(self.repetition_penalty) and lo <= self.repetition_penalty <= hi):
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")
        self.repetition_penalty = float(self.repetition_penalty)
        lo, hi = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (_is_real(v) and lo <= v <= hi):
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}")
            setattr(self, name, float(v))
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not (_is_int(self.n) and 1 <= self.n <= MAX_N):
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        self._check_constraint()

    # -- constrained decoding -------------------------------------------------------------

    def _check_constraint(self) -> None:
        from .engine.constraint_bounds import CONSTRAINT_FIELDS

        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"only one constraint may be given at a time, got {' and '.join(given)}")
        self._constraint: tuple[str, str] | None = None
        if not given:
            return
        from .engine import structured  # llguidance (2 MB of RSS) loads only once a constraint is set
        kind = given[0]
        if kind == "json_schema":
            self.json_schema = structured.schema_dict(self.json_schema)
            value: Any = self.json_schema
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, str) and x for x in c):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {c!r}")
            self.choice = value = list(c)
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
        self._constraint = (kind, structured.compile_constraint(kind, value))

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(the field that constrains the output, its compiled llguidance grammar), or None."""
        return self._constraint

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain the empty string (it would match at once)")
        return list(stop)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
        return list(ids)

    @staticmethod
    def _check_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be None or a dict {{token id: bias}}, got {bias!r}")
        lo, hi = LOGIT_BIAS_RANGE
        out: dict[int, float] = {}
        for k, v in bias.items():
            if isinstance(k, str) and k.strip().isdigit():
                k = int(k)
            if not (_is_int(k) and k >= 0):
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {k!r}")
            if not (_is_real(v) and lo <= v <= hi):
                raise ValueError(f"logit_bias values must be in [{lo:g}, {hi:g}], got {v!r} for token {k}")
            out[k] = float(v)
        return out

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0, or top_k 1)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @classmethod
    def from_kwargs(cls, params: SamplingParams | None = None, **kwargs: Any) -> SamplingParams:
        """params (or the defaults) with kwargs overriding fields; the result is validated
        again. An unknown keyword is a TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in kwargs if k not in names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        if params is None:
            return cls(**kwargs)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        return dataclasses.replace(params, **kwargs)
