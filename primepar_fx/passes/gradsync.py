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

from torch import fx

from primepar_fx.passes.collectives import rename_operand
from primepar_fx.passes.common import STORAGE, RankContext
from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.runtime.gradsync import GradReduction

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
