"""A tiny dependency-free progress bar for the places where a person waits.

Used by :mod:`ellm.hub` while it extracts and hashes model files. It writes to
stderr so that a program's stdout (generated text, JSON) stays clean. On a
terminal it redraws one line in place; elsewhere (CI logs, pipes) it prints a
plain line now and then instead of a stream of carriage returns.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO, TypeVar

__all__ = ["ProgressBar", "format_bytes"]

_BAR_WIDTH = 24
_P = TypeVar("_P", bound="ProgressBar")


def format_bytes(n: float) -> str:
    """Human-readable size with binary prefixes: ``format_bytes(98362432) == '93.8 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024.0 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    raise AssertionError("unreachable")


class ProgressBar:
    """Counts bytes (or items) towards ``total`` and draws a bar on ``stream``.

    ``enabled=False`` makes every method a no-op, so callers never branch on it.
    Redraws are throttled (``min_interval`` seconds on a terminal, ``log_interval``
    elsewhere) because drawing is far slower than the work being measured.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        unit: str = "B",
        enabled: bool = True,
        stream: TextIO | None = None,
        min_interval: float = 0.1,
        log_interval: float = 5.0,
    ) -> None:
        self.total = total if total and total > 0 else None
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self._start = time.monotonic()
        self._closed = False
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        # A terminal shows the bar at once; a log only gets a line if the work is slow.
        self._last_draw = 0.0 if self._tty else self._start
        self._interval = min_interval if self._tty else log_interval

    # -- counting ---------------------------------------------------------

    def update(self, n: int) -> None:
        """Add ``n`` units and redraw if enough time has passed."""
        self.count += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= self._interval:
            self._last_draw = now
            self._draw(final=False)

    def close(self) -> None:
        """Draw the final state once and end the line."""
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw(final=True)

    def __enter__(self: _P) -> _P:  # noqa: PYI019 (typing.Self needs 3.11)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- drawing ----------------------------------------------------------

    def _amount(self, n: float) -> str:
        return format_bytes(n) if self.unit == "B" else f"{n:.0f} {self.unit}"

    def render(self) -> str:
        """The current line, without the leading carriage return."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = f"{self._amount(self.count / elapsed)}/s"
        if self.total is None:
            return f"{self.desc}: {self._amount(self.count)} ({rate})"
        frac = min(self.count / self.total, 1.0)
        filled = round(frac * _BAR_WIDTH)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        return (
            f"{self.desc}: {frac * 100:5.1f}% [{bar}] "
            f"{self._amount(self.count)}/{self._amount(self.total)} ({rate})"
        )

    def _draw(self, *, final: bool) -> None:
        line = self.render()
        try:
            if self._tty:
                # Pad so a shorter line fully covers the previous one.
                self.stream.write("\r" + line.ljust(79) + ("\n" if final else ""))
            elif final or self.count:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            # A closed or broken stderr must never break a download.
            self.enabled = False
