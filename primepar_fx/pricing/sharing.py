"""The search's view of shared re-layouts: a virtual node per tensor whose consumers may share (Eq. 10 stays pairwise).

Whether the consumers of a producer ``u`` share one re-layout (:mod:`primepar_fx.cost.share`) depends on all of
their strategies at once, which no sum of pairwise edge costs can express. A virtual node ``u@share`` between ``u``
and its consumers ``v_1 .. v_n`` (graph order) makes it pairwise again. Its states are:

* one *pass-through* state per strategy ``p`` of ``u``: the edge ``u -> u@share`` is 0 when ``u`` takes ``p`` and
  forbidden otherwise, and the edge ``u@share -> v_i`` is the original edge ``u -> v_i`` in row ``p``: nothing is
  shared, every consumer pays its own re-layout, exactly as without the node;
* one *shared* state per consumer signature ``s`` that every consumer can take: the edge ``u -> u@share`` is the
  first consumer's own edge (its re-layout, net of a reduce-scatter fusion) for any of its strategies of signature
  ``s``; the edge ``u@share -> v_1`` is 0 for its strategies of signature ``s`` and forbidden for the others; the
  edge ``u@share -> v_i`` (``i >= 2``) is minus the input-gradient all-reduce that ``v_i``'s node cost holds and no
  longer runs, and forbidden where its signature is not ``s``.

For any strategies of ``u`` and the consumers, the cheapest state of the virtual node is the pass-through one unless
all consumers have one signature, and then the shared one, which costs what
:func:`~primepar_fx.pricing.summary.summarize` charges: the objective of every choice is its plan's predicted step
time, and the search's optimum is the best plan under sharing. The shared states are added only where the first
consumer's edge is the same for all its strategies of the signature (it is, unless two strategies with one
signature fuse their all-reduce differently) and where sharing saves something; a producer with none gets no node.
An edge that also carries a shared parameter's re-layout (tied weights) keeps its producer out, as the runtime does
not share it either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from primepar_fx.search import CostGraph

#: the suffix of a virtual node's name (``"@"`` cannot occur in an FX node name)
SUFFIX = "@share"


def virtual(name: str) -> bool:
    """Whether ``name`` is a virtual share node of :func:`add_share_nodes`, not an operator."""
    return name.endswith(SUFFIX)


def _shared_states(u: str, group: tuple[str, ...], flows: Mapping) -> list[tuple[int, np.ndarray]]:
    """``(signature, u -> virtual column)`` of every signature all consumers can take and sharing saves on."""
    first = flows[(u, group[0])]
    sigs, at, of = np.unique(first.signature, return_index=True, return_inverse=True)
    # a signature whose columns of the first consumer's edge differ between its strategies is not pairwise
    differs = np.bincount(of, (first.seconds != first.seconds[:, at[of]]).any(axis=0), len(sigs)) > 0
    keep, saves = ~differs, np.zeros(len(sigs), dtype=bool)
    for v in group[1:]:
        f = flows[(u, v)]
        keep &= np.isin(sigs, f.signature)  # one every consumer can take
        # sharing saves where some of its columns (or input-gradient all-reduces) of another consumer are not 0
        nonzero = f.seconds.any(axis=0) | (f.reduce_s != 0)
        saves |= np.isin(sigs, f.signature[nonzero])
    return [(int(sig), first.seconds[:, at[k]]) for k, sig in enumerate(sigs.tolist()) if keep[k] and saves[k]]


def _share_arrays(pu: int, group: tuple[str, ...], u: str, flows: Mapping, edges: Mapping):
    """The virtual node's states and its edges: ``(states, u -> virtual, [virtual -> v for v in group])``."""
    states = _shared_states(u, group, flows)
    if not states:
        return None
    size = pu + len(states)
    into = np.full((pu, size), np.inf)
    into[np.arange(pu), np.arange(pu)] = 0.0
    for s, (_, column) in enumerate(states):
        into[:, pu + s] = column
    outs = []
    for i, v in enumerate(group):
        f = flows[(u, v)]
        out = np.full((size, len(f.signature)), np.inf)
        out[:pu] = edges[(u, v)]
        for s, (sig, _) in enumerate(states):
            mask = f.signature == sig
            out[pu + s, mask] = 0.0 if i == 0 else -f.reduce_s[mask]
        outs.append(out)
    for arr in (into, *outs):
        arr.flags.writeable = False
    return states, into, outs


def add_share_nodes(cg: CostGraph, flows: Mapping, fanout: Mapping[str, tuple[str, ...]]) -> CostGraph:
    """``cg`` with a virtual node (module docstring) between every fan-out producer and its consumers.

    Identical layers share their flows' arrays, so the virtual node of each is built once and its arrays are
    shared too (which is also what lets the search see the layers as identical)."""
    after: dict[str, str] = {}  # producer -> its virtual node, placed right after it
    node_cost = dict(cg.node_cost)
    node_memory = None if cg.node_memory is None else dict(cg.node_memory)
    node_key = None if cg.node_key is None else dict(cg.node_key)
    edges = dict(cg.edge_cost)
    memo: dict[tuple, Any] = {}  # ids of the arrays a virtual node is built from -> what it is built into
    zeros: dict[int, np.ndarray] = {}
    for u, group in fanout.items():
        if any(edges.get((u, v)) is not flows[(u, v)].seconds for v in group):
            continue  # an edge that also re-lays out a tied parameter (or is already routed)
        pu = len(cg.node_cost[u])
        key = (
            pu,
            *((id(flows[(u, v)].seconds), id(flows[(u, v)].signature), id(flows[(u, v)].reduce_s)) for v in group),
        )
        if key not in memo:  # (the ids stay valid: flows holds every array meanwhile)
            memo[key] = _share_arrays(pu, group, u, flows, edges)
        if memo[key] is None:
            continue
        states, into, outs = memo[key]
        name, size = u + SUFFIX, pu + len(states)
        edges[(u, name)] = into
        for v, out in zip(group, outs):
            del edges[(u, v)]
            edges[(name, v)] = out
        after[u] = name
        if size not in zeros:
            zeros[size] = np.zeros(size)
            zeros[size].flags.writeable = False
        node_cost[name] = zeros[size]
        if node_memory is not None:
            node_memory[name] = zeros[size]
        if node_key is not None:
            node_key[name] = ("share", node_key[u], tuple(node_key[v] for v in group), tuple(s for s, _ in states))
    if not after:
        return cg
    nodes = tuple(m for n in cg.nodes for m in ((n, after[n]) if n in after else (n,)))
    return CostGraph(nodes, node_cost, edges, node_memory, node_key)


def complete_choice(graph: CostGraph, choice: Mapping[str, int]) -> dict[str, int]:
    """``choice``, a plan of the graph without virtual nodes (:attr:`PricedGraph.cost_graph`), with each virtual node
    of ``graph`` (:func:`add_share_nodes`) in its cheapest state given its producer's and consumers' strategies:
    the plan's shared re-layouts, as :func:`~primepar_fx.pricing.summary.summarize` prices them. Its pass-through
    state always costs what the edges without the node do, so a plan the graph without them allows stays finite.
    """
    out = dict(choice)
    for name in graph.nodes:
        if name in out:
            continue
        if not virtual(name):
            raise ValueError(f"the choice has no strategy for node {name!r}")
        (u,) = graph.pred[name]
        cost = graph.edge_cost[(u, name)][out[u]].copy()
        for v in graph.succ[name]:
            cost += graph.edge_cost[(name, v)][:, out[v]]
        out[name] = int(np.argmin(cost))
    return out
