"""The layers of a graph's layer stack: which compute nodes each repeated layer runs.

Activation recomputation works layer by layer: a recomputed layer keeps only the tensors that enter it and runs
its Forward again in Backward. The planner prices that per layer and the runtime checkpoints the same nodes, so
both read the layers from here, from the graph alone (a captured graph and one replicated from a short capture
give the same layers).

A layer's parameters name it: the stack is the prefix ``P`` of parameter names ``P.<i>.<rest>`` with the most
distinct indices ``i``, and layer ``i`` starts at the first compute node that reads a parameter of ``P.<i>``. It
also takes the few nodes before that one where that makes fewer tensors enter the layers (a norm's reductions
come before its weight; the same number for every layer, and none that reads a parameter), and runs to the start
of the next layer; the last layer is as long as the one before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import sympy

from primepar_fx.frontend.symbols import S
from primepar_fx.graph.build import OpGraph

#: how many nodes before its first parameter a layer may start (a norm's reductions come before its weight)
_REACH = 32
_INDEXED = re.compile(r"\.(\d+)(?=\.)")


@dataclass(frozen=True)
class LayerUnits:
    """The compute nodes of each layer of the stack ``stack`` (a module list's FQN), layer by layer."""

    stack: str
    units: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.units)

    @cached_property
    def layer_of(self) -> dict[str, int]:
        """Compute node -> the index of its layer (nodes outside the stack are absent)."""
        return {n: i for i, unit in enumerate(self.units) for n in unit}


def _stack_of(graph: OpGraph) -> str | None:
    layers: dict[str, set[int]] = {}
    for fqn in graph.param_shapes:
        for m in _INDEXED.finditer(fqn):  # every indexed prefix: "layers.3.experts.1.w" gives two
            layers.setdefault(fqn[: m.start()], set()).add(int(m.group(1)))
    if not layers:
        return None
    best = max(layers, key=lambda p: (len(layers[p]), -len(p)))
    return best if len(layers[best]) >= 2 else None


def layer_units(graph: OpGraph) -> LayerUnits | None:
    """The layers of ``graph``'s stack (module docstring), or ``None`` when it has no stack of two or more layers
    that each read only their own parameters."""
    stack = _stack_of(graph)
    if stack is None:
        return None
    head = stack + "."
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    first: dict[int, int] = {}
    reads: dict[str, set[int]] = {}
    for i, name in enumerate(order):
        idx = set()
        for p in graph.nodes[name].params:
            if p.startswith(head):
                rest = p[len(head) :].split(".", 1)[0]
                if rest.isdigit():
                    idx.add(int(rest))
        if idx:
            reads[name] = idx
            for k in idx:
                first.setdefault(k, i)
    indices = sorted(first)
    if len(indices) < 2 or indices != list(range(indices[0], indices[0] + len(indices))):
        return None
    raw = [first[k] for k in indices]
    if raw != sorted(raw):
        return None
    pred = graph.graph.pred
    ends = [*raw[1:], len(order)]
    # the same shift for every layer (they repeat); not past a node that reads a parameter, nor into the layer before
    reads_param = [i for i, n in enumerate(order) if graph.nodes[n].params]
    reach = _REACH
    for a in raw:
        reach = min(reach, a - 1 - max((i for i in reads_param if i < a), default=-1))

    def entering(a: int, end: int) -> int:  # tensors made before node a that nodes a..end-1 read
        return len({u for v in order[a:end] for u in pred[v] if pos[u] < a})

    shift = min(range(reach + 1), key=lambda d: (sum(entering(a - d, b) for a, b in zip(raw, ends)), d))
    starts = [a - shift for a in raw]
    last_len = starts[-1] - starts[-2]
    ends = [*starts[1:], min(len(order), starts[-1] + last_len)]
    units = tuple(tuple(order[a:b]) for a, b in zip(starts, ends))
    for k, unit in zip(indices, units):
        if any(reads.get(n, {k}) != {k} for n in unit):
            return None  # a node of one layer reads another layer's parameters: not a stack of layers
    return LayerUnits(stack, units)


def is_score(graph: OpGraph, name: str) -> bool:
    """Whether node ``name`` makes an attention score tensor: an output with two dims that grow with ``S``."""
    return any(
        sum(1 for d in shape if S in sympy.sympify(d).free_symbols) >= 2 for shape in graph.nodes[name].out_shapes
    )


def selective_nodes(graph: OpGraph, unit: tuple[str, ...]) -> tuple[str, ...]:
    """The run of ``unit`` that selective recomputation checkpoints: from the first node that makes attention
    scores to the last that reads them (softmax's output times ``V``), in graph order; empty without scores."""
    scores = [i for i, n in enumerate(unit) if is_score(graph, n)]
    if not scores:
        return ()
    readers = [i for i, n in enumerate(unit) if any(unit[j] in graph.graph.pred[n] for j in scores)]
    return unit[scores[0] : max(scores + readers) + 1]


def unit_inputs(graph: OpGraph, unit: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """The tensors that enter ``unit`` from outside it: ``(producer, first consumer in the unit, input index)``,
    one per producer."""
    inside = set(unit)
    seen: set[str] = set()
    out = []
    for v in unit:
        for u, _, data in graph.graph.in_edges(v, data=True):
            if u in inside:
                continue
            if u in seen:
                continue
            seen.add(u)
            out.append((u, v, data["dst_in"]))
    return out


__all__ = ["LayerUnits", "is_score", "layer_units", "selective_nodes", "unit_inputs"]
