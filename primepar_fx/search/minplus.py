"""Min-plus algebra for merging segments (paper Eq. 13) and identical layers (Eq. 14).

A segment from cut node ``i`` to cut node ``j`` is summarised by ``C_ij(p_i, p_j)``, the cheapest cost of
everything after ``i`` up to and including ``j`` with both ends fixed. Two adjacent segments merge by a min-plus
product over the shared node::

    C_ik(p_i, p_k) = min_{p_j} C_ij(p_i, p_j) + C_jk(p_j, p_k)                               (Eq. 13 / 14)

Because a segment's table includes its end node's cost but not its start node's, the shared node is counted
once and nothing has to be subtracted (the paper's ``- n_j(p_j)``; subtraction would also turn ``inf - inf``
into NaN for forbidden strategies). A skip edge that jumps over ``j`` never appears here: the segment finder
only cuts where no edge jumps (see :mod:`primepar_fx.search.structure`), and the elimination engine adds such
edges inside a segment.

``L`` identical layers combine by repeated squaring, ``floor(log2 L) + popcount(L) - 1`` products (Eq. 14).
Every product keeps its argmin, so :func:`boundaries` recovers the state of every cut inside the merged range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def minplus(a: np.ndarray, b: np.ndarray, *, chunk: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """``C[i, k] = min_j a[i, j] + b[j, k]`` and its argmin ``j``.

    Vectorised over blocks of rows, each a ``(rows, k, j)`` table reduced over its contiguous last axis, in one
    scratch buffer of ``chunk`` entries (see :func:`primepar_fx.search.engine._combine_min` for the measurements).
    """
    m, n = a.shape
    n2, k = b.shape
    if n != n2:
        raise ValueError(f"min-plus product of {a.shape} and {b.shape}: inner sizes differ")
    bt = np.ascontiguousarray(b.T)
    out = np.empty((m, k))
    arg = np.empty((m, k), dtype=np.uint16 if n <= 65535 else np.int32)
    rows = max(1, chunk // max(1, n * k))
    scratch = np.empty(min(m, rows) * n * k)
    for lo in range(0, m, rows):
        r = min(rows, m - lo)
        block = scratch[: r * k * n].reshape(r, k, n)
        np.add(a[lo : lo + r, None, :], bt[None, :, :], out=block)
        j = block.argmin(axis=-1)
        out[lo : lo + r] = np.take_along_axis(block, j[..., None], -1)[..., 0]
        arg[lo : lo + r] = j
    return out, arg


def vecmat(v: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w[k] = min_j v[j] + m[j, k]`` and its argmin (Eq. 11 at segment granularity)."""
    block = v[:, None] + m
    j = block.argmin(axis=0)
    return block[j, np.arange(m.shape[1])], j


@dataclass(frozen=True, eq=False)
class Term:
    """A table over the two ends of ``length`` consecutive segments, with the merge tree that produced it."""

    table: np.ndarray
    length: int
    left: Term | None = None
    right: Term | None = None
    arg: np.ndarray | None = None


def leaf(table: np.ndarray) -> Term:
    return Term(table, 1)


def product(left: Term, right: Term, *, chunk: int = 1 << 16) -> Term:
    """Merge two adjacent ranges (Eq. 13/14)."""
    table, arg = minplus(left.table, right.table, chunk=chunk)
    return Term(table, left.length + right.length, left, right, arg)


def chain(terms: list[Term], *, chunk: int = 1 << 16) -> Term:
    """Merge consecutive ranges left to right."""
    out = terms[0]
    for t in terms[1:]:
        out = product(out, t, chunk=chunk)
    return out


def power(term: Term, count: int, *, chunk: int = 1 << 16) -> Term:
    """``count`` copies of ``term`` in a row, by repeated squaring (Eq. 14 applied ``log2(count)`` times)."""
    if count < 1:
        raise ValueError(f"need at least one copy, got {count}")
    result, base = None, term
    while True:
        if count & 1:
            result = base if result is None else product(result, base, chunk=chunk)
        count >>= 1
        if not count:
            return result
        base = product(base, base, chunk=chunk)


def boundaries(term: Term, first: int, last: int) -> list[int]:
    """States of the ``length + 1`` cut nodes of ``term``'s range, given the states of its two ends."""
    out = [first]
    stack = [(term, first, last)]
    while stack:  # depth-first, left before right, so cut states come out in order
        t, p, q = stack.pop()
        if t.left is None:
            out.append(q)
            continue
        mid = int(t.arg[p, q])
        stack.append((t.right, mid, q))
        stack.append((t.left, p, mid))
    return out
