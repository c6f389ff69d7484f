"""ZeRO-3's parameters kept whole from Forward to Backward (:mod:`primepar_fx.pricing.zero3`): which they are, and how
a node reading one is priced (one all-gather a micro-batch instead of two, its block held whole meanwhile)."""

from __future__ import annotations

import pytest
from opdims import linear_dims as linear

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.model import node_cost, zero_gather_price
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import build_graph
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq
from primepar_fx.partition.enumerate import values_key
from primepar_fx.pricing.zero3 import kept_inputs, kept_whole

CLUSTER = load_cluster("v100-paper")


def _graph(name: str):
    config = get_config(name)
    args, kwargs = example_inputs(config, 2, 8)
    return build_graph(capture(build(config), args, kwargs))


def test_the_parameters_only_nodes_after_the_stack_read_in_backward_are_kept():
    # Llama: the final norm and the untied head; the embedding is not read in Backward at all
    assert kept_whole(_graph("llama-tiny")) == {"final_norm.weight", "lm_head.weight"}
    # GPT-2: the final layer norm (scale and shift) and the tied embedding, which only the head reads in Backward
    gpt2 = _graph("gpt2-tiny")
    assert kept_whole(gpt2) == {"final_norm.weight", "final_norm.bias", "lm_head.weight"}
    readers = [n for n, node in gpt2.nodes.items() if "lm_head.weight" in node.params]
    assert len(readers) == 2  # the embedding and the head both read it, so both nodes see it kept
    assert all(kept_inputs(gpt2, n, kept_whole(gpt2)) for n in readers)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_kept_weight_is_gathered_once_a_micro_batch_and_held_whole_until_backward(micro_batches):
    """Data parallelism over 4 devices (``B,B``): the weight block is whole on each, 4 replicas."""
    op = linear(8, 16, 32, 64)
    part = OpPartition(op, PartitionSeq.parse("B,B"), DeviceMesh((2, 2)))
    opts = CostOptions(zero=3, micro_batches=micro_batches)
    released, kept = (node_cost(part, None, CLUSTER, {}, opts, kept) for kept in ((), (1,)))
    block = 32 * 64 * 4
    gather = ring_factors("all-gather", 4)[0] * block
    m = micro_batches
    # released: Forward and Backward each gather it (less the reduce-scatter's share of the all-reduce: 1/m)
    assert released.comm_bytes["all-gather"] == pytest.approx((2 - 1 / m) * gather, abs=1)
    # kept: Forward's gather only (with one micro-batch, exactly the half of the all-reduce ZeRO-3 leaves out)
    assert kept.comm_bytes.get("all-gather", 0) == pytest.approx((1 - 1 / m) * gather, abs=1)
    assert kept.collective_s <= released.collective_s
    # kept: the whole block stays from Forward to Backward, beyond this device's quarter in the state
    assert kept.stash_bytes - released.stash_bytes == block - block // 4
    assert kept.shard_bytes == released.shard_bytes == block // 4


def test_an_fp32_shard_is_its_own_master():
    """ZeRO-3 steps an fp32 shard in place: no fp32 copy of it beside the parameter shard (a 16-bit one keeps its
    fp32 master); ZeRO-2 keeps a copy of an fp32 shard beside the whole parameter."""
    elems, shard = 4096, 1024
    for dtype, item in (("fp32", 4), ("bf16", 2)):
        zero3 = CostOptions(dtype=dtype, zero=3).state_bytes(elems, shard)
        moments = 8
        assert zero3 == shard * item + shard * item + shard * (moments + (4 if item == 2 else 0)), dtype
    zero2 = CostOptions(dtype="fp32", zero=2).state_bytes(elems, shard)
    assert zero2 == elems * 4 + shard * 4 + shard * (8 + 4)


@pytest.mark.parametrize(("sizes", "hides"), [((8, 16, 32, 64), True), ((4, 1, 2048, 4096), False)])
def test_a_gather_is_priced_hidden_behind_the_nodes_compute_as_far_as_it_goes(sizes, hides):
    """ZeRO-3 prefetches each unit's gather while the unit before it computes: a node's gathers are priced behind
    its own compute of the phase that needs them (Forward; Backward again for a weight it reads there), the rest
    exposed. A small weight's gathers hide; a weight that outweighs the compute shows its excess."""
    part = OpPartition(linear(*sizes), PartitionSeq.parse("B,B"), DeviceMesh((2, 2)))
    three = node_cost(part, None, CLUSTER, {}, CostOptions(zero=3))
    stage2 = node_cost(part, None, CLUSTER, {}, CostOptions(zero=2))
    gather, _ = zero_gather_price(part, 1, CLUSTER, values_key({}), 4)
    forward, backward = three.phase_s[0], three.phase_s[1] + three.phase_s[2]
    # one micro-batch: Backward's gather on top of stage 2 (Forward's is the half of the all-reduce stage 2 sends)
    exposed = max(0.0, gather - min(gather, forward) - min(gather, backward))
    assert three.collective_s - stage2.collective_s == pytest.approx(exposed, rel=1e-9, abs=1e-15)
    assert (exposed == 0) == hides  # (the few tokens of the second: a weight far larger than its compute)


def test_a_tied_weights_saved_gathers_are_no_more_than_its_reader_paid():
    """A case the fuzz found: with ZeRO-3 a tied weight's second reader has its gathers off (the first reader's
    serve it), but they were taken off at their full price while its cost has only the part its compute does not
    hide: its collective seconds came out negative and the plan failed to build (``cost.collective_s: must be
    >= 0``). Searched on two ranks of a tied rotary decoder with two micro-batches."""
    from primepar_fx.models import DecoderConfig
    from primepar_fx.planning.planner import plan_graph

    config = DecoderConfig(name="fuzz", vocab_size=96, hidden=48, layers=3, heads=6, kv_heads=6, ffn_hidden=192,
                           norm="layernorm", mlp="gelu", position="rotary", bias=False, tied_embeddings=True,
                           max_seq=24)  # fmt: skip
    (ids,), kwargs = example_inputs(config, 12, 24, seed=649)
    graph = build_graph(capture(build(config, seed=649), (ids,), {"labels": kwargs["labels"]}))
    plan = plan_graph(graph, world_size=2, cluster="cpu-gloo", batch=12, seq=24, zero=3, micro_batches=2,
                      memory_budget=None, baselines=False)  # fmt: skip
    assert (plan.zero, plan.micro_batches) == (3, 2)
    assert all(n.cost.collective_s >= 0 for n in plan.nodes)
