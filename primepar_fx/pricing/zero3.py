"""ZeRO-3's parameters kept whole from Forward to Backward: those only the nodes after the layer stack read in
Backward (the final norm, the head, a tied embedding's second use).

Backward starts with the nodes after the stack, right after Forward ends with them: freeing their parameters after
Forward only to gather them again at once costs a gather and saves no memory at the peak, so the runtime keeps them
whole (as FSDP2 keeps its root module's, torchtitan its last block's), and the cost model prices them so: one
all-gather a micro-batch, and the whole block held from Forward to Backward. A parameter that a node in or before
the stack reads in Backward is released after Forward as every other (Backward needs it only at its end)."""

from __future__ import annotations

from primepar_fx.cost.model import weights_read_in_backward
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units


def kept_whole(graph: OpGraph) -> frozenset[str]:
    """The parameters (FQNs) that ZeRO-3 keeps whole from Forward to Backward (module docstring); none in a graph
    without a layer stack."""
    layers = layer_units(graph)
    if layers is None:
        return frozenset()
    order = list(graph.nodes)
    end = order.index(layers.units[-1][-1])
    head = layers.stack + "."
    late: dict[str, bool] = {}  # a parameter Backward reads -> whether only nodes after the stack read it there
    for i, name in enumerate(order):
        node = graph.nodes[name]
        needed = weights_read_in_backward(node.dims, node.target)
        for k, fqn in zip(sorted(node.dims.weights), node.params):
            if k in needed and not fqn.startswith(head):
                late[fqn] = late.get(fqn, True) and i > end
    return frozenset(fqn for fqn, only in late.items() if only)


def kept_inputs(graph: OpGraph, name: str, kept: frozenset[str]) -> tuple[int, ...]:
    """The weight inputs of node ``name`` whose parameters are ``kept`` whole (:func:`kept_whole`)."""
    node = graph.nodes[name]
    return tuple(k for k, fqn in zip(sorted(node.dims.weights), node.params) if fqn in kept)
