# Types of the compiled module built from _stack.pyx (what each one does is written there).
from typing import Any

import numpy as np
import numpy.typing as npt

_F32 = npt.NDArray[np.float32]
_I32 = npt.NDArray[np.int32]

class LayerStack:
    # layers: one dict per layer (models/blocks.Decoder.layer_stack builds them)
    def __init__(self, layers: list[dict[str, Any]], T: int, H: int, residual: _F32, proj: _F32, h: _F32,
                 eps: float) -> None: ...
    @property
    def T(self) -> int: ...
    @property
    def H(self) -> int: ...
    @property
    def has_lora(self) -> bool: ...
    # block_tables: attention window -> (B, max_blocks) int32 block table
    def run(self, positions: _I32, seq_ids: _I32, block_tables: dict[int, _I32], key_limit: _I32 | None = None,
            adapter_slots: _I32 | None = None) -> None: ...
