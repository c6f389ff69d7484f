"""Input-gradient sums that wait for the end of backward: the plan prices exactly the ones the passes defer.

GPT-2's learned position table is looked up alike on every rank and added to a batch-split activation, so the
``add`` sums the table's output gradient over the batch ranks; the runtime launches that sum asynchronously and
computes the table's gradient at the end of backward (``DeferredGradients``). The pricing
(:mod:`primepar_fx.pricing.deferred`) and the pass (:func:`~primepar_fx.passes.gradsync.defer_input_gradient_sums`)
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
from primepar_fx.models import DecoderConfig, build, example_inputs
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes import localize
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.summary import summarize
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.pending import DeferredGradients

WORLD, BATCH, SEQ = 4, 4, 16
#: a fuzz case (seed 11, case 37) whose random plan replicates the final RMSNorm's weight product while the LM head
#: splits: the product's activation input needs a gradient, so its sum must not wait; a runtime that deferred it
#: lost that gradient
FUZZ_37 = {
    "vocab_size": 192, "hidden": 96, "layers": 1, "heads": 2, "kv_heads": 1, "ffn_hidden": 192, "fused_qkv": False,
    "norm": "rmsnorm", "mlp": "relu", "position": "rotary", "bias": False, "tied_embeddings": False,
    "embed_norm": True, "max_seq": 24,
}  # fmt: skip


@functools.cache
def graph(name: str, batch: int = BATCH, seq: int = SEQ):
    if name == "fuzz-37":
        model = build(DecoderConfig(name="fuzz", **FUZZ_37), seed=78)
    else:
        model = build(name)
    args, kwargs = example_inputs(model.config, batch, seq)
    return analyze(model, args, kwargs, name=name)


def deferred_in_rank_graphs(g, plan, world: int, batch: int, seq: int) -> list[set[str]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    mesh = DeviceMesh(tuple(plan.digits))
    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            rg = localize(g, plan.partitions(), mesh, rank, {B: batch, S: seq}, ProcessGroups(mesh, rank))
        finally:
            dist.destroy_process_group()
        out.append({m.node for m in rg.gm.modules() if isinstance(m, DeferredGradients)})
    return out


@pytest.mark.parametrize(
    ("model", "plans", "world", "batch", "seq"),
    [
        ("gpt2-tiny", ["data_parallel", "megatron", "random:3", "random:8"], WORLD, BATCH, SEQ),
        ("llama-tiny", ["data_parallel", "random:1", "random:2"], WORLD, BATCH, SEQ),
        ("fuzz-37", ["random:7280"], 2, 12, 24),
    ],
)
def test_the_plan_prices_exactly_the_sums_the_passes_defer(
    model: str, plans: list[str], world: int, batch: int, seq: int
) -> None:
    g = graph(model, batch, seq)
    cluster = load_cluster("cpu-gloo")
    opts = CostOptions(dtype="fp32")
    seen = set()
    for name in plans:
        plan = forced_plan(g, name, world_size=world, cluster=cluster, batch=batch, seq=seq)
        mesh = DeviceMesh(tuple(plan.digits))
        priced, (choice,) = price_assignments(g, [plan.partitions()], mesh, cluster, {B: batch, S: seq}, opts)
        priced_here = {v for (u, v), d in priced.deferred.items() if d.seconds[choice[u], choice[v]] > 0}
        for rank, got in enumerate(deferred_in_rank_graphs(g, plan, world, batch, seq)):
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
