"""StopStringMatcher on streamed text, checked case by case and against a reference that
feeds one character at a time and searches the whole text after each."""
from __future__ import annotations

import random

import pytest

from ellm.engine.stop import StopStringMatcher


def stream(stops: list[str], pieces: list[str], include: bool = False) -> tuple[list[str], bool, str]:
    """Pushes every piece; returns what each push emitted, whether it stopped, and the
    total text including flush()."""
    m = StopStringMatcher(stops, include)
    emitted, stopped = [], False
    for p in pieces:
        out, stopped = m.push(p)
        emitted.append(out)
        if stopped:
            break
    return emitted, stopped, "".join(emitted) + m.flush()


def reference(stops: list[str], text: str, include: bool = False) -> tuple[str, bool]:
    """One character at a time: stop at the first position where some stop string ends;
    among stops ending there, cut at the earliest start."""
    for end in range(1, len(text) + 1):
        hits = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if hits:
            start, s = min(hits)
            return text[:start + len(s)] if include else text[:start], True
    return text, False


def test_split_across_pieces():
    emitted, stopped, total = stream(["Hello world"], ["Say: ", "Hel", "lo wor", "ld", " more"])
    assert stopped and total == "Say: "
    assert emitted == ["Say: ", "", "", ""]  # nothing of the stop string ever shows


def test_held_back_only_while_it_can_match():
    m = StopStringMatcher(["</s>"])
    assert m.push("a<") == ("a", False)
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)  # no longer a prefix: released at once
    assert m.push("</s") == ("", False)
    assert m.push(">tail") == ("", True)
    assert m.push("later") == ("", True)
    assert m.flush() == ""


def test_one_stop_is_a_prefix_of_another():
    # "ab" completes first, whether the text comes whole or in pieces.
    for pieces in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        assert stream(["abc", "ab"], pieces)[1:] == (True, "x")
    # Stops ending at the same place: the one starting earliest wins.
    assert stream(["c", "abc"], ["xab", "c"])[2] == "x"
    assert stream(["c", "abc"], ["xabc"], include=True)[2] == "xabc"
    # A shorter stop inside a longer one's span, ending first.
    assert stream(["abcd", "bc"], ["a", "b", "c", "d"])[2] == "a"


def test_partial_stop_at_end_is_flushed_as_text():
    emitted, stopped, total = stream(["STOP"], ["the end", " ST", "O"])
    assert not stopped
    assert "".join(emitted) == "the end "
    assert total == "the end STO"


def test_overlapping_occurrences():
    # "aab" inside "aaab": the held tail must restart correctly after a failed match.
    assert stream(["aab"], ["a", "a", "a", "b", "!"])[1:] == (True, "a")
    assert stream(["abab"], ["ab", "a", "bab"])[1:] == (True, "")
    assert stream(["abab"], ["aba", "c", "abab"])[1:] == (True, "abac")


def test_unicode_and_empty_pushes():
    emitted, stopped, total = stream(["終わり", "🛑"], ["", "こんにちは", "", "終", "", "わ", "り", "!"])
    assert stopped and total == "こんにちは"
    assert stream(["🛑"], ["naïve ", "🛑 rest"])[2] == "naïve "
    m = StopStringMatcher(["x"])
    assert m.push("") == ("", False)
    assert m.flush() == ""


def test_include_stop_str_in_output():
    emitted, stopped, total = stream(["###"], ["answer ", "#", "##", " junk"], include=True)
    assert stopped and total == "answer ###"
    assert emitted[-1] == "###"


def test_no_stops_and_validation():
    m = StopStringMatcher([])
    assert m.push("anything") == ("anything", False)
    assert m.flush() == ""
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    assert StopStringMatcher("END").push("xEND") == ("x", True)  # a bare string is one stop


def test_matched_string_recorded():
    m = StopStringMatcher(["A", "BB"])
    assert m.push("xB") == ("x", False)
    assert m.push("B") == ("", True)
    assert m.matched == "BB"


def test_random_splits_agree_with_reference():
    rng = random.Random(0)
    alphabet = "ab c"
    for trial in range(400):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        include = trial % 2 == 1
        want, want_stopped = reference(stops, text, include)
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped, total = stream(stops, pieces, include)
        assert (total, stopped) == (want, want_stopped), (stops, text, pieces)
        # Streaming never shows text that is later cut away.
        assert want.startswith("".join(emitted))
