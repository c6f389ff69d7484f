"""The least memory any plan needs per device: every parameter's training state split evenly over every device.

No split, ZeRO stage, recomputation or micro-batching goes below it, so a budget under it is refused before any
search: searching the memory levers of a large model to find that nothing fits takes minutes and gigabytes.
"""

from __future__ import annotations

import dataclasses

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.graph import OpGraph
from primepar_fx.search import InfeasibleBudget


def state_floor(graph: OpGraph, costs: CostOptions, world_size: int) -> tuple[float, str]:
    """A lower bound on any plan's peak per device, and what it counts: each parameter's value, gradient and
    optimizer state (master copy, moments) split evenly over every device, no activation, no buffer (ZeRO-3
    without a master copy keeps more: an fp32 copy of its shard)."""
    params = graph.param_count()
    what = (
        f"the training state alone, split evenly over all {world_size} devices "
        f"({dataclasses.replace(costs, zero=0).describe_state()}; "
        f"{params:,} parameters), before any activation"
    )
    return params * costs.param_state_bytes / world_size, what


def check_state_floor(graph: OpGraph, costs: CostOptions, world_size: int, memory_budget: float | None) -> None:
    """Raise :class:`~primepar_fx.search.InfeasibleBudget` when :func:`state_floor` exceeds ``memory_budget``."""
    floor, what = state_floor(graph, costs, world_size)
    if memory_budget is not None and floor > memory_budget:
        raise InfeasibleBudget(memory_budget, floor, floor=what)
