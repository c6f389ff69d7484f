"""Pass 3: a :class:`~primepar_fx.runtime.Redistribute` node on every edge whose two layouts differ.

The producer side holds ``out_j`` at its last Forward step and needs ``d_out_j`` at its first Backward step; the
consumer needs ``in_k`` at its first Forward step and holds ``d_in_k`` after its Backward (Gradient for a
parameter or a matrix product's W operand) -- the four layouts the cost model prices an edge with
(:mod:`primepar_fx.cost.redistribute`). A user input or buffer is held whole by every rank, so reading it is a local
slice; a parameter is held in its storage layout (:mod:`primepar_fx.passes.shard`). A user output is gathered whole
on every rank (counted as ``"output"`` traffic, which no plan prices). The element a ``getitem`` selects from a
multi-output node is redistributed right after the ``getitem``.
"""

from __future__ import annotations

from torch import fx

from primepar_fx.partition.layouts import Layout
from primepar_fx.passes.common import STORAGE, RankContext, add_module, info, is_getitem
from primepar_fx.runtime.exchange import Exchange, Redistribute, full_layout

#: node.meta key of a Redistribute inserted after a getitem: the getitem whose value it carries
SOURCE = "primepar_source"


def redistribute_module(
    ctx: RankContext,
    held: Layout,
    needed: Layout,
    grad_held: Layout | None,
    grad_needed: Layout | None,
    what: str,
    node: str,
    kind: str = "redistribution",
) -> Redistribute | None:
    fwd = Exchange.plan(held, needed, ctx.mesh, ctx.rank)
    bwd = None
    if grad_held is not None and grad_needed is not None:
        bwd = Exchange.plan(grad_held, grad_needed, ctx.mesh, ctx.rank)
    if fwd.identity and (bwd is None or bwd.identity):
        return None
    return Redistribute(fwd, bwd, ctx.stats, what, node, kind, layouts=(held, needed, grad_held, grad_needed))


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


def _held(ctx: RankContext, value: fx.Node) -> tuple[Layout, Layout | None]:
    """What the producer of ``value`` holds, and where it needs the gradient (``None``: no gradient)."""
    src = value.meta.get(SOURCE, value)
    if src.op == "placeholder":
        if STORAGE in src.meta:
            return src.meta[STORAGE], src.meta[STORAGE]
        return full_layout(_shape(src), ctx.mesh.size), None
    producer = info(src)
    if producer is None:
        raise ValueError(f"node {src.name} ({src.target}) feeds a planned node but has no partition")
    if producer.multi_output:
        raise NotImplementedError(f"node {src.name} has several outputs; only getitem may read it")
    return producer.planned.out_held(0), producer.planned.out_grad_needed(0)


def insert_redistributions(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        me = info(node)
        if me is None:
            continue
        op = me.part.op
        if is_getitem(node):
            producer = info(node.args[0])
            j = node.args[1]
            mod = redistribute_module(
                ctx,
                producer.planned.out_held(j),
                me.computed.in_needed(0),
                me.computed.in_grad_held(0),
                producer.planned.out_grad_needed(j),
                f"{node.args[0].name}[{j}] -> {node.name}",
                node.name,
            )
            if mod is not None:
                with g.inserting_after(node):
                    r = g.call_module(add_module(gm, "redistribute", mod), (node,))
                node.replace_all_uses_with(r, delete_user_cb=lambda u, r=r: u is not r)
                r.meta[SOURCE] = node
            continue
        for k, a in enumerate(list(node.all_input_nodes)):
            if op.inputs[k] is None:
                if op.kind in ("factory", "pointwise"):
                    continue  # new_ones(x, size), type_as(y, x): read only x's dtype (and device), so any block will do
                src = a.meta.get(SOURCE, a)
                if not (src.op == "placeholder" or info(src) is not None) or "val" not in src.meta:
                    continue  # a size, not a tensor
                needed, grad_held = full_layout(_shape(src), ctx.mesh.size), None  # an index list entry: all of it
            else:
                needed, grad_held = me.computed.in_needed(k), me.computed.in_grad_held(k)
            held, grad_needed = _held(ctx, a)
            what = f"{a.meta.get(SOURCE, a).name} -> {node.name}"
            mod = redistribute_module(ctx, held, needed, grad_held, grad_needed, what, node.name)
            if mod is not None:
                with g.inserting_before(node):
                    r = g.call_module(add_module(gm, "redistribute", mod), (a,))
                node.replace_input_with(a, r)
    out = next(n for n in g.nodes if n.op == "output")
    values = []
    for a in out.args[0]:
        if isinstance(a, fx.Node) and (a.op == "placeholder" or info(a.meta.get(SOURCE, a)) is not None):
            held, grad_needed = _held(ctx, a)
            full = full_layout(_shape(a.meta.get(SOURCE, a)), ctx.mesh.size)
            mod = redistribute_module(
                ctx,
                held,
                full,
                full if grad_needed is not None else None,
                grad_needed,
                f"{a.name} -> output",
                "",
                kind="output",
            )
            if mod is not None:
                with g.inserting_before(out):
                    a = g.call_module(add_module(gm, "gather_output", mod), (a,))
        values.append(a)
    out.args = (tuple(values),)
    return gm
