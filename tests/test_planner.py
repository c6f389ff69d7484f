"""``primepar_fx.plan``: a searched plan on real graphs, its JSON, its memory budget and its baselines."""

from __future__ import annotations

import functools

import pytest

import primepar_fx
from primepar_fx import analyze
from primepar_fx.models import build, example_inputs
from primepar_fx.plan import Plan
from primepar_fx.planner import plan_graph
from primepar_fx.search import InfeasibleBudget


@functools.cache
def graph(name: str):
    model = build(name)
    args, kwargs = example_inputs(model.config, 2, 16)
    return analyze(model, args, kwargs, name=name)


def test_plan_works_on_a_meta_device_model_and_round_trips_through_json(tmp_path) -> None:
    model = build("llama-tiny", device="meta")
    args, kwargs = example_inputs(model.config, 2, 16, device="meta")
    plan = primepar_fx.plan(model, (args, kwargs), world_size=4, cluster="a100-dgx", batch=8, seq=64)
    assert plan.world_size == 4 and plan.cluster == "a100-dgx" and (plan.batch, plan.seq) == (8, 64)
    assert len(plan.nodes) == len(analyze(model, args, kwargs).nodes)
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan


def test_every_node_gets_a_legal_partition_and_the_plan_matches_its_model() -> None:
    g = graph("gpt2-tiny")
    plan = plan_graph(g, world_size=4, batch=8, seq=64, baselines=False)
    plan.check_model((n.name, n.op) for n in g.nodes.values())
    from primepar_fx.partition import DeviceMesh, OpPartition

    mesh = DeviceMesh(plan.digits)
    for node_plan in plan.nodes:
        OpPartition(g.nodes[node_plan.name].dims, node_plan.seq, mesh).check_divisible()
    renamed = [(n.name + "_x" if i == 3 else n.name, n.op) for i, n in enumerate(g.nodes.values())]
    with pytest.raises(ValueError):
        plan.check_model(renamed)


def test_a_memory_budget_is_never_exceeded_and_an_impossible_one_names_the_minimum() -> None:
    g = graph("opt-tiny")
    free = plan_graph(g, world_size=4, batch=8, seq=64, baselines=False)
    tight = plan_graph(g, world_size=4, batch=8, seq=64, baselines=False, alpha=1.0)  # memory-first plan
    budget = (tight.predicted.peak_memory_bytes + free.predicted.peak_memory_bytes) / 2
    mid = plan_graph(g, world_size=4, batch=8, seq=64, baselines=False, memory_budget=budget)
    assert mid.predicted.peak_memory_bytes <= budget
    assert mid.predicted.step_time_s >= free.predicted.step_time_s * (1 - 1e-9)
    with pytest.raises(InfeasibleBudget, match="smallest achievable memory"):
        plan_graph(g, world_size=4, batch=8, seq=64, baselines=False, memory_budget=1024)


def test_the_searched_plan_is_never_predicted_slower_than_its_baselines() -> None:
    plan = plan_graph(graph("bloom-tiny"), world_size=8, batch=8, seq=64)
    assert set(plan.baselines) == {"megatron", "data_parallel", "split_only"}
    for name, base in plan.baselines.items():
        assert plan.predicted.step_time_s <= base.predicted.step_time_s * (1 + 1e-9), name
    assert plan.baselines["megatron"].config["name"].startswith("megatron dp")


def test_a_budget_at_the_free_plans_peak_keeps_the_free_plan():
    """The search budget is the reported peak (static memory + the largest ring buffer), not a sum of buffers."""
    from dataclasses import replace

    from primepar_fx.api import analyze
    from primepar_fx.models import build, example_inputs, get_config
    from primepar_fx.planner import plan_graph
    from primepar_fx.search import InfeasibleBudget

    config = replace(get_config("gpt2-tiny"), hidden=256, layers=2, ffn_hidden=1024, vocab_size=1024, max_seq=128)
    graph = analyze(build(config), *example_inputs(config, 4, 16))
    kw = {"world_size": 4, "cluster": "cpu-gloo", "batch": 8, "seq": 128, "baselines": False, "method": "dp"}
    free = plan_graph(graph, **kw)
    buffers = sum(n.cost.memory_bytes for n in free.nodes) - free.predicted.peak_memory_bytes
    assert buffers > 0  # the free plan has ring buffers in several nodes, so a summed budget would exclude it
    tight = plan_graph(graph, memory_budget=free.predicted.peak_memory_bytes, **kw)
    assert tight.predicted.step_time_s == pytest.approx(free.predicted.step_time_s)
    assert tight.predicted.peak_memory_bytes <= free.predicted.peak_memory_bytes
    with pytest.raises(InfeasibleBudget) as info:
        plan_graph(graph, memory_budget=1000.0, **kw)
    smallest = info.value.min_memory  # the smallest feasible budget it reports is feasible
    assert 1000.0 < smallest <= free.predicted.peak_memory_bytes
    lean = plan_graph(graph, memory_budget=smallest, **kw)
    assert lean.predicted.peak_memory_bytes <= smallest
