"""Pass 4: the all-reduces of every node's partition (:func:`primepar_fx.partition.collectives`).

* A collective on ``d_in_k`` (Backward or Gradient) becomes a ``"backward"``
  :class:`~primepar_fx.runtime.AllReduce` on input ``k``: the identity in forward, the sum of the partial gradients
  in backward.
* A collective on ``out0`` (Forward: a split summed-over dim) becomes a ``"forward"`` all-reduce after the node.
  When the node adds a bias after its product (``linear``, ``addmm``, ``baddbmm``), the bias is split off first
  so that it is added once, after the all-reduce (and after the ring of a P(S x S) product).
* Statistics collectives (a split normalised dim, a split class dim, a split loss row dim) are left to the local
  forms of :mod:`primepar_fx.passes.localize`, which all-reduce per-row statistics rather than whole tensors.
"""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.partition import Phase, collectives
from primepar_fx.partition.comm import Collective
from primepar_fx.passes.common import NodeInfo, RankContext, add_module, info
from primepar_fx.runtime.collectives import AllReduce

aten = torch.ops.aten
#: ops with a bias input: its position
BIASED = {aten.linear.default: 2, aten.addmm.default: 0, aten.baddbmm.default: 0}
#: node.meta key: the (I, W) operand nodes of a product whose bias was split off
OPERANDS = "primepar_operands"


def internal(me: NodeInfo, c: Collective) -> bool:
    """Collectives a local form performs itself (statistics, loss reductions)."""
    if me.target is aten.cross_entropy_loss.default:
        return c.tensor in ("out0", "d_in0")
    if me.target is aten.layer_norm.default and (me.part.op.stats & c.dims):
        return c.tensor in ("out0", "d_in0")
    return False


def _all_reduce(gm: fx.GraphModule, ctx: RankContext, c: Collective, mode: str, why: str, node: str) -> str | None:
    group, ranks = ctx.groups.get(c.digits)
    if len(ranks) < 2:
        return None
    return add_module(gm, "all_reduce", AllReduce(group, ranks, c.digits, mode, ctx.stats, why, node))


def has_bias(node: fx.Node) -> bool:
    pos = BIASED.get(node.target)
    return pos is not None and len(node.args) > pos and isinstance(node.args[pos], fx.Node)


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
    for u in users:
        u.replace_input_with(node, add)
    return out


def insert_collectives(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        me = info(node)
        if me is None or me.fallback:
            continue
        colls = [c for c in collectives(me.part) if not internal(me, c)]
        inputs = list(node.all_input_nodes)
        for c in colls:
            if c.tensor.startswith("d_in"):
                k = int(c.tensor[4:])
                name = _all_reduce(gm, ctx, c, "backward", f"gradient of input {k} of {node.name}", node.name)
                if name is not None:
                    with g.inserting_before(node):
                        f = g.call_module(name, (inputs[k],))
                    node.replace_input_with(inputs[k], f)
                    inputs[k] = f
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
                last = r
    return gm
