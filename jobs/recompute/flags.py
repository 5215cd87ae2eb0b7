"""The recompute protocol's state: three flags the checkpointed layers, the tiled MLP and the chunked loss share.

Each is set only by its context manager (restored on exit, so they nest) and read only through its reader, so
every place that changes or reads one is a call to a name in this file (the package docstring says who does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_rows_needing_gradient: int | None = None  # only_first_rows_need_gradient's, while inside it
_first_row = 0  # rows_from's: where in the batch the rows of the calls inside begin
_recomputing = False  # inside a checkpoint's recompute


@contextlib.contextmanager
def only_first_rows_need_gradient(rows: int) -> Iterator[None]:
    """Inside, checkpointed calls over more than ``rows`` rows keep and recompute only their first ``rows``: the
    caller guarantees that the gradient reaching the other rows is zero (DPO's LoRA reference rows)."""
    global _rows_needing_gradient
    before, _rows_needing_gradient = _rows_needing_gradient, rows
    try:
        yield
    finally:
        _rows_needing_gradient = before


def rows_needing_gradient(total: int | None) -> int | None:
    """How many first rows of a batch of ``total`` need a gradient (``only_first_rows_need_gradient``); None: all."""
    rows = _rows_needing_gradient
    return rows if rows is not None and total is not None and rows < total and torch.is_grad_enabled() else None


@contextlib.contextmanager
def rows_from(first: int) -> Iterator[None]:
    """Inside, calls run a slice of the batch's rows that begins at row ``first`` (DPO's reference rows, computed
    without a graph apart from the policy's): per-row state is read from there (``batch_rows``)."""
    global _first_row
    before, _first_row = _first_row, first
    try:
        yield
    finally:
        _first_row = before


def batch_rows(rows: int) -> slice:
    """Which of the batch's rows a call over ``rows`` rows runs: from ``rows_from``'s row, or from the first (a
    trimmed recompute runs the first rows)."""
    return slice(_first_row, _first_row + rows)


@contextlib.contextmanager
def in_recompute() -> Iterator[None]:
    """Inside, calls run in a checkpoint's recompute (``recomputing``)."""
    global _recomputing
    before, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = before


def recomputing() -> bool:
    """Whether this call runs inside a checkpointed layer's recompute, whose outputs backward reads no value of."""
    return _recomputing
