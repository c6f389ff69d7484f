"""Nodes of one strategy (replicated constants) are folded away before the DP (``problem.fold_fixed``): their edges
become costs of the nodes at the other ends. Every plan must cost the same, the DP must still reach the optimum,
and the tables the elimination holds must shrink where such a node tied its neighbours together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primepar_fx.search import CostGraph, DPOptions, DPSolver, TableTooLarge, evaluate, plan_memory, solve
from primepar_fx.search.engine import plan_elimination
from primepar_fx.search.problem import fold_fixed
from primepar_fx.search.synthetic import random_dag

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: eight nodes, node 5 with one strategy between nodes 1, 4 and 6: eliminated as it is, the graph needs a table of
#: 9,000 entries; with node 5's edges folded, 450 (found by a random search over small graphs)
SIZES = (5, 5, 6, 2, 4, 1, 3, 5)
EDGES = [(0, 2), (0, 3), (0, 4), (0, 6), (0, 7), (1, 2), (1, 3), (1, 5), (1, 7), (2, 4), (2, 6), (2, 7)]
EDGES += [(3, 4), (3, 7), (4, 5), (5, 6), (6, 7)]


def hub_graph(seed: int = 0) -> CostGraph:
    rng = np.random.default_rng(seed)
    nodes = tuple(f"n{i}" for i in range(len(SIZES)))
    costs = {n: rng.random(s) * 10.0 for n, s in zip(nodes, SIZES)}
    memory = {n: rng.random(s) * 100.0 for n, s in zip(nodes, SIZES)}
    edges = {(nodes[u], nodes[v]): rng.random((SIZES[u], SIZES[v])) * 10.0 for u, v in EDGES}
    return CostGraph(nodes, costs, edges, memory)


def brute_force(graph: CostGraph) -> float:
    sizes = [graph.strategies(n) for n in graph.nodes]
    return min(evaluate(graph, dict(zip(graph.nodes, c))) for c in itertools.product(*map(range, sizes)))


def peak(graph: CostGraph) -> int:
    """The largest table the engine's elimination of the whole graph holds, nothing kept."""
    rel = {n: i for i, n in enumerate(graph.nodes)}
    scopes = [(i,) for i in range(len(rel))] + [(rel[u], rel[v]) for u, v in graph.edge_cost]
    sizes = [graph.strategies(n) for n in graph.nodes]
    return plan_elimination(sizes, scopes, (), limit=10**12).peak


def test_a_node_of_one_strategy_no_longer_ties_its_neighbours_into_one_table():
    graph = hub_graph()
    folded = fold_fixed(graph)
    assert not [e for e in folded.edge_cost if "n5" in e] and len(folded.edge_cost) == len(graph.edge_cost) - 3
    assert (peak(graph), peak(folded)) == (9000, 450)
    with pytest.raises(TableTooLarge):  # the elimination as it was, under a limit between the two
        plan_elimination(SIZES, [(i,) for i in range(8)] + EDGES, (), limit=1000)
    solver = DPSolver(graph, DPOptions(max_table_entries=1000))
    choice = solver.minimise().choice
    assert choice["n5"] == 0
    assert abs(evaluate(graph, choice) - brute_force(graph)) <= 1e-9 * brute_force(graph)


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(2, 9))
def test_folding_prices_every_plan_alike_and_the_dp_still_finds_the_optimum(seed, n):
    """Chains with skip edges and strategy counts from 1 to 3, so about a third of the nodes have one: every plan
    costs the same on the folded graph (memory unchanged), and the DP's plan, made on it, is brute force's."""
    graph = random_dag(n, max_strategies=3, skip_prob=0.4, seed=seed)
    folded = fold_fixed(graph)
    fixed = {v for v in graph.nodes if graph.strategies(v) == 1}
    assert not [e for e in folded.edge_cost if e[0] in fixed or e[1] in fixed]
    rng = np.random.default_rng(seed)
    for _ in range(10):
        choice = {v: int(rng.integers(graph.strategies(v))) for v in graph.nodes}
        assert evaluate(folded, choice) == pytest.approx(evaluate(graph, choice), rel=1e-12)
        assert plan_memory(folded, choice) == plan_memory(graph, choice)
    best = brute_force(graph)
    assert evaluate(graph, solve(graph, method="dp").choice) == pytest.approx(best, rel=1e-9)


def test_identical_readers_of_fixed_nodes_keep_sharing_one_array():
    """Two layers whose nodes share their cost arrays, each reading one fixed node through one shared edge array:
    their folded costs are one array too, so the DP still recognises the layers by identity."""
    cost, edge, table = np.array([1.0, 2.0, 3.0]), np.array([[0.5, 0.25, 0.0]]), np.zeros((3, 3))
    nodes = ("c", "a0", "b0", "a1", "b1")
    graph = CostGraph(
        nodes,
        {"c": np.zeros(1), "a0": cost, "b0": cost, "a1": cost, "b1": cost},
        {("c", "a0"): edge, ("c", "a1"): edge, ("a0", "b0"): table, ("b0", "a1"): table, ("a1", "b1"): table},
    )
    folded = fold_fixed(graph)
    assert folded.node_cost["a0"] is folded.node_cost["a1"]
    np.testing.assert_array_equal(folded.node_cost["a0"], [1.5, 2.25, 3.0])
    assert folded.node_cost["b0"] is cost and folded.edge_cost[("a0", "b0")] is table
    assert fold_fixed(folded) is folded  # nothing left to fold: the same graph
