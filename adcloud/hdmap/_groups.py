"""Grouping rows of sparse tiles by index, for merging many partial tiles in one pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["group_rows", "reduce_groups"]


def group_rows(
    indices: Sequence[NDArray[Any]],
) -> tuple[NDArray[Any], NDArray[np.intp], NDArray[np.intp]]:
    """Group the rows of several index arrays by index value.

    Returns ``(distinct, order, starts)``: the sorted distinct values, the permutation that
    sorts the concatenated rows (stable, so equal values keep input order) and where each
    value's run starts in that order -- ready for ``ufunc.reduceat``.
    """
    both = np.concatenate(indices)
    order = np.argsort(both, kind="stable")
    ordered = both[order]
    if not len(ordered):
        return ordered, order, np.zeros(0, np.intp)
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    return ordered[starts], order, starts


def reduce_groups(
    arrays: Sequence[NDArray[Any]],
    order: NDArray[np.intp],
    starts: NDArray[np.intp],
    op: np.ufunc,
) -> NDArray[Any]:
    """``op`` over each group of the concatenated ``arrays`` (see :func:`group_rows`)."""
    both = np.concatenate(arrays)
    if not len(starts):
        return both[:0]
    out: NDArray[Any] = op.reduceat(both[order], starts, axis=0)
    return out.astype(both.dtype, copy=False)  # add.reduceat widens small integers
