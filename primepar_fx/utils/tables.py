"""Folding the repeated layers of a per-node table.

A transformer's graph repeats one block of nodes per layer, so a per-node table of llama2-70b has 4,347 rows of
which 80 blocks look the same but for the node names. :func:`fold_repeats` finds the longest stretch of rows that
repeats with one period and keeps its first block, replacing the copies after it with one line that says how many
copies were left out and which nodes they span. Rows are compared on every column but the node name, as printed,
so a folded copy is exactly the block shown above it.

The period is found by comparing the rows' codes with themselves shifted by ``p`` for every ``p`` up to half the
table (one vectorised comparison each), keeping the ``p`` whose longest run of matches leaves out the most rows.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

#: tables shorter than this are printed whole
FOLD_MIN_ROWS = 120


def repeated_block(keys: Sequence[Hashable], min_copies: int = 2) -> tuple[int, int, int] | None:
    """``(start, period, copies)``: rows ``start + period`` to ``start + (copies + 1) * period - 1`` repeat the
    ``period`` rows from ``start`` ``copies`` times over (``keys`` equal row by row); the stretch that leaves out
    the most rows, ``None`` when no block repeats ``min_copies`` times after its first."""
    codes: dict[Hashable, int] = {}
    arr = np.array([codes.setdefault(k, len(codes)) for k in keys], dtype=np.int64)
    n, best, best_left_out = len(arr), None, 0
    for period in range(1, n // (min_copies + 1) + 1):
        same = np.concatenate(([False], arr[period:] == arr[:-period], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        starts, stops = edges[::2], edges[1::2]  # runs of rows i with key[i + period] == key[i]
        longest = int(np.argmax(stops - starts))
        copies = int(stops[longest] - starts[longest]) // period
        if copies >= min_copies and copies * period > best_left_out:
            best, best_left_out = (int(starts[longest]), period, copies), copies * period
    return best


def fold_repeats(
    rows: list[list[Any]],
    key: Callable[[list[Any]], Hashable] | None = None,
    name_col: int = 0,
    min_rows: int = FOLD_MIN_ROWS,
) -> tuple[list[list[Any]], str | None]:
    """``rows`` with the copies of their longest repeated block replaced by one short marker row, and a note for
    under the table that says what was left out (``None``, and ``rows`` unchanged, when ``rows`` has fewer than
    ``min_rows`` rows or nothing repeats).

    Rows are equal when ``key`` (default: the ``str`` of every cell but the name) gives equal keys; pass the
    table's own number formats so that rows fold when they print alike."""
    if len(rows) < min_rows:
        return rows, None
    if key is None:
        key = lambda row: tuple(str(cell) for k, cell in enumerate(row) if k != name_col)  # noqa: E731
    found = repeated_block([key(row) for row in rows])
    if found is None:
        return rows, None
    start, period, copies = found
    first, last = start + period, start + (copies + 1) * period - 1
    marker = [""] * len(rows[0])
    marker[name_col] = "..."
    marker[(name_col + 1) % len(marker)] = f"x{copies} the {period} rows above"
    note = (
        f"...: the {period} rows from {rows[start][name_col]} to {rows[first - 1][name_col]} repeat {copies} more "
        f"times, from {rows[first][name_col]} to {rows[last][name_col]} ({copies * period:,} rows left out, the same "
        "but for the node names)"
    )
    return [*rows[:first], marker, *rows[last + 1 :]], note
