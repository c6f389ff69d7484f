"""Shape-dependent compute efficiency: a calibrated table that slows small matrix-product calls changes the plan only
where it says calls are slow (issue 21, item 2)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import sympy

from primepar_fx.api import analyze
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.cost.latency import ComputeModel
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq
from primepar_fx.planning.planner import plan_graph

BATCH, SEQ, WORLD = 16, 2048, 4
OPTIONS = dict(world_size=WORLD, batch=BATCH, seq=SEQ, dtype="fp16", memory_budget=None, baselines=False, method="dp")


@functools.cache
def graph():
    config = get_config("opt-175b")
    args, kwargs = example_inputs(config, 2, 16)
    return analyze(build(config, device="meta"), args, kwargs, name="opt-175b", replicate_layers=True)


#: v100-paper without pricing the transfers the runtime overlaps with linears (cost.matmul_overlap): with them hidden,
#: the plan that overlaps them beats P(S x S) here by 2% (121.2 s against 123.6 s a step), and this test weighs how
#: slow P(S x S)'s small calls are
PAPER = dataclasses.replace(load_cluster("v100-paper"), matmul_overlap=0.0)


def with_table(table: tuple[tuple[float, float], ...]) -> ClusterSpec:
    """v100-paper (:data:`PAPER`) with its fp16 matmul model carrying ``table``."""
    base = PAPER
    model = dataclasses.replace(base.device.compute_model("matmul", "fp16"), efficiency=table)
    device = dataclasses.replace(base.device, compute={**base.device.compute, "matmul:fp16": model})
    return dataclasses.replace(base, device=device)


def call_flops(name: str, partition: str) -> float:
    """Forward FLOPs of one call (one ring step's sub-op) of node ``name`` under ``partition``."""
    node = graph().nodes[name]
    part = OpPartition(node.dims, PartitionSeq.parse(partition), DeviceMesh((2, 2)))
    subops = 1
    for n in part.parts.values():
        subops *= n
    return float(sympy.sympify(node.flops).subs({B: BATCH, S: SEQ})) / subops


def test_the_table_interpolates_in_log_flops_and_round_trips():
    m = ComputeModel(1e-12, 0.0, 0.0, ((1e6, 0.25), (1e9, 1.0)))
    assert [m.factor(f) for f in (1e3, 1e6, 10**7.5, 1e9, 1e12)] == pytest.approx([0.25, 0.25, 0.625, 1.0, 1.0])
    assert m(1e6, 0) == pytest.approx(4 * ComputeModel(1e-12, 0.0)(1e6, 0))
    spec = with_table(((1e6, 0.25), (1e9, 1.0)))
    assert ClusterSpec.from_json(spec.to_json()) == spec and ClusterSpec.from_toml(spec.to_toml()) == spec
    assert '"efficiency":' not in load_cluster("v100-paper").to_json(), "no table: the spec file is unchanged"
    for bad, message in [
        (((1e6, 1.5),), "factor must be <= 1"),
        (((1e6, 0.5), (1e5, 0.6)), "must increase strictly"),
        (((0, 0.5),), "flops must be > 0"),
        (((1e6,),), r"must be a \(flops, factor\) pair"),
    ]:
        with pytest.raises(ValueError, match=message):
            ComputeModel(1e-12, 0.0, 0.0, bad)


def test_plans_change_only_where_the_table_says_calls_are_slow():
    flat = plan_graph(graph(), cluster=PAPER, **OPTIONS)
    prime = [n for n in flat.nodes if "P" in n.partition]
    assert prime, "the flat model's plan uses P(S x S) here"
    # slow only below every call the model makes: the same plan, to the last digit
    tiny = plan_graph(graph(), cluster=with_table(((1.0, 0.2), (2.0, 1.0))), **OPTIONS)
    assert tiny.nodes == flat.nodes and tiny.predicted == flat.predicted
    # slow at the size of the P(S x S) steps' calls and below, full speed just above: fewer P(S x S) nodes
    small = max(call_flops(n.name, n.partition) for n in prime)
    slow = plan_graph(graph(), cluster=with_table(((small, 0.2), (small * 1.001, 1.0))), **OPTIONS)
    assert sum("P" in n.partition for n in slow.nodes) < len(prime)
    for node in slow.nodes:  # what the table plan keeps or picks for a matrix product runs at full speed
        if graph().nodes[node.name].dims.matmul is not None and node.partition != flat.node(node.name).partition:
            assert call_flops(node.name, node.partition) > small, node.name
