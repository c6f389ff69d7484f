"""Losses: ``cross_entropy_loss``, ``nll_loss`` (and its ``_nd`` / ``_forward`` forms), element-wise losses.

* **cross_entropy_loss** (``self [N, V, *d]`` or ``[V]``; ``target`` class indices ``[N, *d]`` or
  probabilities shaped like ``self``; optional class ``weight [V]``): dims ``N``, ``V``, ``d...``. ``V`` is
  ``stats``: a split of it all-reduces the softmax statistics (max and sum of exponentials) but each device
  keeps its rows. With ``reduction`` ``mean`` / ``sum`` the output is a scalar, so ``N`` (and ``d...``) are
  summed: a split of them all-reduces partial losses (a ``mean`` must divide by the global count).
  ``reduction="none"`` keeps ``[N, *d]``.
* **nll_loss**: the same dims, but ``V`` is simply summed (each device contributes ``-x[target]`` for the
  targets in its vocabulary slice and zero elsewhere); ``nll_loss_forward`` also returns ``total_weight`` (a
  scalar).
* **mse_loss, l1_loss, smooth_l1_loss, huber_loss, binary_cross_entropy(_with_logits)**: element-wise on
  ``self``'s dims, the other tensors broadcast; every dim is summed unless ``reduction="none"``.
"""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.rules.registry import (
    DimNamer,
    RuleContext,
    RuleError,
    align_inputs,
    arg,
    broadcast_map,
    is_one,
    register_rule,
    tensor_arg,
)
from primepar_fx.rules.spec import OpDims, TensorMap

aten = torch.ops.aten

#: ATen's ``reduction`` enum.
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _reduction(node: fx.Node) -> str:
    red = arg(node, "reduction", 1)
    if red not in REDUCTIONS:
        raise RuleError(f"unknown reduction {red!r}")
    return REDUCTIONS[red]  # type: ignore[index]


@register_rule(
    [
        aten.cross_entropy_loss.default,
        aten.nll_loss.default,
        aten.nll_loss_nd.default,
        aten.nll_loss_forward.default,
        aten.nll_loss2d_forward.default,
    ]
)
def class_loss_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x, target = tensor_arg(node, "self"), tensor_arg(node, "target")
    xs, ts = ctx.shape(x), ctx.shape(target)
    nm = DimNamer()
    batched = len(xs) >= 2
    n: TensorMap = ((nm.new(xs[0], role="N"),),) if batched else ()
    v = nm.new(xs[1] if batched else xs[0], role="V")
    rest: TensorMap = tuple(() if is_one(s) else (nm.new(s, pos=i + 2),) for i, s in enumerate(xs[2:]))
    xmap = n + ((v,),) + rest
    maps: dict[fx.Node, TensorMap | None] = {x: xmap}
    maps[target] = xmap if len(ts) == len(xs) else n + rest  # probabilities or class indices
    weight = arg(node, "weight")
    if isinstance(weight, fx.Node):
        maps[weight] = ((v,),)
    reduction = _reduction(node)
    outs = [n + rest if reduction == "none" else ()]
    outs += [()] * (len(ctx.out_shapes) - 1)  # nll_loss_forward's total_weight
    stats = frozenset({v}) if node.target == aten.cross_entropy_loss.default else frozenset()
    return nm.build("loss", align_inputs(node, maps), outs, stats=stats, extra={"reduction": reduction})


@register_rule(
    [
        aten.mse_loss.default,
        aten.l1_loss.default,
        aten.smooth_l1_loss.default,
        aten.huber_loss.default,
        aten.binary_cross_entropy.default,
        aten.binary_cross_entropy_with_logits.default,
    ]
)
def elementwise_loss_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = tensor_arg(node, "self")
    xs = ctx.shape(x)
    nm = DimNamer()
    xmap = nm.map(xs)
    maps: dict[fx.Node, TensorMap | None] = {n: broadcast_map(ctx.shape(n), xmap, xs) for n in node.all_input_nodes}
    reduction = _reduction(node)
    outs = (xmap if reduction == "none" else (),)
    return nm.build("loss", align_inputs(node, maps), outs, extra={"reduction": reduction})
