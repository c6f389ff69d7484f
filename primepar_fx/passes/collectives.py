"""Pass 4: the all-reduces of every node's partition (:func:`primepar_fx.partition.collectives`).

* A collective on ``d_in_k`` (Backward or Gradient) becomes a ``"backward"``
  :class:`~primepar_fx.runtime.AllReduce` on input ``k``: the identity in forward, the sum of the partial gradients
  in backward.
* A collective on ``out0`` (Forward: a split summed-over dim) becomes a ``"forward"`` all-reduce after the node.
  When the node adds a bias after its product (``linear``, ``addmm``, ``baddbmm``), the bias is split off first
  so that it is added once, after the all-reduce (and after the ring of a P(S x S) product).
* Statistics collectives (a split normalised dim, a split class dim, a split loss row dim) are left to the local
  forms of :mod:`primepar_fx.passes.localize`, which all-reduce per-row statistics rather than whole tensors.

:func:`fuse_reduce_scatters` (pass 4b) then turns an all-reduce followed by a slice into one reduce-scatter.
"""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.cost.scatter import (
    BIASED,
    bias_broadcasts,
    fusable_backward,
    fusable_forward,
    has_bias,
    performed_inside,
    scatters,
)
from primepar_fx.partition import Phase, collectives
from primepar_fx.partition.comm import Collective
from primepar_fx.passes.common import NodeInfo, RankContext, add_module, info
from primepar_fx.runtime.collectives import AllReduce, ReduceScatter
from primepar_fx.runtime.exchange import Redistribute

aten = torch.ops.aten
#: node.meta key: the (I, W) operand nodes of a product whose bias was split off
OPERANDS = "primepar_operands"
#: node.meta key of an all-reduce that may fuse with the re-layout after it: its ``Fusable`` and owner's NodeInfo
FUSABLE = "primepar_fusable"
#: node.meta key of the add that :func:`split_bias` puts after a product: the bias node it adds
BIAS_ADD = "primepar_bias_add"


def rename_operand(node: fx.Node, old: fx.Node, new: fx.Node) -> None:
    """``node`` now reads ``new`` where it read ``old``: keep its recorded :data:`OPERANDS` in step."""
    operands = node.meta.get(OPERANDS)
    if operands is not None and old in operands:
        node.meta[OPERANDS] = tuple(new if o is old else o for o in operands)


def internal(me: NodeInfo, c: Collective) -> bool:
    """Collectives a local form performs itself (statistics, loss reductions)."""
    return performed_inside(me.target, me.part.op, c)


def _all_reduce(
    gm: fx.GraphModule, ctx: RankContext, c: Collective, mode: str, why: str, node: str, k: int | None = None
) -> str | None:
    group, ranks = ctx.groups.get(c.digits)
    if len(ranks) < 2:
        return None
    return add_module(gm, "all_reduce", AllReduce(group, ranks, c.digits, mode, ctx.stats, why, node, k))


def split_bias(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Turn ``node`` into its bare product and add the (scaled) bias after it; returns the add node."""
    g = gm.graph
    me = info(node)
    i_idx, w_idx = me.part.op.matmul_operands  # type: ignore[misc]
    inputs = node.all_input_nodes
    node.meta[OPERANDS] = (inputs[i_idx], inputs[w_idx])
    if node.target is aten.linear.default:
        bias, beta, alpha = node.args[2], 1, 1
        node.args, node.kwargs = (node.args[0], node.args[1]), {}
    else:
        bias = node.args[0]
        beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
        alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        node.target = aten.mm.default if node.target is aten.addmm.default else aten.bmm.default
        node.args, node.kwargs = (node.args[1], node.args[2]), {}
    users = list(node.users)
    with g.inserting_after(node):
        out = g.call_function(aten.mul.Tensor, (node, alpha)) if alpha != 1 else node
    with g.inserting_after(out):
        b = g.call_function(aten.mul.Tensor, (bias, beta)) if beta != 1 else bias
    with g.inserting_after(b if b is not bias else out):
        add = g.call_function(aten.add.Tensor, (out, b))
    add.meta[BIAS_ADD] = b
    for u in users:
        u.replace_input_with(node, add)
    return out


def insert_collectives(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    g = gm.graph
    captured = {n.name: n for n in ctx.captured.gm.graph.nodes}
    for node in list(g.nodes):
        me = info(node)
        if me is None or me.fallback:
            continue
        colls = [c for c in collectives(me.part) if not internal(me, c)]
        inputs = list(node.all_input_nodes)
        original = captured.get(node.name)
        for c in colls:
            if c.tensor.startswith("d_in"):
                k = int(c.tensor[4:])
                name = _all_reduce(gm, ctx, c, "backward", f"gradient of input {k} of {node.name}", node.name, k)
                if name is not None:
                    with g.inserting_before(node):
                        f = g.call_module(name, (inputs[k],))
                    node.replace_input_with(inputs[k], f)
                    inputs[k] = f
                    fusable = fusable_backward(me.part, original, k) if original is not None else None
                    if fusable is not None and fusable.collective == c:
                        f.meta[FUSABLE] = (fusable, me)
        forward = [c for c in colls if c.phase is Phase.FORWARD and c.tensor == "out0"]
        last = node
        if node.target in BIASED and has_bias(node) and (forward or me.part.steps > 1):
            last = split_bias(gm, node)
        for c in forward:
            if me.multi_output:
                raise NotImplementedError(f"node {node.name}: a forward all-reduce on a multi-output op")
            name = _all_reduce(gm, ctx, c, "forward", f"partial sums of {node.name}", node.name)
            if name is not None:
                with g.inserting_after(last):
                    r = g.call_module(name, (last,))
                last.replace_all_uses_with(r, delete_user_cb=lambda u, r=r: u is not r)
                fusable = fusable_forward(me.part, original) if original is not None else None
                if fusable is not None and fusable.collective == c:
                    r.meta[FUSABLE] = (fusable, me)
                last = r
    return gm


def _redistribute_of(node: fx.Node, gm: fx.GraphModule) -> Redistribute | None:
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)  # type: ignore[arg-type]
    return mod if isinstance(mod, Redistribute) and mod.layouts is not None else None


def fuse_reduce_scatters(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    """An all-reduce whose re-layout only slices its result becomes one reduce-scatter.

    The test is :func:`~primepar_fx.cost.scatter.scatters`, the one the cost model prices the pair with:

    * Forward: ``node -> all-reduce -> Redistribute -> consumer``; the Redistribute's forward becomes the
      reduce-scatter and the all-reduce (the identity in backward) goes. With a bias split off the product
      (``all-reduce -> add bias -> Redistribute``), the bias is added to the scattered piece instead, through a
      backward all-reduce that sums its gradient over the group (each rank now sees only its piece's rows).
    * Backward: ``producer -> Redistribute -> all-reduce (backward) -> node``; the Redistribute's backward becomes
      the reduce-scatter of the partial gradients and the all-reduce goes.
    """
    g = gm.graph
    for ar in list(g.nodes):
        if FUSABLE not in ar.meta:
            continue
        fusable, owner = ar.meta[FUSABLE]
        reduce = gm.get_submodule(ar.target)
        groups = ctx.mesh.groups(reduce.digits)
        if reduce.mode == "forward":
            add = next(iter(ar.users)) if len(ar.users) == 1 else None
            bias = add.meta.get(BIAS_ADD) if add is not None else None
            if (bias is None) != (fusable.bias is None):
                continue
            last = add if bias is not None else ar
            r = next(iter(last.users)) if len(last.users) == 1 else None
            mod = _redistribute_of(r, gm) if r is not None else None
            if mod is None or not scatters(mod.layouts[0], mod.layouts[1], groups):
                continue
            held, needed = mod.layouts[0], mod.layouts[1]
            if bias is not None and not bias_broadcasts(owner.part.op, fusable.bias, held, needed):
                continue
            mod.fwd = ReduceScatter.plan(held, needed, ctx.mesh, ctx.rank, reduce.group, reduce.ranks, reduce.node)
            r.replace_input_with(last, ar.args[0])
            if bias is not None:
                why = f"bias gradient of {ar.args[0].name} over its scattered pieces"
                grad = AllReduce(reduce.group, reduce.ranks, reduce.digits, "backward", ctx.stats, why, reduce.node)
                with g.inserting_after(r):
                    summed = g.call_module(add_module(gm, "all_reduce", grad), (bias,))
                with g.inserting_after(summed):
                    moved = g.call_function(aten.add.Tensor, (r, summed))
                r.replace_all_uses_with(moved, delete_user_cb=lambda u, moved=moved: u is not moved)
                g.erase_node(add)
        else:
            r = ar.args[0]
            mod = _redistribute_of(r, gm) if isinstance(r, fx.Node) and len(r.users) == 1 else None
            if mod is None or mod.layouts[2] is None or not scatters(mod.layouts[2], mod.layouts[3], groups):
                continue
            held, needed = mod.layouts[2], mod.layouts[3]
            mod.bwd = ReduceScatter.plan(held, needed, ctx.mesh, ctx.rank, reduce.group, reduce.ranks)
            ar.replace_all_uses_with(r)
        g.erase_node(ar)
        delattr(gm, ar.target)
    return gm
