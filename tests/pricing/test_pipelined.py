"""A plan priced as a pipeline (``pricing.pipelined``): one stage is the plan as it is, the tensors that cross a cut
are counted byte for byte, and each rank holds as many micro-batches' activations as its schedule keeps."""

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
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import plan_pieces, price_pipeline, stage_pieces
from primepar_fx.pricing.summary import summarize

CLUSTER = load_cluster("v100-paper")
VALUES = {B: 8, S: 32}


@functools.cache
def graph(name: str, layers: int | None = None):
    config = get_config(name)
    if layers is not None:
        config = dataclasses.replace(config, layers=layers)
    args, kwargs = example_inputs(config, 2, 16)
    return analyze(build(config, device="meta"), args, kwargs, name=name)


def megatron(name: str, m: int, *, dp: int = 1, mp: int = 2, sp: bool = False, layers: int | None = None):
    """A Megatron plan of ``name`` on ``dp * mp`` devices at one of ``m`` micro-batches of VALUES' batch."""
    g, mesh = graph(name, layers), DeviceMesh.for_world_size(dp * mp)
    values = {**VALUES, B: VALUES[B] // m}
    costs = CostOptions(micro_batches=m)
    assignment = megatron_assignment(g, mesh, dp=dp, mp=mp, sequence_parallel=sp, values=values)
    priced, (choice,) = price_assignments(g, [assignment], mesh, CLUSTER, values, costs)
    pieces = plan_pieces(g, priced, choice, costs, values_key(values))
    return g, priced, choice, costs, pieces


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("m", [1, 4])
def test_one_stage_is_the_plan_as_it_is(name, m):
    """A pipeline of one stage runs the micro-batches one after another: the step is the plan's step at ``m``
    micro-batches, the peak its peak (one micro-batch's activations), nothing is sent point to point."""
    g, priced, choice, costs, pieces = megatron(name, m)
    flat = summarize(g, priced, choice, costs).predicted
    pp = price_pipeline(pieces, CLUSTER, m, stages=1, schedule="1F1B")
    assert pp.step_s == pytest.approx(flat.step_time_s * m, rel=1e-9)
    assert pp.peak == flat.peak_memory_bytes
    assert pp.p2p_bytes == 0 and pp.bubble == pytest.approx(0.0, abs=1e-12)
    assert pp.layers == (len(stage_pieces(g)),)


@pytest.mark.parametrize(("dp", "mp", "sp", "split"), [(1, 2, False, 1), (1, 2, True, 2), (2, 1, False, 2)])
def test_the_residual_stream_crosses_the_cut_in_its_layout(dp, mp, sp, split):
    """gpt2-tiny's layers pass only the residual stream (B, S, 64) on: each device receives its block of it, whole
    under tensor parallelism, half under sequence or data parallelism, and sends its gradient back."""
    g, priced, choice, costs, pieces = megatron("gpt2-tiny", 2, dp=dp, mp=mp, sp=sp)
    block = (VALUES[B] // 2) * VALUES[S] * 64 * 4 // split
    assert pieces.cut_bytes(1) == (block, block)
    pp = price_pipeline(pieces, CLUSTER, 2, stages=2, schedule="1F1B")
    assert pp.p2p_bytes == 2 * block  # each device sends m = 2 blocks a step: stage 0 forward, stage 1 back


def test_tensors_without_gradients_cross_forward_only():
    """llama-tiny's rotary tables, made before the first layer, are read by every layer: they cross the cut too,
    and no gradient goes back for them; the residual stream's does."""
    g, priced, choice, costs, pieces = megatron("llama-tiny", 1)
    hidden = VALUES[B] * VALUES[S] * 64 * 4
    forward, backward = pieces.cut_bytes(1)
    assert backward == hidden
    assert forward > hidden


@pytest.mark.parametrize(("schedule", "held"), [("1F1B", (2, 1)), ("GPipe", (4, 4))])
def test_each_rank_holds_the_micro_batches_its_schedule_keeps(schedule, held):
    """Two stages over four micro-batches: under 1F1B stage 0 holds two micro-batches' activations at once and stage
    1 one; under GPipe both hold all four. Each rank's peak is its stage's parameter state, largest buffer and that
    many micro-batches' stash."""
    g, priced, choice, costs, pieces = megatron("gpt2-tiny", 4, layers=4)
    pp = price_pipeline(pieces, CLUSTER, 4, stages=2, schedule=schedule)
    for rank, (a, z) in enumerate(zip(pp.starts, [*pp.starts[1:], len(pieces)])):
        want = sum(pieces.state[a:z]) + max(pieces.buffer[a:z]) + held[rank] * sum(pieces.stash[a:z])
        assert pp.peak_bytes[rank] == want
    assert sum(pp.layers) == 4


def test_bad_pipelines_get_one_clear_error_each():
    g, priced, choice, costs, pieces = megatron("gpt2-tiny", 2)
    with pytest.raises(ValueError, match=r"3 stages x 1 virtual stages need 3 layers; the graph has 2"):
        price_pipeline(pieces, CLUSTER, 4, stages=3, schedule="GPipe")
    with pytest.raises(ValueError, match=r"1F1B runs one stage a rank, got 2 virtual stages"):
        price_pipeline(pieces, CLUSTER, 4, stages=1, schedule="1F1B", virtual=2)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'ZeroBubble'"):
        price_pipeline(pieces, CLUSTER, 4, stages=2, schedule="ZeroBubble")
    one = graph("gpt2-tiny", 1)
    assert stage_pieces(one) is None
    with pytest.raises(ValueError, match=r"has no stack of layers to cut into pipeline stages"):
        plan_pieces(one, priced, choice, costs, values_key(VALUES))
