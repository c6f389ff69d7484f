"""The search: the segmented DP (Eq. 11-14) must reach the ILP's optimum, and brute force's on tiny graphs.

Graphs are random costs on real shapes: chains, the paper's Fig. 6 transformer block (13 nodes, skip edges
``e_{0,7}`` and ``e_{7,12}``) stacked in layers, a global mask node that feeds every layer, ``+inf`` entries.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primepar_fx.search import (
    CostGraph,
    CutOff,
    DPOptions,
    DPSolver,
    InfeasibleBudget,
    InfeasibleGraph,
    Search,
    SearchError,
    TableTooLarge,
    budget_bound,
    evaluate,
    least_memory,
    plan_memory,
    reduce_graph,
    restrict,
    smallest_memory,
    solve,
    solve_budget_dp,
)
from primepar_fx.search import dp as dp_module
from primepar_fx.search.budget import lean_memory_graph, memory_graph
from primepar_fx.search.engine import backtrack, plan_elimination, run
from primepar_fx.search.ilp import solver_name
from primepar_fx.search.minplus import boundaries, leaf, minplus, power
from primepar_fx.search.solve import AUTO_TABLE_STRETCH
from primepar_fx.search.synthetic import random_dag, transformer_graph

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL = 1e-6

#: the paper's Fig. 6 block: n0 is the previous layer's output, n7 and n12 the residual adds
FIG6_EDGES = [(0, 1), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5), (5, 6), (2, 6), (0, 7), (6, 7)]
FIG6_EDGES += [(7, 8), (8, 9), (9, 10), (10, 11), (11, 12), (7, 12)]


def build(nodes, sizes, edges, *, seed: int, inf_fraction: float = 0.0, memory: bool = True) -> CostGraph:
    rng = np.random.default_rng(seed)

    def rand(shape):
        arr = rng.random(shape) * 10.0
        if inf_fraction:
            arr[rng.random(shape) < inf_fraction] = np.inf
        return arr

    costs = {n: rand((sizes[n],)) for n in nodes}
    mem = {n: rng.random(sizes[n]) * 100.0 for n in nodes} if memory else None
    return CostGraph(tuple(nodes), costs, {(u, v): rand((sizes[u], sizes[v])) for u, v in edges}, mem)


def fig6_stack(layers: int, *, seed: int, max_p: int = 3, mask: int | None = None, inf_fraction: float = 0.0):
    """``layers`` Fig. 6 blocks with independent random costs, optionally all reading one global mask."""
    rng = np.random.default_rng(seed)
    nodes = ["mask"] if mask else []
    sizes = {"mask": mask} if mask else {}
    edges = []
    for layer in range(layers):
        name = {i: f"l{layer}.n{i}" for i in range(1, 13)} | {0: f"l{layer - 1}.n12" if layer else "input"}
        nodes += [name[i] for i in range(13) if i or not layer]
        edges += [(name[u], name[v]) for u, v in FIG6_EDGES]
        if mask:
            edges.append(("mask", name[5]))
    sizes |= {n: int(rng.integers(1, max_p + 1)) for n in nodes if n != "mask"}
    return build(nodes, sizes, edges, seed=seed, inf_fraction=inf_fraction)


def ilp_cost(graph: CostGraph, **kw) -> float:
    sol = solve(graph, method="ilp", **kw)
    assert sol.proven_optimal
    return sol.cost


def brute_force(graph: CostGraph, budget: float = math.inf) -> float:
    best = math.inf
    for combo in itertools.product(*(range(graph.strategies(n)) for n in graph.nodes)):
        choice = dict(zip(graph.nodes, combo))
        if plan_memory(graph, choice) <= budget:
            best = min(best, evaluate(graph, choice))
    return best


def assert_close(a: float, b: float) -> None:
    assert abs(a - b) <= REL * max(1.0, abs(a), abs(b)), (a, b)


# ------------------------------------------------------------------------------------------- DP equals ILP
@SETTINGS
@given(n=st.integers(1, 9), max_p=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_dp_equals_ilp_on_random_chains(n, max_p, seed):
    graph = random_dag(n, max_strategies=max_p, skip_prob=0.0, seed=seed)
    sol = solve(graph, method="dp")
    assert sol.proven_optimal
    assert_close(sol.cost, ilp_cost(graph))


@SETTINGS
@given(layers=st.integers(1, 2), seed=st.integers(0, 10**6))
def test_dp_equals_ilp_on_fig6_transformer_blocks_with_residual_skip_edges(layers, seed):
    graph = fig6_stack(layers, seed=seed, max_p=4)
    assert_close(solve(graph, method="dp").cost, ilp_cost(graph))


@SETTINGS
@given(n=st.integers(2, 10), seed=st.integers(0, 10**6))
def test_dp_equals_ilp_on_random_dags_with_many_skip_edges(n, seed):
    graph = random_dag(n, max_strategies=3, skip_prob=0.35, seed=seed)
    assert_close(solve(graph, method="dp").cost, ilp_cost(graph))


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_ilp_with_a_global_mask_feeding_every_layer(layers, seed):
    graph = fig6_stack(layers, seed=seed, max_p=3, mask=3)
    solver = DPSolver(graph)
    # a reader with one strategy takes the mask's edge as a cost of its own (fold_fixed): it couples nothing
    readers = sum(graph.strategies(f"l{k}.n5") > 1 for k in range(layers))
    assert solver.structure.globals == (("mask",) if readers >= 3 else ())
    assert_close(evaluate(graph, solver.minimise().choice), ilp_cost(graph))


def test_a_global_node_lets_the_layers_split_into_segments():
    graph = fig6_stack(6, seed=3, mask=2)
    with_global = DPSolver(graph).structure
    without = DPSolver(graph, DPOptions(max_global_states=1)).structure
    assert with_global.globals == ("mask",) and without.globals == ()
    assert len(with_global.segments) > 6 and len(without.segments) < len(with_global.segments)
    assert_close(evaluate(graph, DPSolver(graph, DPOptions(max_global_states=1)).minimise().choice), ilp_cost(graph))


@SETTINGS
@given(seed=st.integers(0, 10**6), layers=st.sampled_from([1, 3]))
def test_dp_equals_ilp_when_some_costs_are_forbidden(seed, layers):
    graph = fig6_stack(layers, seed=seed, max_p=3, mask=2, inf_fraction=0.25)
    try:
        want = ilp_cost(graph)
    except InfeasibleGraph:
        with pytest.raises(InfeasibleGraph):
            solve(graph, method="dp")
        return
    sol = solve(graph, method="dp")
    assert math.isfinite(sol.cost)
    assert_close(sol.cost, want)


# -------------------------------------------------------------------------------- identical layers (Eq. 14)
@pytest.mark.parametrize("layers", [1, 2, 3, 5, 8])
def test_identical_layer_merging_gives_the_same_optimum_as_no_merging(layers):
    graph = transformer_graph(layers, strategies=(2, 4), views=1, mask_states=2, seed=layers)
    values = {}
    for mode in ("none", "auto", "power"):
        choice = DPSolver(graph, DPOptions(layer_merge=mode)).minimise().choice
        values[mode] = evaluate(graph, choice)
    for v in values.values():
        assert_close(v, values["none"])
    if layers <= 3:
        assert_close(values["none"], ilp_cost(graph))


def test_repeated_layers_are_found_and_merged_by_squaring():
    graph = transformer_graph(8, strategies=(2, 4), views=1, mask_states=2, seed=0)
    solver = DPSolver(graph, DPOptions(layer_merge="power"))
    (stack,) = solver.structure.stacks
    assert stack.count >= 7 and any(item.kind == "stack" for item in solver.items)
    choice = solver.minimise().choice
    assert set(choice) == set(graph.nodes)


def test_layers_with_equal_copies_of_arrays_are_merged_and_a_changed_layer_is_not():
    graph = transformer_graph(5, strategies=(2, 3), views=0, mask_states=None, share_arrays=False, seed=1)
    sizes = DPSolver(graph).structure.class_sizes
    assert max(sizes) >= 4
    costs = dict(graph.node_cost)
    costs["l2.up"] = costs["l2.up"] + 1.0
    changed = CostGraph(graph.nodes, costs, graph.edge_cost, graph.node_memory, graph.node_key)
    assert max(DPSolver(changed).structure.class_sizes) < max(sizes)
    assert_close(evaluate(changed, DPSolver(changed).minimise().choice), ilp_cost(changed))


def test_minplus_power_equals_repeated_products_and_recovers_every_boundary():
    rng = np.random.default_rng(0)
    m = rng.random((5, 5))
    for count in (1, 2, 3, 5, 8):
        term = power(leaf(m), count)
        want = m
        for _ in range(count - 1):
            want = minplus(want, m)[0]
        np.testing.assert_allclose(term.table, want)
        p, q = 1, 3
        cuts = boundaries(term, p, q)
        assert len(cuts) == count + 1 and cuts[0] == p and cuts[-1] == q
        assert math.isclose(sum(m[a, b] for a, b in zip(cuts, cuts[1:])), term.table[p, q])


def tied_stack(layers: int, *, seed: int, columns: bool = False) -> CostGraph:
    """Fig. 6 layers plus a tied-parameter edge from the first node to the last whose matrix has two distinct rows
    (or, ``columns``, two distinct columns): what a tied word embedding gives the search."""
    base = fig6_stack(layers, seed=seed, max_p=3)
    sizes = {n: base.strategies(n) for n in base.nodes}
    sizes["input"] = sizes[base.nodes[-1]] = 4
    graph = build(base.nodes, sizes, list(base.edge_cost), seed=seed)
    rng = np.random.default_rng(seed + 1)
    tied = rng.random((2, 4)) * 10.0
    tied = tied[[0, 1, 1, 0]]  # strategies 0 and 3 store the parameter alike, and 1 and 2
    edges = dict(graph.edge_cost) | {("input", base.nodes[-1]): tied.T if columns else tied}
    return CostGraph(graph.nodes, graph.node_cost, edges, graph.node_memory)


@pytest.mark.parametrize("columns", [False, True])
def test_a_long_edge_with_few_distinct_rows_goes_through_a_proxy_and_keeps_the_optimum(columns):
    graph = tied_stack(6, seed=4, columns=columns)
    # the first node's 4 strategies are too many to condition on (as an embedding's are)
    options = DPOptions(max_global_states=3, min_fanout=4)
    solver = DPSolver(graph, options)
    plain = DPSolver(graph, DPOptions(max_global_states=3, min_fanout=4, max_proxy_states=0))
    (proxy,) = solver.structure.globals
    assert proxy.startswith("~proxy:input->") and plain.structure.globals == ()
    assert len(solver.structure.segments) > 6 > len(plain.structure.segments)  # the layers' cuts are back
    result = solver.minimise()
    assert set(result.choice) == set(graph.nodes)  # the proxy is not part of the answer
    assert_close(result.value, evaluate(graph, result.choice))
    assert_close(result.value, plain.minimise().value)
    assert_close(result.value, ilp_cost(graph))
    # under a budget, the Lagrangian search and its crossover of plans run on the proxied graph too
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = (least + free) / 2
    dp = solve(graph, method="dp", memory_budget=budget, options=options)
    ilp = solve(graph, method="ilp", memory_budget=budget)
    assert set(dp.choice) == set(graph.nodes) and dp.memory <= budget
    assert dp.cost >= ilp.cost * (1 - REL) - REL and dp.bound <= ilp.cost * (1 + REL) + REL


def two_masks(layers: int, *, seed: int, inf_fraction: float = 0.0) -> CostGraph:
    """Fig. 6 layers with two global masks, read by nodes 5 and 9 of every layer, and the first layer's first node."""
    base = fig6_stack(layers, seed=seed, max_p=3, mask=3, inf_fraction=inf_fraction)
    nodes = ("mask2", *base.nodes)
    sizes = {n: base.strategies(n) for n in base.nodes} | {"mask2": 2}
    edges = [*base.edge_cost, *(("mask2", f"l{k}.n9") for k in range(layers)), ("mask2", "input")]
    return build(nodes, sizes, edges, seed=seed + 7, inf_fraction=inf_fraction)


def identical_layers(seed: int, *, tied: bool = False, inf_fraction: float = 0.0) -> CostGraph:
    """Three identical layers reading a global mask, which the DP runs as a class table and a stack of them, each
    made once per mask strategy; ``tied``: and an edge from the embedding to the head with two distinct rows."""
    graph = transformer_graph(3, strategies=(6, 12), mask_states=3, views=1, inf_fraction=inf_fraction, seed=seed)
    if not tied:
        return graph
    rows = np.random.default_rng(seed).random((2, graph.strategies("head"))) * 10.0
    tie = rows[np.arange(graph.strategies("embed")) % 2]
    return CostGraph(graph.nodes, graph.node_cost, dict(graph.edge_cost) | {("embed", "head"): tie}, graph.node_memory)


GLOBAL_GRAPHS = {  # a graph and the options that make its globals
    "mask read by every layer": (lambda seed: fig6_stack(6, seed=seed, max_p=3, mask=3), DPOptions()),
    "tied embedding's proxy": (lambda seed: tied_stack(6, seed=seed), DPOptions(max_global_states=3, min_fanout=4)),
    "two masks, one read by the first node": (lambda seed: two_masks(5, seed=seed), DPOptions()),
    "identical layers reading a mask": (identical_layers, DPOptions()),
    "identical layers, a mask and a tied embedding": (
        lambda seed: identical_layers(seed, tied=True),
        DPOptions(max_global_states=3),
    ),
    "forbidden entries": (lambda seed: identical_layers(seed, inf_fraction=0.02), DPOptions()),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(GLOBAL_GRAPHS))
def test_the_globals_as_one_axis_find_what_one_pass_per_joint_strategy_finds(case, seed):
    build_graph, options = GLOBAL_GRAPHS[case]
    graph = build_graph(seed)
    one_axis = DPSolver(graph, options)
    each = DPSolver(graph, dataclasses.replace(options, batch_globals=False))
    assert one_axis.structure.globals == each.structure.globals and one_axis.structure.globals
    for weight in (0.0, 0.01):
        try:
            want = each.minimise(weight)
        except InfeasibleGraph:
            with pytest.raises(InfeasibleGraph):
                one_axis.minimise(weight)
            continue
        got = one_axis.minimise(weight)
        assert got.choice == want.choice
        assert_close(got.value, want.value)
        assert_close(got.value, evaluate(graph, got.choice) + weight * plan_memory(graph, got.choice))


def test_with_every_segment_a_class_table_the_globals_axis_finds_what_one_pass_each_finds():
    """Class tables that touch a global are made once per joint strategy and applied row by row; the schedule
    rarely picks them on small graphs, so every segment is made one here (the DP's answer does not depend on it)."""
    graph = identical_layers(0, tied=True)
    options = DPOptions(max_global_states=3)
    solvers = [DPSolver(graph, options), DPSolver(graph, dataclasses.replace(options, batch_globals=False))]
    reference = solvers[0].minimise(0.01)
    for solver in solvers:
        solver.items = [dp_module._Item("table", k) for k in range(len(solver.structure.segments))]
        assert any(solver._deps([solver.structure.segments[i.seg]]) for i in solver.items)
    got, want = (solver.minimise(0.01) for solver in solvers)
    assert got.choice == want.choice
    assert_close(got.value, want.value)
    assert_close(got.value, reference.value)


def test_where_the_globals_axis_makes_a_table_too_large_the_dp_runs_one_joint_strategy_at_a_time():
    graph = two_masks(5, seed=3)
    free = DPSolver(graph)
    largest = max(plan.peak for plan in free._plans.values())  # the plans of one joint strategy at a time
    tight = DPSolver(graph, DPOptions(max_table_entries=largest))
    result = tight.minimise()
    assert tight._batched is False  # the globals' axis passed the limit
    assert result.choice == free.minimise().choice
    assert_close(result.value, ilp_cost(graph))


def test_a_known_minimum_is_taken_for_the_dp_s_and_a_choice_outside_the_space_is_refused():
    graph = fig6_stack(2, seed=5, max_p=3, inf_fraction=0.05)
    optimum = Search(graph, method="dp").solve()
    told = Search(graph, method="dp")
    assert told.know_minimum(optimum.choice)
    assert told.solve().choice == optimum.choice and told._solver is None  # no DP was built for it
    forbidden = next(n for n in graph.nodes if np.isinf(graph.node_cost[n]).any())
    outside = dict(optimum.choice) | {forbidden: int(np.flatnonzero(np.isinf(graph.node_cost[forbidden]))[0])}
    assert not Search(graph, method="dp").know_minimum(outside)  # reduce_graph dropped that strategy
    budget = (smallest_memory(graph) + optimum.memory) / 2
    assert_close(told.solve(memory_budget=budget).cost, Search(graph, method="dp").solve(memory_budget=budget).cost)


# ------------------------------------------------------------------------------------------- memory budget
def test_the_ilp_under_a_budget_finds_the_dp_s_plan():
    """A case hypothesis found: CBC with its integer preprocessing returned a plan 2.3% dearer than the DP's as
    proven optimal (127.62 against 124.73, both within the budget)."""
    graph = fig6_stack(1, seed=2357, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = least + 0.25 * (free - least)
    dp = solve(graph, method="dp", memory_budget=budget)
    ilp = solve(graph, method="ilp", memory_budget=budget)
    assert dp.memory <= budget and ilp.memory <= budget
    assert ilp.cost == pytest.approx(dp.cost, rel=REL)
    assert ilp.cost == pytest.approx(124.7266496258216, rel=1e-9)


@SETTINGS
@given(seed=st.integers(0, 10**6), slack=st.floats(0.0, 0.5))
def test_the_dp_never_returns_a_plan_above_the_budget_and_stays_within_the_ilp_bound(seed, slack):
    graph = fig6_stack(1, seed=seed, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = least + slack * (free - least)
    dp = solve(graph, method="dp", memory_budget=budget)
    ilp = solve(graph, method="ilp", memory_budget=budget)
    assert dp.memory <= budget and ilp.memory <= budget
    assert dp.bound <= ilp.cost * (1 + REL) + REL
    assert dp.cost >= ilp.cost * (1 - REL) - REL
    if dp.proven_optimal:
        assert_close(dp.cost, ilp.cost)
    assert_close(solve(graph, method="auto", memory_budget=budget).cost, ilp.cost)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), slack=st.floats(0.05, 0.5))
def test_a_cutoff_above_the_optimum_changes_nothing_and_one_below_it_stops_early(seed, slack):
    """``cutoff``: a caller's better plan. Above the budgeted optimum the answer is the same; at or below it the
    search returns a plan no cheaper than the cutoff, within budget, or (where it proves that before it has a plan
    within budget) raises :class:`CutOff` with a bound at least the cutoff."""
    graph = fig6_stack(1, seed=seed, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = least + slack * (free - least)
    plain = solve(graph, method="auto", memory_budget=budget)
    above = solve(graph, method="auto", memory_budget=budget, cutoff=plain.cost * 1.01 + 1e-9)
    assert_close(above.cost, plain.cost)
    try:
        below = solve(graph, method="dp", memory_budget=budget, cutoff=plain.cost * 0.99)
    except CutOff as stopped:
        assert stopped.bound is not None and stopped.bound >= plain.cost * 0.99
    else:
        assert below.memory <= budget and below.cost >= plain.cost * (1 - REL) - REL


def test_a_cutoff_the_free_plan_reaches_stops_before_the_least_memory_plan(monkeypatch):
    """Where the plan without a budget (a lower bound) already costs the cutoff and does not fit, nothing within
    the budget can beat the caller's plan: :class:`CutOff` at once, carrying that bound, with no least-memory DP
    run (which would only find a plan that does not beat it); :func:`budget_bound` returns the bound. A cutoff
    above it runs the search as before."""
    budget_module = importlib.import_module("primepar_fx.search.budget")
    graph = fig6_stack(1, seed=3, max_p=3)
    free = solve(graph, method="dp")
    budget = smallest_memory(graph) + 0.5 * (free.memory - smallest_memory(graph))
    runs = []
    least = budget_module.least_memory

    def counted(*args, **kwargs):
        runs.append(1)
        return least(*args, **kwargs)

    monkeypatch.setattr(budget_module, "least_memory", counted)
    with pytest.raises(CutOff) as stopped:
        solve_budget_dp(graph, budget, cutoff=free.cost)
    assert stopped.value.bound == pytest.approx(free.cost, rel=1e-12) and not runs
    assert budget_bound(graph, budget, free.cost) >= free.cost and not runs
    found = solve_budget_dp(graph, budget, cutoff=free.cost * 2)
    assert found.memory <= budget and runs


def test_auto_closes_a_duality_gap_with_an_ilp_of_bounded_time_and_keeps_the_dp_plan_if_it_finds_none(monkeypatch):
    """Under a budget, a plan the Lagrangian DP cannot prove (a duality gap) goes to the ILP for at most
    ``GAP_ILP_SECONDS``; where the ILP stops at that limit with no plan, the DP's plan stands, with its bound."""
    solve_module = importlib.import_module("primepar_fx.search.solve")
    graph = fig6_stack(1, seed=0, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = least + 0.1 * (free - least)
    dp = solve(graph, method="dp", memory_budget=budget)
    assert not dp.proven_optimal and dp.bound < dp.cost  # the gap this test needs
    limits = []
    ilp = solve_module._ilp

    def timed(red, memory_budget, alpha, time_limit):
        limits.append(time_limit)
        return ilp(red, memory_budget, alpha, time_limit)

    monkeypatch.setattr(solve_module, "_ilp", timed)
    closed = solve(graph, method="auto", memory_budget=budget)
    assert limits == [solve_module.GAP_ILP_SECONDS] and closed.method == "dp+ilp" and closed.proven_optimal
    assert closed.cost <= dp.cost and closed.memory <= budget

    def stopped(red, memory_budget, alpha, time_limit):
        raise SearchError("the ILP solver (highs) found no plan: time limit reached")

    monkeypatch.setattr(solve_module, "_ilp", stopped)
    kept = solve(graph, method="auto", memory_budget=budget)
    assert (kept.method, kept.proven_optimal, kept.choice) == ("dp", False, dp.choice)
    assert kept.cost == dp.cost and kept.bound == dp.bound and kept.memory <= budget


def test_an_impossible_budget_raises_infeasible_budget_naming_the_smallest_memory():
    graph = fig6_stack(2, seed=5)
    least = smallest_memory(graph)
    for method in ("dp", "ilp", "auto"):
        with pytest.raises(InfeasibleBudget, match=f"{math.ceil(least):,} bytes") as info:
            solve(graph, method=method, memory_budget=least * 0.99)
        assert info.value.min_memory == pytest.approx(least, rel=1e-9)


def test_the_smallest_memory_respects_forbidden_pairs():
    graph = CostGraph(
        ("a", "b"),
        {"a": np.zeros(2), "b": np.zeros(2)},
        {("a", "b"): np.array([[np.inf, 0.0], [0.0, np.inf]])},
        {"a": np.array([0.0, 5.0]), "b": np.array([0.0, 7.0])},
    )
    assert smallest_memory(graph) == 5.0
    assert solve(graph, memory_budget=5.0).memory == 5.0


def least_memory_by_brute_force(graph: CostGraph) -> float:
    best = math.inf
    for combo in itertools.product(*(range(graph.strategies(n)) for n in graph.nodes)):
        choice = dict(zip(graph.nodes, combo))
        if math.isfinite(evaluate(graph, choice)):
            best = min(best, plan_memory(graph, choice))
    return best


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), seed=st.integers(0, 10**6), inf=st.sampled_from([0.1, 0.3, 0.5]), ties=st.booleans())
def test_the_least_memory_on_the_lean_graph_is_brute_forces(n, seed, inf, ties):
    graph = random_dag(n, max_strategies=4, skip_prob=0.5, inf_fraction=inf, seed=seed)
    if ties:  # equal memories: the first of equals is kept, and the optimum is still exact
        graph = CostGraph(
            graph.nodes, graph.node_cost, graph.edge_cost, {k: np.round(v / 40) for k, v in graph.node_memory.items()}
        )
    want = least_memory_by_brute_force(graph)
    if math.isinf(want):
        with pytest.raises(InfeasibleGraph):
            smallest_memory(graph)
        return
    choice, memory = least_memory(graph)
    assert math.isfinite(evaluate(graph, choice)) and memory == plan_memory(graph, choice)
    assert_close(memory, want)


def test_the_memory_graph_keeps_only_edges_that_forbid_and_what_they_forbid():
    dag = random_dag(6, max_strategies=4, skip_prob=0.3, inf_fraction=0.3, seed=7)
    free = next(iter(dag.edge_cost))  # one edge that forbids nothing
    edges = {e: np.where(np.isinf(a), 1.0, a) if e == free else a for e, a in dag.edge_cost.items()}
    graph = CostGraph(dag.nodes, dag.node_cost, edges, dag.node_memory)
    forbidding = {e for e, a in graph.edge_cost.items() if np.isinf(a).any()}
    assert forbidding and forbidding != set(graph.edge_cost)  # the case has both kinds
    mem = memory_graph(graph)
    assert set(mem.edge_cost) == forbidding
    for e in forbidding:
        assert np.array_equal(mem.edge_cost[e], np.where(np.isinf(graph.edge_cost[e]), np.inf, 0.0))
    for n in graph.nodes:
        assert np.array_equal(mem.node_cost[n], np.where(np.isinf(graph.node_cost[n]), np.inf, graph.memory_of(n)))


def test_the_lean_memory_graph_drops_free_edges_and_alike_strategies_and_keeps_layers_shared():
    a = np.array([[0.0, np.inf, 0.0], [0.0, np.inf, 0.0], [np.inf, 0.0, 0.0]])  # rows 0 and 1 allow alike
    free = np.zeros((3, 3))
    memory = np.array([3.0, 1.0, 2.0])
    nodes = ("x0", "x1", "x2", "x3")
    graph = CostGraph(
        nodes,
        dict.fromkeys(nodes, memory),
        {("x0", "x1"): a, ("x1", "x2"): free, ("x2", "x3"): a},
        dict.fromkeys(nodes, memory),
    )
    lean = lean_memory_graph(graph)
    assert set(lean.graph.edge_cost) == {("x0", "x1"), ("x2", "x3")}
    # the producers: rows 0 and 1 alike, 1 kept (less memory); the consumers: a's columns all differ
    assert [lean.kept[n].tolist() for n in nodes] == [[1, 2], [0, 1, 2], [1, 2], [0, 1, 2]]
    assert lean.graph.node_cost["x0"] is lean.graph.node_cost["x2"]  # identical layers stay one array
    assert lean.graph.edge_cost[("x0", "x1")] is lean.graph.edge_cost[("x2", "x3")]
    assert least_memory(graph)[1] == least_memory_by_brute_force(graph) == 2 * (1.0 + 2.0)


@pytest.mark.parametrize("alpha", [0.0, 1e-3, 1e-1])
def test_alpha_trades_cost_for_memory_the_same_way_in_dp_and_ilp(alpha):
    graph = fig6_stack(1, seed=11, max_p=4)
    assert_close(solve(graph, method="dp", alpha=alpha).cost, ilp_cost(graph, alpha=alpha))


# -------------------------------------------------------------------------------------------- brute force
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 10**6), inf=st.sampled_from([0.0, 0.2]), cut=st.floats(0, 1))
def test_brute_force_equals_dp_and_ilp_on_tiny_graphs(n, seed, inf, cut):
    graph = random_dag(n, max_strategies=3, skip_prob=0.5, inf_fraction=inf, seed=seed)
    want = brute_force(graph)
    if math.isinf(want):
        with pytest.raises(InfeasibleGraph):
            solve(graph, method="dp")
        return
    assert_close(solve(graph, method="dp").cost, want)
    assert_close(solve(graph, method="ilp").cost, want)
    budget = smallest_memory(graph) * (1 + cut)
    want = brute_force(graph, budget)
    assert_close(solve(graph, method="auto", memory_budget=budget).cost, want)
    assert solve(graph, method="dp", memory_budget=budget).memory <= budget


# ------------------------------------------------------------------------------------- engine and problem
def test_the_engine_keeps_the_requested_variables_and_backtracks_their_minimisers():
    rng = np.random.default_rng(2)
    domains, scopes = [2, 3, 2, 3], [(0,), (1,), (2,), (3,), (0, 1), (1, 2), (0, 2), (2, 3)]
    tables = [rng.random([domains[u] for u in s]) for s in scopes]
    plan = plan_elimination(domains, scopes, (3, 0), limit=1000)
    res = run(plan, tables)
    for a, b in itertools.product(range(3), range(2)):
        values = backtrack(plan, res.records, (a, b))
        total = sum(t[tuple(values[u] for u in s)] for t, s in zip(tables, scopes))
        assert math.isclose(total, res.table[a, b])
        assert total == min(
            sum(t[tuple(x[u] for u in s)] for t, s in zip(tables, scopes))
            for x in itertools.product(*map(range, domains))
            if x[3] == a and x[0] == b
        )


def test_an_incremental_engine_rerun_equals_a_fresh_run():
    rng = np.random.default_rng(4)
    domains = [3, 4, 2, 3, 4]
    scopes = [(i,) for i in range(5)] + [(0, 1), (1, 2), (2, 3), (3, 4), (1, 3), (0, 4)]
    tables = [rng.random([domains[u] for u in s]) for s in scopes]
    plan = plan_elimination(domains, scopes, (0, 4), limit=1000)
    first = run(plan, tables, keep_outputs=True)
    tables[2] = tables[2] + rng.random(2) * 5
    again = run(plan, tables, base=first, changed=[2])
    fresh = run(plan, tables)
    np.testing.assert_array_equal(again.table, fresh.table)
    assert all(np.array_equal(a, b) for a, b in zip(again.records, fresh.records))


def test_dp_options_reject_an_unknown_merge_mode():
    with pytest.raises(ValueError, match="layer_merge"):
        DPOptions(layer_merge="squaring")


def test_a_table_over_the_limit_raises_and_auto_falls_back_to_the_ilp():
    nodes = [f"n{i}" for i in range(6)]
    graph = build(nodes, dict.fromkeys(nodes, 4), list(itertools.combinations(nodes, 2)), seed=0)
    with pytest.raises(TableTooLarge, match="method='ilp'"):
        solve(graph, method="dp", options=DPOptions(max_table_entries=100))
    sol = solve(graph, method="auto", options=DPOptions(max_table_entries=100))
    assert sol.method == "ilp" and sol.proven_optimal
    assert_close(sol.cost, solve(graph, method="dp").cost)


def test_a_table_a_little_past_the_limit_runs_the_exact_dp_with_the_limit_stretched_without_a_budget():
    """K4 of 4 strategies: the first table has 256 entries, past a limit of 100 but within AUTO_TABLE_STRETCH
    times it, so ``auto`` runs the DP once more with the larger limit: exact, proven, brute force's optimum. Under
    a budget (many DP runs) it narrows instead, and the plan is not proven."""
    nodes = [f"n{i}" for i in range(4)]
    graph = build(nodes, dict.fromkeys(nodes, 4), list(itertools.combinations(nodes, 2)), seed=3)
    tight = {"options": DPOptions(max_table_entries=100), "ilp_max_variables": 10, "ilp_max_pairs": 0}
    with pytest.raises(TableTooLarge) as info:
        solve(graph, method="dp", options=tight["options"])
    assert info.value.entries == 256 and 100 < 256 <= AUTO_TABLE_STRETCH * 100
    sol = solve(graph, method="auto", **tight)
    assert sol.method == "dp" and sol.proven_optimal
    assert_close(sol.cost, brute_force(graph))
    budget = (smallest_memory(graph) + sol.memory) / 2
    assert solve(graph, method="auto", memory_budget=budget, **tight).method == "dp-narrowed"


def test_where_the_ilp_is_too_large_too_auto_searches_a_narrower_space():
    """Tables too large for the DP and an ILP too large: the nodes of the failing tables keep their locally
    cheapest strategies until the DP fits. The plan is a real one (its cost is what evaluate gives, no better than
    the optimum found by brute force) and is marked not proven; with nothing to narrow, the error stays."""
    nodes = [f"n{i}" for i in range(6)]
    graph = build(nodes, dict.fromkeys(nodes, 4), list(itertools.combinations(nodes, 2)), seed=0)
    narrow = {"options": DPOptions(max_table_entries=100), "ilp_max_variables": 10}
    sol = solve(graph, method="auto", ilp_max_pairs=0, **narrow)
    assert sol.method == "dp-narrowed" and not sol.proven_optimal and sol.bound == -math.inf
    assert math.isfinite(sol.cost) and sol.cost == evaluate(graph, sol.choice)
    best = min(evaluate(graph, dict(zip(nodes, c))) for c in itertools.product(range(4), repeat=6))
    assert sol.cost >= best and sol.cost <= 1.5 * best  # the locally cheapest strategies keep it near
    if solver_name() == "highs":  # from the narrowed plan the ILP by column generation proves the optimum
        proved = solve(graph, method="auto", **narrow)
        assert proved.method == "dp-narrowed+ilp" and proved.proven_optimal
        assert_close(proved.cost, best)
    with pytest.raises(TableTooLarge, match="neither solver"):
        solve(graph, method="auto", options=DPOptions(max_table_entries=1), ilp_max_variables=10)


def test_a_narrowed_search_warns_once_a_process_and_says_it_at_info_level_after(monkeypatch, caplog):
    """A plan's memory levers search many related graphs: the same narrowing is one warning, not one per search."""
    import logging

    monkeypatch.setattr(importlib.import_module("primepar_fx.search.solve"), "_NARROWED_SAID", set())
    nodes = [f"n{i}" for i in range(6)]
    graph = build(nodes, dict.fromkeys(nodes, 4), list(itertools.combinations(nodes, 2)), seed=0)
    narrow = {"options": DPOptions(max_table_entries=100), "ilp_max_variables": 10, "ilp_max_pairs": 0}
    with caplog.at_level(logging.INFO, logger="primepar_fx.search.solve"):
        for _ in range(3):
            assert solve(graph, method="auto", **narrow).method == "dp-narrowed"
    said = [r.levelno for r in caplog.records if "narrowed to their locally cheapest" in r.getMessage()]
    assert said == [logging.WARNING, logging.INFO, logging.INFO]


def test_forbidden_strategies_are_dropped_and_choices_use_the_original_indices():
    inf = np.inf
    graph = CostGraph(
        ("a", "b"),
        {"a": np.array([inf, 1.0, 2.0]), "b": np.array([0.0, 0.0])},
        {("a", "b"): np.array([[0.0, 0.0], [inf, 5.0], [0.0, inf]])},
    )
    assert list(reduce_graph(graph).kept["a"]) == [1, 2]
    for method in ("dp", "ilp"):
        sol = solve(graph, method=method)
        assert sol.choice == {"a": 2, "b": 0} and sol.cost == 2.0


@pytest.mark.parametrize(
    "edges, match",
    [
        ({("b", "a"): np.zeros((2, 2))}, "backwards"),
        ({("a", "b"): np.zeros((2, 3))}, "shape"),
        ({("a", "b"): np.full((2, 2), np.nan)}, "NaN"),
        ({("a", "c"): np.zeros((2, 2))}, "not in the graph"),
    ],
)
def test_cost_graph_rejects_malformed_input(edges, match):
    with pytest.raises(ValueError, match=match):
        CostGraph(("a", "b"), {"a": np.zeros(2), "b": np.zeros(2)}, edges)


def test_a_larger_synthetic_model_agrees_across_merge_modes():
    graph = transformer_graph(24, strategies=(3, 8), views=3, mask_states=3, seed=4)
    auto = DPSolver(graph).minimise()
    power_ = DPSolver(graph, DPOptions(layer_merge="power")).minimise()
    assert_close(evaluate(graph, auto.choice), auto.value)
    assert_close(evaluate(graph, power_.choice), auto.value)


def test_restrict_takes_the_kept_strategies_and_keeps_shared_arrays_shared():
    graph = transformer_graph(4, strategies=(3, 5), views=1, mask_states=2, inf_fraction=0.0, seed=3)
    rng = np.random.default_rng(0)
    by_kind = {}  # one random subset per kind, so every layer keeps the same strategies
    kept = {}
    for n in graph.nodes:
        kind, size = graph.node_key[n], graph.strategies(n)
        if kind not in by_kind:
            by_kind[kind] = np.sort(rng.choice(size, size=max(1, size - 1), replace=False))
        kept[n] = by_kind[kind].copy()  # equal contents, distinct objects
    memory = {n: graph.node_memory[n] * 2.0 for n in graph.nodes}
    sub = restrict(graph, kept, memory)
    for n in graph.nodes:
        np.testing.assert_array_equal(sub.node_cost[n], graph.node_cost[n][kept[n]])
        np.testing.assert_array_equal(sub.node_memory[n], memory[n][kept[n]])
    for (u, v), arr in graph.edge_cost.items():
        np.testing.assert_array_equal(sub.edge_cost[u, v], arr[np.ix_(kept[u], kept[v])])
    # every layer's copy of a shared array, cut the same way, is one array again
    assert sub.node_cost["l1.up"] is sub.node_cost["l2.up"]
    assert sub.edge_cost["l1.mul", "l1.down"] is sub.edge_cost["l3.mul", "l3.down"]
    assert len({id(a) for a in sub.edge_cost.values()}) == len({id(a) for a in graph.edge_cost.values()})
    # a node left out, or keeping every strategy, keeps its arrays as they are
    whole = restrict(graph, {n: np.arange(graph.strategies(n)) for n in graph.nodes})
    assert all(whole.edge_cost[e] is graph.edge_cost[e] for e in graph.edge_cost)
    assert restrict(graph, {}).node_cost["l0.up"] is graph.node_cost["l0.up"]


def test_reducing_forbidden_strategies_keeps_identical_layers_shared():
    graph = transformer_graph(6, strategies=(3, 6), views=1, mask_states=None, inf_fraction=0.2, seed=2)
    red = reduce_graph(graph)
    assert any(len(k) < graph.strategies(n) for n, k in red.kept.items())
    reduced = {(u, v) for u, v in graph.edge_cost if len(red.kept[u]) < graph.strategies(u)}
    assert any(u.startswith("l1.") for u, _ in reduced)  # the layers' edges lost strategies, and stay shared:
    assert len({id(a) for a in red.graph.edge_cost.values()}) == len({id(a) for a in graph.edge_cost.values()})
    assert_close(evaluate(graph, solve(graph, method="dp").choice), ilp_cost(graph))


def test_a_search_builds_its_dp_once_and_a_budget_after_a_free_search_gives_the_same_plan(monkeypatch):
    graph = fig6_stack(3, seed=11, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budgets = [least + f * (free - least) for f in (0.3, 0.6)]
    built = []
    init = DPSolver.__init__

    def counting(self, *args, **kwargs):
        built.append(args[0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(DPSolver, "__init__", counting)
    search = Search(graph, method="dp")
    plans = [search.solve(), *(search.solve(memory_budget=b) for b in budgets)]
    ours = [g for g in built if g is search.reduced.graph]
    assert len(ours) == 1  # the least-memory DPs run on a graph of their own
    for budget, plan in zip([None, *budgets], plans):
        alone = solve(graph, method="dp", memory_budget=budget)
        assert plan.choice == alone.choice and plan.cost == alone.cost and plan.proven_optimal == alone.proven_optimal
        if budget is not None:
            assert plan.memory <= budget


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), slack=st.floats(0.05, 0.6))
def test_hinted_multipliers_keep_the_guarantees_and_a_bracket_of_the_same_budget_saves_runs(seed, slack):
    """``hints``: multipliers tried first. The plan stays within budget and its bound below the optimum, whatever
    the hints; the bracket a search ended with, given back for the same budget, needs at most four DP runs (the
    free plan, the two hints, one crossing) and no least-memory run."""
    graph = fig6_stack(2, seed=seed, max_p=3)
    least, free = smallest_memory(graph), solve(graph, method="dp").memory
    budget = least + slack * (free - least)
    optimum = solve(graph, method="ilp", memory_budget=budget).cost
    plain = solve_budget_dp(graph, budget)
    hinted = solve_budget_dp(graph, budget, hints=plain.multipliers)
    odd = solve_budget_dp(graph, budget, hints=(1e9, 1e-12, -1.0, math.inf, math.nan))
    for result in (plain, hinted, odd):
        assert result.memory <= budget
        assert result.bound <= optimum * (1 + REL) + REL <= result.cost * (1 + REL) + 2 * REL
    if len(plain.multipliers) == 2:
        assert hinted.runs <= min(plain.runs, 4)
