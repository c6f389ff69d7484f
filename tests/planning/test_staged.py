"""Pipeline stages in our search (``planning.staged``): a plan asked for ``p`` stages runs as that pipeline, its
predictions are the pipeline's pricing of its own stage plan, its record round-trips, and bad input fails once."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from primepar_fx import analyze
from primepar_fx.compiler.agree import check_runnable, compile_options
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning import planner, staged
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import plan_graph
from primepar_fx.planning.staged import pipeline_counts, stage_choices
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import plan_pieces, price_pipeline, stage_pieces
from primepar_fx.record.fields import PlanError
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.record.plan import Plan
from primepar_fx.search import InfeasibleBudget

SIZES = {"batch": 32, "seq": 64}


@functools.cache
def graph(name: str, layers: int):
    config = dataclasses.replace(get_config(name), layers=layers)
    args, kwargs = example_inputs(config, 2, 16)
    return analyze(build(config, device="meta"), args, kwargs, name=name)


@functools.cache
def planned(name: str, layers: int, world: int, stages: int | None, cluster: str = "v100-paper", **kw):
    return plan_graph(
        graph(name, layers), world_size=world, cluster=cluster, stages=stages, memory_budget=None, **SIZES, **kw
    )


@pytest.mark.parametrize(("name", "stages"), [("gpt2-tiny", 2), ("llama-tiny", 4)])
def test_a_plan_asked_for_stages_runs_as_that_pipeline_priced_as_its_own_stage_plan(name, stages):
    """The plan's step, peak and stage peaks are price_pipeline's of its own partitions on one stage's mesh at its
    micro-batch, and its layers are cut over exactly its stages."""
    g, plan = graph(name, 4), planned(name, 4, 8, stages)
    pipe = plan.pipeline
    assert pipe is not None and pipe.stages == stages and plan.world_size == 8
    assert math.prod(plan.digits) == plan.stage_devices == 8 // stages
    assert pipe.layers == len(stage_pieces(g)) and pipe.micro_batches == plan.micro_batches >= stages
    costs = plan.cost_options()
    values = {B: SIZES["batch"] // pipe.micro_batches, S: SIZES["seq"]}
    cluster = load_cluster("v100-paper")
    priced, (choice,) = price_assignments(g, [plan.partitions()], DeviceMesh(plan.digits), cluster, values, costs)
    pieces = plan_pieces(g, priced, choice, costs, values_key(values))
    pp = price_pipeline(pieces, cluster, pipe.micro_batches, stages=stages, schedule=pipe.schedule,
                        virtual=pipe.virtual_stages)  # fmt: skip
    assert plan.predicted.step_time_s == pytest.approx(pp.step_s, rel=1e-9)
    assert plan.predicted.peak_memory_bytes == pp.peak and pipe.stage_peak_bytes == pp.peak_bytes
    assert pipe.layers_per_stage == pp.layers and pipe.p2p_bytes == pp.p2p_bytes > 0
    assert Plan.from_json(plan.to_json()) == plan


def test_auto_on_one_node_searches_no_stages_and_across_nodes_is_never_slower():
    """On one node auto is the plan without stages; across nodes it keeps a pipeline only where it is faster."""
    auto, flat = planned("gpt2-tiny", 4, 4, None), planned("gpt2-tiny", 4, 4, 1)  # v100-paper: 4 GPUs a node
    assert auto.search.stages_tried is None
    assert (auto.nodes, auto.predicted, auto.digits, auto.pipeline) == (flat.nodes, flat.predicted, flat.digits, None)
    flat, auto = (planned("llama-tiny", 4, 16, s, "h100-dgx") for s in (1, None))
    assert stage_choices(graph("llama-tiny", 4), PlanOptions.make(cluster="h100-dgx", world_size=16)) == [2, 4]
    assert auto.predicted.step_time_s <= flat.predicted.step_time_s and auto.search.stages_tried
    if auto.pipeline is not None:
        assert auto.predicted.step_time_s < flat.predicted.step_time_s


def test_a_stage_search_prices_each_stage_s_share_of_the_parameter_state():
    """CostOptions.stages: a node's memory counts 1/p of its state (the rest lives on the other stages), its stash
    whole."""
    g = graph("gpt2-tiny", 4)
    mesh, cluster, values = DeviceMesh.for_world_size(2), load_cluster("v100-paper"), {B: 8, S: 64}
    costs = CostOptions()
    dp = data_parallel_assignment(g, mesh, values=values)
    priced, (choice,) = price_assignments(g, [dp], mesh, cluster, values, costs)
    assert any(priced.node_costs[n][choice[n]].param_bytes for n in g.nodes)
    for name in g.nodes:
        c = priced.node_costs[name][choice[name]]
        whole, quarter = c.memory_bytes(costs), c.memory_bytes(dataclasses.replace(costs, stages=4))
        assert whole - quarter == c.state_bytes(costs) - -(-c.state_bytes(costs) // 4)


def test_micro_batch_counts_of_a_pipeline_fill_it_and_split_the_batch():
    assert pipeline_counts(32, 4, "auto") == [4, 8, 16, 32]
    assert pipeline_counts(24, 4, "auto") == [4, 8, 24]
    assert pipeline_counts(24, 4, 6) == [6]
    with pytest.raises(ValueError, match="batch of 3 does not split into at least 4 micro-batches"):
        pipeline_counts(3, 4, "auto")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 8, "stages": 3}, "3 pipeline stages do not divide the 8 devices"),
        ({"world_size": 8, "stages": 4, "micro_batches": 2}, "needs at least 4 micro-batches, got micro_batches=2"),
        ({"world_size": 8, "stages": 4, "batch": 2}, "batch of 2 does not split into 4 micro-batches"),
        ({"world_size": 8, "schedule": "Zigzag"}, "unknown pipeline schedule 'Zigzag': torch.distributed"),
        ({"world_size": 8, "schedule": "ZBVZeroBubble"}, "'ZBVZeroBubble' is torch.distributed.pipelining's but"),
        ({"world_size": 8, "stages": 0}, "stages must be None"),
        ({"digits": (2, 2, 2), "stages": 2}, "stages=2 with digits"),
    ],
)
def test_bad_pipeline_options_fail_at_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions.make(cluster="v100-paper", **kwargs)


def test_more_stages_than_layers_names_the_model_and_its_layers():
    with pytest.raises(ValueError, match="4 pipeline stages need a layer each; gpt2-tiny has 2 layers"):
        plan_graph(graph("gpt2-tiny", 2), world_size=8, cluster="v100-paper", stages=4, **SIZES)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"world_size": 4, "stages": 1}, "stages=1 asks for none"),
        ({"world_size": 4}, "the 4 devices fit one node of 4"),
    ],
)
def test_a_schedule_without_stages_to_run_it_fails_before_the_search(kwargs, why):
    """``--schedule`` is only read by the stage search: where none runs it would be silently unused."""
    with pytest.raises(ValueError, match=f"schedule 'GPipe' names how pipeline stages run.*\\({why}\\)"):
        plan_graph(graph("gpt2-tiny", 2), cluster="v100-paper", schedule="GPipe", **kwargs, **SIZES)


def _pipeline(**changes):
    fields = dict(stages=2, schedule="1F1B", virtual_stages=1, micro_batches=4, layers_per_stage=(2, 2))
    return Pipeline(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"stages": 1, "layers_per_stage": (4,)}, "plan.pipeline.stages"),
        ({"schedule": "Zigzag"}, "plan.pipeline.schedule"),
        ({"micro_batches": 1}, "plan.pipeline.schedule"),  # 1F1B needs a micro-batch a stage
        ({"layers_per_stage": (4,)}, "plan.pipeline.layers_per_stage"),
        ({"layers_per_stage": (4, 0)}, r"plan.pipeline.layers_per_stage\[1\]"),
        ({"bubble": 1.5}, "plan.pipeline.bubble"),
        ({"stage_peak_bytes": (1, 2, 3)}, "plan.pipeline.stage_peak_bytes"),
    ],
)
def test_a_bad_pipeline_record_names_its_field(changes, where):
    with pytest.raises(PlanError, match=where):
        _pipeline(**changes)


def test_a_pipelined_plan_loads_only_where_its_stages_devices_and_micro_batches_agree():
    plan = planned("gpt2-tiny", 4, 8, 2)
    data = plan.to_dict()
    assert Plan.from_dict(data) == plan
    for change, where in (
        ({"world_size": 7}, "plan.pipeline.stages: 2 stages do not divide the plan's 7 devices"),
        ({"world_size": 6}, r"plan.digits: \[2, 2\] x 2 stages multiply to 8, not world_size 6"),
        ({"digits": [2, 2, 2]}, "plan.digits"),
        ({"pipeline": {**data["pipeline"], "micro_batches": 8}}, "plan.pipeline.micro_batches"),
        ({"pipeline": {**data["pipeline"], "depth": 3}}, "plan.pipeline.depth"),
    ):
        with pytest.raises(PlanError, match=where):
            Plan.from_dict({**data, **change})


def test_compile_searches_without_stages_and_the_backend_and_dump_refuse_a_pipelined_plan():
    """``compile`` runs a pipelined plan it is given (tests/compiler/test_pipeline_runtime.py) but searches none
    itself; the ``torch.compile`` backend and the graph dump run no pipeline and say so."""
    assert compile_options(cluster="cpu-gloo").stages == 1
    pipelined = planned("gpt2-tiny", 4, 8, 2)
    check_runnable(pipelined)
    with pytest.raises(NotImplementedError, match="pipeline of 2 stages.*the graph dump does not run.*--stages 1"):
        check_runnable(pipelined, pipelines=False, what="the graph dump")
    check_runnable(planned("gpt2-tiny", 4, 8, 1), pipelines=False)


def test_a_schedule_over_the_budget_is_searched_again_under_the_budget_less_its_overshoot(monkeypatch):
    """The stage search prices memory as 1F1B's first stage holds it; interleaving holds more, so its faster plan
    can overshoot. It is searched once more under the budget lowered by the overshoot, and every stage fits."""
    g = graph("llama-tiny", 4)
    kw = dict(world_size=8, cluster="v100-paper", stages=2, baselines=False, **SIZES)
    free = plan_graph(g, memory_budget=None, **kw)
    budget = int(free.predicted.peak_memory_bytes * 0.75)
    budgets = []
    search = staged._search

    def spy(state, m, ceiling, walk):
        budgets.append(state.opts.memory_budget)
        return search(state, m, ceiling, walk)

    monkeypatch.setattr(staged, "_search", spy)
    plan = plan_graph(g, memory_budget=budget, **kw)
    assert min(budgets) < budget == max(budgets)  # searched again, lower
    assert max(plan.pipeline.stage_peak_bytes) == plan.predicted.peak_memory_bytes <= budget
    assert plan.pipeline.schedule == "Interleaved1F1B"  # the faster schedule, brought under the budget


def test_where_nothing_fits_without_stages_a_pipeline_that_fits_is_the_plan(monkeypatch):
    """The plan without stages raising InfeasibleBudget (forced here) leaves the stage search to find the plan; the
    baselines come without split-only (it is the plan without stages' space); with stages=1 the error stands."""
    g = graph("llama-tiny", 4)

    def nothing_fits(state):
        raise InfeasibleBudget(1.0, 2.0)

    monkeypatch.setattr(planner, "search_counts", nothing_fits)
    kw = dict(world_size=16, cluster="h100-dgx", memory_budget=None, **SIZES)
    plan = plan_graph(g, **kw)
    assert plan.pipeline is not None and plan.pipeline.stages in (2, 4) and plan.search.stages_tried
    assert "split_only" not in plan.baselines and "megatron_pipelined" in plan.baselines
    with pytest.raises(InfeasibleBudget):
        plan_graph(g, stages=1, **kw)
