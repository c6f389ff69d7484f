"""Element-wise ops: one table of ATen ops, one rule.

Every dim of the (first) output is an iteration dim, named after its size; each tensor input maps onto them by
right-aligned numpy broadcasting, so a size-1 (or missing) input dim maps to ``()`` and a split of that iteration
dim leaves the input whole and sums its gradient. Ops with several outputs (``native_dropout``: output and mask)
give every output the same map. Nothing is summed in forward and no dim is ``no_split``.

The family is declared as data: :data:`POINTWISE` lists ``packet name -> overload names``;
:data:`DTYPE_ONLY` lists ops whose inputs after the first are read for their dtype alone (``type_as``), which map to
``None`` (the op reads no data of them, so any layout will do).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from primepar_fx.rules.registry import (
    DimNamer,
    RuleContext,
    RuleError,
    align_inputs,
    broadcast_map,
    register_rule,
    same_size,
)
from primepar_fx.rules.spec import OpDims, TensorMap

log = logging.getLogger(__name__)

_ARITH = ("Tensor", "Scalar")
_CMP = ("Tensor", "Scalar")
_UNARY = ("default",)

#: ``aten`` packet name -> overloads that are element-wise (with broadcasting) over all their tensor arguments.
POINTWISE: dict[str, tuple[str, ...]] = {
    # arithmetic
    "add": _ARITH,
    "sub": _ARITH,
    "rsub": _ARITH,
    "mul": _ARITH,
    "div": ("Tensor", "Scalar", "Tensor_mode", "Scalar_mode"),
    "true_divide": _ARITH,
    "floor_divide": ("default", "Scalar"),
    "remainder": _ARITH,
    "fmod": _ARITH,
    "pow": ("Tensor_Tensor", "Tensor_Scalar", "Scalar"),
    "maximum": _UNARY,
    "max": ("other",),
    "min": ("other",),
    "minimum": _UNARY,
    "clamp": ("default", "Tensor"),
    "clamp_min": ("default", "Tensor"),
    "clamp_max": ("default", "Tensor"),
    "addcmul": _UNARY,
    "addcdiv": _UNARY,
    "lerp": ("Scalar", "Tensor"),
    "neg": _UNARY,
    "positive": _UNARY,
    "abs": _UNARY,
    "sign": _UNARY,
    "reciprocal": _UNARY,
    "square": _UNARY,
    "sqrt": _UNARY,
    "rsqrt": _UNARY,
    "exp": _UNARY,
    "exp2": _UNARY,
    "expm1": _UNARY,
    "log": _UNARY,
    "log2": _UNARY,
    "log1p": _UNARY,
    "sin": _UNARY,
    "cos": _UNARY,
    "tan": _UNARY,
    "tanh": _UNARY,
    "erf": _UNARY,
    "floor": _UNARY,
    "ceil": _UNARY,
    "round": ("default", "decimals"),
    "trunc": _UNARY,
    "nan_to_num": _UNARY,
    # activations
    "relu": _UNARY,
    "gelu": _UNARY,
    "silu": _UNARY,
    "sigmoid": _UNARY,
    "softplus": _UNARY,
    "mish": _UNARY,
    "elu": _UNARY,
    "leaky_relu": _UNARY,
    "hardtanh": _UNARY,
    "hardswish": _UNARY,
    "hardsigmoid": _UNARY,
    "threshold": _UNARY,
    "logit": _UNARY,
    # comparisons, logic, selection
    "eq": _CMP,
    "ne": _CMP,
    "lt": _CMP,
    "le": _CMP,
    "gt": _CMP,
    "ge": _CMP,
    "isnan": _UNARY,
    "isinf": _UNARY,
    "logical_not": _UNARY,
    "logical_and": _UNARY,
    "logical_or": _UNARY,
    "logical_xor": _UNARY,
    "bitwise_not": _UNARY,
    "bitwise_and": _ARITH,
    "bitwise_or": _ARITH,
    "bitwise_xor": _ARITH,
    "__and__": _ARITH,
    "__or__": _ARITH,
    "__xor__": _ARITH,
    "where": ("self", "ScalarOther", "ScalarSelf", "Scalar"),
    "masked_fill": ("Scalar", "Tensor"),
    "fill": ("Scalar", "Tensor"),
    # random masks (a split draws independent numbers per slice, which is as good as one draw)
    "dropout": _UNARY,
    "native_dropout": _UNARY,
    "feature_dropout": _UNARY,
    "alpha_dropout": _UNARY,
    "bernoulli": ("default", "p"),
    "exponential": ("default",),  # Gumbel noise (PhiMoE's router samples its experts with it)
    "uniform": ("default",),
    # copies and casts
    "clone": _UNARY,
    "contiguous": _UNARY,
    "alias": _UNARY,
    "detach": _UNARY,
    "lift_fresh": _UNARY,
    "lift_fresh_copy": _UNARY,
    "alias_copy": _UNARY,
    "copy": _UNARY,
    "_to_copy": _UNARY,
    "to": ("dtype", "dtype_layout", "device"),
}

#: Ops whose first input is element-wise and whose other tensor inputs only lend a dtype (mapped to ``None``).
DTYPE_ONLY: dict[str, tuple[str, ...]] = {
    "type_as": _UNARY,
    "to": ("other",),
}


def resolve(table: dict[str, tuple[str, ...]]) -> tuple[list[torch._ops.OpOverload], list[str]]:
    """The ``aten`` op overloads a table names, and the names this torch build lacks (skipped, logged)."""
    ops: list[torch._ops.OpOverload] = []
    missing: list[str] = []
    for packet_name, overloads in table.items():
        packet = getattr(torch.ops.aten, packet_name, None)
        for ov in overloads:
            op = getattr(packet, ov, None) if packet is not None else None
            if isinstance(op, torch._ops.OpOverload):
                ops.append(op)
            else:
                missing.append(f"aten.{packet_name}.{ov}")
    if missing:
        log.debug("ops missing from this torch build, no rule registered: %s", missing)
    return ops, missing


_POINTWISE_OPS, _MISSING = resolve(POINTWISE)
_DTYPE_ONLY_OPS, _MISSING_DTYPE_ONLY = resolve(DTYPE_ONLY)
#: Table entries this torch build does not have (a test keeps it empty for the pinned version).
UNRESOLVED: tuple[str, ...] = tuple(_MISSING + _MISSING_DTYPE_ONLY)


def elementwise(node: fx.Node, ctx: RuleContext, *, data: set[fx.Node] | None = None) -> OpDims:
    """The element-wise rule; ``data`` restricts the inputs that are read (others map to ``None``)."""
    if not ctx.out_shapes:
        raise RuleError("an element-wise op needs a tensor output")
    ref = ctx.out_shapes[0]
    for other in ctx.out_shapes[1:]:
        if len(other) != len(ref) or not all(same_size(a, b) for a, b in zip(other, ref, strict=True)):
            raise RuleError(f"outputs of different shapes {ctx.out_shapes} are not element-wise")
    nm = DimNamer()
    omap = nm.map(ref)
    maps: dict[fx.Node, TensorMap | None] = {}
    for n in node.all_input_nodes:
        shp = ctx.shape_of(n)
        if shp is not None and (data is None or n in data):
            maps[n] = broadcast_map(shp, omap, ref)
    return nm.build("pointwise", align_inputs(node, maps), (omap,) * len(ctx.out_shapes))


@register_rule(_POINTWISE_OPS)
def pointwise_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return elementwise(node, ctx)


@register_rule(_DTYPE_ONLY_OPS)
def dtype_only_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    first = node.args[0]
    if not isinstance(first, fx.Node):
        raise RuleError(f"expected a tensor first argument, got {first!r}")
    return elementwise(node, ctx, data={first})
