"""Pass 10: activation recomputation, as the plan says (:class:`~primepar_fx.record.levers.Recompute`).

Each recomputed layer of the plan becomes one node of the rank graph: a submodule holding the layer's nodes (its
planned nodes and every node the earlier passes put between them: re-layouts, collectives, ring products) called
through non-reentrant activation checkpointing (:func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False``). Forward keeps only the tensors that enter the layer; Backward runs the layer's Forward
again, collectives and ring transfers included (every rank recomputes the same layers in the same order, so they
meet), and then its Backward; random ops draw the same numbers again (the RNG state is restored).

``selective`` recomputes, per layer, the run of nodes from the first that makes attention scores to the last that
reads them (:func:`~primepar_fx.graph.layers.selective_nodes`). The layers are the planner's
(:func:`~primepar_fx.graph.layers.layer_units` of the same graph), found among the rank graph's nodes by the
planned node each one computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from primepar_fx.graph.layers import layer_units, selective_nodes
from primepar_fx.passes.common import RankContext, add_module, info


class Checkpointed(nn.Module):
    """``body`` run under non-reentrant activation checkpointing: its inputs are kept, its activations are not."""

    def __init__(self, body: fx.GraphModule, layer: int, mode: str) -> None:
        super().__init__()
        self.body = body
        self.layer, self.mode = layer, mode
        #: called with the inputs before the body runs, in Forward and again when Backward recomputes it (ZeRO-3
        #: gathers the parameters it reads: :mod:`primepar_fx.runtime.zero3`)
        self.before_run: Callable[[tuple[Any, ...]], None] | None = None

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._body(*args)
        return checkpoint(self._body, *args, use_reentrant=False, preserve_rng_state=True)

    def _body(self, *args: Any) -> Any:
        if self.before_run is not None:
            self.before_run(args)
        return self.body(*args)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, mode={self.mode!r}"


def _wrap(gm: fx.GraphModule, nodes: list[fx.Node], layer: int, mode: str) -> None:
    """Move ``nodes`` (a contiguous run of the graph) into a :class:`Checkpointed` submodule called in their place."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: body.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    module = Checkpointed(fx.GraphModule(gm, body, class_name=f"Layer{layer}"), layer, mode)
    target = add_module(gm, f"recompute_layer{layer}", module)
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(target, tuple(inputs))
        results = [gm.graph.call_function(_item, (call, i)) for i in range(len(outputs))]
    for o, r in zip(outputs, results):
        o.replace_all_uses_with(r)
    for n in reversed(nodes):
        gm.graph.erase_node(n)


def _item(values: tuple, i: int) -> Any:
    return values[i]


def recompute_layers(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    """Checkpoint the plan's recomputed layers (module docstring); a plan without recomputation is left as is."""
    policy = ctx.recompute
    if policy is None or not policy.active:
        return gm
    units = layer_units(ctx.graph)
    if units is None or units.stack != policy.stack or len(units) != len(policy.layers):
        found = "no layer stack" if units is None else f"{len(units)} layers of {units.stack}"
        raise ValueError(
            f"the plan recomputes {len(policy.layers)} layers of {policy.stack}, but the model has {found}: "
            "plan is for another model"
        )
    order = list(gm.graph.nodes)
    where: dict[str, int] = {}
    for i, n in enumerate(order):
        me = info(n)
        if me is not None:
            where.setdefault(me.name, i)
    done = -1
    for layer, (mode, unit) in enumerate(zip(policy.layers, units.units)):
        if mode == "none":
            continue
        names = unit if mode == "full" else selective_nodes(ctx.graph, unit)
        spots = [where[n] for n in names if n in where]
        if not spots:
            continue
        if min(spots) <= done:
            raise ValueError(f"layer {layer} of {policy.stack}: its nodes overlap the layer before it in the graph")
        done = max(spots)
        wrap = order[min(spots) : done + 1]
        if any(n.op in ("placeholder", "output") for n in wrap):
            raise ValueError(f"layer {layer} of {policy.stack}: its nodes are not a contiguous run of the graph")
        _wrap(gm, wrap, layer, mode)
    return gm
