"""Normalisations: ``layer_norm`` / ``native_layer_norm``, ``rms_norm`` / ``_fused_rms_norm``, and softmax.

* **layer_norm, rms_norm** over the trailing ``normalized_shape`` dims (``D``; ``D2`` ... when there are
  several): those dims are ``stats`` (a split of them all-reduces the mean / variance, §3.2), ``weight`` and
  ``bias`` map onto them, and the leading dims (``B``, ``S`` ...) map 1:1. The extra outputs of the native
  kernels (``mean``, ``rstd``: the leading shape with size-1 normalised dims) map onto the leading dims.
* **softmax / log_softmax**: every dim maps 1:1; the normalised dim is ``no_split`` (the paper splits any
  dim of a softmax but that one).
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
)
from primepar_fx.rules.spec import OpDims, TensorMap
from primepar_fx.rules.view import along_dims_rule

aten = torch.ops.aten


@register_rule(
    [aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default, aten._fused_rms_norm.default]
)
def layer_norm_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = arg(node, "input")
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor input, got {x!r}")
    xs = ctx.shape(x)
    k = len(list(arg(node, "normalized_shape")))  # type: ignore[call-overload]
    if not 0 < k <= len(xs):
        raise RuleError(f"normalized_shape of {k} dims does not fit an input of shape {xs}")
    nm = DimNamer()
    lead = nm.map(xs[: len(xs) - k])
    normed = tuple(() if is_one(s) else (nm.new(s, role="D"),) for s in xs[len(xs) - k :])
    xmap = lead + normed
    maps: dict[fx.Node, TensorMap | None] = {x: xmap}
    for name in ("weight", "bias"):
        try:
            p = arg(node, name)
        except RuleError:  # rms_norm has no bias
            continue
        if isinstance(p, fx.Node):
            maps[p] = broadcast_map(ctx.shape(p), xmap, xs)
    outs = tuple(broadcast_map(s, xmap, xs) for s in ctx.out_shapes)
    stats = frozenset(d for group in normed for d in group)
    return nm.build("norm", align_inputs(node, maps), outs, stats=stats)


@register_rule(
    [
        aten.softmax.int,
        aten._softmax.default,
        aten._safe_softmax.default,
        aten.log_softmax.int,
        aten._log_softmax.default,
    ]
)
def softmax_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = arg(node, "self")
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor input, got {x!r}")
    rank = len(ctx.shape(x))
    dim = arg(node, "dim")
    if not isinstance(dim, int) or not -max(rank, 1) <= dim < max(rank, 1):
        raise RuleError(f"bad softmax dim {dim!r} for rank {rank}")
    return along_dims_rule(node, ctx, [x], [dim % max(rank, 1)] if rank else [], kind="norm", share=True)
