"""Where the dynamic program may cut the graph: global nodes, cut points, segments and repeated layers.

*Cut points.* In the DP order (topological, global nodes removed), position ``c`` is a cut when no edge jumps
over it: no edge ``(u, v)`` has ``pos(u) < c < pos(v)``. The table of everything processed so far then depends on
``c``'s strategy alone (the frontier has collapsed to ``c``). The first and last positions are always cuts. For
the paper's Fig. 6 block the cuts are ``n0``, ``n7`` and ``n12``; ``n2`` is a cut only inside ``[n0, n7]`` once the
skip edge ``e_{0,7}`` is set aside, which the elimination engine does implicitly (Eq. 12-13).

*Segments.* The nodes from one cut to the next, with the edges among them. Every edge lies in exactly one
segment, because none jumps a cut.

*Global nodes.* A node that feeds every layer (an attention mask, a rotary table) jumps over every cut of the
layers and would merge them all into one segment. A node is made *global* when it has at least ``min_fanout``
consumers, at most ``max_states`` strategies, and its out-edges jump at least two cut points of the graph
without the candidates. Globals are chosen most-jumps-first while the product of their strategy counts stays at
most ``max_product``. The DP conditions on them: it tries every joint strategy of theirs (as an array axis) and folds
their edges into their neighbours' node costs (:mod:`primepar_fx.search.dp`). Other wide nodes stay in the graph
and the engine carries them as an extra table axis (exact, but with one larger segment).

*Classes and stacks (Eq. 14).* Segments whose node keys, sizes and edge pattern match, and whose cost arrays are
equal (checked with ``np.array_equal``), form a class: the DP computes one table per class. A stack is a run of
``count >= 2`` repeats of the same ``period`` consecutive classes: identical layers.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from math import prod

import numpy as np

from primepar_fx.search.problem import CostGraph

log = logging.getLogger(__name__)

Edge = tuple[str, str]


@dataclass(frozen=True)
class Segment:
    """Nodes from one cut to the next (both included) and the edges among them."""

    nodes: tuple[str, ...]
    edges: tuple[Edge, ...]
    cls: int


@dataclass(frozen=True)
class Stack:
    """Segments ``first .. first + period * count - 1``: ``count`` identical layers of ``period`` segments."""

    first: int
    period: int
    count: int


@dataclass(frozen=True)
class Structure:
    """The decomposition the DP runs on; it depends on the graph's shape and arrays, never on a multiplier."""

    order: tuple[str, ...]
    globals: tuple[str, ...]
    segments: tuple[Segment, ...]
    class_sizes: tuple[int, ...]
    class_deps: tuple[tuple[str, ...], ...]
    stacks: tuple[Stack, ...]
    #: for every non-global node, its edges to or from global nodes
    touches: Mapping[str, tuple[Edge, ...]]


def jump_counts(order: tuple[str, ...], edges: list[Edge]) -> np.ndarray:
    """For every position in ``order``, the number of ``edges`` that jump over it."""
    pos = {n: i for i, n in enumerate(order)}
    cover = np.zeros(len(order) + 1, dtype=np.int64)
    for u, v in edges:
        a, b = pos[u], pos[v]
        if b - a > 1:
            cover[a + 1] += 1
            cover[b] -= 1
    return np.cumsum(cover[:-1])


def cut_positions(order: tuple[str, ...], edges: list[Edge]) -> list[int]:
    """Positions in ``order`` that no edge jumps over (always including the first and the last)."""
    return [int(i) for i in np.flatnonzero(jump_counts(order, edges) == 0)]


def select_globals(
    graph: CostGraph, *, min_fanout: int, max_states: int, max_product: int, forced: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """Nodes to condition on (see the module docstring); ``forced`` ones (the DP's proxies) first, while the product
    of strategy counts allows."""
    chosen, size = [], 1
    for g in forced:
        if size * graph.strategies(g) <= max_product:
            chosen.append(g)
            size *= graph.strategies(g)
    cands = [
        n
        for n in graph.nodes
        if len(graph.succ[n]) >= min_fanout and graph.strategies(n) <= max_states and n not in forced
    ]
    if not cands:
        return tuple(sorted(chosen, key=graph.index.__getitem__))
    drop = set(cands) | set(chosen)
    order = tuple(n for n in graph.nodes if n not in drop)
    inner = [e for e in graph.edge_cost if e[0] not in drop and e[1] not in drop]
    cut_pos = sorted(graph.index[order[c]] for c in cut_positions(order, inner)) if order else []
    jumps = {}
    for g in cands:
        lo, hi = graph.index[g], max(graph.index[v] for v in graph.succ[g])
        jumps[g] = bisect.bisect_left(cut_pos, hi) - bisect.bisect_right(cut_pos, lo)
    for g in sorted(cands, key=lambda n: (-jumps[n], graph.index[n])):
        if jumps[g] >= 2 and size * graph.strategies(g) <= max_product:
            chosen.append(g)
            size *= graph.strategies(g)
    return tuple(sorted(chosen, key=graph.index.__getitem__))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and np.array_equal(a, b))


class _Classifier:
    """Groups segments into classes: equal signature first, then equal arrays."""

    def __init__(self, graph: CostGraph, touches: Mapping[str, tuple[Edge, ...]]) -> None:
        self.graph = graph
        self.touches = touches
        self.reps: dict[Hashable, list[tuple[int, Segment]]] = {}
        self.sizes: list[int] = []
        self.deps: list[tuple[str, ...]] = []

    def key(self, node: str) -> Hashable:
        g = self.graph
        if g.node_key is not None:
            return (g.node_key[node], g.strategies(node))
        h = hashlib.blake2b(g.node_cost[node].tobytes(), digest_size=16)
        if g.node_memory is not None:
            h.update(g.node_memory[node].tobytes())
        return h.hexdigest()

    def signature(self, nodes: tuple[str, ...], edges: tuple[Edge, ...]) -> Hashable:
        rel = {n: i for i, n in enumerate(nodes)}
        glob = tuple(
            (i, e[0] if e[1] == n else e[1], e[1] == n) for i, n in enumerate(nodes) if i for e in self.touches[n]
        )
        return (
            self.graph.strategies(nodes[0]),
            tuple(self.key(n) for n in nodes[1:]),
            tuple((rel[u], rel[v]) for u, v in edges),
            glob,
        )

    def equal(self, a: Segment, b_nodes: tuple[str, ...], b_edges: tuple[Edge, ...]) -> bool:
        g = self.graph
        for x, y in zip(a.nodes[1:], b_nodes[1:]):
            if not _same(g.node_cost[x], g.node_cost[y]) or not _same(g.memory_of(x), g.memory_of(y)):
                return False
            if not all(_same(g.edge_cost[e], g.edge_cost[f]) for e, f in zip(self.touches[x], self.touches[y])):
                return False
        return all(_same(g.edge_cost[e], g.edge_cost[f]) for e, f in zip(a.edges, b_edges))

    def classify(self, nodes: tuple[str, ...], edges: tuple[Edge, ...]) -> Segment:
        sig = self.signature(nodes, edges)
        for cls, rep in self.reps.setdefault(sig, []):
            if self.equal(rep, nodes, edges):
                self.sizes[cls] += 1
                return Segment(nodes, edges, cls)
        seg = Segment(nodes, edges, len(self.sizes))
        self.reps[sig].append((seg.cls, seg))
        self.sizes.append(1)
        deps = {u if v == n else v for n in nodes[1:] for u, v in self.touches[n]}
        self.deps.append(tuple(sorted(deps, key=self.graph.index.__getitem__)))
        return seg


def find_stacks(classes: list[int], *, max_period: int) -> list[Stack]:
    """Greedy left-to-right runs of a repeated block of classes, longest coverage first (ties: shorter period)."""
    stacks, s, m = [], 0, len(classes)
    while s < m:
        best = None
        for p in range(1, min(max_period, (m - s) // 2) + 1):
            if classes[s] != classes[s + p]:
                continue
            block, r = classes[s : s + p], 1
            while s + (r + 1) * p <= m and classes[s + r * p : s + (r + 1) * p] == block:
                r += 1
            if r >= 2 and (best is None or p * r > best.period * best.count):
                best = Stack(s, p, r)
        if best is None:
            s += 1
        else:
            stacks.append(best)
            s += best.period * best.count
    return stacks


def analyse(
    graph: CostGraph,
    *,
    min_fanout: int = 3,
    max_global_states: int = 16,
    max_global_product: int = 64,
    max_period: int = 256,
    forced: tuple[str, ...] = (),
) -> Structure:
    """Globals, cuts, segments, classes and stacks of ``graph``; ``forced`` nodes are made global first."""
    glob = select_globals(
        graph, min_fanout=min_fanout, max_states=max_global_states, max_product=max_global_product, forced=forced
    )
    gset = set(glob)
    order = tuple(n for n in graph.nodes if n not in gset)
    inner = [e for e in graph.edge_cost if e[0] not in gset and e[1] not in gset]
    touches: dict[str, list[Edge]] = {n: [] for n in order}
    for u, v in graph.edge_cost:
        if (u in gset) != (v in gset):
            touches[v if u in gset else u].append((u, v))
    touches_t = {
        n: tuple(sorted(es, key=lambda e: (graph.index[e[0]], graph.index[e[1]]))) for n, es in touches.items()
    }
    cuts = cut_positions(order, inner) if order else []
    pos = {n: i for i, n in enumerate(order)}
    per_seg: list[list[Edge]] = [[] for _ in range(max(0, len(cuts) - 1))]
    for u, v in sorted(inner, key=lambda e: (pos[e[0]], pos[e[1]])):
        per_seg[bisect.bisect_right(cuts, pos[u]) - 1].append((u, v))
    classifier = _Classifier(graph, touches_t)
    segments = tuple(
        classifier.classify(order[a : b + 1], tuple(per_seg[k])) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))
    )
    stacks = find_stacks([s.cls for s in segments], max_period=max_period)
    log.debug(
        "structure: %d nodes, %d global(s) %s (%d joint states), %d segments in %d classes, stacks %s",
        len(graph.nodes),
        len(glob),
        list(glob),
        prod(graph.strategies(g) for g in glob),
        len(segments),
        len(classifier.sizes),
        [(s.period, s.count) for s in stacks],
    )
    return Structure(order, glob, segments, tuple(classifier.sizes), tuple(classifier.deps), tuple(stacks), touches_t)
