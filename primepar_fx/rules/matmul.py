"""Matrix products: ``linear``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul`` (and ``dot``, ``mv``).

Each is ``O[*batch, M, K] = I[*batch, M, N] . W[*batch, N, K]`` with the contraction ``N`` absent from the
output (a split of it leaves partial sums), and ``matmul=(M, N, K)`` / ``matmul_operands=(I, W)`` set for the
P(S x S) primitive. Dims are named after their symbolic size when they have one (``B``, ``S``, ``T``, ``BS``),
else by role (``M``, ``N``, ``K``), else by position; so ``linear`` on ``[B, S, Hin]`` has dims ``B, S, N, K``
with ``matmul=("S", "N", "K")``, and Q.K^T as a ``bmm`` on ``[b, S, E] x [b, E, S]`` has ``M, N, K = S, N, T``.
A bias (``linear``'s ``bias``, ``addmm``/``baddbmm``'s ``self``) broadcasts onto the output (``[K]`` -> ``K``).

FLOPs are ``2 * numel(batch) * M * N * K``, as ``torch.utils.flop_counter`` counts them (the bias add is free).
"""

from __future__ import annotations

import sympy
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

aten = torch.ops.aten


def _node(x: object, what: str) -> fx.Node:
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor for {what}, got {x!r}")
    return x


def contraction(
    node: fx.Node,
    ctx: RuleContext,
    a: fx.Node,
    b: fx.Node,
    *,
    b_transposed: bool = False,
    addend: fx.Node | None = None,
) -> OpDims:
    """``a [*ba, M, N] @ b [*bb, N, K]`` (``b [*bb, K, N]`` when ``b_transposed``), numpy ``matmul`` semantics.

    A 1-d ``a`` has no ``M`` and a 1-d ``b`` no ``K`` (then ``matmul`` roles are left unset); leading batch
    dims broadcast onto the output's. ``M``, ``N`` and ``K`` exist even when of size 1, since they carry roles.
    """
    if a is b:
        raise RuleError("the same tensor is both operands of a matrix product")
    sa, sb = ctx.shape(a), ctx.shape(b)
    if len(ctx.out_shapes) != 1:
        raise RuleError(f"expected one output, got {len(ctx.out_shapes)}")
    out = ctx.out_shapes[0]
    has_m, has_k = len(sa) >= 2, len(sb) >= 2
    n_batch = len(out) - has_m - has_k
    if n_batch < 0:
        raise RuleError(f"output {out} too small for operands {sa} and {sb}")
    nm = DimNamer()
    batch = [() if is_one(s) else (nm.new(s, pos=i),) for i, s in enumerate(out[:n_batch])]
    m = nm.new(sa[-2], hint="M", pos=n_batch) if has_m else None
    n = nm.new(sa[-1], hint="N")
    k = nm.new(sb[-1] if not b_transposed else sb[0], hint="K", pos=len(out) - 1) if has_k else None
    bmap: TensorMap = tuple(batch)
    omap = bmap + (((m,),) if m else ()) + (((k,),) if k else ())
    amap = broadcast_map(sa[: len(sa) - 1 - has_m], bmap, out[:n_batch]) + (((m,),) if m else ()) + ((n,),)
    if b_transposed:
        wmap: TensorMap = ((k,), (n,)) if k else ((n,),)
    else:
        wmap = broadcast_map(sb[: len(sb) - 1 - has_k], bmap, out[:n_batch]) + ((n,),) + (((k,),) if k else ())
    maps: dict[fx.Node, TensorMap | None] = {a: amap, b: wmap}
    if addend is not None:
        maps[addend] = broadcast_map(ctx.shape(addend), omap, out)
    roles = (m, n, k) if m is not None and k is not None else None
    flops = 2 * sympy.Mul(*out) * nm.sizes[nm.dims.index(n)]
    inputs = align_inputs(node, maps)
    operands = (node.all_input_nodes.index(a), node.all_input_nodes.index(b)) if roles else None
    return nm.build("matmul", inputs, (omap,), matmul=roles, matmul_operands=operands, flops=flops)


@register_rule(aten.linear.default)
def linear_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``linear(x [..., N], weight [K, N], bias [K])``: dims ``(batch..., N, K)``, bias maps to ``K`` only."""
    x, w = _node(arg(node, "input"), "input"), _node(arg(node, "weight"), "weight")
    bias = arg(node, "bias")
    if len(ctx.shape(w)) != 2:
        raise RuleError(f"linear weight must be 2-d, got {ctx.shape(w)}")
    return contraction(node, ctx, x, w, b_transposed=True, addend=bias if isinstance(bias, fx.Node) else None)


_SECOND_OPERAND = {
    aten.mm.default: "mat2",
    aten.bmm.default: "mat2",
    aten.matmul.default: "other",
    aten.dot.default: "tensor",
    aten.mv.default: "vec",
}


@register_rule(list(_SECOND_OPERAND))
def mm_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    second = _SECOND_OPERAND[node.target]
    return contraction(node, ctx, _node(arg(node, "self"), "self"), _node(arg(node, second), second))


@register_rule([aten.addmm.default, aten.baddbmm.default])
def addmm_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``addmm(bias, a, b)`` / ``baddbmm(bias, a, b)``: ``beta * bias + alpha * a @ b``."""
    names = ("mat1", "mat2") if node.target == aten.addmm.default else ("batch1", "batch2")
    a, b = (_node(arg(node, n), n) for n in names)
    bias = _node(arg(node, "self"), "self")
    return contraction(node, ctx, a, b, addend=bias)
