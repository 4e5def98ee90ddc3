"""The one exception type for malformed model files."""
from __future__ import annotations

from pathlib import Path


class FormatError(ValueError):
    """A model file is malformed; the message names the file and what is wrong."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
