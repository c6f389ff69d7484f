"""The ILP by column generation: exact on the full partition space, with a small share of the edge pairs as
variables.

The ILP of :mod:`~primepar_fx.search.ilp` has a variable ``y`` per finite pair of every edge: 1.9 million for two
llama2-70b layers on the full 8-GPU space, 46 million on the full 16-GPU space, too many to build as one model
(docs/benchmarks/measured_in_code.md). Few of them matter, and the LP's duals say which:

1. **The LP over a few pairs.** The *master* is the ILP with a ``y`` only for some pairs of each edge: at first
   those of a start plan (any plan of finite cost within the budget, so the master is feasible). Its LP
   relaxation gives duals ``a_p`` for an edge's row constraints and ``b_q`` for its column constraints, and with
   them every absent pair's reduced cost ``d(p, q) = e(p, q) - a_p - b_q`` (vectorised over the edge's matrix).
   For every row and every column of every edge the most negative absent pair is added, and the LP solved again,
   until no pair is below ``-TOLERANCE``: the LP value is then the optimum of the *whole* LP, a lower bound ``L``
   on the ILP.
2. **The ILP over those pairs.** With the x's binary the master gives a plan of cost ``U``; it is a plan of the
   whole ILP too (a restriction), so ``L <= optimum <= U``. Where the last LP's x's are already all 0 or 1, that
   LP solution is a plan of cost ``L`` and no MIP is run (``U = L``).
3. **Closing the gap.** For the final duals every plan ``z`` costs at least ``L + sum_j d_j z_j`` (the reduced
   costs ``d_j`` are >= 0 on every column at its lower bound), so a plan that uses a pair with ``d > U - L`` costs
   more than ``U``. Every pair with ``d <= U - L`` is added and the ILP solved once more: its optimum is the whole
   ILP's. A gap below ``TOLERANCE`` times ``U`` (relative 1e-6, the cross-check's tolerance) counts as closed:
   the plan is then within that of the optimum. Where the LP is integral, as on the model graphs measured
   (bench/ilp_check.py), ``U = L`` and neither this step nor step 2's MIP runs.

Costs are in the ILP's scaled units (:func:`~primepar_fx.search.ilp_arrays.objective_scale`: the largest coefficient
~1e6), so ``TOLERANCE`` (1e-6) is far below any cost that matters and above HiGHS's dual feasibility tolerance.
Needs HiGHS (``highspy``): it warm-starts the LP after columns are added.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from primepar_fx.search.ilp_arrays import (
    IlpModel,
    build_model,
    constant_edge,
    highs_instance,
    highs_outcome,
    objective_scale,
    set_binary,
)
from primepar_fx.search.problem import CostGraph

log = logging.getLogger(__name__)

#: a pair enters the master when its reduced cost (scaled units) is below minus this
TOLERANCE = 1e-6
#: an LP column value this close to 0 or 1 counts as integral (HiGHS's primal feasibility tolerance is 1e-7)
INTEGRAL = 1e-6


@dataclass(frozen=True)
class Generated:
    """What the column generation did: LP rounds, pairs in the master at the end, all finite pairs, the LP's lower
    bound and the final plan's cost (scaled units, without the constant edges)."""

    rounds: int
    pairs: int
    all_pairs: int
    lower: float
    upper: float


class _Edges:
    """The non-constant edges with their scaled costs and which pairs the master holds."""

    def __init__(self, graph: CostGraph, scale: float, memory_only: bool) -> None:
        self.keys = [k for k, e in graph.edge_cost.items() if not constant_edge(e)]
        self.cost = {}
        for k in self.keys:
            e = graph.edge_cost[k]
            self.cost[k] = np.where(np.isfinite(e), 0.0, np.inf) if memory_only else scale * e
        self.held = {k: np.zeros(graph.edge_cost[k].shape, dtype=bool) for k in self.keys}
        self.rows: Mapping[tuple[str, str], int] = {}

    def reduced(self, k, duals: np.ndarray) -> np.ndarray:
        """Reduced costs of edge ``k``'s pairs (``inf`` for forbidden ones)."""
        pu, pv = self.cost[k].shape
        r = self.rows[k]
        return self.cost[k] - duals[r : r + pu, None] - duals[None, r + pu : r + pu + pv]


def _start_pairs(edges: _Edges, start: Mapping[str, int]) -> dict:
    pairs = {}
    for u, v in edges.keys:
        p, q = np.array([start[u]]), np.array([start[v]])
        edges.held[u, v][p, q] = True
        pairs[u, v] = (p, q)
    return pairs


def _add_columns(h, edges: _Edges, new: dict) -> int:
    """Give the HiGHS instance ``h`` a ``y`` for each new pair; returns how many."""
    costs, starts, index = [], [], []
    count = 0
    for k, (p, q) in new.items():
        if p.size == 0:
            continue
        edges.held[k][p, q] = True
        pu = edges.cost[k].shape[0]
        r = edges.rows[k]
        costs.append(edges.cost[k][p, q])
        starts.append(count * 2 + 2 * np.arange(p.size))
        index.append(np.stack([r + p, r + pu + q], axis=1).ravel())
        count += p.size
    if not count:
        return 0
    cost = np.concatenate(costs)
    index = np.concatenate(index).astype(np.int32)
    h.addCols(
        count,
        cost,
        np.zeros(count),
        np.ones(count),
        index.size,
        np.concatenate(starts).astype(np.int32),
        index,
        np.ones(index.size),
    )
    return count


def _most_negative(edges: _Edges, duals: np.ndarray) -> dict:
    """Per row and per column of every edge, its absent pair of most negative reduced cost (below -TOLERANCE)."""
    new = {}
    for k in edges.keys:
        d = edges.reduced(k, duals)
        d[edges.held[k]] = np.inf
        pu, pv = d.shape
        by_row = d.argmin(axis=1)
        by_col = d.argmin(axis=0)
        p = np.concatenate([np.arange(pu), by_col])
        q = np.concatenate([by_row, np.arange(pv)])
        keep = d[p, q] < -TOLERANCE
        if keep.any():
            pairs = np.unique(np.stack([p[keep], q[keep]], axis=1), axis=0)
            new[k] = (pairs[:, 0], pairs[:, 1])
    return new


def _within(edges: _Edges, duals: np.ndarray, gap: float) -> dict:
    """Every absent pair whose reduced cost is at most ``gap``."""
    new = {}
    for k in edges.keys:
        d = edges.reduced(k, duals)
        d[edges.held[k]] = np.inf
        p, q = np.nonzero(d <= gap)
        if p.size:
            new[k] = (p, q)
    return new


def _integral(x: np.ndarray) -> bool:
    """Whether the LP's node columns ``x`` are all 0 or 1 (to within ``INTEGRAL``): each edge's pair columns then
    are too (a row and a column of its pairs sum to 1 each), so the LP solution is a plan."""
    return bool(np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= INTEGRAL))


def solve_generated(
    graph: CostGraph,
    start: Mapping[str, int],
    *,
    alpha: float = 0.0,
    budget: float | None = None,
    margin: float = 0.0,
    memory_only: bool = False,
    limit: float | None = None,
) -> tuple[np.ndarray | None, str, IlpModel, Generated]:
    """The ILP of ``graph`` by column generation from the plan ``start`` (module docstring): the column values of
    the final master (None without a plan), the outcome (as :func:`~primepar_fx.search.ilp_arrays.highs_outcome`), the
    model (its node columns) and what the generation did."""
    edges = _Edges(graph, objective_scale(graph, alpha, memory_only), memory_only)
    model = build_model(graph, alpha, budget, margin, memory_only, pairs=_start_pairs(edges, start))
    edges.rows = model.edge_rows
    h = highs_instance(model, limit, binary=False)
    # presolve would rebuild each round's LP from scratch; without it the dual simplex starts from the last basis
    # (less LP time, fewer rounds: docs/benchmarks/measured_in_code.md)
    h.setOptionValue("presolve", "off")
    rounds = 0
    while True:
        h.run()
        values, outcome = highs_outcome(h)
        if outcome != "optimal":
            return None, outcome, model, Generated(rounds, 0, 0, np.nan, np.nan)
        rounds += 1
        lower = h.getObjectiveValue()
        duals = np.asarray(h.getSolution().row_dual)
        added = _add_columns(h, edges, _most_negative(edges, duals))
        log.debug("column generation round %d: LP %.9g, %d pairs added", rounds, lower, added)
        if not added:
            break
    if _integral(values[: model.integer]):  # the LP's optimum is a plan: the whole ILP's optimum, no MIP to run
        upper = lower
    else:
        h.setOptionValue("presolve", "choose")
        set_binary(h, model.integer)
        h.run()
        values, outcome = highs_outcome(h)
        upper = h.getObjectiveValue() if values is not None else np.inf
    gap = upper - lower
    if values is not None and gap > TOLERANCE * max(1.0, abs(upper)):
        if _add_columns(h, edges, _within(edges, duals, gap)):
            h.run()
            values, outcome = highs_outcome(h)
            upper = h.getObjectiveValue()
    pairs = sum(int(m.sum()) for m in edges.held.values())
    every = sum(int(np.isfinite(graph.edge_cost[k]).sum()) for k in edges.keys)
    return values, outcome, model, Generated(rounds, pairs, every, lower, upper)
