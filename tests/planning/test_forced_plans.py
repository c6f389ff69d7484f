"""``primepar_fx.planning.planner.forced_plan``: named strategies (Megatron, data parallel, P(S x S), random)."""

from __future__ import annotations

import functools

import pytest

from primepar_fx.api import analyze
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.record.plan import Plan

CLUSTER = "cpu-gloo"


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config("gpt2-tiny"), 4, 16)
    return analyze(build("gpt2-tiny"), args, kwargs, name="gpt2-tiny")


@functools.cache
def searched(world_size: int):
    return plan_graph(graph(), world_size=world_size, cluster=CLUSTER, batch=8, seq=64)


def forced(name: str, world_size: int = 4, batch: int = 8, seq: int = 64) -> Plan:
    return forced_plan(graph(), name, world_size=world_size, cluster=CLUSTER, batch=batch, seq=seq)


def linear_partitions(plan: Plan) -> list[str]:
    parts = [n.partition for n in plan.nodes if n.op == "aten.linear.default"]
    assert parts, "gpt2-tiny has linears"
    return parts


def test_prime_puts_p2x2_on_every_linear_of_four_devices() -> None:
    assert set(linear_partitions(forced("prime", 4))) == {"P2x2"}


def test_prime_on_eight_devices_pairs_p2x2_with_one_more_element() -> None:
    plan = forced("prime", 8)
    assert plan.digits == (2, 2, 2)
    for text in linear_partitions(plan):
        seq = PartitionSeq.parse(text)
        assert len(seq.elements) == 2 and "P2x2" in text.split(","), text
    constants = [n for n in graph().nodes.values() if not n.requires_grad]
    assert constants and all(plan.node(n.name).partition == "R,R,R" for n in constants)


def test_prime_past_three_digits_runs_on_the_free_searchs_groupings_with_p_on_every_linear() -> None:
    """Issue 61: on 16 devices of two nodes (four digits) the full mesh's tables passed the dynamic program's limit
    (``TableTooLarge`` on Llama); the forced plan now searches the groupings the free search does and keeps the
    one with P(S x S) on the most nodes."""
    args, kwargs = example_inputs(get_config("llama-tiny"), 4, 16)
    llama = analyze(build("llama-tiny"), args, kwargs, name="llama-tiny")
    plan = forced_plan(llama, "prime", world_size=16, cluster="v100-paper", batch=8, seq=64)
    assert plan.search.grouped and plan.world_size == 16 and len(plan.digits) == 3
    assert plan.digits in {(4, 2, 2), (2, 2, 4)}  # the groupings with two equal consecutive digits
    assert all("P2x2" in text.split(",") for text in linear_partitions(plan))


def test_megatron_and_data_parallel_match_the_baselines_of_the_searched_plan() -> None:
    base = searched(4).baselines
    for name in ("megatron", "data_parallel"):
        plan = forced(name, 4)
        assert {n.name: n.partition for n in plan.nodes} == base[name].partitions, name
        assert plan.predicted == base[name].predicted, name
    assert forced("megatron", 4).search.config == base["megatron"].config


def test_megatron_sp_is_the_fastest_sequence_parallel_configuration_and_uses_reduce_scatters() -> None:
    sp = forced("megatron-sp", 4)
    assert sp.search.config["sequence_parallel"] is True
    assert sp.search.config["name"].endswith("+SP")
    kinds = {k for n in sp.nodes for k in n.cost.comm_bytes}
    assert "reduce-scatter" in kinds
    with pytest.raises(ValueError, match="unknown forced plan"):
        forced("megatron-sq", 4)


def test_a_forced_plan_is_a_full_plan_for_its_model_and_round_trips_through_json() -> None:
    g, plan = graph(), forced("data_parallel", 4)
    plan.check_model((n.name, n.op) for n in g.nodes.values())
    assert (plan.model, plan.world_size, plan.digits, plan.cluster) == ("gpt2-tiny", 4, (2, 2), CLUSTER)
    assert (plan.batch, plan.seq, plan.dtype, plan.baselines) == (8, 64, "fp32", {})
    assert plan.search.forced == "data_parallel"
    assert all(n.cost is not None for n in plan.nodes)
    assert Plan.from_json(plan.to_json()) == plan


def test_random_plans_are_seeded_and_every_partition_is_legal_even_where_sizes_barely_divide() -> None:
    def parts(name: str) -> dict[str, str]:
        return {n.name: n.partition for n in forced(name, 8, batch=2, seq=2).nodes}

    first, again, other = parts("random:3"), parts("random:3"), parts("random:4")
    assert first == again
    assert first != other
    mesh, values = DeviceMesh((2, 2, 2)), {B: 2, S: 2}
    for plan in (first, other):
        for name, text in plan.items():
            OpPartition(graph().nodes[name].dims, PartitionSeq.parse(text), mesh).check_divisible(values)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("alpa", "unknown forced plan 'alpa'.*random:SEED"),
        ("random", "unknown forced plan"),
        ("random:x3", "seed 'x3'"),
        ("random:", "seed ''"),
    ],
)
def test_bad_forced_plan_names_are_rejected(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        forced(name)
