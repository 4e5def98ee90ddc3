"""Compare two recordings op by op and find the first op whose error passes its tolerance.

For every (layer, op) both sides recorded, over the kept positions: the largest absolute
difference, the relative error ||ellm - ref|| / ||ref|| (Frobenius, in float64) and the
cosine similarity. An op diverges when its relative error is above the tolerance for its
op and the weights' quantization (tolerances.py). The first divergence is the first such
op in forward order: errors carry forward through the residual stream, so everything after
it is expected to be off too, and the first one is where to look.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from .recorder import Key, forward_order


@dataclass
class OpDiff:
    layer: int | None
    op: str
    max_abs: float
    rel: float
    cos: float
    tol: float
    over: bool
    shape: tuple[int, int]

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def metrics(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(max_abs, rel, cos) of a against the reference b (same shape)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = a64 - b64
    max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    nb, na = float(np.linalg.norm(b64)), float(np.linalg.norm(a64))
    nd = float(np.linalg.norm(d))
    rel = nd / nb if nb > 0 else (0.0 if nd == 0 else float("inf"))
    cos = float(a64 @ b64) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return max_abs, rel, cos


def compare(ellm: dict[Key, np.ndarray], ref: dict[Key, np.ndarray], num_layers: int,
            tolerance: Callable[[str], float]) -> list[OpDiff]:
    """Rows of the two sides must be the same positions; keys one side lacks are skipped."""
    rows = []
    for key in forward_order(num_layers):
        if key not in ellm or key not in ref:
            continue
        a, b = ellm[key], ref[key]
        if a.shape != b.shape:
            raise ValueError(f"layer {key[0]} {key[1]}: ellm recorded {a.shape}, the reference {b.shape}")
        max_abs, rel, cos = metrics(a, b)
        tol = tolerance(key[1])
        rows.append(OpDiff(key[0], key[1], max_abs, rel, cos, tol, not rel <= tol, a.shape))
    return rows


def first_divergence(rows: list[OpDiff]) -> OpDiff | None:
    return next((r for r in rows if r.over), None)


def select_positions(ref: dict[Key, np.ndarray], positions: np.ndarray, n_heads: int) -> dict[Key, np.ndarray]:
    """A reference recorded at every position, cut down to `positions` (sorted, ascending).

    attn_probs rows (n_heads * T) keep the keys up to the last kept position, as ellm's do."""
    out = {}
    last = int(positions.max()) + 1 if len(positions) else 0
    for key, a in ref.items():
        a = a[positions]
        if key[1] == "attn_probs":
            a = np.ascontiguousarray(a.reshape(len(positions), n_heads, -1)[:, :, :last]).reshape(len(positions), -1)
        out[key] = a
    return out
