"""The ILP of :mod:`~primepar_fx.search.ilp` as arrays, and HiGHS over them: shared by the whole ILP
(:func:`~primepar_fx.search.ilp.solve_ilp`) and its column generation (:mod:`~primepar_fx.search.colgen`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from primepar_fx.search.problem import CostGraph


def constant_edge(a: np.ndarray) -> bool:
    """Whether the edge matrix ``a`` is one finite constant (it then adds that constant and no variables)."""
    return bool(np.isfinite(a).all() and (a == a.flat[0]).all())


def highspy_module():
    """The ``highspy`` module, or None where it is not installed."""
    try:
        import highspy  # noqa: PLC0415 -- optional (the ``ilp`` extra); PuLP's CBC is the fallback
    except ImportError:
        return None
    return highspy


@dataclass
class IlpModel:
    """The ILP as arrays: column costs and bounds, the constraint matrix in coordinates, row bounds."""

    cost: np.ndarray  # per column, scaled
    upper: np.ndarray  # per column (0 forbids it)
    integer: int  # the first ``integer`` columns (the x's) are binary, the rest (the y's) continuous
    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    constant: float  # added to the objective (constant edges)
    node_columns: dict[str, slice]
    scale: float  # the objective's factor (:func:`objective_scale`)
    edge_rows: dict[tuple[str, str], int]  # a non-constant edge's first row: its P_u rows, then its P_v rows


def objective_scale(graph: CostGraph, alpha: float, memory_only: bool) -> float:
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


def build_model(
    graph: CostGraph,
    alpha: float,
    budget: float | None,
    margin: float,
    memory_only: bool,
    pairs: Mapping[tuple[str, str], tuple[np.ndarray, np.ndarray]] | None = None,
) -> IlpModel:
    """The ILP of the module docstring as arrays (one pass over the nodes and edges, no per-variable objects).

    ``pairs``: per non-constant edge, the (p, q) pairs that get a ``y`` (all finite ones when not given): the
    restricted master of a column generation (:mod:`~primepar_fx.search.colgen`)."""
    scale = objective_scale(graph, alpha, memory_only)
    costs, uppers, rows, cols, values, lower, upper = [], [], [], [], [], [], []
    node_columns, column, row = {}, 0, 0
    for n in graph.nodes:  # one strategy per node
        weights = graph.memory_of(n) if memory_only else graph.node_cost[n] + alpha * graph.memory_of(n)
        k = weights.size
        allowed = np.isfinite(weights)
        costs.append(np.where(allowed, scale * weights, 0.0))
        uppers.append(allowed.astype(np.float64))
        node_columns[n] = slice(column, column + k)
        rows.append(np.full(k, row))
        cols.append(np.arange(column, column + k))
        values.append(np.ones(k))
        lower.append(1.0)
        upper.append(1.0)
        column, row = column + k, row + 1
    integer, constant, edge_rows = column, 0.0, {}
    for (u, v), e in graph.edge_cost.items():  # the linearisation: sum_q y[p, q] = x[u, p], sum_p y[p, q] = x[v, q]
        if constant_edge(e):
            constant += 0.0 if memory_only else scale * float(e.flat[0])
            continue
        p, q = np.nonzero(np.isfinite(e)) if pairs is None else pairs[u, v]
        m, (pu, pv), edge_rows[u, v] = p.size, e.shape, row
        ys = np.arange(column, column + m)
        costs.append(np.zeros(m) if memory_only else scale * e[p, q])
        uppers.append(np.ones(m))
        rows += [row + p, row + np.arange(pu), row + pu + q, row + pu + np.arange(pv)]
        cols += [ys, np.arange(pu) + node_columns[u].start, ys, np.arange(pv) + node_columns[v].start]
        values += [np.ones(m), -np.ones(pu), np.ones(m), -np.ones(pv)]
        lower += [0.0] * (pu + pv)
        upper += [0.0] * (pu + pv)
        column, row = column + m, row + pu + pv
    if budget is not None:  # the memory budget, scaled by the budget
        per = budget if budget > 0 else 1.0
        for n in graph.nodes:
            rows.append(np.full(graph.strategies(n), row))
            cols.append(np.arange(node_columns[n].start, node_columns[n].stop))
            values.append(graph.memory_of(n) / per)
        lower.append(-np.inf)
        upper.append(budget / per - margin * abs(budget / per))
    return IlpModel(
        np.concatenate(costs),
        np.concatenate(uppers),
        integer,
        np.concatenate(rows),
        np.concatenate(cols),
        np.concatenate(values),
        np.asarray(lower, dtype=np.float64),
        np.asarray(upper, dtype=np.float64),
        constant,
        node_columns,
        scale,
        edge_rows,
    )


def _silently(make):
    """``make()`` with the process's standard output closed: HiGHS prints a banner when its first instance is
    made, whatever its options, and the CLI's plans go to standard output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return make()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def highs_instance(model: IlpModel, limit: float | None, *, binary: bool = True):
    """A HiGHS instance holding ``model`` (the x's binary unless ``binary`` is false: the LP relaxation)."""
    highspy = highspy_module()
    h = _silently(highspy.Highs)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)  # the default 1e-4 would call a plan 0.01% off the optimum optimal
    if limit is not None:
        h.setOptionValue("time_limit", float(limit))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.cost.size, model.row_lower.size
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = model.cost, np.zeros(model.cost.size), model.upper
    lp.row_lower_ = np.where(np.isinf(model.row_lower), -highspy.kHighsInf, model.row_lower)
    lp.row_upper_ = model.row_upper
    order = np.lexsort((model.rows, model.cols))  # column-wise
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate(([0], np.cumsum(np.bincount(model.cols, minlength=model.cost.size))))
    lp.a_matrix_.index_ = model.rows[order].astype(np.int32)
    lp.a_matrix_.value_ = model.values[order]
    h.passModel(lp)
    if binary:
        set_binary(h, model.integer)
    return h


def set_binary(h, count: int) -> None:
    """Make the first ``count`` columns of the HiGHS instance ``h`` integer (with bounds 0..1: binary)."""
    kinds = np.full(count, int(highspy_module().HighsVarType.kInteger), dtype=np.uint8)
    h.changeColsIntegrality(count, np.arange(count, dtype=np.int32), kinds)


def highs_outcome(h) -> tuple[np.ndarray | None, str]:
    """After ``h.run()``: the column values (None without a plan) and ``optimal``, ``feasible`` (stopped with a
    plan), ``infeasible`` or the solver's status."""
    highspy = highspy_module()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None, "infeasible"
    has_plan = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
    if not has_plan:
        return None, h.modelStatusToString(status)
    optimal = status == highspy.HighsModelStatus.kOptimal
    return np.asarray(h.getSolution().col_value), "optimal" if optimal else "feasible"
