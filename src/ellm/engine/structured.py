"""Constrained decoding on llguidance: a grammar per request, a matcher per sequence, and
the batch's allowed-token masks computed while the forward pass runs.

Three pieces:
  compile_constraint(kind, value)  SamplingParams' json_schema / regex / choice / grammar
                  -> an llguidance grammar (a string), checked once; a bad schema, regex or
                  grammar is a ValueError that names the field and llguidance's message.
  GrammarState    one sequence's LLMatcher: advanced with every sampled token, `done` once
                  the grammar can take nothing but EOS.
  MaskFiller      one per engine: fills the int32 bitmask rows of a batch's constrained
                  sequences with llguidance's parallel fill (it releases the GIL) in a
                  worker thread, started before model.forward and joined after, so the mask
                  work runs beside the forward pass instead of after it.

The mask layout is llguidance's: token i is bit i % 32 of int32 word i // 32; the sampler
applies it in C (csrc/sample.h, ellm_mask_apply_f32). EOS bits are set only where the
grammar may end, so a constrained sequence ends by EOS only on a complete output.

Preemption needs no rollback here: the scheduler keeps a preempted sequence's output ids
and recomputes their K/V, so the matcher (which follows the output ids, not the cache)
stays right (tests/test_structured.py forces preemptions and checks the outputs). A path
that cuts output ids (speculative decoding) must call matcher.rollback(n) with them.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from .constraint_bounds import CONSTRAINT_FIELDS, MAX_SCHEMA_DEPTH, check_constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions   # a TypedDict of llguidance's stubs only

# JSON is generated compactly, spaced as json.dumps spaces it: a free-whitespace JSON
# grammar lets a small model emit newlines until max_tokens. A schema's own "x-guidance"
# options still override these.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_dict(schema: Any) -> dict[str, Any]:
    """A JSON schema as a dict, from a dict, a JSON string, or a pydantic model class (or
    anything else with model_json_schema()); a ValueError names what is wrong."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"json_schema is nested more than {MAX_SCHEMA_DEPTH} levels deep (the limit)") from None
    if not isinstance(schema, dict):
        raise ValueError("json_schema must be a dict, a JSON string or a pydantic model class, "
                         f"got {type(schema).__name__}")
    return schema


# Compiled constraints, newest last: a request's constraint is checked by the server,
# then again by SamplingParams, and once more per choice (dataclasses.replace validates
# anew); the second and later compiles of the same value are a dict lookup.
_COMPILED: OrderedDict[tuple[str, str], str] = OrderedDict()
_COMPILED_KEEP = 64
_COMPILED_LOCK = threading.Lock()


# Keywords whose values are data, not schemas: never rewritten (strict_objects, and the
# reference rewriting of ellm.server.tools).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required"})
# Keywords whose values map names to schemas.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def strict_objects(schema: Any) -> Any:
    """schema with additionalProperties: false on every object schema, at every level,
    that names its properties and says nothing of others (OpenAI's strict mode), so a
    constrained output holds only the declared keys. Branches of an allOf (which add up
    to one object) and objects with an allOf are left open."""
    def walk(node: Any, in_all_of: bool = False) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k in DATA_KEYWORDS:
                out[k] = v
            elif k in SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            elif k == "allOf" and isinstance(v, list):
                out[k] = [walk(x, in_all_of=True) for x in v]
            else:
                out[k] = walk(v)
        kind = out.get("type", "object")
        if ("properties" in out and not in_all_of and "allOf" not in out and "additionalProperties" not in out
                and "unevaluatedProperties" not in out and (kind == "object" or
                                                          (isinstance(kind, list) and "object" in kind))):
            out["additionalProperties"] = False
        return out
    return walk(schema)


def compile_constraint(kind: str, value: Any) -> str:
    """The llguidance grammar for one constraint field, validated (without a tokenizer).
    kind is one of CONSTRAINT_FIELDS; value is already normalised by SamplingParams.
    The value is measured against constraint_bounds' limits first (a ValueError naming
    the limit), so llguidance never sees one that could overflow its stack or take
    minutes. A value compiled recently is not compiled again."""
    try:
        check_constraint(kind, value)
    except ValueError as e:
        raise ValueError(f"{kind}: {e}") from None
    key = (kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True))
    with _COMPILED_LOCK:
        grammar = _COMPILED.get(key)
        if grammar is not None:
            _COMPILED.move_to_end(key)
            return grammar
    grammar = _compile(kind, value)
    with _COMPILED_LOCK:
        _COMPILED[key] = grammar
        while len(_COMPILED) > _COMPILED_KEEP:
            _COMPILED.popitem(last=False)
    return grammar


def _compile(kind: str, value: Any) -> str:
    try:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_DEFAULTS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(choice_regex(value))
        elif kind == "grammar":  # Lark, or GBNF (llguidance converts it to Lark)
            grammar = llguidance.grammar_from("grammar", value)
        else:
            raise ValueError(f"unknown constraint {kind!r}; known: {', '.join(CONSTRAINT_FIELDS)}")
    except ValueError as e:
        raise ValueError(f"{kind} is invalid: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{kind} is invalid: {messages[0] if messages else 'rejected by llguidance'}")
    return grammar


# Characters that mean something in llguidance's (Rust) regex syntax, escaped in a literal.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    return "".join(f"\\{ch}" if ch in _REGEX_META else (f"\\x{{{ord(ch):x}}}" if ord(ch) < 32 else ch)
                   for ch in text)


# Groups nested deeper than this in a choice regex (options that are prefixes of each
# other, many levels down) go back to one alternative per option.
_CHOICE_TRIE_DEPTH = 64


def choice_regex(options: list[str]) -> str:
    """One regex matching exactly the options, factored by common prefix (a trie), so the
    lexer's work grows with the options' total size: one alternative per option (as
    llguidance's own choice grammar has it) costs time quadratic in their number (20,000
    options ~3 s, against ~0.2 s for this). Built without recursion; a trie whose groups
    would nest past _CHOICE_TRIE_DEPTH gives the flat alternation instead."""
    root: dict[str, Any] = {}
    for option in dict.fromkeys(options):
        node = root
        for ch in option:
            node = node.setdefault(ch, {})
        node[""] = {}   # an option ends here
    # post-order over the trie with an explicit stack; each node's regex from its children's
    done: dict[int, str] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[dict[str, Any], bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for key, child in node.items() if key)
            continue
        ends = "" in node
        branches = [_regex_literal(key) + done.pop(id(child)) for key, child in sorted(node.items()) if key]
        below = max((depth.pop(id(child)) for key, child in node.items() if key), default=0)
        # a single child path is a plain run of literals, no group
        if not branches:
            body = ""
        elif len(branches) == 1 and not ends:
            body = branches[0]
        else:
            body = "(" + "|".join(branches) + ")" + ("?" if ends else "")
            below += 1
        if below > _CHOICE_TRIE_DEPTH:
            return "|".join(_regex_literal(o) for o in dict.fromkeys(options))
        done[id(node)], depth[id(node)] = body, below
    return done[id(root)]


# One LLTokenizer per (ellm Tokenizer, vocab size, EOS ids): building one reads the whole
# vocabulary (about 1 s for SmolLM2's 49k tokens, a few s for Gemma's 262k), so it is built
# on the first constrained request and kept as long as the Tokenizer lives.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = \
    weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: frozenset[int] | list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of an ellm Tokenizer. Both kinds of ellm tokenizer (a folder's
    tokenizer.json and one rebuilt from a GGUF vocabulary) hold a Hugging Face `tokenizers`
    backend, whose JSON llguidance reads (byte-level BPE and SentencePiece byte-fallback
    alike). vocab_size is the model's logits width (it may exceed the tokenizer's)."""
    key = (int(vocab_size), tuple(sorted(int(t) for t in eos_ids)))
    with _TOKENIZERS_LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        built = per.get(key)
        if built is None:
            built = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=key[0],
                                           eos_token=list(key[1]) or None)
            per[key] = built
        return built


# One fresh matcher per (tokenizer, grammar), copied for each sequence: building one
# compiles the grammar's lexer against the vocabulary (up to seconds for a large grammar),
# a copy is cheap. The server builds it in its constraint threads (prepare_matcher), so the
# engine thread only copies.
_MATCHERS: OrderedDict[tuple[int, str], tuple[Any, llguidance.LLMatcher]] = OrderedDict()
_MATCHERS_KEEP = 32
_MATCHERS_LOCK = threading.Lock()


def prepare_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """The fresh matcher of a grammar for a tokenizer, built once (any thread); a
    ValueError when the grammar cannot be used with it."""
    key = (id(tokenizer), grammar)
    with _MATCHERS_LOCK:
        got = _MATCHERS.get(key)
        if got is not None and got[0] is tokenizer:
            _MATCHERS.move_to_end(key)
            return got[1]
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the constraint cannot be used with this tokenizer: {matcher.get_error()}")
    with _MATCHERS_LOCK:
        _MATCHERS[key] = (tokenizer, matcher)
        while len(_MATCHERS) > _MATCHERS_KEEP:
            _MATCHERS.popitem(last=False)
    return matcher


class GrammarState:
    """One sequence's matcher. num_tokens counts the output tokens it has consumed."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = prepare_matcher(tokenizer, grammar).deep_copy()
        self.num_tokens = 0

    def advance(self, token_id: int) -> bool:
        """Consumes a sampled token; False when the matcher refused it (it is then in error)."""
        ok = self.matcher.consume_token(int(token_id))
        if ok:
            self.num_tokens += 1
        return ok

    @property
    def done(self) -> bool:
        """The grammar can take no more tokens (EOS aside): the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class PendingMasks:
    """Masks being filled in the worker thread; wait() joins it."""

    def __init__(self, future: Future[None], rows: list[np.ndarray | None]) -> None:
        self._future, self._rows = future, rows

    def wait(self) -> list[np.ndarray | None]:
        """Per batch row: its int32 mask row, or None for an unconstrained sequence."""
        self._future.result()
        return self._rows


class MaskFiller:
    """Fills a batch's grammar masks beside the forward pass (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        self.words = (int(vocab_size) + 31) // 32
        self._buf = np.empty((0, self.words), np.int32)
        # the thread that fills the masks and llguidance's pool it fills them on, made together
        self._workers: tuple[ThreadPoolExecutor, llguidance.LLExecutor] | None = None

    def start(self, states: list[GrammarState | None]) -> PendingMasks | None:
        """Starts filling the masks of the constrained rows; None when there are none (the
        unconstrained path pays nothing)."""
        todo = [(st.matcher, i) for i, st in enumerate(states) if st is not None]
        if not todo:
            return None
        if self._workers is None:
            self._workers = (ThreadPoolExecutor(1, thread_name_prefix="ellm-grammar-masks"), llguidance.LLExecutor())
        pool, executor = self._workers
        if len(self._buf) < len(states):  # grows by doubling, kept across steps
            self._buf = np.empty((max(len(states), 2 * len(self._buf)), self.words), np.int32)
        buf = self._buf[:len(states)]
        rows: list[np.ndarray | None] = [buf[i] if st is not None else None for i, st in enumerate(states)]
        future = pool.submit(llg_numpy.fill_next_token_bitmask_par, executor, todo, buf)
        return PendingMasks(future, rows)

    def close(self) -> None:
        if self._workers is not None:
            self._workers[0].shutdown(wait=True)
            self._workers = None
