"""Pipeline stages as a lever (``planning.pipelines``) and Megatron-LM with pipelines as a baseline
(``planning.compare.best_megatron_pipelined``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from primepar_fx import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning import compare
from primepar_fx.planning.baselines import data_parallel_assignment, megatron_assignment
from primepar_fx.planning.pipelines import pipeline_micro_batches, schedules, stage_counts
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import plan_pieces, price_pipeline


@functools.cache
def graph(name: str, layers: int):
    config = dataclasses.replace(get_config(name), layers=layers)
    args, kwargs = example_inputs(config, 2, 16)
    return analyze(build(config, device="meta"), args, kwargs, name=name)


def test_stage_counts_divide_the_world_and_fill_whole_nodes():
    assert stage_counts(128, 80, 8) == [2, 4, 8, 16, 32, 64]  # each stage on 64, 32, 16, 8, 4 or 2 GPUs
    assert stage_counts(128, 6, 8) == [2, 4]  # no more stages than layers
    assert stage_counts(24, 32, 8) == [3, 6, 12, 24]  # not 2: a stage of 12 GPUs would hold a node and a half
    assert stage_counts(4, 2, 4) == [2]
    assert stage_counts(2, 1, 2) == []


def test_micro_batches_give_each_replica_whole_samples_and_fill_the_pipeline():
    assert pipeline_micro_batches(512, 4, 4) == [128, 64, 32]  # 1, 2 and 4 samples a replica
    assert pipeline_micro_batches(16, 4, 2) == [8, 4]  # 4 samples a replica would be 2 micro-batches for 4 stages
    assert pipeline_micro_batches(6, 2, 4) == []


def test_schedules_need_a_layer_in_every_stage_and_torch_s_micro_batch_rounds():
    assert list(schedules(2, 4, 4)) == [("1F1B", 1), ("Interleaved1F1B", 2)]
    assert list(schedules(2, 3, 4)) == [("1F1B", 1)]  # 4 virtual stages for 3 layers
    assert list(schedules(4, 8, 3)) == [("Interleaved1F1B", 2)]  # 1F1B's warm-up needs a micro-batch a stage
    assert list(schedules(4, 8, 9)) == [("1F1B", 1)]  # interleaved runs 2 rounds of 4 on 4 ranks: not 9


def test_megatron_with_pipelines_is_the_fastest_of_every_split_count_and_schedule():
    """Without a budget the baseline is the fastest of every stage count, micro-batch count, Megatron split and
    schedule, each priced on its own (the search skips what cannot win without replaying it)."""
    g, cluster, full = graph("gpt2-tiny", 4), load_cluster("v100-paper"), DeviceMesh((2, 2))
    values, opts = {B: 16, S: 32}, CostOptions()
    base = compare.best_megatron_pipelined(g, full, cluster, values, opts, None)
    every = []
    for p in stage_counts(4, 4, cluster.devices_per_node):
        sub = DeviceMesh.for_world_size(4 // p)
        for dp in (1, 2, 4):
            if dp > sub.size:
                continue
            for m in pipeline_micro_batches(16, p, dp):
                micro, costs = {**values, B: 16 // m}, CostOptions(micro_batches=m)
                for sp in (False, True) if dp < sub.size else (False,):
                    plan = megatron_assignment(g, sub, dp=dp, sequence_parallel=sp, values=micro)
                    priced, (choice,) = price_assignments(g, [plan], sub, cluster, micro, costs)
                    pieces = plan_pieces(g, priced, choice, costs, values_key(micro))
                    for name, v in schedules(p, 4, m):
                        pp = price_pipeline(pieces, cluster, m, stages=p, schedule=name, virtual=v)
                        every.append((pp.step_s, p, dp, m, sp, name))
    fastest = min(every)
    assert len(every) > 10
    assert base.predicted.step_time_s == pytest.approx(fastest[0], rel=1e-12)
    config = base.config
    assert (config["pp"], config["dp"], config["micro_batches"], config["sequence_parallel"], config["schedule"]) == (
        fastest[1:]
    )
    assert (
        sum(config["layers_per_stage"]) == 4
        and len(config["layers_per_stage"]) == config["pp"] * (config["virtual_stages"])
    )
    assert f"x pp{config['pp']}" in config["name"]


def test_fsdp_with_pipelines_is_the_fastest_of_every_stage_count_and_schedule():
    """FSDP x PP: each stage's data parallelism with ZeRO-3 (gathered again every micro-batch, two units whole at a
    time), the fastest of every stage count, micro-batch count and schedule, each priced on its own."""
    g, cluster, full = graph("gpt2-tiny", 4), load_cluster("v100-paper"), DeviceMesh((2, 2))
    values = {B: 16, S: 32}
    base = compare.best_fsdp_pipelined(g, full, cluster, values, CostOptions(), None)
    every = []
    for p in stage_counts(4, 4, cluster.devices_per_node):
        sub = DeviceMesh.for_world_size(4 // p)
        for m in pipeline_micro_batches(16, p, sub.size):
            micro = {**values, B: 16 // m}
            costs = CostOptions(zero=3, regather_all=True, micro_batches=m)
            plan = data_parallel_assignment(g, sub, values=micro)
            priced, (choice,) = price_assignments(g, [plan], sub, cluster, micro, costs)
            pieces = plan_pieces(g, priced, choice, costs, values_key(micro))
            gathered = compare.fsdp_gathered(g, priced, choice)
            for name, v in schedules(p, 4, m):
                pp = price_pipeline(pieces, cluster, m, stages=p, schedule=name, virtual=v, extra_peak=gathered)
                every.append((pp.step_s, pp.peak, p, m, name))
    fastest = min(every)
    assert base.predicted.step_time_s == pytest.approx(fastest[0], rel=1e-12)
    assert base.predicted.peak_memory_bytes == fastest[1]
    config = base.config
    assert (config["pp"], config["micro_batches"], config["schedule"]) == fastest[2:]
    assert config["name"].startswith(f"fsdp{4 // config['pp']} x pp{config['pp']} (ZeRO-3)")


def test_a_graph_without_layers_has_no_pipelined_baseline():
    g, cluster = graph("gpt2-tiny", 1), load_cluster("v100-paper")
    for staged in (compare.best_megatron_pipelined, compare.best_fsdp_pipelined):
        assert staged(g, DeviceMesh((2, 2)), cluster, {B: 16, S: 32}, CostOptions(), None) is None
