"""Reusable activation buffers, so a decode step allocates nothing.

A buffer is made once per name, by the backend (`ops.empty`), and grown only when a
batch has more rows than any before it; each forward takes views of the first rows.
Views stay valid until the next forward pass writes the same buffer. `generation` counts
the buffers made: a captured CUDA graph holds buffer addresses, so a step executor that
replays one captures it again when the generation has moved.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class Workspace:
    def __init__(self, ops: Any) -> None:
        self.ops = ops   # whose `empty` makes the buffers (host or device memory)
        self._bufs: dict[str, Any] = {}
        self.generation = 0   # buffers made so far (a new one moves every later view)

    def get(self, name: str, rows: int, *tail: int) -> Any:
        """A float32 (rows, *tail) view of the buffer `name`."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows or tuple(buf.shape[1:]) != tail:
            grown = max(rows, 2 * buf.shape[0]) if buf is not None and tuple(buf.shape[1:]) == tail else rows
            buf = self.ops.empty((grown, *tail), np.float32)
            self._bufs[name] = buf
            self.generation += 1
        return buf[:rows]

    def holds(self, view: Any) -> bool:
        """True while `view` is a view of one of the current buffers (an array type that
        does not say its base, a backend's own, never is)."""
        base = getattr(view, "base", None)
        return base is not None and any(base is b for b in self._bufs.values())

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._bufs.values())
