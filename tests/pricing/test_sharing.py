"""The search graph's virtual share nodes (:mod:`primepar_fx.pricing.sharing`): the objective of every choice is
its plan's predicted step time, so the DP's optimum (= the ILP's) is the best plan under shared re-layouts."""

from __future__ import annotations

import functools
import random

import pytest

import primepar_fx
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.levers.peak import least_plan, ring_buffers
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.sharing import SUFFIX, complete_choice, virtual
from primepar_fx.pricing.summary import summarize
from primepar_fx.search import solve
from primepar_fx.search.problem import evaluate

MODEL = "llama-tiny"
VALUES = {B: 4, S: 32}
OPTS = CostOptions(dtype="fp32")
CASES = [(2, "cpu-gloo"), (4, "v100-paper")]


@functools.cache
def graph():
    config = get_config(MODEL)
    args, kwargs = example_inputs(config, 2, 16)
    return primepar_fx.analyze(build(config), args, kwargs, name=MODEL)


@functools.cache
def priced(world: int, cluster: str):
    spec = load_cluster(cluster)
    return price_graph(graph(), spec.mesh(world), spec, VALUES, OPTS)


def step_time(p, choice) -> float:
    return summarize(graph(), p, choice, OPTS, nodes=False).predicted.step_time_s


@pytest.mark.parametrize(("world", "cluster"), CASES)
def test_a_virtual_node_sits_between_each_normed_input_and_its_projections(world, cluster):
    sg = priced(world, cluster).search_graph
    shared = {n.removesuffix(SUFFIX): sg.succ[n] for n in sg.nodes if virtual(n)}
    for u, consumers in shared.items():
        assert u + SUFFIX in sg.succ[u] and not set(consumers) & set(sg.succ[u])  # reached only through it
        assert consumers == priced(world, cluster).fanout[u]
    projections = [vs for vs in shared.values() if all(graph().nodes[v].params for v in vs)]
    assert sorted(len(vs) for vs in projections) == [2, 2, 3, 3]  # gate/up and q/k/v of both layers


@pytest.mark.parametrize(("world", "cluster"), CASES)
def test_the_objective_of_any_choice_is_its_predicted_step_time(world, cluster):
    """With the operators' strategies fixed, each virtual node's best state makes the objective the plan's time."""
    p = priced(world, cluster)
    sg = p.search_graph
    rng = random.Random(world)
    for _ in range(8):
        choice = {n: rng.randrange(len(p.strategies[n])) for n in p.strategies}
        full = {**choice, **{n: choice[n.removesuffix(SUFFIX)] for n in sg.nodes if virtual(n)}}
        for n in (n for n in sg.nodes if virtual(n)):  # independent of each other given the operators
            full[n] = min(range(sg.strategies(n)), key=lambda s, n=n: evaluate(sg, {**full, n: s}))
        assert evaluate(sg, full) == pytest.approx(step_time(p, choice), rel=1e-12)


@pytest.mark.parametrize(("world", "cluster"), CASES)
def test_dp_and_ilp_agree_and_are_the_predicted_step_time(world, cluster):
    p = priced(world, cluster)
    dp, ilp = solve(p.search_graph, method="dp"), solve(p.search_graph, method="ilp")
    assert dp.cost == pytest.approx(ilp.cost, rel=1e-9)
    assert dp.cost == pytest.approx(step_time(p, dp.choice), rel=1e-12)
    pairwise = solve(p.cost_graph, method="dp")  # the search that ignores sharing cannot do better
    assert dp.cost <= step_time(p, pairwise.choice) * (1 + 1e-12)


@pytest.mark.parametrize(("world", "cluster"), CASES)
def test_a_choice_completed_with_the_virtual_nodes_best_states_is_its_predicted_step_time(world, cluster):
    p = priced(world, cluster)
    sg = p.search_graph
    rng = random.Random(world + 1)
    for _ in range(8):
        choice = {n: rng.randrange(len(p.strategies[n])) for n in p.strategies}
        full = complete_choice(sg, choice)
        assert set(full) == set(sg.nodes) and all(full[n] == choice[n] for n in choice)
        assert evaluate(sg, full) == pytest.approx(step_time(p, choice), rel=1e-12)
    best = solve(sg, method="dp")
    real = {n: s for n, s in best.choice.items() if not virtual(n)}
    assert evaluate(sg, complete_choice(sg, real)) == pytest.approx(best.cost, rel=1e-12)
    with pytest.raises(ValueError, match="no strategy for node"):
        complete_choice(sg, {n: s for n, s in real.items() if n != sg.nodes[0]})


@pytest.mark.parametrize(("world", "cluster"), CASES)
def test_the_least_memory_is_the_same_without_the_virtual_nodes(world, cluster):
    """Memory-only searches run on the graph without share nodes (levers.recompute): they hold no memory and their
    pass-through states forbid nothing, so the least peak and its plan's peak are the same."""
    p = priced(world, cluster)
    assert any(virtual(n) for n in p.search_graph.nodes)
    with_virtual = least_plan(p.search_graph, ring_buffers(p))
    without = least_plan(p.cost_graph, ring_buffers(p, p.cost_graph))
    assert without[0] == with_virtual[0]
    assert set(without[1]) == set(p.cost_graph.nodes)
