"""Tied parameters (GPT-2's token table, also its LM head): where both readers need the table in one layout and
all-reduce its gradient over the same digits, the later reader's gradient is summed into the first's and
all-reduced once (:class:`~primepar_fx.pricing.priced.TiedSaving`, :func:`~primepar_fx.passes.share.share_relayouts`).
The search prices exactly that, the prediction counts it, and the rank graph runs it."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

import primepar_fx
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.scatter import reduce_scatter_seconds
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.sharing import SUFFIX, virtual
from primepar_fx.pricing.summary import summarize
from primepar_fx.report.dump import fake_rank_graphs
from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.search import solve
from primepar_fx.search.problem import evaluate

MODEL, BATCH, SEQ, WORLD = "gpt2-tiny", 4, 16, 4
VALUES = {B: BATCH, S: SEQ}
OPTS = CostOptions(dtype="fp32")
TABLE = "lm_head.weight"  # export names the tied pair by the LM head; the token embedding reads it first


@functools.cache
def graph():
    config = get_config(MODEL)
    args, kwargs = example_inputs(config, BATCH, SEQ)
    return primepar_fx.analyze(build(config), args, kwargs, name=MODEL)


@functools.cache
def priced(world: int = WORLD, cluster: str = "cpu-gloo"):
    spec = load_cluster(cluster)
    return price_graph(graph(), spec.mesh(world), spec, VALUES, OPTS)


def readers() -> list[str]:
    return [n for n, node in graph().nodes.items() if TABLE in node.params]


def step_time(p, choice) -> float:
    return summarize(graph(), p, choice, OPTS, nodes=False).predicted.step_time_s


def test_the_table_has_two_readers_and_one_saving_between_them():
    first, later = readers()
    assert graph().tied  # the model does tie them
    assert set(priced().tied) == {(first, later)}


def test_data_parallel_all_reduces_the_tables_gradient_once():
    """Data parallel: both readers hold the whole table and sum its gradient over all ranks; the prediction is
    lower by exactly one ring all-reduce of the table, and the rank graph has none left for it (it goes to the
    gradient buckets, once)."""
    spec = load_cluster("cpu-gloo")
    mesh = spec.mesh(WORLD)
    p = price_graph(graph(), mesh, spec, VALUES, OPTS, fixed=data_parallel_assignment(graph(), mesh, values=VALUES))
    first, later = readers()
    choice = dict.fromkeys(p.strategies, 0)
    assert p.tied[(first, later)].shared[choice[first], choice[later]]
    with_saving = summarize(graph(), p, choice, OPTS).predicted.comm_bytes
    untied = dataclasses.replace(p, tied={})  # (its edge still has the seconds off: bytes only)
    without = summarize(graph(), untied, choice, OPTS, nodes=False).predicted.comm_bytes
    rows, cols = graph().param_shapes[TABLE]
    assert without - with_saving == round(ring_factors("all-reduce", WORLD)[0] * rows * cols * 4)

    plan = forced_plan(graph(), "data_parallel", world_size=WORLD, batch=BATCH, seq=SEQ, cluster="cpu-gloo")
    assert plan.predicted.comm_bytes == with_saving
    rank = fake_rank_graphs(graph(), plan, [0])[0]
    table = next(n for n in rank.gm.graph.nodes if n.op == "placeholder" and n.name == "p_lm_head_weight")
    assert table.name in rank.grad_reductions
    assert not any(isinstance(rank.gm.get_submodule(u.target), AllReduce) for u in table.users if u.op == "call_module")
    assert len(table.users) == 2  # the embedding and the LM head read the stored slice itself


def test_the_objective_of_any_choice_is_its_predicted_step_time():
    p = priced()
    sg = p.search_graph
    rng = random.Random(7)
    first, later = readers()
    seen_shared = seen_apart = 0
    for _ in range(12):
        choice = {n: rng.randrange(len(p.strategies[n])) for n in p.strategies}
        if rng.random() < 0.5:  # often enough, a pair that shares
            i, j = map(int, next(iter(zip(*p.tied[(first, later)].shared.nonzero()))))
            choice[first], choice[later] = i, j
        shared = bool(p.tied[(first, later)].shared[choice[first], choice[later]])
        seen_shared, seen_apart = seen_shared + shared, seen_apart + (not shared)
        full = {**choice, **{n: choice[n.removesuffix(SUFFIX)] for n in sg.nodes if virtual(n)}}
        for n in (n for n in sg.nodes if virtual(n)):
            full[n] = min(range(sg.strategies(n)), key=lambda s, n=n: evaluate(sg, {**full, n: s}))
        assert evaluate(sg, full) == pytest.approx(step_time(p, choice), rel=1e-12)
    assert seen_shared and seen_apart


@pytest.mark.parametrize(("world", "cluster"), [(2, "cpu-gloo"), (4, "v100-paper")])
def test_dp_and_ilp_agree_and_are_the_predicted_step_time(world, cluster):
    p = priced(world, cluster)
    dp, ilp = solve(p.search_graph, method="dp"), solve(p.search_graph, method="ilp")
    assert dp.cost == pytest.approx(ilp.cost, rel=1e-9)
    assert dp.cost == pytest.approx(step_time(p, dp.choice), rel=1e-12)


def test_readers_that_do_not_share_pay_each_all_reduce_s_latency_on_their_edge():
    """Apart, both readers keep their all-reduce in the graph (one message each, not a bucket's share): the edge
    is the re-layout plus both latencies the bucketed node prices left out; shared, the re-layout less ``v``'s."""
    from primepar_fx.cost.model import edge_cost_matrix
    from primepar_fx.cost.share import input_all_reduce_latency
    from primepar_fx.partition.enumerate import values_key
    from primepar_fx.partition.layouts import bound_partition

    p, spec = priced(), load_cluster("cpu-gloo")
    first, later = readers()
    (k_u,), (k_v,) = (sorted(graph().nodes[n].dims.weights) for n in (first, later))
    parts = {n: [bound_partition((graph().nodes[n].dims, s, p.mesh)) for s in p.strategies[n]] for n in (first, later)}
    relayout, _ = edge_cost_matrix(parts[first], k_u, parts[later], k_v, spec, VALUES, OPTS, shared=True)

    def latency(n, k):
        target = graph().nodes[n].target
        return [input_all_reduce_latency(q, target, k, spec, values_key(VALUES), 4) for q in parts[n]]

    lat_u, lat_v = latency(first, k_u), latency(later, k_v)
    tied, edge = p.tied[(first, later)], p.cost_graph.edge_cost[(first, later)]
    fused = p.scatter[(first, later)].backward_scattered  # apart, v's all-reduce and the re-layout back may fuse
    apart = [(i, j) for i in range(len(lat_u)) for j in range(len(lat_v)) if not tied.shared[i, j]]
    assert any(lat_u[i] > 0 and lat_v[j] > 0 and not fused[i, j] for i, j in apart)
    for i, j in apart:
        if not fused[i, j]:
            assert edge[i, j] == pytest.approx(relayout[i, j] + lat_u[i] + lat_v[j], rel=1e-12, abs=1e-15)
    for i, j in zip(*tied.shared.nonzero()):
        assert edge[i, j] == pytest.approx(relayout[i, j] - tied.reduce_s[j], rel=1e-12, abs=1e-15)


def test_a_later_reader_s_own_all_reduce_fused_with_the_re_layout_back_is_priced_as_a_reduce_scatter():
    """Apart, where the re-layout of the later reader's gradient back to the storage layout only slices it, the
    runtime runs one reduce-scatter instead of the all-reduce and the slice: the edge is the re-layout plus the
    first reader's latency plus the lone reduce-scatter, less the bucketed all-reduce the node priced; the summary
    reports the reduce-scatter's bytes on the later reader."""
    from primepar_fx.cost.blocks import block_bytes, tensor_map
    from primepar_fx.cost.model import edge_cost_matrix
    from primepar_fx.cost.share import input_all_reduce_latency
    from primepar_fx.partition import collectives
    from primepar_fx.partition.enumerate import values_key
    from primepar_fx.partition.layouts import bound_partition

    p, spec, vkey = priced(), load_cluster("cpu-gloo"), values_key(VALUES)
    first, later = readers()
    (k_u,), (k_v,) = (sorted(graph().nodes[n].dims.weights) for n in (first, later))
    parts = {n: [bound_partition((graph().nodes[n].dims, s, p.mesh)) for s in p.strategies[n]] for n in (first, later)}
    relayout, _ = edge_cost_matrix(parts[first], k_u, parts[later], k_v, spec, VALUES, OPTS, shared=True)
    tied, edge = p.tied[(first, later)], p.cost_graph.edge_cost[(first, later)]
    fused = p.scatter[(first, later)].backward_scattered
    pairs = list(zip(*fused.nonzero()))
    assert pairs and not any(tied.shared[i, j] for i, j in pairs)
    for i, j in pairs:
        q = parts[later][j]
        (c,) = [c for c in collectives(q) if c.tensor == f"d_in{k_v}"]
        block = block_bytes(q, tensor_map(q.op, c.tensor), vkey, 4)
        scattered = reduce_scatter_seconds(spec, block, p.mesh, c.digits)  # point to point, as the runtime runs it
        bucketed = spec.collective_time("all-reduce", block, p.mesh, c.digits, bucketed=True)
        lat_u = input_all_reduce_latency(parts[first][i], graph().nodes[first].target, k_u, spec, vkey, 4)
        expected = relayout[i, j] + lat_u + scattered - bucketed
        assert edge[i, j] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        bus, _ = ring_factors("reduce-scatter", spec.group_size(p.mesh, c.digits))
        assert fused[i, j] == round(bus * block)
    i, j = pairs[0]
    choice = dict.fromkeys(graph().nodes, 0) | {first: int(i), later: int(j)}
    node = {n.name: n for n in summarize(graph(), p, choice, OPTS).nodes}[later]
    assert node.cost.comm_bytes.get("reduce-scatter") == fused[i, j]
    assert node.cost.collective_s >= 0


def test_the_tied_edge_goes_through_a_proxy_so_the_layers_stay_separable():
    """The tied edge jumps every layer. Its rows differ by the layout the first reader stores the table in and by
    how it reduces the gradient (64 distinct of 125 on 8 devices): the DP routes it through a proxy with that many
    states (:mod:`~primepar_fx.search.proxy`), the optimum unchanged; with too few states allowed it cannot, and
    the whole model is one segment (17x slower on bloom-176b)."""
    import numpy as np

    from primepar_fx.partition import DeviceMesh
    from primepar_fx.search.dp import DPOptions, DPSolver

    priced = price_graph(graph(), DeviceMesh((2, 2, 2)), load_cluster("v100-paper"), VALUES, OPTS)
    ((u, v),) = priced.tied
    rows = len(np.unique(priced.cost_graph.edge_cost[(u, v)], axis=0))
    assert 32 < rows <= DPOptions().max_proxy_states
    proxies = DPSolver(priced.search_graph).proxied.proxies
    assert [(n, len(np.unique(c))) for n, c in proxies.values()] == [(u, rows)]
    assert not DPSolver(priced.search_graph, DPOptions(max_proxy_states=32)).proxied.proxies
    free = solve(priced.search_graph, method="dp")
    narrow = solve(priced.search_graph, method="dp", options=DPOptions(max_proxy_states=32))
    assert free.cost == pytest.approx(narrow.cost, rel=1e-12)


@pytest.mark.parametrize(("zero", "micro_batches"), [(1, 1), (3, 2)])
def test_with_zero_a_table_whose_readers_do_not_share_gathers_nothing(zero, micro_batches):
    """ZeRO shards a parameter's state over the replicas of its gradient bucket. A table whose readers keep an
    all-reduce each in the graph (they do not share) has no bucket, so the runtime neither shards it nor
    all-gathers it: the summary reports no all-gather on either reader, and the objective agrees; where they
    share, the first reader alone gathers it, as without the pairing. (ZeRO-3 with one micro-batch gathers this
    table no more than the all-reduce's share: the head keeps it whole from Forward to Backward.)"""
    opts = dataclasses.replace(OPTS, zero=zero, micro_batches=micro_batches)
    spec = load_cluster("cpu-gloo")
    p = price_graph(graph(), spec.mesh(WORLD), spec, VALUES, opts)
    first, later = readers()
    tied = p.tied[(first, later)]
    costs = {n: p.node_costs[n] for n in (first, later)}
    gathers = {n: [dict(c.zero_gather_bytes) for c in costs[n]] for n in (first, later)}
    sg, rng, seen = p.search_graph, random.Random(3), set()
    for _ in range(40):
        choice = {n: rng.randrange(len(p.strategies[n])) for n in p.strategies}
        i, j = choice[first], choice[later]
        if not any(gathers[first][i].values()) and not any(gathers[later][j].values()):
            continue
        seen.add(bool(tied.shared[i, j]))
        nodes = {n.name: n for n in summarize(graph(), p, choice, opts).nodes}
        sent = {n: nodes[n].cost.comm_bytes.get("all-gather", 0) for n in (first, later)}
        own = {n: costs[n][choice[n]].comm_bytes.get("all-gather", 0) for n in (first, later)}
        if tied.shared[i, j]:
            assert sent == {first: own[first], later: 0}
        else:
            assert sent == {first: own[first] - sum(gathers[first][i].values()), later: 0}
        full = {**choice, **{n: choice[n.removesuffix(SUFFIX)] for n in sg.nodes if virtual(n)}}
        for n in (n for n in sg.nodes if virtual(n)):
            full[n] = min(range(sg.strategies(n)), key=lambda s, n=n: evaluate(sg, {**full, n: s}))
        predicted = summarize(graph(), p, choice, opts, nodes=False).predicted.step_time_s
        assert evaluate(sg, full) == pytest.approx(predicted, rel=1e-12)
    assert seen == {True, False}
