"""Input-gradient sums that wait for the end of backward: the plan prices exactly the ones the passes defer.

GPT-2's learned position table is looked up alike on every rank and added to a batch-split activation, so the
``add`` sums the table's output gradient over the batch ranks; the runtime launches that sum asynchronously and
computes the table's gradient at the end of backward (``DeferredGradients``). The pricing
(:mod:`primepar_fx.planning.deferred`) and the pass (:func:`~primepar_fx.passes.gradsync.defer_input_gradient_sums`)
read the same facts from the plan; these tests hold them together on every rank of several plans.
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from primepar_fx import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes import localize
from primepar_fx.planning.compare import price_assignments
from primepar_fx.planning.planner import forced_plan
from primepar_fx.planning.summary import summarize
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.pending import DeferredGradients

WORLD, BATCH, SEQ = 4, 4, 16


@functools.cache
def graph(name: str):
    model = build(name)
    args, kwargs = example_inputs(model.config, BATCH, SEQ)
    return analyze(model, args, kwargs, name=name)


def deferred_in_rank_graphs(g, plan) -> list[set[str]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    mesh = DeviceMesh(tuple(plan.digits))
    out = []
    for rank in range(WORLD):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        try:
            rg = localize(g, plan.partitions(), mesh, rank, {B: BATCH, S: SEQ}, ProcessGroups(mesh, rank))
        finally:
            dist.destroy_process_group()
        out.append({m.node for m in rg.gm.modules() if isinstance(m, DeferredGradients)})
    return out


@pytest.mark.parametrize(
    ("model", "plans"),
    [("gpt2-tiny", ["data_parallel", "megatron", "random:3", "random:8"]), ("llama-tiny", ["data_parallel"])],
)
def test_the_plan_prices_exactly_the_sums_the_passes_defer(model: str, plans: list[str]) -> None:
    g = graph(model)
    cluster = load_cluster("cpu-gloo")
    opts = CostOptions(dtype="fp32")
    seen = set()
    for name in plans:
        plan = forced_plan(g, name, world_size=WORLD, cluster=cluster, batch=BATCH, seq=SEQ)
        mesh = DeviceMesh(tuple(plan.digits))
        priced, (choice,) = price_assignments(g, [plan.partitions()], mesh, cluster, {B: BATCH, S: SEQ}, opts)
        priced_here = {v for (u, v), d in priced.deferred.items() if d.seconds[choice[u], choice[v]] > 0}
        for rank, got in enumerate(deferred_in_rank_graphs(g, plan)):
            assert got == priced_here, (name, rank)
        # the saving is the consumer's all-reduce's, reported on it; the bytes are the plan's either way
        summary = summarize(g, priced, choice, opts)
        assert summary.predicted.comm_bytes == plan.predicted.comm_bytes
        seen |= priced_here
    if model == "gpt2-tiny":
        assert seen, "the position table's sum is deferred under data parallelism"
        assert all(g.nodes[v].op == "aten.add.Tensor" for v in seen)
    else:  # rotary positions: no table, nothing to defer
        assert not seen
