"""Mixed-precision bytes: what a device keeps per parameter (issue 18 item 2), in the cost model and the plan."""

from __future__ import annotations

import functools
import json

import pytest

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.forced import forced_plan
from primepar_fx.record.fields import PlanError
from primepar_fx.record.plan import Plan


@pytest.mark.parametrize(
    ("options", "nbytes"),
    [
        (CostOptions(), 16),  # fp32: parameter, gradient, two moments
        (CostOptions(dtype="bf16"), 16),  # 2 + 2 + fp32 master 4 + 4 + 4
        (CostOptions(dtype="fp16"), 16),
        (CostOptions(dtype="bf16", grad_dtype="fp32"), 18),  # Megatron's fp32 gradient accumulation
        (CostOptions(dtype="bf16", master_weights=False), 12),
        (CostOptions(dtype="fp32", master_weights=True), 20),
        (CostOptions(dtype="bf16", state_dtype="bf16"), 12),
        (CostOptions(optimizer_states=0), 8),  # SGD without momentum
    ],
)
def test_bytes_a_parameter_keeps(options: CostOptions, nbytes: int) -> None:
    assert options.param_state_bytes == nbytes
    again = CostOptions.from_training_state(options.dtype, 0.0, options.training_state())
    assert again.param_state_bytes == nbytes and again.keeps_master == options.keeps_master


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_dtype": "int8"}, "unknown dtype"),
        ({"state_dtype": "fp64"}, "unknown dtype"),
        ({"master_weights": "yes"}, "master_weights must be"),
        ({"optimizer_states": 1.5}, "optimizer_states must be a whole number"),
        ({"optimizer_states": -1}, "non-negative"),
    ],
)
def test_bad_training_state_options_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CostOptions(**kwargs)


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config("llama-tiny"), 4, 16)
    return analyze(build("llama-tiny"), args, kwargs, name="llama-tiny")


@functools.cache
def data_parallel(dtype: str, **state) -> Plan:
    sizes = {"world_size": 4, "cluster": "cpu-gloo", "batch": 8, "seq": 64, **state}
    return forced_plan(graph(), "data_parallel", dtype=dtype, **sizes)


def test_a_data_parallel_plan_counts_every_parameter_at_its_bytes() -> None:
    """Data parallelism holds every parameter on every device, so the peak moves by exactly the parameter count
    times the bytes per parameter that change; the activations do not move."""
    params = sum(p.numel() for p in build("llama-tiny").parameters())
    peak = {
        key: data_parallel(dtype, **dict(state)).predicted.peak_memory_bytes
        for key, dtype, state in [
            ("bf16", "bf16", ()),
            ("bf16 no master", "bf16", (("master_weights", False),)),
            ("bf16 fp32 grads", "bf16", (("grad_dtype", "fp32"),)),
        ]
    }
    assert peak["bf16"] - peak["bf16 no master"] == 4 * params
    assert peak["bf16 fp32 grads"] - peak["bf16"] == 2 * params
    plan = data_parallel("bf16")
    assert plan.search.training_state == {
        "grad_dtype": "bf16",
        "master_weights": True,
        "optimizer_states": 2,
        "state_dtype": "fp32",
        "bytes_per_parameter": 16,
        "zero": 0,
        "micro_batches": 1,
    }
    assert "16 B a parameter: bf16 parameter and gradient, fp32 master, 2 fp32 moments" in plan.summary_table()


def test_the_plan_json_keeps_the_training_state_and_rejects_a_bad_one() -> None:
    plan = data_parallel("bf16", grad_dtype="fp32")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.cost_options().param_state_bytes == 18
    data = json.loads(plan.to_json())
    data["search"]["training_state"]["bytes_per_parameter"] = 16
    with pytest.raises(PlanError, match="bytes_per_parameter is 16 but its other fields make 18"):
        Plan.from_dict(data)
    data["search"]["training_state"] = {"gradient_dtype": "fp32"}
    with pytest.raises(PlanError, match=r"plan.search.*unknown field\(s\) \['gradient_dtype'\]"):
        Plan.from_dict(data)
    del data["search"]["training_state"]  # a plan from before: the defaults
    assert Plan.from_dict(data).cost_options().param_state_bytes == 16


def test_zero_splits_what_data_parallel_replicas_keep_alike() -> None:
    """On 4 data-parallel devices, ZeRO stage 1 keeps a quarter of the master copy and the moments (12 of the 16
    bytes a bf16 parameter keeps), stage 2 a quarter of the gradient too; parameters and activations stay."""
    params = sum(p.numel() for p in build("llama-tiny").parameters())
    peak = {z: data_parallel("bf16", zero=z).predicted.peak_memory_bytes for z in (0, 1, 2)}
    assert peak[0] - peak[1] == pytest.approx(12 * params * 3 / 4, rel=1e-3)
    assert peak[0] - peak[2] == pytest.approx((12 + 2) * params * 3 / 4, rel=1e-3)
    assert data_parallel("bf16", zero=2).search.training_state["zero"] == 2


def test_micro_batches_hold_one_micro_batch_and_sum_gradients_once() -> None:
    """A step of 2 micro-batches of 4 holds what a step of batch 4 holds, and takes twice its time and bytes but
    for the gradient sum, done once: it is cheaper than two steps of 4 and its nodes add up to the step."""
    half = data_parallel("bf16", batch=4)
    two = data_parallel("bf16", micro_batches=2)
    assert two.micro_batches == 2 and half.micro_batches == 1
    assert two.predicted.peak_memory_bytes == half.predicted.peak_memory_bytes
    assert half.predicted.step_time_s < two.predicted.step_time_s < 2 * half.predicted.step_time_s
    assert half.predicted.comm_bytes < two.predicted.comm_bytes < 2 * half.predicted.comm_bytes
    assert sum(n.cost.step_s for n in two.nodes) == pytest.approx(two.predicted.step_time_s)
    assert "2 micro-batches of 4" in two.summary_table().splitlines()[0]
    again = Plan.from_json(two.to_json())
    assert again.micro_batches == 2 and again.batch == 8
    with pytest.raises(ValueError, match="micro_batches=3 does not divide the batch of 8"):
        data_parallel("bf16", micro_batches=3)


def test_zero3_splits_the_parameters_and_gathers_those_backward_reads_twice() -> None:
    """ZeRO-3 on 4 data-parallel devices keeps a quarter of each parameter too (2 of its 16 bytes at bf16), holds
    one node's replicated blocks whole while it runs, and sends one all-gather more than stage 2 for every weight
    Backward reads again: all of llama-tiny's but the embedding table, which only a lookup reads, and the head and
    final norm, which are kept whole from Forward to Backward (held whole at the peak, between the two)."""
    model = build("llama-tiny")
    params = sum(p.numel() for p in model.parameters())
    table = model.embed_tokens.weight.numel()
    kept = model.lm_head.weight.numel() + model.final_norm.weight.numel()
    two, three = data_parallel("bf16", zero=2), data_parallel("bf16", zero=3)
    assert three.zero == 3 and three.search.training_state["zero"] == 3
    largest = max(p.numel() for p in model.parameters())  # (a node's gathered blocks: its parameters but its chunk)
    drop = 2 * params * 3 / 4
    assert two.predicted.peak_memory_bytes - three.predicted.peak_memory_bytes == pytest.approx(
        drop - 2 * largest * 3 / 4 - 2 * kept * 3 / 4, rel=1e-3
    )
    gathered = 2 * (params - table - kept) * 3 / 4  # an all-gather's bus bytes per device of each read weight
    assert three.predicted.comm_bytes - two.predicted.comm_bytes == pytest.approx(gathered, rel=1e-6)
