"""Long edges with few distinct rows, routed through a small node the DP conditions on.

A tied word embedding is read by the first node and by the LM head at the end, so its edge ``e_uv`` jumps every
cut of the layers between them: the DP would carry ``u``'s strategy through the whole model as an extra table axis,
in one segment, and could not share the identical layers' tables (Eq. 14). But ``e_uv`` depends on ``u``'s strategy
only through the layout in which ``u`` stores the parameter, and many strategies store it alike: the matrix has few
distinct rows.

:func:`add_proxies` replaces such an edge by a *proxy* node ``w`` with one state per distinct row ``r``::

    e_uw(p, r) = 0 if row(p) == r else +inf          e_wv(r, q) = e_uv(p, q) for any p with row(p) == r

(or, when ``e_uv`` has fewer distinct columns, the same with ``u`` and ``v`` swapped). For every choice of ``u``
and ``v`` the cheapest ``w`` adds exactly ``e_uv(p_u, p_v)``, so the minimum is unchanged. The proxy has at most
``max_states`` states, and the DP makes it a global node (:func:`~primepar_fx.search.structure.select_globals`):
it conditions on each state (all of them at once, as an axis of the chain's arrays), the layers' cuts come back,
and only the segments at the two ends are recomputed per state.

Only edges that jump at least two cut points of the graph without the candidates are proxied; elsewhere the
engine's extra axis is cheap.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from primepar_fx.search.problem import CostGraph
from primepar_fx.search.structure import cut_positions, jump_counts

#: a proxy's node name: ``~proxy:u->v``, which no captured node has
PREFIX = "~proxy:"


@dataclass(frozen=True)
class Proxied:
    """``graph`` with the proxies added (the input graph when there are none) and, per proxy, how to read its
    state off a choice of the original nodes: ``(node, classes)`` with ``classes[p]`` the proxy's state when
    ``node`` takes strategy ``p``."""

    graph: CostGraph
    proxies: dict[str, tuple[str, np.ndarray]]

    def extend(self, choice: dict[str, int]) -> dict[str, int]:
        """``choice`` with every proxy's state filled in (the one that adds the original edge's cost)."""
        return choice | {w: int(classes[choice[n]]) for w, (n, classes) in self.proxies.items()}

    def strip(self, choice: dict[str, int]) -> dict[str, int]:
        return {n: p for n, p in choice.items() if n not in self.proxies}


def _narrow_side(matrix: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """``(axis, distinct, classes)``: the axis (0 rows, 1 columns) with fewer distinct slices, the distinct slices
    (as rows) and the class of each slice."""
    rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
    cols, col_of = np.unique(matrix.T, axis=0, return_inverse=True)
    if len(cols) < len(rows):
        return 1, cols, col_of.reshape(-1)
    return 0, rows, row_of.reshape(-1)


def _screen(matrix: np.ndarray, weights: np.ndarray, max_states: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """:func:`_narrow_side` of ``matrix`` when its narrow side has at most ``max_states`` distinct slices and fewer
    than its strategies, else ``None``."""
    # a quick bound first: equal rows have equal sums under any weights (rows of +inf stay +inf, never NaN)
    rows = len(np.unique(matrix @ weights[: matrix.shape[1]]))
    cols = len(np.unique(weights[: matrix.shape[0]] @ matrix))
    if min(rows, cols) > max_states:
        return None
    axis, distinct, classes = _narrow_side(matrix)
    if len(distinct) <= max_states and len(distinct) < matrix.shape[axis]:
        return axis, distinct, classes
    return None


def add_proxies(
    graph: CostGraph, *, max_states: int, min_jumps: int = 2, skip: frozenset[str] = frozenset()
) -> Proxied:
    """Route every edge that jumps ``min_jumps`` or more cuts, and has at most ``max_states`` distinct rows or
    columns (fewer than the strategies on that side), through a proxy node (module docstring). The edges of the
    ``skip`` nodes (those the DP will condition on anyway) are left out when finding cuts.

    Candidates are the edges that alone jump ``min_jumps`` or more positions no other edge jumps; the cuts are then
    found without all of them."""
    if max_states < 1:
        return Proxied(graph, {})
    order = graph.nodes
    kept = [e for e in graph.edge_cost if e[0] not in skip and e[1] not in skip]
    weights = np.random.default_rng(0).random(max((max(m.shape) for m in graph.edge_cost.values()), default=1)) + 0.5
    alone = np.concatenate(([0], np.cumsum(jump_counts(order, kept) == 1)))  # alone[k]: such positions before k
    cands = {}
    screened: dict[int, tuple[int, np.ndarray, np.ndarray] | None] = {}  # by the id of a (shared) edge matrix
    for u, v in kept:
        lo, hi, matrix = graph.index[u], graph.index[v], graph.edge_cost[u, v]
        if alone[hi] - alone[lo + 1] < min_jumps or min(matrix.shape) <= 1:
            continue
        if id(matrix) not in screened:
            screened[id(matrix)] = _screen(matrix, weights, max_states)
        if screened[id(matrix)] is not None:
            cands[u, v] = screened[id(matrix)]
    if not cands:
        return Proxied(graph, {})
    cuts = cut_positions(order, [e for e in kept if e not in cands])
    node_cost, edge_cost = dict(graph.node_cost), {e: m for e, m in graph.edge_cost.items()}
    memory = None if graph.node_memory is None else dict(graph.node_memory)
    keys = None if graph.node_key is None else dict(graph.node_key)
    after: dict[str, list[str]] = {}
    proxies: dict[str, tuple[str, np.ndarray]] = {}
    arrays: dict[int, tuple[np.ndarray, ...]] = {}
    for (u, v), (axis, distinct, classes) in cands.items():
        lo, hi = graph.index[u], graph.index[v]
        if bisect.bisect_left(cuts, hi) - bisect.bisect_right(cuts, lo) < min_jumps:
            continue
        w = f"{PREFIX}{u}->{v}"
        states = len(distinct)
        if id(classes) not in arrays:  # one set per screened matrix, so proxies of identical layers share them
            pick = np.where(classes[:, None] == np.arange(states)[None, :], 0.0, np.inf)  # [side's strategy, state]
            arrays[id(classes)] = (pick, pick.T, np.ascontiguousarray(distinct.T), np.zeros(states))
        pick, pick_t, distinct_t, zeros = arrays[id(classes)]
        del edge_cost[u, v]
        if axis == 0:  # u's strategy picks the row: u -> w (consistency), w -> v (the row)
            edge_cost[u, w], edge_cost[w, v] = pick, distinct
            proxies[w] = (u, classes)
        else:  # v's strategy picks the column: u -> w (the column), w -> v (consistency)
            edge_cost[u, w], edge_cost[w, v] = distinct_t, pick_t
            proxies[w] = (v, classes)
        node_cost[w] = zeros
        if memory is not None:
            memory[w] = zeros
        if keys is not None:
            keys[w] = ("proxy", u, v, states)
        after.setdefault(u, []).append(w)
    if not proxies:
        return Proxied(graph, {})
    nodes = tuple(x for n in order for x in (n, *after.get(n, ())))
    return Proxied(CostGraph(nodes, node_cost, edge_cost, memory, keys), proxies)
