"""Rebuild a Hugging Face `tokenizers` tokenizer from the vocabulary stored in a GGUF file.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys: the token
strings, their types, and either the BPE merges (byte-level vocabularies) or per-token
scores (SentencePiece vocabularies). From those we build the same tokenizer transformers
builds when it loads the file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so
that token ids agree with that reference, with one deliberate exception:

* A "smollm" (or "starcoder") byte-level vocabulary gets the pre-tokenizer it was trained
  with -- every digit split off on its own, then GPT-2's byte-level split -- which is what
  the model's own tokenizer.json declares and what llama.cpp applies. transformers knows no
  split for these names and falls back to plain GPT-2 splitting, which differs only where
  whitespace runs meet digits ("\\n\\n1", "a  1").

SentencePiece vocabularies without merges (Gemma) need their merges recovered from the
vocabulary; `derive_merges` does that in vectorised numpy (0.9 s of CPU for Gemma's 262k
tokens) and keeps the result in ellm's cache for the next load, so later loads spend their
time inside `tokenizers` itself (about 0.7 s).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The published split patterns of byte-level vocabularies whose `tokenizer.ggml.pre` names
# one; anything else gets GPT-2's own split (ByteLevel with use_regex), as in transformers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies trained with every digit isolated before the GPT-2 split.
_DIGIT_SPLIT = frozenset({"smollm", "starcoder"})


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _valid_tokens(tokens: Sequence[str]) -> list[str]:
    """The GGUF reader keeps bytes that are not UTF-8 as lone surrogates (surrogateescape),
    which cannot cross into Rust; spell those tokens with U+FFFD instead."""
    out = list(tokens)
    try:
        "".join(out).encode("utf-8")  # one pass over the whole vocabulary: the usual case
        return out
    except UnicodeEncodeError:
        pass
    for i, t in enumerate(out):
        if not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                out[i] = t.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return out


# ---------------------------------------------------------------------------------------
# Merges recovered from a vocabulary
# ---------------------------------------------------------------------------------------

def derive_merges(tokens: Sequence[str], scores: np.ndarray | None = None, *,
                  cache: Path | None = None) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every way of cutting a token into two halves that are both tokens is a merge. Merges
    rank by the merged token's score (higher first; without scores, earlier in the vocabulary
    first), then by longer left half, then longer right half -- the order transformers'
    `generate_merges` gives, so the BPE model behaves identically.

    cache: a folder that keeps each vocabulary's merges (as token ids, named by a hash of
    the tokens and scores) for the next load: Gemma 3's take 0.9 s to derive and a few
    milliseconds to read back. A cache file that cannot be read or written, or does not
    hold ids of this vocabulary, is derived again.
    """
    tokens = list(tokens)
    max_len = max(map(len, tokens), default=0)
    # The hashed path needs distinct tokens; a 64-bit polynomial hash is also only trusted
    # for strings far shorter than the lengths at which known mod-2^64 collisions start.
    if len(set(tokens)) != len(tokens) or max_len > 1024:
        return _derive_merges_plain(tokens, scores)
    path = None if cache is None else cache / f"merges-{_vocabulary_digest(tokens, scores)}.npy"
    pairs = None if path is None else _read_merge_ids(path, len(tokens))
    if pairs is None:
        pairs = _merge_ids(tokens, scores)
        if path is not None:
            _write_merge_ids(path, pairs)
    # Gathering through an object array keeps the 2 x 515k string look-ups in C.
    table = np.empty(len(tokens), dtype=object)
    table[:] = tokens
    return list(zip(table[pairs[:, 0]].tolist(), table[pairs[:, 1]].tolist()))


def _merge_ids(tokens: list[str], scores: np.ndarray | None) -> np.ndarray:
    """derive_merges' merges as (left id, right id) rows, best first (distinct tokens)."""
    left, right, merged, left_len = _split_pairs(tokens)
    if scores is not None:
        s = np.asarray(scores, dtype=np.float64)[merged]
        right_len = np.fromiter(map(len, tokens), np.int64, len(tokens))[merged] - left_len
        # lexsort is stable and sorts by its last key first: score, then the halves' lengths.
        order = np.lexsort((-right_len, -left_len, -s))
        left, right = left[order], right[order]
    return np.stack([left, right], axis=1).astype(np.int32)


# Bumped whenever derive_merges' order changes, so older cache files are not read.
_MERGES_FORMAT = b"ellm derived merges 1"


def _vocabulary_digest(tokens: list[str], scores: np.ndarray | None) -> str:
    h = hashlib.sha256(_MERGES_FORMAT)
    h.update(np.fromiter(map(len, tokens), np.int64, len(tokens)).tobytes())   # where each token ends
    h.update("".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(b"no scores" if scores is None else np.asarray(scores, np.float64).tobytes())
    return h.hexdigest()[:40]


def _read_merge_ids(path: Path, n_tokens: int) -> np.ndarray | None:
    try:
        pairs = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if pairs.dtype != np.int32 or pairs.ndim != 2 or pairs.shape[1] != 2:
        return None
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n_tokens):
        return None
    return pairs


def _write_merge_ids(path: Path, pairs: np.ndarray) -> None:
    """Written to a temporary name and renamed, so a reader never sees half a file. A cache
    that cannot be written (a read-only home, a full disk) costs the next load the
    derivation again, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".merges-", suffix=".npy", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, pairs, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _split_pairs(tokens: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(left id, right id, merged id, left length) for every split of every token into two
    tokens, ordered by merged id and then by longer left half first.

    Substrings are compared by a rolling polynomial hash over the vocabulary's code points
    (all tokens concatenated), so the ~1.2M candidate halves of a 262k vocabulary are looked
    up in numpy rather than one Python dict probe at a time.
    """
    n = len(tokens)
    lens = np.fromiter(map(len, tokens), np.int64, n)
    ends = np.cumsum(lens)
    starts = ends - lens
    codes = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    total = len(codes)

    base = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2**64
    inv = np.uint64(pow(int(base), -1, 1 << 64))
    with np.errstate(over="ignore"):
        pw = np.full(total + 1, base, np.uint64)
        pw[0] = 1
        pw = np.cumprod(pw, dtype=np.uint64)  # pw[i] = base**i
        ipw = np.full(total + 1, inv, np.uint64)
        ipw[0] = 1
        ipw = np.cumprod(ipw, dtype=np.uint64)  # ipw[i] = base**-i
        prefix = np.zeros(total + 1, np.uint64)  # (total+1,) sum of (c+1)*base**-i before i
        np.cumsum((codes + np.uint64(1)) * ipw[:total], out=prefix[1:])

    def substring_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # hash of codes[a:b] = sum (c_i+1) * base**(b-1-i), mixed with the length and a
        # final avalanche step so that the low bits (the table slot) are well spread.
        with np.errstate(over="ignore"):
            x = (prefix[b] - prefix[a]) * pw[b - 1] + (b - a).astype(np.uint64) * np.uint64(0x632BE59BD9B4E019)
            x ^= x >> np.uint64(31)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(29)
        return x

    table = _HashTable(substring_hash(starts, ends))

    n_splits = np.maximum(lens - 1, 0)
    merged = np.repeat(np.arange(n, dtype=np.int64), n_splits)  # (n_candidates,)
    first = np.cumsum(n_splits) - n_splits
    # left length runs len-1 .. 1 within each token: longer left halves rank first
    left_len = lens[merged] - 1 - (np.arange(len(merged), dtype=np.int64) - first[merged])
    cut = starts[merged] + left_len
    left = table.find(substring_hash(starts[merged], cut))
    hit = np.flatnonzero(left >= 0)
    right = table.find(substring_hash(cut[hit], ends[merged[hit]]))
    keep = hit[right >= 0]
    left, right, merged, left_len = left[keep], right[right >= 0], merged[keep], left_len[keep]
    # A hash hit must at least have the right lengths; anything else is a collision.
    good = (lens[left] == left_len) & (lens[right] == lens[merged] - left_len)
    return left[good], right[good], merged[good], left_len[good]


class _HashTable:
    """Open-addressing table from 64-bit hashes to token ids, built and probed with numpy."""

    def __init__(self, keys: np.ndarray) -> None:
        n = len(keys)
        self.size = 1 << max(int(n).bit_length() + 2, 4)  # load factor <= 1/4
        self.mask = self.size - 1
        self.keys = np.zeros(self.size, np.uint64)
        self.vals = np.full(self.size, -1, np.int64)
        pending = np.arange(n, dtype=np.int64)
        slot = (keys & np.uint64(self.mask)).astype(np.int64)
        while len(pending):
            s = slot[pending]
            free = np.flatnonzero(self.vals[s] < 0)
            cand, cs = pending[free], s[free]
            # Several ids may aim at one free slot: one write wins, the others probe on.
            self.vals[cs] = cand
            won = self.vals[cs] == cand
            self.keys[cs[won]] = keys[cand[won]]
            lost = np.ones(len(pending), bool)
            lost[free[won]] = False
            pending = pending[lost]
            slot[pending] = (slot[pending] + 1) & self.mask

    def find(self, q: np.ndarray) -> np.ndarray:
        """Token id for each hash in `q`, or -1."""
        out = np.full(len(q), -1, np.int64)
        idx = np.arange(len(q), dtype=np.int64)
        slot = (q & np.uint64(self.mask)).astype(np.int64)
        while len(idx):
            v = self.vals[slot]
            hit = (v >= 0) & (self.keys[slot] == q[idx])
            out[idx[hit]] = v[hit]
            more = (v >= 0) & ~hit
            idx, slot = idx[more], (slot[more] + 1) & self.mask
        return out


def _derive_merges_plain(tokens: list[str], scores: np.ndarray | None) -> list[tuple[str, str]]:
    """The same merges by plain dict lookups, for vocabularies with repeated tokens.

    A repeated token string keeps its last id and last score but its first position, as a
    Python dict built from the list would."""
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {t: (float(scores[i]) if scores is not None else -float(i)) for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for token, score in rank.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found.extend((score, len(a), len(b), len(found) + j, a, b) for j, (a, b) in enumerate(pairs))
    found.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3]))
    return [(a, b) for *_, a, b in found]


# ---------------------------------------------------------------------------------------
# Whole tokenizers
# ---------------------------------------------------------------------------------------

def backend_from_gguf(meta: Mapping[str, Any], merges_cache: Path | None = None) -> Backend:
    """A `tokenizers.Tokenizer` for the vocabulary described by GGUF metadata `meta`.
    merges_cache: where a SentencePiece vocabulary's derived merges are kept between loads
    (derive_merges' `cache`), or None.

    Raises ValueError for a tokenizer model this module cannot rebuild."""
    kind = meta.get("tokenizer.ggml.model")
    raw_tokens = meta.get("tokenizer.ggml.tokens")
    if not raw_tokens:
        raise ValueError("the GGUF metadata holds no tokenizer.ggml.tokens")
    tokens = _valid_tokens(raw_tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = np.asarray(types, dtype=np.int64) if types is not None else np.full(len(tokens), TOKEN_NORMAL)
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        backend = _byte_level(meta, tokens)
    elif kind == "llama":
        style = _family_vocab_style(str(meta.get("general.architecture", "")))
        backend = _sentencepiece(meta, tokens, gemma=style == "gemma", merges_cache=merges_cache)
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (gpt2 and llama are)")
    _add_marked_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    _set_post_processor(backend, meta, tokens, default_bos=kind == "llama")
    return backend


def _family_vocab_style(arch: str) -> str | None:
    """How the architecture's family spells its SentencePiece vocabulary in GGUF files
    (`GGUF_VOCAB_STYLE` in models/<family>.py), or None for the usual way."""
    from ..config import ConfigError
    from ..models import family_for_gguf
    try:
        return getattr(family_for_gguf(arch), "GGUF_VOCAB_STYLE", None)
    except ConfigError:
        return None


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> Backend:
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # Tokens written outside the byte alphabet (rare) are respelled through it; the common
    # case, none, is one pass over all the text.
    if set("".join(tokens)) <= letters:
        spelled = tokens
    else:
        spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = dict(zip(spelled, range(len(spelled))))
    merges = []
    for i, m in enumerate(meta.get("tokenizer.ggml.merges") or ()):
        a, sep, b = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if sep:
            # The tokenizers library panics (a Rust panic, not an exception) on some merges
            # whose parts are not whole tokens, so each is checked here first.
            if not (a in vocab and b in vocab and a + b in vocab):
                raise ValueError(f"tokenizer.ggml.merges[{i}] {m!r} does not join two tokens of the "
                                 "vocabulary into a third")
            merges.append((a, b))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre in _DIGIT_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _REGEX_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], gemma: bool,
                   merges_cache: Path | None = None) -> Backend:
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        # Gemma files store its whitespace-run tokens with real spaces, while its text is
        # looked up with spaces turned into "▁"; respell them so they can be reached. Its
        # scores do not follow its merge order, the order of the tokens in the file does.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        merges = derive_merges(tokens, cache=merges_cache)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        merges = derive_merges(tokens, np.asarray(scores) if scores is not None else None, cache=merges_cache)
    vocab = dict(zip(tokens, range(len(tokens))))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # Llama-2 style: a "▁" is put in front of the text (unless the file says not to),
        # and taken off again when decoding.
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _add_marked_tokens(backend: Backend, tokens: list[str], types: np.ndarray, byte_level: bool) -> None:
    """Register control tokens as special and user-defined tokens as added tokens, so both
    are matched whole in the text instead of being cut into pieces."""
    letters = set(byte_alphabet().values()) if byte_level else None
    control = [AddedToken(tokens[i], normalized=False, special=True)
               for i in np.flatnonzero(types == TOKEN_CONTROL).tolist()
               # in a byte-level vocabulary a control token outside the byte alphabet is a
               # mislabel; adding it would grow the vocabulary past the model's
               if letters is None or set(tokens[i]) <= letters]
    if control:
        backend.add_special_tokens(control)
    # (as transformers does, only those the model vocabulary spells the same way: Gemma's
    # space runs were respelled with "▁" and are reached through the normalizer instead)
    user = [AddedToken(tokens[i], normalized=False, special=False)
            for i in np.flatnonzero(types == TOKEN_USER_DEFINED).tolist()
            if backend.token_to_id(tokens[i]) is not None]
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: Backend, meta: Mapping[str, Any], tokens: list[str], default_bos: bool) -> None:
    """BOS / EOS around every encoded text, as the file's add_bos_token / add_eos_token say
    (SentencePiece files that say nothing get BOS, as llama.cpp and transformers do)."""
    def named(key: str) -> tuple[str, int] | None:
        i = meta.get(key)
        return (tokens[int(i)], int(i)) if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = named("tokenizer.ggml.bos_token_id"), named("tokenizer.ggml.eos_token_id")
    add_bos = bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = eos is not None and bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = template_processor(bos if add_bos else None, eos if add_eos else None)


def template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """A post-processor that puts `bos` before and `eos` after each sequence, either optional."""
    def one(seq: str, type_id: int) -> str:
        parts = [f"{bos[0]}:{type_id}"] if bos else []
        parts.append(f"{seq}:{type_id}")
        if eos:
            parts.append(f"{eos[0]}:{type_id}")
        return " ".join(parts)

    special = [t for t in (bos, eos) if t is not None]
    if bos and eos and bos[0] == eos[0]:
        special = [bos]
    return processors.TemplateProcessing(single=one("$A", 0), pair=f"{one('$A', 0)} {one('$B', 1)}",
                                         special_tokens=special)
