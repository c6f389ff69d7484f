"""Pass 1: bind every planned node to its partition (``node.meta["primepar"]``), checking the plan fits the graph.

A node whose partition has no local computation the rewrite knows (an ``amax`` over a split dim, a norm other than
``layer_norm`` with its normalised dim split, ...) is marked a *fallback*: it computes with the all-``Replicate``
partition, i.e. it gathers its inputs and runs whole, and only its boundary keeps the plan's layout.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from primepar_fx.partition import OpPartition, PartitionSeq
from primepar_fx.passes.common import META, NodeInfo, RankContext, arg
from primepar_fx.passes.layouts import replicated

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}
_NEVER_LOCAL = {aten.as_strided.default, aten.unflatten.int, aten.native_layer_norm.default}


def has_local_form(node: fx.Node, part: OpPartition) -> bool:
    """Whether the rewrite knows this node's local computation under ``part`` (module docstring)."""
    split = {d for d, p in part.parts.items() if p > 1}
    if not split or part.steps > 1:
        return True
    op, target = part.op, node.target
    if target in _NEVER_LOCAL:
        return False
    if op.kind == "reduce":
        summed = op.summed_dims(op.outputs[0]) if op.outputs else frozenset()
        return not (summed & split) or target in _SUMS
    if op.kind == "norm":
        return not (op.stats & split) or target is aten.layer_norm.default
    if op.kind == "loss":
        if target is aten.cross_entropy_loss.default:
            return arg(node, 2, "weight", None) is None and float(arg(node, 5, "label_smoothing", 0.0)) == 0.0
        return not (op.summed_dims(op.outputs[0]) & split)
    return True


def annotate_plan(gm: fx.GraphModule, ctx: RankContext, partitions: dict[str, PartitionSeq]) -> fx.GraphModule:
    """Attach a :class:`~primepar_fx.passes.common.NodeInfo` to every node of the plan's graph."""
    nodes = ctx.graph.nodes
    for node in gm.graph.nodes:
        if node.name not in nodes:
            continue
        opnode = nodes[node.name]
        if node.name not in partitions:
            raise ValueError(f"the plan has no partition for node {node.name} ({opnode.op})")
        part = OpPartition(opnode.dims, partitions[node.name], ctx.mesh)
        part.check_divisible(ctx.values)
        fallback = not has_local_form(node, part)
        compute = OpPartition(opnode.dims, replicated(ctx.mesh), ctx.mesh) if fallback else part
        if fallback:
            if len(opnode.dims.outputs) != 1:
                raise NotImplementedError(
                    f"node {node.name} ({opnode.op}) has no local form for partition {part.seq} and several "
                    "outputs; choose another partition for it"
                )
            ctx.fallbacks.append(node.name)
            log.info("node %s (%s, %s) runs whole: no local form for this partition", node.name, opnode.op, part.seq)
        node.meta[META] = NodeInfo(node.name, node.target, part, compute, fallback, opnode.requires_grad, ctx.vkey)
    return gm
