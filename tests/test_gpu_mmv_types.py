"""benchmarks/gpu/mmv_types.py's matrices (the device check times a product of each): a
valid matrix of every type it names, whose dequantized weights are finite numbers."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ellm.formats.dequant import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
mmv_types = pytest.importorskip("mmv_types")


@pytest.mark.parametrize("name", mmv_types.TYPES)
def test_random_matrices_of_every_type_are_finite(name: str) -> None:
    w = mmv_types.random_linear(name, 16, 512)
    assert w.qtype.name == name and (w.out_features, w.in_features) == (16, 512)
    dense = dequantize(w.data, w.qtype, (16, 512))
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0
