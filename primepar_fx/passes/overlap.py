"""Pass 6c: re-layouts that move whole rows fused with the linears beside them, so that each overlaps the other.

A linear (``aten.linear``) maps each row of its input (every index of the dims before the last) on its own, so a
re-layout whose every piece spans the last dim (:func:`~primepar_fx.runtime.collective_matmul.moves_rows`) can run a row
block at a time next to it. Two patterns, found from the modules the earlier passes put in the graph, not from
names:

* ``Redistribute(x) -> linear(., W_1), ..., linear(., W_n)``: an exchange that gathers rows (Megatron's all-gather
  before q/k/v or gate/up under sequence parallelism, shared by its readers: :mod:`~primepar_fx.passes.share`),
  read by nothing but linears, as their input. It becomes one
  :class:`~primepar_fx.runtime.collective_matmul.GatherLinears` node and a ``getitem`` per linear (which keeps the
  linear's plan annotation); its backward is the re-layout's reduce-scatter (fused by
  :func:`~primepar_fx.passes.collectives.fuse_reduce_scatters`) or exchange.
* ``linear(x, W) -> Redistribute``: a bias-free linear whose one reader is a re-layout whose forward is a
  reduce-scatter of rows (the row-parallel o/down projections under sequence parallelism). It becomes one
  :class:`~primepar_fx.runtime.collective_matmul.LinearScatter` node.

Both patterns also need what the cost model's rules ask (:mod:`primepar_fx.cost.matmul_overlap`, which prices
the overlap): the re-layout's four layouts hold every row whole (:func:`~primepar_fx.cost.matmul_overlap.rows_only`),
and in the plan's graph every reader of the gathered value is a linear reading it as its input
(:func:`~primepar_fx.cost.matmul_overlap.feeds_linears`), or the scattered linear has that one reader
(:func:`~primepar_fx.cost.matmul_overlap.linear_into`). The messages stay the re-layout's, so the bytes stay the
plan's. ``PRIMEPAR_DISABLE_PASSES=overlap_collective_matmuls`` keeps the plain re-layouts (the same results and
bytes, with the overlap the plan prices not run).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from primepar_fx.cost.matmul_overlap import Reader, feeds_linears, linear_into, rows_only
from primepar_fx.cost.model import checkpoint_stop
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units, selective_nodes
from primepar_fx.passes.common import RankContext, add_module, info
from primepar_fx.runtime.collective_matmul import GatherLinears, LinearScatter
from primepar_fx.runtime.collectives import ReduceScatter
from primepar_fx.runtime.exchange import Exchange, Redistribute

aten = torch.ops.aten


def _redistribute(gm: fx.GraphModule, node: fx.Node) -> Redistribute | None:
    """The re-layout ``node`` runs, if it is one whose layouts hold every row whole."""
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)  # type: ignore[arg-type]
    if not isinstance(mod, Redistribute) or mod.layouts is None or not rows_only(*mod.layouts):
        return None
    return mod


def _readers(graph: OpGraph, name: str) -> list[Reader]:
    return [(graph.nodes[w].target, graph.input_names(w)) for w in graph.graph.successors(name)]


def _linear_reading(node: fx.Node, x: fx.Node) -> bool:
    """``node`` is a linear whose input is ``x`` and whose weight and bias are not."""
    if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
        return False
    return len(node.args) in (2, 3) and node.args[0] is x and x not in node.args[1:]


def _gathers(gm: fx.GraphModule, ctx: RankContext, node: fx.Node) -> Redistribute | None:
    """The re-layout of ``node`` when it is the first pattern's (module docstring)."""
    mod = _redistribute(gm, node)
    if mod is None or not isinstance(mod.fwd, Exchange) or not mod.fwd.comm:
        return None
    value = info(node.args[0])  # type: ignore[arg-type]  # the planned value itself (no all-reduce in between)
    if value is None or not feeds_linears(value.name, _readers(ctx.graph, value.name)):
        return None
    users = list(node.users)
    return mod if users and all(_linear_reading(u, node) for u in users) else None


def _fuse_gather(gm: fx.GraphModule, ctx: RankContext, node: fx.Node, mod: Redistribute) -> bool:
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    linears = sorted(node.users, key=order.__getitem__)
    params: list[fx.Node] = []
    has_bias = []
    for lin in linears:
        bias = lin.args[2] if len(lin.args) > 2 else None
        has_bias.append(bias is not None)
        params += [lin.args[1]] + ([bias] if bias is not None else [])  # type: ignore[list-item]
    if any(not isinstance(p, fx.Node) or order[p] > order[linears[0]] for p in params):
        return False  # a weight made after the first linear, or a constant: left alone
    fused = GatherLinears(mod.fwd, mod.bwd, tuple(has_bias), ctx.stats, mod.what, mod.node, mod.kind)  # type: ignore[arg-type]
    with g.inserting_before(linears[0]):
        call = g.call_module(add_module(gm, "gather_linears", fused), (node.args[0], *params))
        outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(linears))]
    for lin, out in zip(linears, outs):
        out.meta.update(lin.meta)  # the plan annotation of the linear it computes (recompute_layers reads it)
        lin.replace_all_uses_with(out)
        g.erase_node(lin)
    target = node.target
    g.erase_node(node)
    delattr(gm, target)  # type: ignore[arg-type]
    return True


def checkpoint_stops(ctx: RankContext) -> frozenset[str]:
    """The planned nodes where the plan's recomputed runs stop (:func:`~primepar_fx.cost.model.checkpoint_stop`):
    Backward computes each again, but not the collectives after it."""
    policy = ctx.recompute
    units = layer_units(ctx.graph) if policy is not None and policy.active else None
    if units is None:
        return frozenset()
    stops = []
    for mode, unit in zip(policy.layers, units.units):  # type: ignore[union-attr]
        run = unit if mode == "full" else selective_nodes(ctx.graph, unit) if mode == "selective" else []
        last = checkpoint_stop(ctx.graph.nodes, run)
        if last >= 0:
            stops.append(run[last])
    return frozenset(stops)


def _scatters(
    gm: fx.GraphModule, ctx: RankContext, node: fx.Node, stops: frozenset[str]
) -> tuple[fx.Node, Redistribute] | None:
    """``(the re-layout node, its module)`` when ``node`` is the second pattern's linear (module docstring); not
    where a recomputed run stops (``stops``): fused, its reduce-scatter would run again with it, which the plan
    does not price."""
    me = info(node)
    if me is None or node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
        return None
    if me.name in stops:
        return None
    if not linear_into(me.name, me.target, _readers(ctx.graph, me.name)):
        return None
    if len(node.args) == 3 and node.args[2] is not None or len(node.users) != 1:
        return None
    (user,) = node.users
    mod = _redistribute(gm, user)
    if mod is None or user.args[0] is not node or not isinstance(mod.fwd, ReduceScatter):
        return None
    if mod.bwd is not None and not isinstance(mod.bwd, Exchange):
        return None  # the gradient's way back is a reduce-scatter too: not this pattern
    return user, mod


def _fuse_scatter(gm: fx.GraphModule, ctx: RankContext, node: fx.Node, user: fx.Node, mod: Redistribute) -> None:
    g = gm.graph
    fused = LinearScatter(mod.fwd, mod.bwd, ctx.stats, mod.what, mod.node, mod.kind)  # type: ignore[arg-type]
    with g.inserting_before(user):
        call = g.call_module(add_module(gm, "linear_scatter", fused), (node.args[0], node.args[1]))
    call.meta.update(node.meta)  # the plan annotation of the linear it computes
    user.replace_all_uses_with(call)
    target = user.target
    g.erase_node(user)
    g.erase_node(node)
    delattr(gm, target)  # type: ignore[arg-type]


def overlap_collective_matmuls(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    """Fuse each re-layout that moves whole rows with the linears it feeds or follows (module docstring)."""
    for node in list(gm.graph.nodes):
        mod = _gathers(gm, ctx, node)
        if mod is not None:
            _fuse_gather(gm, ctx, node, mod)
    stops = checkpoint_stops(ctx)
    for node in list(gm.graph.nodes):
        found = _scatters(gm, ctx, node, stops)
        if found is not None:
            _fuse_scatter(gm, ctx, node, *found)
    return gm
