"""The host's side of sample.cu's rows (ops/cuda.py launches the kernels): grammar masks
packed for `sample_rows`, and `logprob_rows`' plan and records. No CuPy here, so that
ops/cuda.py and ops/cuda_graphs.py (which reads a launched step's records) both import it."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

LOGPROB_HEAD = 6   # sample.cu logprob_rows: a record's words before its top ids (the last: the chosen id)


def mask_table(masks: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    """Per row its grammar mask's row in one table (-1: none) -> {"mask_rows": int32 (B,),
    "masks": int32 (rows with a mask, words)}: what sample_rows reads."""
    given = [m for m in masks if m is not None]
    words = max(int(m.shape[0]) for m in given)
    table = np.zeros((len(given), words), np.int32)   # (a shorter row: its tokens past it forbidden)
    rows = np.full(len(masks), -1, np.int32)
    j = 0
    for b, m in enumerate(masks):
        if m is not None:
            table[j, :m.shape[0]] = m
            rows[b] = j
            j += 1
    return {"mask_rows": rows, "masks": table}


def mask_allows_any(bits: np.ndarray, V: int) -> bool:
    """Whether a grammar mask (int32 words, token i at bit i % 32 of word i // 32) allows
    any token below V."""
    full = min(V // 32, int(bits.shape[0]))
    if bits[:full].any():
        return True
    rest = V % 32
    return bool(rest and full < bits.shape[0] and int(bits[full]) & ((1 << rest) - 1))


class LogprobPlan:
    """The rows of a batch that ask for logprobs (CudaOps.logprobs_before_sampling): src,
    the raw logits they are read from; src_rows and id_rows, int32 (R,) on the device, each
    record's row of src and of the batch (None: record r's is r); want, those batch rows;
    asked, how many top logprobs each wants."""

    def __init__(self, src: Any, src_rows: Any, id_rows: Any, want: list[int], asked: list[int]) -> None:
        self.src, self.src_rows, self.id_rows, self.want, self.asked = src, src_rows, id_rows, want, asked


def read_logprob_records(records: np.ndarray, asked: Sequence[int]) -> list[Any]:
    """logprob_rows' records (R, LOGPROB_HEAD + 2 n) int32 on the host -> per row (the chosen
    token's logprob, its `asked[r]` top (id, logprob), most likely first), or the ValueError
    the host's sampler raises for a row without a finite maximum. The logprobs are the raw
    logits less the row's log-sum-exp, subtracted here as the host's sampler does."""
    from ..engine.sampler import no_finite_maximum
    n = (records.shape[1] - LOGPROB_HEAD) // 2
    lse = np.ascontiguousarray(records[:, :2]).view(np.float64)[:, 0]
    head = np.ascontiguousarray(records[:, 2:4]).view(np.float32)   # (max, chosen logit)
    out: list[Any] = []
    for r, k in enumerate(asked):
        mx = float(head[r, 0])
        if not math.isfinite(mx):
            out.append(no_finite_maximum(mx))
            continue
        m = min(k, int(records[r, 4]))
        rec = records[r]
        ids = rec[LOGPROB_HEAD:LOGPROB_HEAD + m].tolist()
        vals = rec[LOGPROB_HEAD + n:LOGPROB_HEAD + n + m].view(np.float32).tolist()
        total = float(lse[r])
        out.append((float(head[r, 1]) - total, [(int(i), v - total) for i, v in zip(ids, vals)]))
    return out
