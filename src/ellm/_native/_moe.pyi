# Types of the compiled module built from _moe.pyx (what each one does is written there).
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

MAX_TOP_K: int
SCRATCH_USE: str

class ExpertStack:
    def __new__(cls, weights: Sequence[npt.NDArray[Any]], qtype: int, in_features: int) -> Self: ...
    @property
    def qtype(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...

def route(logits: npt.NDArray[np.float32], top_k: int, norm_topk_prob: bool, ids: npt.NDArray[np.int32],
          weights: npt.NDArray[np.float32]) -> None: ...
def experts(x: npt.NDArray[np.float32], ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32],
            gate: ExpertStack, up: ExpertStack, down: ExpertStack, out: npt.NDArray[np.float32],
            max_pass_tokens: int = 0) -> None: ...
def scratch_bytes() -> int: ...
