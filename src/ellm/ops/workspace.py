"""Reusable activation buffers, so a decode step allocates nothing.

A buffer is made once per name and grown only when a batch has more rows than any
before it; each forward takes views of the first rows. Views stay valid until the next
forward pass writes the same buffer.
"""
from __future__ import annotations

import numpy as np


class Workspace:
    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, rows: int, *tail: int) -> np.ndarray:
        """A float32 (rows, *tail) view of the buffer `name`."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != tail:
            grown = max(rows, 2 * buf.shape[0]) if buf is not None and buf.shape[1:] == tail else rows
            buf = np.empty((grown, *tail), np.float32)
            self._bufs[name] = buf
        return buf[:rows]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())
