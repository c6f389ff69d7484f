"""``CostGraph.derive``: a graph made from another one's arrays without the checks of a new graph. It must be the graph
the checked constructor makes from the same fields (index, adjacency, arrays by identity), refuse edges the parent
lacks, and check the new arrays of the fields it is told to: the budgeted search derives hundreds of graphs from one
pricing and trusts only slices, sums and masks of checked arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primepar_fx.search import CostGraph, solve
from primepar_fx.search.budget import memory_graph
from primepar_fx.search.problem import InfeasibleGraph, fold_fixed, reduce_graph, restrict
from primepar_fx.search.synthetic import random_dag, transformer_graph


def same_graph(a: CostGraph, b: CostGraph) -> None:
    """``a`` and ``b`` hold the same fields, arrays by identity, dicts in the same order."""
    assert a.nodes == b.nodes and dict(a.index) == dict(b.index)
    assert dict(a.succ) == dict(b.succ) and dict(a.pred) == dict(b.pred)
    for field in ("node_cost", "edge_cost", "node_memory"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert list(x) == list(y), field
            assert all(x[k] is y[k] for k in x), field
    assert a.node_key == b.node_key


def checked_copy(graph: CostGraph) -> CostGraph:
    """What the checked constructor makes of ``graph``'s fields."""
    return CostGraph(graph.nodes, graph.node_cost, graph.edge_cost, graph.node_memory, graph.node_key)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 9), fixed=st.booleans())
def test_the_derivations_make_the_graph_the_checked_constructor_makes(seed, n, fixed):
    graph = random_dag(n, seed=seed, max_strategies=4, inf_fraction=0.1)
    if fixed:  # a node of one strategy, for fold_fixed to drop its edges
        first = graph.nodes[0]
        costs = dict(graph.node_cost, **{first: graph.node_cost[first][:1]})
        memory = dict(graph.node_memory or {}, **{first: graph.memory_of(first)[:1]})
        edges = {(u, v): a[:1] if u == first else a for (u, v), a in graph.edge_cost.items()}
        graph = CostGraph(graph.nodes, costs, edges, memory, graph.node_key)
    rng = np.random.default_rng(seed)
    kept = {m: np.flatnonzero(rng.random(graph.strategies(m)) < 0.7) for m in graph.nodes}
    kept = {m: k if len(k) else np.array([0]) for m, k in kept.items()}
    for derived in (restrict(graph, kept), fold_fixed(graph), memory_graph(graph)):
        same_graph(derived, checked_copy(derived))
    try:
        optimum = solve(graph, method="dp").cost
    except InfeasibleGraph:
        with pytest.raises(InfeasibleGraph):
            solve(fold_fixed(graph), method="dp")
        return
    assert solve(fold_fixed(graph), method="dp").cost == pytest.approx(optimum, rel=1e-12)


def test_repeated_layers_keep_sharing_their_arrays_and_the_optimum():
    graph = transformer_graph(6, seed=3)
    reduced = reduce_graph(graph)
    same_graph(reduced.graph, checked_copy(reduced.graph))
    assert len({id(a) for a in reduced.graph.node_cost.values()}) < len(graph.nodes) / 2  # still shared
    assert solve(reduced.graph, method="dp").cost == pytest.approx(solve(graph, method="dp").cost, rel=1e-12)


def test_a_derived_graph_refuses_edges_its_parent_lacks_and_checks_the_new_arrays_it_is_told_to():
    graph = random_dag(4, seed=1, max_strategies=3)
    u, v = graph.nodes[3], graph.nodes[0]  # edges run forward: the parent has no (n3, n0)
    with pytest.raises(ValueError, match="must be the graph's"):
        graph.derive(edge_cost={**graph.edge_cost, (u, v): np.zeros((graph.strategies(u), graph.strategies(v)))})
    name = graph.nodes[1]
    bad = np.full(graph.strategies(name), np.nan)
    with pytest.raises(ValueError, match=rf"node_cost\['{name}'\] contains NaN"):
        graph.derive(node_cost={**graph.node_cost, name: bad})
    with pytest.raises(ValueError, match=rf"node_memory\['{name}'\] contains \+inf"):
        graph.derive(node_memory={**(graph.node_memory or {}), name: np.full(graph.strategies(name), np.inf)})
    edge = next(iter(graph.edge_cost))
    with pytest.raises(ValueError, match="has shape"):
        graph.derive(edge_cost={**graph.edge_cost, edge: np.zeros((1, 1, 1))})
    with pytest.raises(ValueError, match="float64"):
        graph.derive(node_cost={**graph.node_cost, name: np.zeros(graph.strategies(name), dtype=np.int64)})
    trusted = graph.derive(node_cost={**graph.node_cost, name: bad}, checked=())  # what a caller vouches for
    assert np.isnan(trusted.node_cost[name]).all()
    dropped = graph.derive(edge_cost={e: a for e, a in graph.edge_cost.items() if e != edge})
    assert edge[1] not in dropped.succ[edge[0]] and edge[0] not in dropped.pred[edge[1]]
    same_graph(dropped, checked_copy(dropped))
