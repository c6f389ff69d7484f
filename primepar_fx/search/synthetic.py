"""Seeded synthetic cost graphs for tests and benchmarks (random costs, real transformer shapes).

:func:`transformer_graph` builds stacked decoder layers the way ``torch.export`` lays them out: a residual input,
Q/K/V branches with view/transpose chains, attention that also reads a global mask built once, a gated MLP, and
two residual adds per layer, plus an embedding before and a head after. :func:`random_dag` builds small random
DAGs with skip edges. Costs are uniform random; ``inf_fraction`` of the entries are made ``+inf`` (forbidden).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from primepar_fx.search.problem import CostGraph


@dataclass(frozen=True)
class LayerShape:
    """The per-layer template: ``(kind, input kinds)`` in topological order; ``x`` is the layer input."""

    views: int = 2

    def template(self) -> list[tuple[str, tuple[str, ...]]]:
        out: list[tuple[str, tuple[str, ...]]] = [("ln1", ("x",))]

        def branch(name: str, src: tuple[str, ...]) -> str:
            out.append((name, src))
            last = name
            for i in range(self.views):
                out.append((f"{name}_v{i}", (last,)))
                last = f"{name}_v{i}"
            return last

        q, k, v = branch("q", ("ln1",)), branch("k", ("ln1",)), branch("v", ("ln1",))
        out += [("scores", (q, k, "@mask")), ("softmax", ("scores",))]
        attn = branch("attn", ("softmax", v))
        out += [("oproj", (attn,)), ("add1", ("x", "oproj")), ("ln2", ("add1",))]
        out += [("up", ("ln2",)), ("gate", ("ln2",)), ("act", ("gate",)), ("mul", ("act", "up"))]
        out += [("down", ("mul",)), ("add2", ("add1", "down"))]
        return out


class _Costs:
    """Random arrays per node kind and per edge kind, optionally shared between layers."""

    def __init__(self, rng: np.random.Generator, strategies: tuple[int, int], inf_fraction: float, share: bool):
        self.rng, self.lo_hi, self.inf, self.share = rng, strategies, inf_fraction, share
        self.sizes: dict[str, int] = {}
        self.vectors: dict[tuple[str, str], np.ndarray] = {}
        self.matrices: dict[tuple[str, str], np.ndarray] = {}

    def size(self, kind: str) -> int:
        if kind not in self.sizes:
            lo, hi = self.lo_hi
            self.sizes[kind] = int(self.rng.integers(lo, hi + 1))
        return self.sizes[kind]

    def _random(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        arr = self.rng.random(shape) * scale
        if self.inf:
            arr[self.rng.random(shape) < self.inf] = np.inf
        return arr

    def vector(self, kind: str, what: str) -> np.ndarray:
        key = (kind, what)
        if key not in self.vectors:
            mem = what == "mem"
            self.vectors[key] = (
                self.rng.random(self.size(kind)) * 1e6 if mem else self._random((self.size(kind),), 10.0)
            )
        return self.vectors[key] if self.share else self.vectors[key].copy()

    def matrix(self, src: str, dst: str) -> np.ndarray:
        key = (src, dst)
        if key not in self.matrices:
            self.matrices[key] = self._random((self.size(src), self.size(dst)), 10.0)
        return self.matrices[key] if self.share else self.matrices[key].copy()


def transformer_graph(
    layers: int,
    *,
    strategies: tuple[int, int] = (4, 8),
    views: int = 2,
    mask_states: int | None = 4,
    inf_fraction: float = 0.0,
    memory: bool = True,
    share_arrays: bool = True,
    seed: int = 0,
) -> CostGraph:
    """``layers`` identical decoder layers (node costs per kind, edge costs per kind pair); see module docstring.

    ``mask_states=None`` leaves out the global mask. With ``share_arrays=False`` every layer gets its own copy of
    the (equal) arrays, so the search must compare contents rather than identities.
    """
    costs = _Costs(np.random.default_rng(seed), strategies, inf_fraction, share_arrays)
    nodes, kinds, edges = ["embed"], {"embed": "embed"}, {}
    if mask_states is not None:
        costs.sizes["mask"] = mask_states
        nodes.append("mask")
        kinds["mask"] = "mask"
    prev = "embed"
    for layer in range(layers):
        names = {"x": prev, "@mask": "mask"}
        for kind, inputs in LayerShape(views).template():
            name = names[kind] = f"l{layer}.{kind}"
            nodes.append(name)
            kinds[name] = kind
            for src in inputs:
                if src == "@mask" and mask_states is None:
                    continue
                u = names[src]
                edges[(u, name)] = costs.matrix(kinds[u], kind)
        prev = names["add2"]
    for kind in ("norm", "head", "loss"):
        nodes.append(kind)
        kinds[kind] = kind
        edges[(prev, kind)] = costs.matrix(kinds[prev], kind)
        prev = kind
    node_cost = {n: costs.vector(kinds[n], "cost") for n in nodes}
    node_memory = {n: costs.vector(kinds[n], "mem") for n in nodes} if memory else None
    return CostGraph(tuple(nodes), node_cost, edges, node_memory, {n: kinds[n] for n in nodes})


def random_dag(
    n: int,
    *,
    max_strategies: int = 3,
    skip_prob: float = 0.3,
    inf_fraction: float = 0.0,
    memory: bool = True,
    seed: int = 0,
) -> CostGraph:
    """A chain ``0 -> 1 -> ... -> n-1`` plus random forward skip edges, with random sizes and costs."""
    rng = np.random.default_rng(seed)
    nodes = tuple(f"n{i}" for i in range(n))
    size = {v: int(rng.integers(1, max_strategies + 1)) for v in nodes}

    def rand(shape: tuple[int, ...]) -> np.ndarray:
        arr = rng.random(shape) * 10.0
        if inf_fraction:
            arr[rng.random(shape) < inf_fraction] = np.inf
        return arr

    edges = {}
    for j in range(1, n):
        edges[(nodes[j - 1], nodes[j])] = rand((size[nodes[j - 1]], size[nodes[j]]))
        for i in range(j - 1):
            if rng.random() < skip_prob:
                edges[(nodes[i], nodes[j])] = rand((size[nodes[i]], size[nodes[j]]))
    node_cost = {v: rand((size[v],)) for v in nodes}
    node_memory = {v: rng.random(size[v]) * 100.0 for v in nodes} if memory else None
    return CostGraph(nodes, node_cost, edges, node_memory)
