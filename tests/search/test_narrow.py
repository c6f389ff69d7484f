"""``auto``'s narrower space (``Search._narrowed``) where the DP's tables are too large and the ILP is too: it
narrows one failing table a round, so a graph with many separate tangles needs as many rounds."""

from __future__ import annotations

import itertools

import numpy as np

from primepar_fx.search import CostGraph, DPOptions, evaluate, solve


def tangles(count: int, *, size: int = 5, seed: int = 0) -> CostGraph:
    """``count`` complete graphs of four nodes of ``size`` strategies, each joined to the next by one edge: every
    clique's elimination holds a table of ``size**4`` entries (625: past five times a limit of 100, so the DP is
    not run again with a stretched limit), and each is its own table to narrow."""
    rng = np.random.default_rng(seed)
    nodes = tuple(f"c{k}.n{i}" for k in range(count) for i in range(4))
    edges = [(f"c{k}.n{i}", f"c{k}.n{j}") for k in range(count) for i, j in itertools.combinations(range(4), 2)]
    edges += [(f"c{k}.n3", f"c{k + 1}.n0") for k in range(count - 1)]
    return CostGraph(
        nodes,
        {n: rng.random(size) * 10.0 for n in nodes},
        {e: rng.random((size, size)) * 10.0 for e in edges},
        {n: rng.random(size) * 100.0 for n in nodes},
    )


def test_a_graph_with_more_tangles_than_eight_is_narrowed_table_by_table():
    graph = tangles(12)
    narrow = {"options": DPOptions(max_table_entries=100), "ilp_max_variables": 10, "ilp_max_pairs": 0}
    sol = solve(graph, method="auto", **narrow)
    assert sol.method == "dp-narrowed" and not sol.proven_optimal
    assert sol.cost == evaluate(graph, sol.choice)
    best = solve(graph, method="dp").cost  # the exact DP, with the default limit
    assert best <= sol.cost <= 1.5 * best
