"""ZeRO-3's units for the runtime, read from the graph and the plan's recomputation as the cost model prices them."""

from __future__ import annotations

from primepar_fx.cost.model import weights_read_in_backward
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units, selective_nodes
from primepar_fx.record.levers import Recompute


def zero3_units(graph: OpGraph, recompute: Recompute | None) -> dict[str, tuple[str, bool]]:
    """ZeRO-3's units, as the cost model prices them: per parameter, the node that reads it first (a unit holds one
    node's parameters: gathered while that node runs) and whether Backward reads its values, so that it is gathered
    again (a node reading it keeps it, :func:`~primepar_fx.cost.model.weights_read_in_backward`, or runs again: a
    recomputed layer gathers every parameter it reads)."""
    again: set[str] = set()
    units = layer_units(graph) if recompute is not None and recompute.active else None
    if units is not None and units.stack == recompute.stack and len(units) == len(recompute.layers):  # type: ignore[union-attr]
        for mode, unit in zip(recompute.layers, units.units):  # type: ignore[union-attr]
            if mode != "none":
                again.update(unit if mode == "full" else selective_nodes(graph, unit))
    read: dict[str, bool] = {}
    first: dict[str, str] = {}
    for name, node in graph.nodes.items():
        needed = weights_read_in_backward(node.dims, node.target)
        for k, fqn in zip(sorted(node.dims.weights), node.params):
            read[fqn] = read.get(fqn, False) or k in needed or name in again
            first.setdefault(fqn, name)
    return {fqn: (first[fqn], read[fqn]) for fqn in read}
