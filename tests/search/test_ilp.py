"""The ILP on both of its solvers: HiGHS given the arrays (``highspy``) and CBC through PuLP (the fallback).

Each must reach brute force's optimum on tiny graphs (forbidden strategies and pairs, budgets, the memory-only
objective) and the two must agree with each other and with the DP on larger ones.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from primepar_fx.search import CostGraph, SearchError, evaluate, plan_memory, reduce_graph, solve
from primepar_fx.search.ilp import IlpInfeasible, solve_ilp, solver_name
from primepar_fx.search.ilp_arrays import highspy_module
from primepar_fx.search.problem import InfeasibleGraph
from primepar_fx.search.synthetic import random_dag, transformer_graph

SOLVERS = [
    "cbc",
    pytest.param("highs", marks=pytest.mark.skipif(highspy_module() is None, reason="highspy is not installed")),
]
REL = 1e-6


def brute_force(graph: CostGraph, budget: float = math.inf, memory_only: bool = False) -> float:
    best = math.inf
    for combo in itertools.product(*(range(graph.strategies(n)) for n in graph.nodes)):
        choice = dict(zip(graph.nodes, combo))
        if not math.isfinite(evaluate(graph, choice)):
            continue
        memory = plan_memory(graph, choice)
        if memory <= budget:
            best = min(best, memory if memory_only else evaluate(graph, choice))
    return best


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 10**6), inf=st.sampled_from([0.0, 0.3]), cut=st.floats(0, 1))
def test_each_solver_reaches_brute_force_with_forbidden_pairs_budgets_and_the_memory_objective(
    solver, n, seed, inf, cut
):
    graph = random_dag(n, max_strategies=3, skip_prob=0.5, inf_fraction=inf, seed=seed)
    want = brute_force(graph)
    red = reduce_graph(graph) if math.isfinite(want) else None
    if red is None:
        with pytest.raises(InfeasibleGraph):
            solve_ilp(reduce_graph(graph).graph, solver=solver)
        return
    res = solve_ilp(red.graph, solver=solver)
    assert res.solver == solver and res.proven_optimal
    assert close(evaluate(graph, red.lift(res.choice)), want)
    least = solve_ilp(red.graph, minimise_memory=True, solver=solver)
    assert close(plan_memory(graph, red.lift(least.choice)), brute_force(graph, memory_only=True))
    budget = plan_memory(graph, red.lift(least.choice)) * (1 + cut)
    res = solve_ilp(red.graph, memory_budget=budget, solver=solver)
    assert plan_memory(graph, red.lift(res.choice)) <= budget
    assert close(evaluate(graph, red.lift(res.choice)), brute_force(graph, budget))
    with pytest.raises(IlpInfeasible, match="no plan fits"):
        solve_ilp(red.graph, memory_budget=plan_memory(graph, red.lift(least.choice)) * (1 - 1e-3), solver=solver)


@pytest.mark.parametrize("seed", [0, 1])
def test_highs_and_cbc_agree_with_the_dp_on_transformer_stacks(seed):
    if highspy_module() is None:
        pytest.skip("highspy is not installed")
    graph = transformer_graph(3, strategies=(3, 6), seed=seed)
    red = reduce_graph(graph)
    costs = [evaluate(red.graph, solve_ilp(red.graph, solver=s, alpha=1e-3).choice, 1e-3) for s in ("highs", "cbc")]
    want = solve(graph, method="dp", alpha=1e-3).cost
    assert close(costs[0], want) and close(costs[1], want), (costs, want)


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_graph_of_constant_edges_is_solved_with_their_constant(solver):
    nodes = ("a", "b", "c")
    costs = {"a": np.array([3.0, 1.0]), "b": np.array([2.0, 5.0, 4.0]), "c": np.array([7.0])}
    edges = {("a", "b"): np.full((2, 3), 0.5), ("b", "c"): np.array([[1.0], [0.0], [2.0]])}
    graph = CostGraph(nodes, costs, edges)
    res = solve_ilp(graph, solver=solver)
    assert res.choice == {"a": 1, "b": 0, "c": 0} and res.proven_optimal
    assert res.variables == 6 + 3  # the x's and the one non-constant edge's y's
    assert evaluate(graph, res.choice) == pytest.approx(1.0 + 2.0 + 7.0 + 0.5 + 1.0)


def test_highs_prints_nothing_to_standard_output(capfd):
    """HiGHS writes a banner to the process's standard output when its first instance is made; the plan
    printed by the CLI must not carry it."""
    if highspy_module() is None:
        pytest.skip("highspy is not installed")
    solve_ilp(random_dag(4, seed=3), solver="highs")
    assert capfd.readouterr().out == ""


def test_an_unknown_solver_is_named():
    with pytest.raises(ValueError, match="'gurobi'"):
        solver_name("gurobi")
    if highspy_module() is None:
        with pytest.raises(SearchError, match="highspy"):
            solver_name("highs")
    else:
        assert solver_name() == "highs"


# ------------------------------------------------------------------------------------------- column generation
needs_highs = pytest.mark.skipif(highspy_module() is None, reason="highspy is not installed")


@needs_highs
@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 10), seed=st.integers(0, 10**6), inf=st.sampled_from([0.0, 0.3]), cut=st.floats(0, 1))
def test_column_generation_reaches_the_whole_ilp_s_optimum_from_any_plan(n, seed, inf, cut):
    graph = random_dag(n, max_strategies=5, skip_prob=0.5, inf_fraction=inf, seed=seed)
    try:
        red = reduce_graph(graph)
    except InfeasibleGraph:
        return
    g = red.graph
    least = solve_ilp(g, minimise_memory=True, solver="highs")  # a plan far from the fastest: the start
    whole = solve_ilp(g, solver="highs")
    generated = solve_ilp(g, solver="highs", start=least.choice)
    assert generated.proven_optimal and close(evaluate(g, generated.choice), evaluate(g, whole.choice))
    budget = plan_memory(g, least.choice) + cut * (plan_memory(g, whole.choice) - plan_memory(g, least.choice))
    within = solve_ilp(g, solver="highs", memory_budget=budget, start=least.choice)
    assert plan_memory(g, within.choice) <= budget
    assert close(evaluate(g, within.choice), evaluate(g, solve_ilp(g, solver="highs", memory_budget=budget).choice))
    lean = solve_ilp(g, minimise_memory=True, solver="highs", start=whole.choice)
    assert close(plan_memory(g, lean.choice), plan_memory(g, least.choice))


@needs_highs
def test_column_generation_closes_the_gap_of_a_fractional_lp():
    """A triangle whose edges charge 1 for equal strategies: the LP relaxation costs 0 (every x at 1/2, the y's on
    unequal pairs), every plan at least 1. The pairs priced within the gap are added and the ILP proves 1."""
    from primepar_fx.search.colgen import solve_generated

    equal = np.eye(2)
    graph = CostGraph(
        ("a", "b", "c"), {n: np.zeros(2) for n in "abc"}, {e: equal for e in (("a", "b"), ("a", "c"), ("b", "c"))}
    )
    values, outcome, model, generated = solve_generated(graph, {"a": 0, "b": 1, "c": 0})
    assert outcome == "optimal" and generated.lower == pytest.approx(0.0, abs=1e-6)
    assert generated.upper == pytest.approx(1e6)  # the scaled unit: the largest cost is 1e6
    assert generated.pairs == 12  # by the end every pair: each lies within the gap of 1
    choice = {n: int(np.argmax(values[cols])) for n, cols in model.node_columns.items()}
    assert evaluate(graph, choice) == 1.0


@needs_highs
def test_an_integral_lp_is_the_plan_without_a_mip(monkeypatch):
    """A chain's LP is integral (a tree): its last LP solution is the plan, no MIP runs, and it is the DP's
    optimum. The triangle above, whose LP is fractional, still goes through the MIP."""
    import primepar_fx.search.colgen as colgen

    mips = []
    real = colgen.set_binary
    monkeypatch.setattr(colgen, "set_binary", lambda h, count: (mips.append(count), real(h, count)))
    rng = np.random.default_rng(5)
    names = tuple("abcdef")
    graph = CostGraph(
        names,
        {n: rng.uniform(0, 10, 4) for n in names},
        {(u, v): rng.uniform(0, 10, (4, 4)) for u, v in itertools.pairwise(names)},
    )
    values, outcome, model, generated = colgen.solve_generated(graph, dict.fromkeys(names, 0))
    assert outcome == "optimal" and mips == [] and generated.upper == generated.lower
    choice = {n: int(np.argmax(values[cols])) for n, cols in model.node_columns.items()}
    assert close(evaluate(graph, choice), evaluate(graph, solve(graph, method="dp").choice))
    triangle = CostGraph(
        ("a", "b", "c"), {n: np.zeros(2) for n in "abc"}, {e: np.eye(2) for e in (("a", "b"), ("a", "c"), ("b", "c"))}
    )
    colgen.solve_generated(triangle, {"a": 0, "b": 1, "c": 0})
    assert mips == [6]


@needs_highs
def test_a_start_plan_must_be_a_finite_plan_of_the_graph():
    graph = CostGraph(("a", "b"), {"a": np.array([1.0, np.inf]), "b": np.zeros(2)}, {("a", "b"): np.zeros((2, 2))})
    with pytest.raises(ValueError, match="infinite cost"):
        solve_ilp(graph, solver="highs", start={"a": 1, "b": 0})
    with pytest.raises(ValueError, match="every node"):
        solve_ilp(graph, solver="highs", start={"a": 0})
