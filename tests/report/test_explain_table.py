"""``primepar_fx.explain`` attributes reduce-scatter savings as the plan does.

The priced graph's edge costs are net of what fusing an all-reduce and the re-layout after it into a
reduce-scatter saves (``cost.scatter``). ``planner.summarize`` reports that saving off the collectives of the node
that runs the all-reduce and keeps the redistribution whole; ``explain`` must do the same, or an option shows a
negative redistribution time (gpt2-tiny's ``linear_2`` at ``N,K`` once showed ``-0.203`` ms for 196,608 bytes).
"""

from __future__ import annotations

import functools

import pytest

import primepar_fx
from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.fixed import price_fixed
from primepar_fx.record.plan import Plan
from primepar_fx.report.explain import Explanation, price_plan

WORLD, BATCH, SEQ = 4, 8, 64  # the sizes of docs/dump.md's example


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config("gpt2-tiny"), BATCH, SEQ)
    return analyze(build("gpt2-tiny", device="meta"), args, kwargs, name="gpt2-tiny")


@functools.cache
def searched() -> Plan:
    """Megatron dp2 x mp2 with sequence parallelism: reduce-scatters on both sides of every block. (The search on
    cpu-gloo used to find a plan like it; since parameter gradients travel in buckets it finds data parallelism,
    which has no re-layout to fuse.)"""
    return forced_plan(graph(), "megatron-sp", world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)


@functools.cache
def explained(name: str) -> Explanation:
    return primepar_fx.explain(searched(), name, graph=graph())


def switched(name: str, partition: str):
    """The plan's summary (``planner.summarize``) with ``name`` alone switched to ``partition``."""
    plan = searched()
    seqs = price_plan(graph(), plan, free=name).strategies[name]
    assignment = dict(plan.partitions())
    assignment[name] = next(s for s in seqs if str(s) == partition)
    values = {B: plan.batch, S: plan.seq}
    mesh = DeviceMesh(tuple(plan.digits))
    return price_fixed(graph(), assignment, mesh, load_cluster(plan.cluster), values, CostOptions(dtype=plan.dtype))


def options(why: Explanation):
    return (why.chosen, *why.alternatives)


def test_the_cases_below_have_reduce_scatter_savings() -> None:
    priced = price_plan(graph(), searched(), free="linear_2")
    assert any("linear_2" in edge for edge in priced.scatter), "no reduce-scatter saving on linear_2's edges"
    # linear_2 at N,K all-reduces its own output, which becomes a reduce-scatter for gelu (its saving)
    assert explained("linear_2").chosen.partition == "B,K"
    # add_2 after the row-parallel linear_3 (B,N): a sequence split of add_2 makes linear_3's all-reduce a
    # reduce-scatter (the neighbour's saving)
    assert searched().node("linear_3").partition == "B,N"


@pytest.mark.parametrize("name", ["linear_2", "add_2", "layer_norm_1", "linear_3"])
def test_no_option_has_a_negative_redistribution(name: str) -> None:
    negative = [(o.partition, o.redistribution_s) for o in options(explained(name)) if o.redistribution_s < 0]
    assert not negative, (name, negative)
    for o in options(explained(name)):
        assert o.neighbour_collective_s <= 0, (name, o)
        assert o.collective_s >= 0, (name, o)
        # the parts add up to the objective (alpha is 0 for this plan)
        total = o.node_s + o.redistribution_s + o.neighbour_collective_s
        assert total == pytest.approx(o.objective_s, rel=1e-9, abs=1e-12), (name, o)


@pytest.mark.parametrize(("name", "partition"), [("linear_2", "N,K"), ("add_2", "B,B"), ("add_2", "R,S")])
def test_a_switched_option_is_what_the_plan_reports_for_it(name: str, partition: str) -> None:
    """The option's node time, collectives and bytes are what ``summarize`` gives the node after the switch, and
    its objective less the chosen one's is the change of the whole plan's predicted step time."""
    why = explained(name)
    option = next(o for o in why.alternatives if o.partition == partition)
    after = switched(name, partition)
    cost = next(n for n in after.nodes if n.name == name).cost
    assert option.node_s == pytest.approx(cost.step_s - cost.redistribution_s, rel=1e-9)
    assert option.collective_s == pytest.approx(cost.collective_s, rel=1e-9, abs=1e-12)
    assert option.comm_bytes == sum(b for k, b in cost.comm_bytes.items() if k != "redistribution")
    delta = after.predicted.step_time_s - searched().predicted.step_time_s
    assert option.objective_s - why.chosen.objective_s == pytest.approx(delta, rel=1e-6, abs=1e-12)


def test_linear_2_at_n_k_shows_its_own_saving_against_its_collectives() -> None:
    option = next(o for o in explained("linear_2").alternatives if o.partition == "N,K")
    cost = next(n for n in switched("linear_2", "N,K").nodes if n.name == "linear_2").cost
    assert cost.comm_bytes.get("reduce-scatter", 0) > 0  # the plan's own account has the reduce-scatter
    assert option.redistribution_s > 0 and option.redistribution_bytes == 196_608
    assert option.neighbour_collective_s == 0


def test_add_2_at_b_s_shows_linear_3_s_saving_as_the_neighbours() -> None:
    why = explained("add_2")
    option = why.chosen  # sequence parallel: B,S
    assert option.partition == "B,S"
    assert option.neighbour_collective_s < 0 and option.collective_s == 0
    # against add_2 at B,R, where linear_3's all-reduce stays an all-reduce (at B,B it fuses too: a batch split over
    # linear_3's all-reduce group is a slice of its result as well)
    before = next(n for n in switched("add_2", "B,R").nodes if n.name == "linear_3").cost
    after = searched().node("linear_3").cost
    assert after.comm_bytes.get("reduce-scatter", 0) > 0 and before.comm_bytes.get("reduce-scatter", 0) == 0
    assert option.neighbour_collective_s == pytest.approx(after.collective_s - before.collective_s, rel=1e-9)
    # the table grows a column for it only when a shown row has such a saving
    assert "neighbours' coll. ms" in why.table(top=len(why.alternatives))
    assert "neighbours' coll. ms" not in explained("linear_2").table()
