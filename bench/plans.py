"""Plans for the benchmarks: a plan from a fixed assignment (one Megatron configuration), and a plan re-priced on
another cluster spec, both through the planner's own pricing (``price_graph(fixed=...)`` + ``summarize``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, PartitionSeq
from primepar_fx.planning.baselines import config_name, megatron_assignment, megatron_configs
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import make_plan
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import Summary, summarize
from primepar_fx.record.plan import Plan
from primepar_fx.record.search import SearchRecord


def price_fixed(
    graph: OpGraph,
    assignment: dict[str, PartitionSeq],
    mesh: DeviceMesh,
    cluster: str | ClusterSpec,
    batch: int,
    seq: int,
    dtype: str,
) -> Summary:
    """The planner's summary (per-node costs, whole-plan prediction) of ``assignment`` on ``cluster``."""
    opts = CostOptions(dtype=dtype)
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    priced = price_graph(graph, mesh, spec, {B: batch, S: seq}, opts, fixed=assignment)
    return summarize(graph, priced, dict.fromkeys(graph.nodes, 0), opts)


def reprice(graph: OpGraph, plan: Plan, cluster: str | ClusterSpec) -> Plan:
    """``plan`` with its per-node costs and prediction from ``cluster`` instead of the spec it was made for."""
    mesh = DeviceMesh(tuple(plan.digits))
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    summary = price_fixed(graph, plan.partitions(), mesh, spec, plan.batch, plan.seq, plan.dtype)
    return replace(plan, nodes=summary.nodes, predicted=summary.predicted, cluster=spec.name)


def megatron_plan(
    graph: OpGraph, config: dict[str, Any], *, world_size: int, cluster: str, batch: int, seq: int, dtype: str = "fp32"
) -> Plan:
    """The Megatron plan of one configuration (``{"dp", "mp", "sequence_parallel"}``), not the cheapest one."""
    spec = load_cluster(cluster)
    mesh = spec.mesh(world_size)
    assignment = megatron_assignment(graph, mesh, values={B: batch, S: seq}, **config)
    summary = price_fixed(graph, assignment, mesh, cluster, batch, seq, dtype)
    options = PlanOptions.make(cluster=spec, world_size=world_size, batch=batch, seq=seq, dtype=dtype)
    return make_plan(
        graph,
        options,
        mesh,
        summary,
        baselines={},
        search=SearchRecord(forced="megatron", config={**config, "name": config_name(config)}),
    )


def megatron_config(world_size: int, cluster: str, dp: int, sequence_parallel: bool) -> dict[str, Any]:
    """The :func:`~primepar_fx.planning.baselines.megatron_configs` entry of this ``dp`` and ``sequence_parallel``."""
    mesh = load_cluster(cluster).mesh(world_size)
    for config in megatron_configs(mesh):
        if config["dp"] == dp and config["sequence_parallel"] == sequence_parallel:
            return config
    raise ValueError(f"no Megatron configuration dp{dp} (sequence_parallel={sequence_parallel}) on {mesh.digits}")
