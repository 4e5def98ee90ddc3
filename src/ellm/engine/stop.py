"""Stop strings over streamed text.

The detokenizer hands text over piece by piece, and a stop string may arrive split over
many pieces ("Hel", "lo wor", "ld"). StopStringMatcher holds back only the longest tail of
the pending text that could still grow into a stop string, so a stream never shows part of
a stop string, and emits everything before it.

Which stop wins: the one that completes first (ends earliest in the text); among stops
ending at the same place, the one starting earliest (the longest). This is what a reader
feeding one character at a time would see, so the result does not depend on how the text
was split into pieces.
"""
from __future__ import annotations


class StopStringMatcher:
    """push(text) -> (text safe to emit now, stopped?); flush() at EOS/length returns the
    held-back tail. After a stop, the rest of the text (and any later push) is dropped."""

    def __init__(self, stops: str | list[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops)
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = list(dict.fromkeys(stops))  # drop duplicates, keep order
        self.include_stop_str_in_output = include_stop_str_in_output
        # Every proper prefix of every stop: a pending tail in here may still become a stop.
        self._prefixes = {s[:i] for s in self.stops for i in range(1, len(s))}
        self._longest_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, new_text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return new_text, False
        text = self._held + new_text
        hit = self._first_stop(text)
        if hit is not None:
            start, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return text[:end], True
        keep = self._held_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text (a partial stop string is plain text once the output ends)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # The held part contains no complete stop (it was checked on the previous push),
        # so a match found here is the first one in the stream.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop."""
        for k in range(min(len(text), self._longest_prefix), 0, -1):
            if text[len(text) - k:] in self._prefixes:
                return k
        return 0
