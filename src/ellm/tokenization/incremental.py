"""Streaming detokenization: text out as tokens come in, one token at a time.

Decoding each new token on its own is wrong in three ways:

* a character may be spread over several tokens (UTF-8 bytes), so a token's text can end
  in part of a character;
* SentencePiece byte-fallback decoding is all-or-nothing over a run of consecutive
  `<0xNN>` tokens: the run becomes text if its bytes are valid UTF-8, else one U+FFFD per
  byte, so a later byte can turn characters already seen into U+FFFD;
* decoders treat the first token of a sequence specially (some drop its leading space).

So each push decodes a short window of recent ids and hands out only the part of that
window's text not handed out before:

* while a byte-fallback run is open nothing is handed out; its text is final once a token
  of another kind follows it (a run longer than _RUN_HOLD is streamed anyway, holding back
  only a trailing U+FFFD stretch, so a pathological stream cannot stall the output);
* otherwise only a final U+FFFD is held back. Byte-level decoders (GPT-2 style) replace
  invalid bytes by the maximal-subpart rule, so an unfinished character at the end shows as
  exactly one U+FFFD and everything before it is final.

The window is cut back to its last few visible tokens every _SLIDE_AT ids (never inside
an open run), so a push costs one small decode however long the stream has run.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_REPLACEMENT = "\ufffd"
_KEEP = 4  # visible tokens kept when the window is cut back (an unfinished char spans <= 3)
_SLIDE_AT = 16  # cut the window back once it holds this many ids
_CONTEXT = 16  # prompt ids kept as context
_RUN_HOLD = 64  # byte-fallback tokens held back before a run is streamed regardless


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    Joined, the pieces returned by `push` and `flush` equal `decode(ids)` of all pushed ids
    (with the same skip_special_tokens), and no piece contains U+FFFD unless that text does.
    (The one exception: a run of more than _RUN_HOLD byte-fallback tokens that later turns
    out to be invalid UTF-8.) With `prompt_ids`, decoding continues from the end of the
    prompt, so the first piece gets the leading space it has after the prompt; the prompt
    itself is not returned.

    `decode(ids, skip_special_tokens)` is the tokenizer's decode; `byte_ids` are its
    byte-fallback tokens (`<0x00>`..`<0xFF>`), `special_ids` its special tokens, which the
    decoder does not see when skip_special_tokens is set.
    """

    def __init__(self, decode: Callable[[list[int], bool], str], prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, byte_ids: Collection[int] = frozenset(),
                 special_ids: Collection[int] = frozenset()) -> None:
        self._decode_fn = decode
        self._skip = skip_special_tokens
        self._bytes = frozenset(byte_ids)
        self._silent = frozenset(special_ids) if skip_special_tokens else frozenset()
        ids = [int(i) for i in (prompt_ids or ())][-_CONTEXT:]
        # Keep a few visible tokens of context, and the whole byte run the prompt may end in.
        run_start = len(ids)
        while run_start > 0 and (ids[run_start - 1] in self._bytes or ids[run_start - 1] in self._silent):
            run_start -= 1
        self._ids = ids[min(self._cut_point(ids), max(run_start - 1, 0)):]
        self._run = sum(1 for i in ids[run_start:] if i in self._bytes)  # the open run's length
        self._done = len(self._text()) if self._ids else 0  # chars of the window's text handed out

    def _text(self) -> str:
        return self._decode_fn(self._ids, self._skip)

    def _cut_point(self, ids: list[int]) -> int:
        """Index from which `ids` holds its last _KEEP tokens that the decoder sees."""
        seen = 0
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] not in self._silent:
                seen += 1
                if seen == _KEEP:
                    return k
        return 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", or several characters)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id in self._silent:
            return ""  # invisible to the decoder: the text is unchanged
        if token_id in self._bytes:
            self._run += 1
            if self._run < _RUN_HOLD:
                return ""
            # A very long run: stream what is valid so far, hold its trailing U+FFFD stretch.
            text = self._text()
            return self._emit(text, len(text.rstrip(_REPLACEMENT)))
        self._run = 0
        text = self._text()
        held = 1 if text.endswith(_REPLACEMENT) else 0
        out = self._emit(text, len(text) - held)
        if len(self._ids) >= _SLIDE_AT:
            # Restart the window on its last few visible tokens; the held character (if
            # any) is made of at most 3 bytes, all inside them.
            self._ids = self._ids[self._cut_point(self._ids):]
            self._done = len(self._text()) - held
        return out

    def _emit(self, text: str, end: int) -> str:
        out = text[self._done:end]
        self._done = max(self._done, end)
        return out

    def flush(self) -> str:
        """The text still held back (an unfinished character or byte run) at the end."""
        text = self._text()
        out = text[self._done:]
        self._done = len(text)
        self._run = 0
        return out
