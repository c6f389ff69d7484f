"""Megatron-LM with sequence parallelism runs one all-gather before, and one reduce-scatter after, each attention
and each MLP: four re-layouts per decoder layer (each with its backward dual), however many linears read the
gathered tensor (Q, K and V; gate and up). The runtime does exactly that (its consumers share one re-layout,
``passes.share``), and the cost model charges exactly that (``cost.share``: the later consumers' re-layouts are
priced as not run). Counted as the difference between a 3-layer and a 2-layer model, so the embedding and the
head, which are not per layer, drop out.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.report.dump import fake_rank_graphs

BATCH, SEQ, WORLD = 8, 64, 4
VALUES = {B: BATCH, S: SEQ}


@functools.cache
def graph(layers: int):
    config = dataclasses.replace(get_config("llama-tiny"), layers=layers)
    args, kwargs = example_inputs(config, BATCH, SEQ)
    return analyze(build(config, device="meta"), args, kwargs, name="llama-tiny")


def runtime_relayouts(layers: int) -> int:
    plan = forced_plan(graph(layers), "megatron-sp", world_size=WORLD, batch=BATCH, seq=SEQ, cluster="cpu-gloo")
    assert plan.search.config["mp"] == 2 and plan.search.config["sequence_parallel"]
    rank = fake_rank_graphs(graph(layers), plan, [0])[0]
    kinds = collections.Counter(type(m).__name__ for m in rank.gm.modules())
    # a re-layout alone, or fused with the linears beside it (passes.overlap): one each
    return kinds["Redistribute"] + kinds["GatherLinears"] + kinds["LinearScatter"]


def priced_relayouts(layers: int) -> int:
    """Edges that move bytes under Megatron dp2 x mp2 + SP, less those the cost model prices as shared."""
    g, mesh = graph(layers), DeviceMesh((2, 2))
    assignment = megatron_assignment(g, mesh, dp=2, mp=2, sequence_parallel=True, values=VALUES)
    priced, (choice,) = price_assignments(g, [assignment], mesh, load_cluster("cpu-gloo"), VALUES, CostOptions())
    moving = {(u, v) for (u, v), b in priced.edge_bytes.items() if b[choice[u], choice[v]] > 0}
    shared = {(s.u, s.v) for s in priced.not_run(choice) if not s.tied}  # (and those sharing an all-reduce)
    return len(moving - shared)


def test_megatron_sp_runs_and_is_priced_with_four_relayouts_per_layer() -> None:
    assert runtime_relayouts(3) - runtime_relayouts(2) == 4
    assert priced_relayouts(3) - priced_relayouts(2) == 4
