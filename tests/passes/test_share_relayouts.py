"""The share_relayouts pass: consumers that need a tensor alike read one re-layout and one gradient all-reduce.

The plan's side (what it stops pricing, against Megatron-LM's counts) is ``tests/cost/test_share_volume.py``; that the
ranks then send the predicted bytes and train like one device is ``tests/compiler/test_distributed.py``
(llama-tiny, ``megatron`` and ``megatron-sp``).
"""

from __future__ import annotations

import functools
import os

import pytest
from torch import fx

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.passes.runner import DISABLE_ENV
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import make_plan
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import summarize
from primepar_fx.record.search import SearchRecord
from primepar_fx.report.dump import fake_rank_graphs
from primepar_fx.runtime.collectives import AllReduce, ReduceScatter
from primepar_fx.runtime.exchange import Redistribute
from primepar_fx.runtime.ring import RingMatmul

MODEL, WORLD, BATCH, SEQ = "llama-tiny", 2, 4, 16


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config(MODEL), BATCH, SEQ)
    return analyze(build(MODEL, device="meta"), args, kwargs, name=MODEL)


def megatron(sp: bool):
    """Megatron-LM's dp1 x mp2 plan (with or without sequence parallelism), not the cheapest configuration."""
    spec, values, opts = load_cluster("cpu-gloo"), {B: BATCH, S: SEQ}, CostOptions(dtype="fp32")
    mesh = spec.mesh(WORLD)
    assignment = megatron_assignment(graph(), mesh, dp=1, sequence_parallel=sp, values=values)
    priced = price_graph(graph(), mesh, spec, values, opts, fixed=assignment)
    summary = summarize(graph(), priced, dict.fromkeys(priced.strategies, 0), opts)
    options = PlanOptions.make(cluster=spec, world_size=WORLD, batch=BATCH, seq=SEQ)
    return make_plan(graph(), options, mesh, summary, baselines={}, search=SearchRecord(forced="megatron"))


@functools.cache
def rank_graph(sp: bool, disabled: str = ""):
    old = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = disabled
    try:
        return fake_rank_graphs(graph(), megatron(sp), [0])[0]
    finally:
        if old is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = old


def _projection(node: fx.Node) -> str | None:
    """``q_proj`` for the linear of a ``...q_proj.weight`` parameter."""
    weights = [a.name for a in node.all_input_nodes if a.op == "placeholder" and a.name.endswith("_proj_weight")]
    return weights[0].removesuffix("_weight").rsplit("_", 2)[-2] + "_proj" if weights else None


def _inputs_of_projections(gm: fx.GraphModule) -> dict[str, list[str]]:
    """The node each projection reads its activation from -> the projections that read it."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        name = _projection(node) if node.op == "call_function" else None
        if name is not None:
            out.setdefault(node.args[0].name, []).append(name)
    return out


#: the projections stay apart from the re-layout they read (tests/passes/test_overlap.py fuses them)
APART = "overlap_collective_matmuls"


@pytest.mark.parametrize("sp", [False, True])
def test_the_projections_of_one_norm_read_one_module(sp):
    gm = rank_graph(sp, APART).gm
    readers = sorted(tuple(sorted(v)) for v in _inputs_of_projections(gm).values())
    layers = get_config(MODEL).layers
    want = [("down_proj",)] * layers + [("gate_proj", "up_proj")] * layers + [("k_proj", "q_proj", "v_proj")] * layers
    assert readers == sorted(want + [("o_proj",)] * layers)


def test_sequence_parallel_gathers_once_and_reduce_scatters_the_summed_gradient():
    gm = rank_graph(True, APART).gm
    shared = [n for n in gm.graph.nodes if n.op == "call_module" and len(n.users) >= 2]
    modules = [gm.get_submodule(n.target) for n in shared if {_projection(u) for u in n.users} - {None}]
    assert len(modules) == 2 * get_config(MODEL).layers
    for mod in modules:
        assert isinstance(mod, Redistribute) and not mod.fwd.identity  # the all-gather, once
        assert isinstance(mod.bwd, ReduceScatter)  # the consumers' gradients summed, then reduce-scattered once


def test_without_the_pass_every_projection_has_its_own_chain():
    with_pass, without = rank_graph(False), rank_graph(False, "share_relayouts")
    readers = [len(v) for v in _inputs_of_projections(without.gm).values()]
    assert set(readers) == {1}
    count = dict(with_pass.pass_counts)["share_relayouts"]
    before = dict(with_pass.pass_counts)["insert_collectives"]
    layers = get_config(MODEL).layers
    # no SP: each projection input is replicated already; only its backward all-reduce is shared (2 + 1 per layer)
    assert before["AllReduce"] - count["AllReduce"] == 3 * layers
    all_reduces = [m for m in with_pass.gm.modules() if isinstance(m, AllReduce) and m.mode == "backward"]
    assert (
        len(all_reduces)
        == sum(1 for m in without.gm.modules() if isinstance(m, AllReduce) and m.mode == "backward") - 3 * layers
    )


def test_ring_products_with_a_bias_share_their_input():
    """P(S x S) q/k/v of a model with biases: each product names its operands (split-off bias) and then reads the
    shared chain; the ring pass must find them (a regression: OPT on 4 ranks, ``prime``)."""
    args, kwargs = example_inputs(get_config("opt-tiny"), BATCH, SEQ)
    opt = analyze(build("opt-tiny", device="meta"), args, kwargs, name="opt-tiny")
    plan = forced_plan(opt, "prime", world_size=4, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    gm = fake_rank_graphs(opt, plan, [1])[1].gm
    rings = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), RingMatmul)]
    inputs = {}
    for ring in rings:
        inputs.setdefault(ring.args[0], []).append(ring)
    assert sorted(len(v) for v in inputs.values() if len(v) > 1) == [3] * get_config("opt-tiny").layers
