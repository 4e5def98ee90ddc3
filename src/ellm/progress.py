"""Progress bars (tqdm) for the places where a person waits: pulling, extracting and
hashing model files.

Bars go to stderr so that a program's stdout (generated text, JSON) stays clean. On a
terminal a bar redraws in place ten times a second; elsewhere (CI logs, pipes) it is
drawn in plain ASCII every few seconds, so a log gets a few lines, not a stream of
carriage returns.

watch_folders() drives a bar from the outside: it sums the bytes of the files in some
folders while another program (pip) writes them, for downloads ellm does not do itself.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["progress_bar", "watch_folders"]


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def progress_bar(total: int | None, desc: str, *, enabled: bool = True, stream: TextIO | None = None) -> tqdm:
    """A byte-counting bar towards total (None: unknown) on stream (default stderr).
    enabled=False gives a bar whose every method does nothing, so callers never branch."""
    from tqdm import tqdm  # (here: loading a model that is already in the cache draws no bar)
    out = stream if stream is not None else sys.stderr
    tty = _isatty(out)
    # The size is read once; a terminal that reports none (a pty nobody sized) gets 80x24,
    # else tqdm would take the bar to be below the screen and draw nothing.
    size = shutil.get_terminal_size((80, 24)) if tty else None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=out,
                disable=not enabled, leave=True, ncols=size and size.columns, nrows=size and size.lines,
                ascii=None if tty else True, mininterval=0.1 if tty else 5.0)


def _bytes_in(folders: Sequence[Path]) -> int:
    total = 0
    for folder in folders:
        for root, _dirs, files in os.walk(folder):
            for name in files:
                with contextlib.suppress(OSError):   # a file may vanish between listing and stat
                    total += os.stat(os.path.join(root, name)).st_size
    return total


@contextlib.contextmanager
def watch_folders(bar: tqdm, folders: Sequence[Path], interval: float = 0.25) -> Iterator[None]:
    """While the block runs, moves bar to the bytes held in folders (never backwards:
    a file moved from one folder to another counts once, at its largest)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            seen = _bytes_in(folders)
            if seen > bar.n:
                bar.update(min(seen, bar.total or seen) - bar.n)

    thread = threading.Thread(target=poll, name="ellm-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
