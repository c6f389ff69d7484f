"""The integer linear program (ILP) over the same costs: the exact cross-check of the DP, and the budget certifier.

Variables:

* ``x[i, p]`` binary: node ``i`` uses strategy ``p`` (forbidden strategies are dropped beforehand by
  :func:`~primepar_fx.search.problem.reduce_graph`);
* ``y[u, v, p, q]`` continuous in ``[0, 1]``: edge ``(u, v)`` sees the pair ``(p, q)``; only finite pairs get one.

Objective (Eq. 10)::

    min  sum_(i,p) (n_i(p) + alpha * m_i(p)) x[i,p]  +  sum_(u,v,p,q) e_uv(p, q) y[u,v,p,q]

Constraints, each with the function that builds it:

* one strategy per node, ``sum_p x[i, p] = 1`` -- :func:`_add_nodes`;
* the edge linearisation, ``sum_q y[u,v,p,q] = x[u,p]`` and ``sum_p y[u,v,p,q] = x[v,q]`` -- :func:`_add_edges`.
  With binary ``x`` this forces ``y[u,v,p,q] = x[u,p] x[v,q]`` (a transportation polytope with 0/1 margins has
  one point), so ``y`` need not be integral; a pair with no ``y`` (an ``inf`` entry) is thereby forbidden. Edges
  whose matrix is one constant add that constant and no variables;
* the memory budget, ``sum_(i,p) m_i(p) x[i,p] <= B`` -- :func:`_add_budget`, scaled by ``B``. The plan's memory
  is re-summed exactly; if solver tolerances let it past ``B``, the constraint is tightened (``BUDGET_MARGINS``).

Solver: HiGHS through ``pulp.HiGHS`` when ``highspy`` is importable, else CBC. A solve is *proven optimal* only
when ``prob.sol_status == 1``; a time limit may stop it with a feasible plan (``sol_status == 2``) while
``LpStatus`` still says "Optimal".
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from primepar_fx.search.problem import CostGraph, InfeasibleGraph, SearchError, plan_memory

log = logging.getLogger(__name__)

#: relative tightenings of the budget constraint tried in turn if a plan breaks the budget by solver tolerance
BUDGET_MARGINS = (0.0, 1e-9, 1e-7, 1e-5)


@dataclass(frozen=True)
class IlpResult:
    """An ILP plan: the strategy per node, whether the solver proved it optimal, the solver's name, the wall time
    and the number of variables."""

    choice: dict[str, int]
    proven_optimal: bool
    solver: str
    seconds: float
    variables: int


class IlpInfeasible(SearchError):
    """The ILP has no feasible point (for a budget: no plan fits)."""


def ilp_size(graph: CostGraph, past: float = math.inf) -> int:
    """Number of variables the ILP would have (to decide whether it is affordable); counting stops once it is above
    ``past`` (the count returned is then some number above ``past``, not the whole)."""
    n = sum(graph.strategies(v) for v in graph.nodes)
    constant: dict[int, bool] = {}  # identical layers share their arrays: each is checked once
    for a in graph.edge_cost.values():
        if n > past:
            break
        if id(a) not in constant:
            constant[id(a)] = _constant(a)
        n += 0 if constant[id(a)] else a.size
    return n


def _constant(a: np.ndarray) -> bool:
    return bool(np.isfinite(a).all() and (a == a.flat[0]).all())


def _solver(time_limit: float | None) -> tuple[pulp.LpSolver, str]:
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit)
    if highs.available():
        return highs, "highs"
    with warnings.catch_warnings():  # PuLP 3.x deprecates its bundled CBC in favour of a separately installed one
        warnings.simplefilter("ignore", DeprecationWarning)
        # CBC's integer preprocessing cut off the optimum of a 13-node graph under a memory budget and still
        # reported it proven (tests/search/test_search.py::test_the_ilp_under_a_budget_finds_the_dp_s_plan)
        options = ["preprocess off"]
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=0.0, options=options), "cbc"


def _variable(prob: pulp.LpProblem, name: str, low: float, cat: str) -> pulp.LpVariable:
    """``prob.add_variable`` where PuLP has it (3.x; 4.0 requires it), else the ``LpVariable`` constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, None if cat == pulp.LpContinuous else 1, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def _add_nodes(prob: pulp.LpProblem, graph: CostGraph) -> dict[str, list[pulp.LpVariable]]:
    x = {}
    for i, n in enumerate(graph.nodes):
        x[n] = [_variable(prob, f"x_{i}_{p}", 0, pulp.LpBinary) for p in range(graph.strategies(n))]
        prob += pulp.lpSum(x[n]) == 1, f"one_{i}"
    return x


def _objective_scale(graph: CostGraph, alpha: float, memory_only: bool) -> float:
    """A factor that brings the largest objective coefficient to ~1e6.

    Costs in seconds can be ~1e-9..1e-2; left as they are, they sit below the solver's absolute tolerances and a
    worse plan passes as proven optimal. The choice is re-evaluated exactly afterwards, so scaling is harmless.
    """
    largest = 0.0
    for n in graph.nodes:
        w = graph.memory_of(n) if memory_only else graph.node_cost[n] + alpha * graph.memory_of(n)
        finite = np.abs(w[np.isfinite(w)])
        largest = max(largest, float(finite.max()) if finite.size else 0.0)
    if not memory_only:
        for e in graph.edge_cost.values():
            finite = np.abs(e[np.isfinite(e)])
            largest = max(largest, float(finite.max()) if finite.size else 0.0)
    return 1e6 / largest if largest > 0 else 1.0


def _add_edges(
    prob: pulp.LpProblem, graph: CostGraph, x: dict[str, list[pulp.LpVariable]], with_cost: bool, scale: float = 1.0
):
    """Linearised edges; returns the objective terms and the constant from constant edges."""
    terms, constant = [], 0.0
    for k, ((u, v), e) in enumerate(graph.edge_cost.items()):
        if _constant(e):
            constant += scale * float(e.flat[0]) if with_cost else 0.0
            continue
        rows: list[list] = [[] for _ in range(e.shape[0])]
        cols: list[list] = [[] for _ in range(e.shape[1])]
        for p, q in zip(*np.nonzero(np.isfinite(e))):
            y = _variable(prob, f"y_{k}_{p}_{q}", 0.0, pulp.LpContinuous)
            rows[p].append(y)
            cols[q].append(y)
            if with_cost and e[p, q] != 0.0:
                terms.append(scale * float(e[p, q]) * y)
        for p, ys in enumerate(rows):
            prob += pulp.lpSum(ys) == x[u][p], f"row_{k}_{p}"
        for q, ys in enumerate(cols):
            prob += pulp.lpSum(ys) == x[v][q], f"col_{k}_{q}"
    return terms, constant


def _add_budget(
    prob: pulp.LpProblem, graph: CostGraph, x: dict[str, list[pulp.LpVariable]], budget: float, margin: float
) -> None:
    scale = budget if budget > 0 else 1.0
    lhs = pulp.lpSum(
        float(m) / scale * var for n in graph.nodes for m, var in zip(graph.memory_of(n), x[n]) if m != 0.0
    )
    prob += lhs <= budget / scale - margin * abs(budget / scale), "memory_budget"


def _solve_once(graph: CostGraph, alpha: float, budget: float | None, margin: float, memory_only: bool, limit):
    prob = pulp.LpProblem("primepar_search", pulp.LpMinimize)
    x = _add_nodes(prob, graph)
    scale = _objective_scale(graph, alpha, memory_only)
    terms, constant = _add_edges(prob, graph, x, with_cost=not memory_only, scale=scale)
    for n in graph.nodes:
        weights = graph.memory_of(n) if memory_only else graph.node_cost[n] + alpha * graph.memory_of(n)
        terms += [scale * float(w) * var for w, var in zip(weights, x[n]) if w != 0.0]
    prob += pulp.lpSum(terms) + constant
    if budget is not None:
        _add_budget(prob, graph, x, budget, margin)
    solver, name = _solver(limit)
    prob.solve(solver)
    status = prob.sol_status
    if status == pulp.LpSolutionInfeasible:
        if budget is None:
            raise InfeasibleGraph("the ILP has no feasible plan")
        raise IlpInfeasible(f"no plan fits the memory budget {budget:.6g}")
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SearchError(f"the ILP solver ({name}) found no plan: {pulp.LpStatus[prob.status]}, status {status}")
    choice = {n: int(np.argmax([v.value() or 0.0 for v in x[n]])) for n in graph.nodes}
    return choice, status == pulp.LpSolutionOptimal, name, prob.numVariables()


def solve_ilp(
    graph: CostGraph,
    *,
    alpha: float = 0.0,
    memory_budget: float | None = None,
    minimise_memory: bool = False,
    time_limit: float | None = None,
) -> IlpResult:
    """Solve the ILP of the module docstring (or, with ``minimise_memory``, minimise memory alone).

    The budget constraint is first posed exactly; if solver tolerances let the rounded plan exceed the budget
    (re-summed exactly), it is tightened by ``BUDGET_MARGINS`` in turn.
    """
    start = time.perf_counter()
    for margin in BUDGET_MARGINS:
        choice, proven, name, size = _solve_once(graph, alpha, memory_budget, margin, minimise_memory, time_limit)
        if memory_budget is None or plan_memory(graph, choice) <= memory_budget:
            break
        log.info("ILP plan exceeds the budget by solver tolerance; tightening by %.0e", margin)
    else:
        raise SearchError(f"the ILP could not return a plan within the budget {memory_budget:.6g}")
    seconds = time.perf_counter() - start
    log.debug("ILP (%s): %d variables, proven %s, %.3fs", name, size, proven, seconds)
    return IlpResult(choice, proven, name, seconds, size)
