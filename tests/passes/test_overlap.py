"""The overlap_collective_matmuls pass: re-layouts that move whole rows fused with the linears beside them.

That the fused nodes compute the plain nodes' values, gradients and bytes is
``tests/runtime/test_collective_matmul.py``; that the ranks then train like one device and send the predicted bytes
is ``tests/compiler/test_distributed.py`` (``megatron-sp``). Here: where the pass fuses, and that it fuses exactly
the edges the cost model prices as overlapped (:mod:`primepar_fx.cost.matmul_overlap`), so the prediction is of what
runs.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from torch import fx

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes.common import info
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import make_plan
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import summarize
from primepar_fx.record.search import SearchRecord
from primepar_fx.report.dump import fake_rank_graphs
from primepar_fx.runtime.collective_matmul import GatherLinears, LinearScatter
from primepar_fx.runtime.exchange import Redistribute

MODEL, BATCH, SEQ = "llama-tiny", 4, 16
aten = torch.ops.aten


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config(MODEL), BATCH, SEQ)
    return analyze(build(MODEL, device="meta"), args, kwargs, name=MODEL)


@functools.cache
def plan(name: str, world: int):
    if name == "megatron dp1 (no SP)":  # Megatron-LM's tensor parallelism over every rank, without SP
        spec, values = load_cluster("cpu-gloo"), {B: BATCH, S: SEQ}
        mesh = spec.mesh(world)
        assignment = megatron_assignment(graph(), mesh, dp=1, sequence_parallel=False, values=values)
        priced = price_graph(graph(), mesh, spec, values, CostOptions(), fixed=assignment)
        summary = summarize(graph(), priced, dict.fromkeys(priced.strategies, 0), CostOptions())
        options = PlanOptions.make(cluster=spec, world_size=world, batch=BATCH, seq=SEQ)
        return make_plan(graph(), options, mesh, summary, baselines={}, search=SearchRecord(forced="megatron"))
    return forced_plan(graph(), name, world_size=world, cluster="cpu-gloo", batch=BATCH, seq=SEQ)


@functools.cache
def rank_graph(name: str, world: int, rank: int = 1):
    return fake_rank_graphs(graph(), plan(name, world), [rank])[rank].gm


def modules(gm: fx.GraphModule, kind: type) -> list[tuple[fx.Node, object]]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), kind):
            out.append((n, gm.get_submodule(n.target)))
    return out


def fused_edges(gm: fx.GraphModule) -> set[tuple[str, str]]:
    """The plan's edges ``(producer, consumer)`` whose re-layout runs fused with a linear in this rank graph."""
    edges = set()
    for node, _ in modules(gm, GatherLinears):
        producer = info(node.args[0]).name
        edges |= {(producer, info(u).name) for u in node.users if u.target is operator.getitem}
    for _, mod in modules(gm, LinearScatter):
        edges.add(tuple(mod.what.split(" -> ")))  # type: ignore[arg-type]
    return edges


def priced_edges(name: str, world: int) -> set[tuple[str, str]]:
    """The edges the cost model prices as overlapped under the plan's strategies (one per node: index 0)."""
    p = plan(name, world)
    spec = load_cluster("cpu-gloo")
    priced = price_graph(
        graph(), DeviceMesh(tuple(p.digits)), spec, {B: BATCH, S: SEQ}, CostOptions(), fixed=p.partitions()
    )
    return {edge for edge, saving in priced.overlap.items() if saving.seconds[0, 0] > 0}


def test_sequence_parallelism_fuses_each_gather_with_its_linears_and_each_row_parallel_linear_with_its_scatter():
    gm = rank_graph("megatron-sp", 2)
    layers = get_config(MODEL).layers
    gathers = modules(gm, GatherLinears)
    # q/k/v and gate/up of each layer, and the LM head
    assert sorted(len(m.has_bias) for _, m in gathers) == sorted([3, 2] * layers + [1])
    scatters = modules(gm, LinearScatter)
    assert len(scatters) == 2 * layers  # o and down
    beside = [n for n, _ in modules(gm, Redistribute) if any(u.target is aten.linear.default for u in n.users)]
    assert beside == []  # no re-layout left before a linear


def test_without_sequence_parallelism_nothing_moves_beside_a_linear():
    gm = rank_graph("megatron dp1 (no SP)", 2)
    assert not modules(gm, GatherLinears) and not modules(gm, LinearScatter)
    assert priced_edges("megatron dp1 (no SP)", 2) == set()


@pytest.mark.parametrize(("name", "world"), [("megatron-sp", 2), ("megatron-sp", 4), ("random:3", 4), ("random:5", 4)])
def test_the_pass_fuses_exactly_the_edges_the_plan_prices_as_overlapped(name, world):
    fused = fused_edges(rank_graph(name, world))
    assert fused == priced_edges(name, world)
    if name == "megatron-sp":
        assert len(fused) == 7 * get_config(MODEL).layers + 1  # q, k, v, gate, up, o, down; the LM head
