"""ZeRO-3's units for the runtime, read from the graph and the plan's recomputation as the cost model prices them."""

from __future__ import annotations

from typing import NamedTuple

from primepar_fx.cost.model import weights_read_in_backward
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import LayerUnits, layer_units, selective_nodes
from primepar_fx.pricing.zero3 import kept_whole
from primepar_fx.record.levers import Recompute


class UnitKey(NamedTuple):
    """The ZeRO-3 unit of a parameter (:func:`zero3_units`)."""

    unit: str
    #: Backward reads it: gathered again for Backward
    read: bool
    #: kept whole from Forward to Backward (:func:`~primepar_fx.pricing.zero3.kept_whole`)
    kept: bool


def zero3_units(graph: OpGraph, recompute: Recompute | None) -> dict[str, UnitKey]:
    """ZeRO-3's units, per parameter. A unit is a whole layer, as FSDP2 wraps each block
    (``"layer <i>"``: the parameters ``<stack>.<i>.*`` of :func:`~primepar_fx.graph.layers.layer_units`), and the
    parameters outside the stack are two units, those first read before the layers (``"before"``: embeddings) and
    after them (``"after"``: the final norm and the head); a graph without a stack has a unit per node that first
    reads a parameter. ``read``: whether Backward reads its values, so that it is gathered again (a node reading it
    keeps it, :func:`~primepar_fx.cost.model.weights_read_in_backward`, or runs again: a recomputed layer gathers
    every parameter it reads). A unit's parameters that Backward reads and those it does not are kept apart: the
    runtime gathers the first ones again for Backward, and only them, as the cost model prices it; so are those it
    keeps whole from Forward to Backward (``kept``)."""
    layers = layer_units(graph)
    again = _run_again(graph, layers, recompute)
    read: dict[str, bool] = {}
    first: dict[str, str] = {}
    for name, node in graph.nodes.items():
        needed = weights_read_in_backward(node.dims, node.target)
        for k, fqn in zip(sorted(node.dims.weights), node.params):
            read[fqn] = read.get(fqn, False) or k in needed or name in again
            first.setdefault(fqn, name)
    kept = kept_whole(graph)
    return {fqn: UnitKey(_unit_of(fqn, first[fqn], graph, layers), read[fqn], fqn in kept) for fqn in read}


def _run_again(graph: OpGraph, layers: LayerUnits | None, recompute: Recompute | None) -> set[str]:
    """The nodes a recomputed layer runs again in Backward."""
    again: set[str] = set()
    active = recompute is not None and recompute.active and layers is not None
    if active and layers.stack == recompute.stack and len(layers) == len(recompute.layers):  # type: ignore[union-attr]
        for mode, unit in zip(recompute.layers, layers.units):  # type: ignore[union-attr]
            if mode != "none":
                again.update(unit if mode == "full" else selective_nodes(graph, unit))
    return again


def _unit_of(fqn: str, first: str, graph: OpGraph, layers: LayerUnits | None) -> str:
    """The unit of parameter ``fqn``, first read by node ``first`` (:func:`zero3_units`)."""
    if layers is None:
        return f"node {first}"
    head = layers.stack + "."
    if fqn.startswith(head):
        index = fqn[len(head) :].split(".", 1)[0]
        if index.isdigit():
            return f"layer {index}"
    order = list(graph.nodes)
    return "before" if order.index(first) < order.index(layers.units[0][0]) else "after"
