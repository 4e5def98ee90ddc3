# Types of the compiled module built from _lora.pyx (what each one does is written there).
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

DTYPES: dict[str, tuple[int, type[np.generic]]]
MAX_PARTS: int
SCRATCH_USE: str

class FactorArena:
    def __init__(self) -> None: ...
    def place(self, m: npt.NDArray[Any]) -> npt.NDArray[Any]: ...

# a slot: None, or (A^T, B^T, scale, dtype name)
_Slot = tuple[npt.NDArray[Any], npt.NDArray[Any], float, str] | None

class LoraTable:
    def __new__(cls, slots: Sequence[_Slot], out_features: int, in_features: int,
                arena: FactorArena | None = None) -> Self: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def address(self) -> int: ...

# parts: (table, y) pairs, y a writable float32 (T, >= N) array
def apply(x: npt.NDArray[np.float32], row_slots: npt.NDArray[np.int32],
          parts: Sequence[tuple[LoraTable, npt.NDArray[np.float32]]]) -> None: ...
