"""Shared re-layouts (:mod:`primepar_fx.cost.share`): what the plan stops paying, against Megatron-LM's counts.

A Llama layer reads its attention norm's output three times (q, k, v) and its MLP norm's output twice (gate, up).
Megatron-LM, like DTensor, gathers each norm's output once and reduces the summed input gradient once. Our plan
prices one re-layout and one gradient all-reduce per consumer unless they share, so sharing must save, per layer
and device, exactly ``(3 - 1) + (2 - 1) = 3`` of each (and, with sequence parallelism, two of the three gathers of
the embedding output's gradient): with sequence parallelism 3 all-gathers and 3
reduce-scatters of ``B*S*h`` (``(t-1)/t`` of it each), without it 3 all-reduces (``2(t-1)/t`` each). With the
sharing the layer's volume is then Megatron's closed form for split projections, as it is for GPT-2's fused one
(``tests/cost/test_megatron_volume.py``). The graph pass that runs it: ``tests/passes/test_share_relayouts.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import pytest

import primepar_fx
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import summarize

MODEL = "llama-tiny"
VALUES = {B: 4, S: 32}
OPTS = CostOptions(dtype="fp32")


@functools.cache
def graph() -> OpGraph:
    config = get_config(MODEL)
    args, kwargs = example_inputs(config, 2, 16)
    return primepar_fx.analyze(build(config), args, kwargs, name=MODEL)


@functools.cache
def priced(t: int, sp: bool):
    g, mesh = graph(), DeviceMesh.for_world_size(t)
    plan = megatron_assignment(g, mesh, dp=1, sequence_parallel=sp, values=VALUES)
    assert not plan.fallbacks, plan.fallbacks
    return price_graph(g, mesh, load_cluster("v100-paper"), VALUES, OPTS, fixed=plan)


def comm(t: int, sp: bool, share: bool) -> int:
    p = priced(t, sp)
    if not share:
        p = dataclasses.replace(p, fanout={})
    choice = dict.fromkeys(p.strategies, 0)
    return summarize(graph(), p, choice, OPTS, nodes=False).predicted.comm_bytes


@pytest.mark.parametrize("t", [2])
@pytest.mark.parametrize("sp", [False, True])
def test_sharing_saves_two_qkv_and_one_gate_up_relayouts_per_layer(t, sp):
    config = get_config(MODEL)
    bsh = VALUES[B] * VALUES[S] * config.hidden * OPTS.itemsize
    per_layer = 3 * 2 * Fraction(t - 1, t) * bsh  # SP: 3 all-gathers + 3 reduce-scatters; else 3 all-reduces
    # SP also splits the vocabulary-parallel embedding's output by sequence for its three readers (the first norm
    # twice, the residual add), whose gradients it gathers back: shared, one gather instead of three
    embedding = 2 * Fraction(t - 1, t) * bsh if sp else 0
    saved = comm(t, sp, share=False) - comm(t, sp, share=True)
    want = config.layers * per_layer + embedding
    assert saved == pytest.approx(float(want), abs=config.layers * 3 + 3)  # bytes round per node


@pytest.mark.parametrize("sp", [False, True])
def test_the_consumers_that_share_are_the_projections_of_one_norm(sp):
    p = priced(2, sp)
    shared = p.shared_consumers(dict.fromkeys(p.strategies, 0))
    g = graph()
    moved = [u for u, vs in shared.items() if any(p.flows[(u, v)].reduce_bytes[0] for v in vs)]
    projections = sorted(tuple(sorted(g.nodes[v].params[0].split(".")[-2] for v in p.fanout[u])) for u in moved)
    layers = get_config(MODEL).layers
    assert projections == [("gate_proj", "up_proj")] * layers + [("k_proj", "q_proj", "v_proj")] * layers


def test_a_consumer_that_differs_keeps_every_relayout():
    """All or nothing: when one consumer of a shared input needs another layout, none shares (what the graph pass
    does too), and the plan is priced pairwise as before."""
    p = priced(2, True)
    choice = dict.fromkeys(p.strategies, 0)
    u, group = next((u, vs) for u, vs in p.fanout.items() if len(vs) == 3 and p.flows[(u, vs[0])].reduce_bytes[0])
    assert group[1:] == p.shared_consumers(choice)[u]
    other = dataclasses.replace(p.flows[(u, group[2])], signature=p.flows[(u, group[2])].signature + 10**6)
    flows = {**p.flows, (u, group[2]): other}
    assert u not in dataclasses.replace(p, flows=flows).shared_consumers(choice)
