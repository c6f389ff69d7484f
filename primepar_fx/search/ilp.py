"""The integer linear program (ILP) over the same costs: the exact cross-check of the DP, and the budget certifier.

Variables:

* ``x[i, p]`` binary: node ``i`` uses strategy ``p`` (forbidden strategies are dropped beforehand by
  :func:`~primepar_fx.search.problem.reduce_graph`);
* ``y[u, v, p, q]`` continuous in ``[0, 1]``: edge ``(u, v)`` sees the pair ``(p, q)``; only finite pairs get one.

Objective (Eq. 10)::

    min  sum_(i,p) (n_i(p) + alpha * m_i(p)) x[i,p]  +  sum_(u,v,p,q) e_uv(p, q) y[u,v,p,q]

Constraints, all built as arrays by :func:`~primepar_fx.search.ilp_arrays.build_model` (no per-variable objects):

* one strategy per node, ``sum_p x[i, p] = 1``;
* the edge linearisation, ``sum_q y[u,v,p,q] = x[u,p]`` and ``sum_p y[u,v,p,q] = x[v,q]``.
  With binary ``x`` this forces ``y[u,v,p,q] = x[u,p] x[v,q]`` (a transportation polytope with 0/1 margins has
  one point), so ``y`` need not be integral; a pair with no ``y`` (an ``inf`` entry) is thereby forbidden. Edges
  whose matrix is one constant add that constant and no variables;
* the memory budget, ``sum_(i,p) m_i(p) x[i,p] <= B``, scaled by ``B``. The plan's memory is re-summed exactly;
  if solver tolerances let it past ``B``, the constraint is tightened (``BUDGET_MARGINS``).

Solvers (:func:`solver_name`): HiGHS, given the arrays directly through ``highspy`` (the ``ilp`` extra), where it
is installed; else CBC through PuLP, which builds one Python object per variable. HiGHS is what makes the exact
cross-check of the full partition space affordable: two llama2-70b layers on the full 8-GPU space, 1.9 million
variables, solve to proven optimality in less time than building the PuLP model alone takes
(docs/benchmarks/measured_in_code.md). HiGHS runs with ``mip_rel_gap = 0`` (its default, 1e-4, would accept a plan
0.01% above the optimum as optimal). A solve is *proven optimal* only when the solver says so; a time limit may stop it
with a feasible plan, which is returned as not proven.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pulp

from primepar_fx.search.colgen import solve_generated
from primepar_fx.search.ilp_arrays import (
    IlpModel,
    build_model,
    constant_edge,
    highs_instance,
    highs_outcome,
    highspy_module,
)
from primepar_fx.search.problem import CostGraph, InfeasibleGraph, SearchError, evaluate, plan_memory

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
            constant[id(a)] = constant_edge(a)
        n += 0 if constant[id(a)] else a.size
    return n


def solver_name(solver: str | None = None) -> str:
    """The ILP solver a solve would use: ``solver`` when given (``"highs"`` or ``"cbc"``), else HiGHS where
    ``highspy`` is installed and CBC (bundled with PuLP) otherwise."""
    if solver not in (None, "highs", "cbc"):
        raise ValueError(f"solver must be 'highs', 'cbc' or None, got {solver!r}")
    if solver == "highs" and highspy_module() is None:
        raise SearchError("solver='highs' needs the highspy package: pip install 'primepar-fx[ilp]'")
    return solver or ("highs" if highspy_module() is not None else "cbc")


def _run_highs(model: IlpModel, limit: float | None) -> tuple[np.ndarray | None, str]:
    """Solve ``model`` with HiGHS."""
    h = highs_instance(model, limit)
    h.run()
    return highs_outcome(h)


def _run_cbc(model: IlpModel, limit: float | None) -> tuple[np.ndarray | None, str]:
    """Solve ``model`` with CBC through PuLP (the fallback where ``highspy`` is not installed)."""
    prob = pulp.LpProblem("primepar_search", pulp.LpMinimize)
    columns = [
        _variable(prob, f"x_{j}" if j < model.integer else f"y_{j}", 0, up, j < model.integer)
        for j, up in enumerate(model.upper.tolist())
    ]
    prob += pulp.lpSum(c * columns[j] for j, c in enumerate(model.cost.tolist()) if c != 0.0) + model.constant
    order = np.argsort(model.rows, kind="stable")
    bounds = np.searchsorted(model.rows[order], np.arange(model.row_lower.size + 1))
    cols, values = model.cols[order].tolist(), model.values[order].tolist()
    for r, (low, up) in enumerate(zip(model.row_lower.tolist(), model.row_upper.tolist())):
        lhs = pulp.lpSum(values[k] * columns[cols[k]] for k in range(bounds[r], bounds[r + 1]))
        prob += (lhs == up) if low == up else (lhs <= up), f"r_{r}"
    with warnings.catch_warnings():  # PuLP 3.x deprecates its bundled CBC in favour of a separately installed one
        warnings.simplefilter("ignore", DeprecationWarning)
        # CBC's integer preprocessing cut off the optimum of a 13-node graph under a memory budget and still
        # reported it proven (tests/search/test_search.py::test_the_ilp_under_a_budget_finds_the_dp_s_plan)
        cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=0.0, options=["preprocess off"])
    prob.solve(cbc)
    status = prob.sol_status
    if status == pulp.LpSolutionInfeasible:
        return None, "infeasible"
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, f"{pulp.LpStatus[prob.status]}, status {status}"
    values = np.array([v.value() or 0.0 for v in columns])
    return values, "optimal" if status == pulp.LpSolutionOptimal else "feasible"


def _variable(prob: pulp.LpProblem, name: str, low: float, up: float, binary: bool) -> pulp.LpVariable:
    """``prob.add_variable`` where PuLP has it (3.x; 4.0 requires it), else the ``LpVariable`` constructor."""
    cat = pulp.LpBinary if binary else pulp.LpContinuous
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


def _solve_once(
    graph: CostGraph, alpha: float, budget: float | None, margin: float, memory_only: bool, limit, name, start
):
    if name == "highs" and _usable_start(graph, start, budget, margin):
        values, outcome, model, generated = solve_generated(
            graph, start, alpha=alpha, budget=budget, margin=margin, memory_only=memory_only, limit=limit
        )
        log.debug("ILP by column generation: %s", generated)
        size = model.integer + generated.pairs
    else:
        model = build_model(graph, alpha, budget, margin, memory_only)
        values, outcome = (_run_highs if name == "highs" else _run_cbc)(model, limit)
        size = model.cost.size
    if outcome == "infeasible":
        if budget is None:
            raise InfeasibleGraph("the ILP has no feasible plan")
        raise IlpInfeasible(f"no plan fits the memory budget {budget:.6g}")
    if values is None:
        raise SearchError(f"the ILP solver ({name}) found no plan: {outcome}")
    choice = {n: int(np.argmax(values[cols])) for n, cols in model.node_columns.items()}
    return choice, outcome == "optimal", size


def _usable_start(graph: CostGraph, start: Mapping[str, int] | None, budget: float | None, margin: float) -> bool:
    """Whether ``start`` keeps a column generation's first master feasible: a plan of finite cost, within the
    budget as this solve poses it (tightened by ``margin``)."""
    if start is None:
        return False
    if set(start) != set(graph.nodes) or any(not 0 <= start[n] < graph.strategies(n) for n in graph.nodes):
        raise ValueError("start must give every node of the graph one of its strategies")
    if not math.isfinite(evaluate(graph, start)):
        raise ValueError("start has infinite cost (a forbidden strategy or pair)")
    return budget is None or plan_memory(graph, start) <= budget - margin * abs(budget)


def solve_ilp(
    graph: CostGraph,
    *,
    alpha: float = 0.0,
    memory_budget: float | None = None,
    minimise_memory: bool = False,
    time_limit: float | None = None,
    solver: str | None = None,
    start: Mapping[str, int] | None = None,
) -> IlpResult:
    """Solve the ILP of the module docstring (or, with ``minimise_memory``, minimise memory alone) with ``solver``
    (:func:`solver_name`: HiGHS where installed, else CBC).

    ``start``: a plan of finite cost (within ``memory_budget``, if given). With HiGHS the ILP is then solved by
    column generation from it (:mod:`~primepar_fx.search.colgen`): exact, with a share of the edge pairs as
    variables (``variables`` counts those), where the whole ILP would not fit in memory. CBC ignores it.

    The budget constraint is first posed exactly; if solver tolerances let the rounded plan exceed the budget
    (re-summed exactly), it is tightened by ``BUDGET_MARGINS`` in turn.
    """
    name = solver_name(solver)
    began = time.perf_counter()
    for margin in BUDGET_MARGINS:
        choice, proven, size = _solve_once(
            graph, alpha, memory_budget, margin, minimise_memory, time_limit, name, start
        )
        if memory_budget is None or plan_memory(graph, choice) <= memory_budget:
            break
        log.info("ILP plan exceeds the budget by solver tolerance; tightening by %.0e", margin)
    else:
        raise SearchError(f"the ILP could not return a plan within the budget {memory_budget:.6g}")
    seconds = time.perf_counter() - began
    log.debug("ILP (%s): %d variables, proven %s, %.3fs", name, size, proven, seconds)
    return IlpResult(choice, proven, name, seconds, size)
