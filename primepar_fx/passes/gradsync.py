"""Pass 4c: parameter gradients leave the graph for the gradient buckets of :mod:`primepar_fx.runtime.gradsync`.

A parameter whose only use is a ``"backward"`` :class:`~primepar_fx.runtime.AllReduce` (its consumer's partition
sums the parameter's gradient over a group: the parameter is replicated there) loses that node; the rank graph
records a :class:`~primepar_fx.runtime.gradsync.GradReduction` for it instead, and the compiled module sums its
gradient in a bucket, asynchronously, while backward goes on. The sum, its group and its bytes are the plan's; only
when it runs changes. Left in the graph: parameters that arrive whole (the ``torch.compile`` path, whose
gradients belong to the caller's parameters), parameters with several uses, and parameters re-laid out before their
all-reduce (a reduce-scatter then, see :func:`~primepar_fx.passes.collectives.fuse_reduce_scatters`).
"""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.cost.share import flat_arguments, moves_nothing
from primepar_fx.partition import collectives
from primepar_fx.passes.collectives import rename_operand
from primepar_fx.passes.common import STORAGE, RankContext, add_module, info
from primepar_fx.passes.redistribute import SOURCE
from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.runtime.gradsync import GradReduction
from primepar_fx.runtime.pending import DeferredGradients

#: the ProcessGroups channel of the gradient buckets
CHANNEL = "grad"


def defer_parameter_gradients(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    if ctx.whole_params:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder" and STORAGE in n.meta]:
        if len(ph.users) != 1:
            continue
        (ar,) = ph.users
        mod = gm.get_submodule(ar.target) if ar.op == "call_module" else None  # type: ignore[arg-type]
        if not isinstance(mod, AllReduce) or mod.mode != "backward" or not ar.users:
            continue
        group = ctx.groups.get(mod.digits, channel=CHANNEL)
        first = min(order[u] for u in ar.users)
        ctx.grad_reductions[ph.name] = GradReduction(mod.digits, group, mod.node, first)  # type: ignore[arg-type]
        ar.replace_all_uses_with(ph)
        for user in ph.users:  # a product whose bias was split off names its operands (collectives.OPERANDS)
            rename_operand(user, ar, ph)
        gm.graph.erase_node(ar)
        delattr(gm, ar.target)  # type: ignore[arg-type]
    return gm


def deferrable(
    node: fx.Node, consumer: fx.Node, k: int, digits: tuple[int, ...], ctx: RankContext
) -> tuple[int, ...] | None:
    """The positions (among its node arguments) of ``node``'s parameters when the sum over ``digits`` of the
    gradient of ``consumer``'s input ``k``, which ``node`` produces, may wait for the end of backward
    (:class:`~primepar_fx.runtime.pending.DeferredGradients`), else ``None``. The rules of
    :mod:`primepar_fx.pricing.deferred`, which prices it, read from the plan, so every rank decides alike:
    ``node`` is a plain op that only ``consumer`` reads, computed alike on every rank of the group (its partition
    replicates those digits) with no collective of its own, nothing is re-laid out between the two, and its inputs
    with a gradient are parameters that only it reads."""
    me, them = info(node), info(consumer)
    if node.op != "call_function" or me is None or them is None or me.fallback or len(node.users) != 1:
        return None
    part = me.part
    if not set(digits) <= set(part.replicate_digits) or collectives(part) or not flat_arguments(node):
        return None
    if not moves_nothing(part, 0, them.part, k, ctx.vkey):
        return None
    params = []
    for j, a in enumerate(x for x in node.args if isinstance(x, fx.Node)):
        if a.op == "placeholder" and STORAGE in a.meta:
            if len(a.users) != 1 or a.name in ctx.grad_reductions:
                return None
            params.append(j)
        elif _may_need_gradient(a):
            return None
    return tuple(params) or None


def _may_need_gradient(node: fx.Node) -> bool:
    """Whether the value ``node`` passes on may carry a gradient: its planned producer's (through a re-layout),
    a user input's floating dtype, and ``True`` for anything else (a module output the plan does not name)."""
    src = node.meta.get(SOURCE, node)
    me = info(src)
    if me is not None:
        return me.requires_grad
    if src.op == "placeholder":
        val = src.meta.get("val")
        return isinstance(val, torch.Tensor) and val.is_floating_point()
    return True


def defer_input_gradient_sums(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    """Pass 6b: a ``"backward"`` all-reduce right after a node that :func:`deferrable` accepts becomes one
    :class:`~primepar_fx.runtime.pending.DeferredGradients` node (a learned position table read alike on every
    rank, whose consumer splits the batch): the sum runs asynchronously, in the plan's bytes, and the table's
    gradient is computed at the end of backward."""
    if ctx.whole_params:
        return gm
    for ar in list(gm.graph.nodes):
        mod = gm.get_submodule(ar.target) if ar.op == "call_module" else None  # type: ignore[arg-type]
        if not isinstance(mod, AllReduce) or mod.mode != "backward" or mod.input_index is None:
            continue
        node, users = ar.args[0], list(ar.users)
        if not isinstance(node, fx.Node) or len(users) != 1:
            continue
        params = deferrable(node, users[0], mod.input_index, mod.digits, ctx)
        if params is None:
            continue
        args = tuple(a for a in node.args if isinstance(a, fx.Node))
        slots = tuple(k for k, a in enumerate(node.args) if isinstance(a, fx.Node))
        template = [None if isinstance(a, fx.Node) else a for a in node.args]
        group = ctx.groups.get(mod.digits)
        deferred = DeferredGradients(
            node.target, template, dict(node.kwargs), slots, params, group, ctx.stats, mod.node
        )
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(add_module(gm, "deferred_gradients", deferred), args)
        new.meta = dict(node.meta)
        ar.replace_all_uses_with(new)
        gm.graph.erase_node(ar)
        delattr(gm, ar.target)  # type: ignore[arg-type]
        gm.graph.erase_node(node)
    return gm
