"""Opening model files without trusting what the path points at.

A path named `model.gguf` may be a FIFO, a character device or a socket: a plain `open()`
of a FIFO for reading waits forever for a writer, and a device may never end. Every model
file is therefore checked to be a regular file before it is read, and opened with
O_NONBLOCK so that even a path swapped for a FIFO after the check cannot block the open
(csrc/mapfile.c does the same for the memory maps).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import FormatError

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(mode: int) -> str:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def regular_file_size(path: str | Path) -> int:
    """The size of `path` (symlinks followed); FormatError if it is missing or not a
    regular file. Only stat() is called, which never blocks."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, f"cannot open: it is {_not_regular(st.st_mode)}, not a regular file")
    return st.st_size


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a JSON side file of a model:
    an index, a tokenizer). FormatError if it is not a regular file or is larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(path, f"cannot open: it is {_not_regular(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FormatError(path, f"is {st.st_size} bytes, more than the {limit} allowed for it")
        data = f.read(st.st_size + 1)  # (read(limit) would allocate the whole limit at once)
    if len(data) != st.st_size:
        raise FormatError(path, "changed size while being read")
    return data
