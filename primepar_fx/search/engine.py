"""Exact min-sum variable elimination: the engine that computes one segment's table (paper Eq. 11-12).

Variables are operators, each with a finite domain (its strategies). Factors are tables over one variable (node
cost, Eq. 7) or two (edge cost, Eq. 8-9). The engine minimises the sum of all factors over every variable that is
not *kept*, and returns a table over the kept variables plus the argmin tables needed to recover the minimiser::

    T(keep) = min over the others of  sum_f  f(scope_f)

Eliminating a variable ``v`` adds every factor that mentions ``v`` into one table over the union ``U`` of their
scopes and takes the minimum (and argmin) over ``v``; the result is a new factor over ``U - {v}``.

*Order.* :func:`plan_elimination` picks, each time, the variable whose combined table ``U`` is smallest, ties
broken by topological position. On a chain with one kept end this is the paper's Eq. 11 in topological order,
``C_{i,j+1}(p_i, p_{j+1}) = min_{p_j} C_ij(p_i, p_j) + n_{j+1}(p_{j+1}) + e_{j,j+1}(p_j, p_{j+1})``, one
``O(P^3)`` step per node; a node that also feeds ``n_{j+1}`` from the kept end adds ``e_{i,j+1}`` (Eq. 12). On
fan-outs such as Q/K/V projections it eliminates each branch's interior first (series-parallel reduction), where
a purely topological frontier would hold every branch at once (``P^4`` and more).

*Limits.* Planning raises :class:`~primepar_fx.search.problem.TableTooLarge` before any arithmetic when a table
would exceed ``limit`` entries. Execution works in chunks of at most ``chunk`` entries to bound memory.

The plan depends only on scopes and domains, so one plan serves every re-run with new costs (the Lagrangian
budget loop, conditioning on global nodes, identical segments).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from primepar_fx.search.problem import TableTooLarge

log = logging.getLogger(__name__)

Scope = tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """Eliminate ``var``: add factors ``inputs`` into a table laid out as ``layout``, then min over ``var``."""

    var: int
    layout: Scope
    inputs: tuple[int, ...]

    @property
    def axis(self) -> int:
        return self.layout.index(self.var)

    @property
    def rest(self) -> Scope:
        return tuple(u for u in self.layout if u != self.var)


@dataclass(frozen=True)
class Elimination:
    """An elimination order. Factor ``len(scopes) + k`` is the output of ``steps[k]``."""

    domains: tuple[int, ...]
    scopes: tuple[Scope, ...]
    keep: Scope
    steps: tuple[Step, ...]
    final: tuple[int, ...]
    work: int
    peak: int


@dataclass(frozen=True)
class Result:
    """The table over the kept variables (axes in ``keep`` order), one argmin table per step and (if asked for)
    every step's output table."""

    table: np.ndarray
    records: tuple[np.ndarray, ...]
    outputs: tuple[np.ndarray, ...] = ()


def _layout(var: int, others: list[int]) -> Scope:
    """Put ``var`` last: numpy's argmin over the contiguous last axis is the fastest way to get a minimum (it reads
    memory in order, where ``min`` or ``argmin`` over a middle axis strides), and it yields the argmin for free."""
    return (*sorted(others), var)


def plan_elimination(
    domains: Sequence[int],
    scopes: Sequence[Scope],
    keep: Sequence[int],
    *,
    limit: int,
    names: Sequence[str] | None = None,
) -> Elimination:
    """Choose a greedy elimination order (smallest combined table first, then lowest variable index)."""
    domains = tuple(int(d) for d in domains)
    keep_set = set(keep)
    scopes_l: list[Scope] = [tuple(s) for s in scopes]
    factors_of: list[set[int]] = [set() for _ in domains]
    for f, scope in enumerate(scopes_l):
        for u in scope:
            factors_of[u].add(f)
    version = [0] * len(domains)

    def union(v: int) -> set[int]:
        out = {v}
        for f in factors_of[v]:
            out.update(scopes_l[f])
        return out

    heap = [(prod(domains[u] for u in union(v)), v, 0) for v in range(len(domains)) if v not in keep_set]
    heapq.heapify(heap)
    steps, work, peak, done = [], 0, 0, set()
    while heap:
        size, v, ver = heapq.heappop(heap)
        if ver != version[v] or v in done:
            continue
        if size > limit:

            def label(u: int) -> str:
                return f"{names[u] if names is not None else u!s} ({domains[u]})"

            others = ", ".join(label(u) for u in sorted(union(v) - {v}))
            raise TableTooLarge(
                f"eliminating {label(v)} needs a table of {size:,} entries (limit {limit:,}) over its neighbours "
                f"{others}; the graph is too entangled for the dynamic program here: use method='ilp' or 'auto', "
                "or raise the limit",
                () if names is None else tuple(str(names[u]) for u in [v, *sorted(union(v) - {v})]),
                size,
            )
        members = union(v)
        inputs = tuple(sorted(factors_of[v]))
        steps.append(Step(v, _layout(v, [u for u in members if u != v]), inputs))
        work, peak = work + size, max(peak, size)
        done.add(v)
        new = len(scopes_l)
        scopes_l.append(steps[-1].rest)
        for u in members - {v}:
            factors_of[u].difference_update(inputs)
            factors_of[u].add(new)
            if u not in keep_set:
                version[u] += 1
                heapq.heappush(heap, (prod(domains[w] for w in union(u)), u, version[u]))
    consumed = {f for step in steps for f in step.inputs}
    final = tuple(f for f in range(len(scopes_l)) if f not in consumed)
    return Elimination(domains, tuple(scopes_l[: len(scopes)]), tuple(keep), tuple(steps), final, work, peak)


def _expand(table: np.ndarray, scope: Scope, layout: Scope, domains: tuple[int, ...]) -> np.ndarray:
    """View ``table`` (axes ``scope``) broadcastable to ``layout``, contiguous in layout order."""
    if not scope:
        return table.reshape((1,) * len(layout))
    order = sorted(range(len(scope)), key=lambda i: layout.index(scope[i]))
    moved = np.ascontiguousarray(table.transpose(order)) if order != list(range(len(scope))) else table
    return moved.reshape(tuple(domains[u] if u in scope else 1 for u in layout))


def _premerge(pairs: list[tuple[np.ndarray, Scope]], layout: Scope, dom: tuple[int, ...]):
    """Add together factors whose joint scope is smaller than ``layout`` first (e.g. a node cost into an edge),
    so that the full-size table is touched by as few additions as possible."""
    full = prod(dom[u] for u in layout)
    pairs = list(pairs)
    while len(pairs) > 2:
        best = None
        for i, j in itertools.combinations(range(len(pairs)), 2):
            union = tuple(u for u in layout if u in pairs[i][1] or u in pairs[j][1])
            size = prod(dom[u] for u in union)
            if size < full and (best is None or size < best[0]):
                best = (size, i, j, union)
        if best is None:
            break
        _, i, j, union = best
        merged = _expand(pairs[i][0], pairs[i][1], union, dom) + _expand(pairs[j][0], pairs[j][1], union, dom)
        pairs = [p for k, p in enumerate(pairs) if k not in (i, j)] + [(merged, union)]
    return pairs


def _combine_min(parts: list[np.ndarray], shape: tuple[int, ...], scratch: np.ndarray):
    """``min`` and ``argmin`` over the last axis of the broadcast sum of ``parts``.

    Works in blocks of rows (axis 0) that fit ``scratch``, reused across blocks and steps: re-allocating a
    multi-megabyte block each time (fresh pages fault in on first touch) costs more than the arithmetic.
    """
    if len(shape) == 1:
        acc = np.add(parts[0], parts[1]) if len(parts) > 1 else np.array(parts[0], dtype=np.float64)
        for p in parts[2:]:
            acc += p
        acc = np.broadcast_to(acc, shape)
        a = int(acc.argmin())
        return np.asarray(acc[a]), np.asarray(a, dtype=_index_dtype(shape[-1]))
    inner = prod(shape[1:])
    rows = max(1, scratch.size // inner)
    if rows * inner > scratch.size:
        scratch = np.empty(rows * inner)
    best = np.empty(shape[:-1])
    arg = np.empty(shape[:-1], dtype=_index_dtype(shape[-1]))
    flat_best, flat_arg = best.reshape(-1), arg.reshape(-1)
    row_ids = np.arange(rows * inner // shape[-1])
    for lo in range(0, shape[0], rows):
        n = min(rows, shape[0] - lo)
        acc = scratch[: n * inner].reshape((n, *shape[1:]))
        sl = [p[lo : lo + n] if p.shape[0] > 1 else p for p in parts]
        if len(sl) > 1:
            np.add(sl[0], sl[1], out=acc)
        else:
            np.copyto(acc, sl[0])
        for p in sl[2:]:
            np.add(acc, p, out=acc)
        acc2 = acc.reshape(-1, shape[-1])
        a = acc2.argmin(axis=1)
        out = slice(lo * inner // shape[-1], (lo + n) * inner // shape[-1])
        flat_best[out] = acc2[row_ids[: a.size], a]
        flat_arg[out] = a
    return best, arg


def _index_dtype(size: int) -> type:
    return np.uint16 if size <= 65535 else np.int32


def run(
    plan: Elimination,
    tables: Sequence[np.ndarray],
    *,
    chunk: int = 1 << 16,
    keep_outputs: bool = False,
    base: Result | None = None,
    changed: Collection[int] = (),
) -> Result:
    """Execute ``plan`` on factor ``tables`` (aligned with ``plan.scopes``).

    Incremental re-run: given ``base``, an earlier run of the same plan made with ``keep_outputs=True``, and the
    ids of the initial factors whose tables differ (``changed``), only the steps that depend on them are
    recomputed. The DP uses this when it conditions on a global node: only the few node costs next to the
    global change, so most of a layer's steps are reused.
    """
    dom = plan.domains
    scratch = np.empty(min(chunk, max(plan.peak, 1)))
    live: list[np.ndarray | None] = list(tables)
    scopes = list(plan.scopes)
    argmins, outputs, dirty = [], [], set(changed)
    for k, step in enumerate(plan.steps):
        if base is not None and dirty.isdisjoint(step.inputs):
            best, arg = base.outputs[k], base.records[k]
        else:
            pairs = _premerge([(live[f], scopes[f]) for f in step.inputs], step.layout, dom)
            parts = [_expand(t, sc, step.layout, dom) for t, sc in pairs] or [np.zeros((1,) * len(step.layout))]
            best, arg = _combine_min(parts, tuple(dom[u] for u in step.layout), scratch)
            dirty.add(len(live))
        for f in step.inputs:
            live[f] = None  # free inputs early
        live.append(best)
        scopes.append(step.rest)
        argmins.append(arg)
        if keep_outputs:
            outputs.append(best)
    keep = plan.keep
    table = np.zeros(tuple(dom[u] for u in keep))
    for f in plan.final:
        table = table + _expand(live[f], scopes[f], keep, dom) if keep else table + live[f].reshape(())
    return Result(table, tuple(argmins), tuple(outputs))


def backtrack(plan: Elimination, records: Sequence[np.ndarray], kept: Sequence[int]) -> list[int]:
    """Values of every variable, given the values of the kept ones (in ``plan.keep`` order)."""
    values = [-1] * len(plan.domains)
    for u, p in zip(plan.keep, kept):
        values[u] = int(p)
    for step, arg in zip(reversed(plan.steps), reversed(records)):
        values[step.var] = int(arg[tuple(values[u] for u in step.rest)])
    return values
