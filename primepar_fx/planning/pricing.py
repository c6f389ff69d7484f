"""Price every node's partition space and every edge's redistribution: the search's :class:`CostGraph` (Eq. 10).

For each compute node of an :class:`~primepar_fx.graph.OpGraph` the legal partition sequences are enumerated on
the mesh (:func:`~primepar_fx.partition.enumerate_sequences`) and priced with :func:`node_cost` (Eq. 7); for each
data-flow edge the redistribution matrix (Eq. 8-9) is priced with :func:`edge_cost_matrix`. Identical layers
produce identical work, so both are cached by a structural key (the node's ``OpDims`` and ATen op; for an edge,
both ends' keys and the tensor's output/input indices): a model with L identical layers is priced once per layer
shape, not L times.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch
from torch import fx
from tqdm.auto import tqdm

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.model import (
    CostOptions,
    NodeCost,
    direction_key,
    edge_cost_matrix,
    node_cost,
    price_directions,
)
from primepar_fx.cost.redistribute import LayoutPairs, check_edge, consumer_sides, pairs_of, producer_sides
from primepar_fx.cost.scatter import ScatterSaving, fusable_backward, fusable_forward, graph_facts, scatter_saving
from primepar_fx.frontend.symbols import META_DTYPES
from primepar_fx.graph import OpGraph, OpNode
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Replicate, enumerate_sequences
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import bound_partition
from primepar_fx.search import CostGraph
from primepar_fx.utils.gcpause import gc_paused

log = logging.getLogger(__name__)


@dataclass
class PricedGraph:
    """The search problem plus what is needed to read its answer back."""

    cost_graph: CostGraph
    mesh: DeviceMesh
    strategies: dict[str, list[PartitionSeq]]
    node_costs: dict[str, list[NodeCost]]
    edge_bytes: dict[tuple[str, str], np.ndarray]
    seconds: float
    #: edges where an all-reduce and the re-layout after it fuse into a reduce-scatter, for some strategy pairs;
    #: ``edge_cost`` already has the seconds saved subtracted (:mod:`primepar_fx.cost.scatter`)
    scatter: dict[tuple[str, str], ScatterSaving] = field(default_factory=dict)

    def subset(self, keep: Callable[[PartitionSeq], bool]) -> PricedGraph:
        """This pricing with every node's strategies narrowed to those ``keep`` accepts, in their order.

        Each cost is per strategy or per pair of strategies, so this is what pricing the narrower space gives,
        bit for bit: the planner reads its split-only baseline (``keep`` = no P(S x S)) off its own pricing. Arrays
        shared between nodes (identical layers) stay shared. Raises ``ValueError`` naming a node left with none.
        """
        kept: dict[int, np.ndarray] = {}  # id of a strategy list (shared by a node's copies) -> the rows kept
        rows: dict[str, np.ndarray] = {}
        for name, seqs in self.strategies.items():
            if id(seqs) not in kept:
                kept[id(seqs)] = np.flatnonzero(np.array([bool(keep(s)) for s in seqs], dtype=bool))
            rows[name] = kept[id(seqs)]
            if not len(rows[name]):
                raise ValueError(f"node {name}: no strategy is kept (of {', '.join(map(str, seqs[:4]))}, ...)")
        memo: dict[tuple[int, ...], Any] = {}  # the ids stay valid: every array is held by self meanwhile

        def take(arr: np.ndarray, *index: np.ndarray) -> np.ndarray:
            key = (id(arr), *map(id, index))
            if key not in memo:
                out = arr[np.ix_(*index)] if len(index) > 1 else arr[index[0]]
                out.flags.writeable = arr.flags.writeable
                memo[key] = out
            return memo[key]

        def pick(items: list, name: str) -> list:
            key = (id(items), id(rows[name]))
            if key not in memo:
                memo[key] = [items[i] for i in rows[name]]
            return memo[key]

        cg = self.cost_graph
        sub = CostGraph(
            nodes=cg.nodes,
            node_cost={n: take(c, rows[n]) for n, c in cg.node_cost.items()},
            edge_cost={(u, v): take(m, rows[u], rows[v]) for (u, v), m in cg.edge_cost.items()},
            node_memory=None if cg.node_memory is None else {n: take(m, rows[n]) for n, m in cg.node_memory.items()},
            node_key=cg.node_key,
        )
        scatter = {
            (u, v): ScatterSaving(*(take(getattr(sav, f.name), rows[u], rows[v]) for f in dataclasses.fields(sav)))
            for (u, v), sav in self.scatter.items()
        }
        return PricedGraph(
            sub,
            self.mesh,
            {n: pick(s, n) for n, s in self.strategies.items()},
            {n: pick(c, n) for n, c in self.node_costs.items()},
            {(u, v): take(b, rows[u], rows[v]) for (u, v), b in self.edge_bytes.items()},
            self.seconds,
            scatter,
        )


def default_workers() -> int:
    """Threads for pricing re-layouts: one per core this process may use, at most two (more gain little: the rest
    of the work holds the GIL)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _frozen(values: list[float]) -> np.ndarray:
    out = np.array(values)
    out.flags.writeable = False
    return out


def node_key(node: OpNode) -> tuple:
    return (node.dims, node.target)


def out_index(consumer: OpNode) -> int:
    """Which output of its producer an edge carries: ``getitem`` picks one, everything else reads output 0."""
    return int(consumer.dims.extra.get("selects", 0))


def tensor_itemsize(node: fx.Node, out: int, opts: CostOptions) -> int:
    """Bytes per element of output ``out`` of ``node``: the plan's dtype for floating-point tensors, the tensor's
    own for integer and boolean ones (token ids, masks), which a dtype choice does not change."""
    dtypes = node.meta.get(META_DTYPES) or ()
    dtype = dtypes[out] if out < len(dtypes) else None
    if dtype is None or dtype.is_floating_point or dtype.is_complex:
        return opts.itemsize
    return torch.empty((), dtype=dtype).element_size()


def shared_parameters(graph: OpGraph) -> list[tuple[str, int, str, int]]:
    """``(u, k_u, v, k_v)`` for every parameter that several nodes read: ``u`` is its first reader (it stores the
    parameter in its own layout, input ``k_u``) and ``v`` a later one (input ``k_v``). Tied embeddings are this."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for name, node in graph.nodes.items():
        for k, fqn in zip(sorted(node.dims.weights), node.params):
            seen = readers.setdefault(fqn, [])
            if not seen or seen[-1][0] != name:  # a node reading it twice stores it once
                seen.append((name, k))
    return [(*found[0], *later) for found in readers.values() for later in found[1:]]


@gc_paused
def price_graph(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    *,
    allow_prime: bool = True,
    fixed: Mapping[str, PartitionSeq | Sequence[PartitionSeq]] | None = None,
    canonical: bool = False,
    replicate_constants: bool = True,
    restrict: Callable[[str, list[PartitionSeq]], list[PartitionSeq]] | None = None,
    progress: bool = False,
    workers: int | None = None,
) -> PricedGraph:
    """Build the :class:`CostGraph`; ``fixed`` pins some nodes to one sequence, or to a list of sequences priced
    side by side (the baselines: every cost is per sequence or per pair of sequences, so the assignments of several
    plans are priced at once and each reads its own entries).

    ``canonical`` searches the canonical subspace of :func:`~primepar_fx.partition.enumerate_sequences` (one order
    of splits per network level), a few times smaller at 16 or more devices but not exact.

    ``replicate_constants`` runs gradient-free constant subgraphs (attention masks, rotary and position tables,
    shifted labels) replicated instead of searching their partitions: their compute is negligible, a replicated
    producer feeds any consumer layout without traffic, and they take no gradient. It keeps these nodes, which
    feed every layer, from entangling the layers in the DP.

    ``restrict(name, seqs)`` narrows the enumerated sequences of each searched node (not the ``fixed`` or
    replicated constant ones) to the ones it returns, e.g. to force P(S x S) wherever it is legal.

    ``progress`` shows a progress bar per pass (nodes, then edges) on stderr.

    ``workers``: threads that price the distinct re-layouts (:func:`~primepar_fx.cost.model.price_directions`);
    by default one per core, at most two. The costs do not depend on it.
    """
    start = time.perf_counter()
    levels = tuple(cluster.group_level(mesh, (p,)) for p in range(len(mesh.digits))) if canonical else None
    strategies: dict[str, list[PartitionSeq]] = {}
    costs: dict[str, list[NodeCost]] = {}
    # value: (entry number, sequences, their costs, their bound partitions)
    node_cache: dict[tuple, tuple[int, list[PartitionSeq], list[NodeCost], list[OpPartition]]] = {}
    partitions: dict[str, list[OpPartition]] = {}
    space: dict[str, int] = {}  # node -> entry number of its node_cache entry, a cheap key for the edge cache
    legal: dict[tuple, list[PartitionSeq]] = {}
    for name, node in tqdm(graph.nodes.items(), desc="pricing nodes", disable=not progress, leave=False):
        if fixed is not None and name in fixed:
            pinned = fixed[name]
            seqs = [pinned] if isinstance(pinned, PartitionSeq) else list(pinned)
        elif replicate_constants and not node.requires_grad:
            seqs = [PartitionSeq(tuple(Replicate() for _ in mesh.digits))]
        else:
            if node_key(node) not in legal:
                legal[node_key(node)] = enumerate_sequences(
                    node.dims, mesh, values=values, allow_prime=allow_prime, levels=levels
                )
            seqs = legal[node_key(node)] if restrict is None else restrict(name, legal[node_key(node)])
        if not seqs:
            raise ValueError(f"node {name} ({node.op}) has no legal partition on device digits {mesh.digits}")
        nk = node_key(node)
        key = (nk, None if seqs is legal.get(nk) else tuple(seqs))  # None: the legal sequences, not hashed again
        if key not in node_cache:
            bound = [bound_partition((node.dims, s, mesh)) for s in seqs]
            priced = [node_cost(p, node.target, cluster, values, opts) for p in bound]
            node_cache[key] = (len(node_cache), seqs, priced, bound)
        space[name], strategies[name], costs[name], partitions[name] = node_cache[key]
    edge_cost, edge_bytes = {}, {}
    edge_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    sides: dict[tuple, tuple] = {}  # (node entry, output) or (node entry, input, None) -> its edge sides
    vkey = values_key(values)
    scatter: dict[tuple[str, str], ScatterSaving] = {}
    scatter_cache: dict[tuple, ScatterSaving | None] = {}

    fusable_cache: dict[tuple, tuple[int, tuple] | None] = {}

    def fusable_all(name: str, node: OpNode, k: int | None) -> tuple[int, tuple] | None:
        """Per strategy of ``name``: its Forward output all-reduce (``k=None``) or input ``k``'s gradient all-reduce
        that may fuse with a re-layout (:mod:`primepar_fx.cost.scatter`), with the number of its cache entry (a
        cheap key); ``None`` when no strategy has one."""
        fx_node = graph.fx_node(name)
        key = (space[name], k, graph_facts(fx_node, k))  # the answer depends on the partitions and these facts only
        if key not in fusable_cache:
            if k is None:
                found = tuple(fusable_forward(p, fx_node) for p in partitions[name])
            else:
                found = tuple(fusable_backward(p, fx_node, k) for p in partitions[name])
            fusable_cache[key] = (len(fusable_cache), found) if any(found) else None
        return fusable_cache[key]

    # pass 1: every data-flow edge with its cache key; each distinct key's layouts and the directions they re-lay
    # out; the edges where an all-reduce may fuse with the re-layout
    flows: list[tuple[str, str, int, int, tuple, tuple | None]] = []
    layouts: dict[tuple, tuple] = {}  # edge key -> (pairs, direction keys)
    directions: dict[tuple, LayoutPairs] = {}
    fusions: dict[tuple, tuple] = {}  # scatter key -> what scatter_saving needs
    for u, v, data in graph.graph.edges(data=True):
        pu, pv = graph.nodes[u], graph.nodes[v]
        k_in, k_out = data["dst_in"], out_index(pv)
        if pv.dims.inputs[k_in] is None or not pu.dims.outputs:
            continue
        item = tensor_itemsize(graph.fx_node(u), k_out, opts)
        key = (space[u], space[v], k_out, k_in, item)
        fwd = fusable_all(u, pu, None) if k_out == 0 else None
        bwd = fusable_all(v, pv, k_in) if pv.requires_grad and pu.requires_grad else None
        skey = None if fwd is None and bwd is None else (key, fwd and fwd[0], bwd and bwd[0])
        flows.append((u, v, k_in, k_out, key, skey))
        if skey is not None and skey not in fusions:
            fusions[skey] = (
                partitions[u],
                k_out,
                partitions[v],
                k_in,
                fwd[1] if fwd else [None] * len(strategies[u]),
                bwd[1] if bwd else [None] * len(strategies[v]),
            )
        if key in layouts:
            continue
        check_edge(partitions[u][0], k_out, partitions[v][0], k_in, vkey)
        if (space[u], k_out) not in sides:  # a node's layouts, shared by its edges
            sides[space[u], k_out] = producer_sides(partitions[u], k_out, vkey)
        if (space[v], k_in, None) not in sides:
            sides[space[v], k_in, None] = consumer_sides(partitions[v], k_in, vkey)
        pairs = pairs_of(sides[space[u], k_out], sides[space[v], k_in, None])
        dkeys = tuple(None if d is None else direction_key(d, mesh, cluster, item) for d in pairs)
        layouts[key] = pairs, dkeys
        directions.update((k, d) for k, d in zip(dkeys, pairs) if k is not None)

    # pass 2: the re-layout directions on the worker threads, the reduce-scatter savings meanwhile on this one
    def savings() -> None:
        for skey, args in fusions.items():
            scatter_cache[skey] = scatter_saving(*args, cluster, values, opts)

    price_directions(
        directions, mesh, cluster, workers=default_workers() if workers is None else workers, alongside=savings
    )
    # pass 3: each edge's matrices
    for u, v, k_in, k_out, key, skey in tqdm(flows, desc="pricing edges", disable=not progress, leave=False):
        if key not in edge_cache:
            pairs, dkeys = layouts[key]
            producers, consumers = partitions[u], partitions[v]
            edge_cache[key] = edge_cost_matrix(
                producers, k_out, consumers, k_in, cluster, values, opts, itemsize=key[-1], pairs=pairs, keys=dkeys
            )
        edge_cost[(u, v)], edge_bytes[(u, v)] = edge_cache[key]
        if skey is not None and scatter_cache[skey] is not None:
            scatter[(u, v)] = scatter_cache[skey]
            edge_cost[(u, v)] = edge_cost[(u, v)] - scatter[(u, v)].forward_s - scatter[(u, v)].backward_s
    for u, k_u, v, k_v in shared_parameters(graph):
        sec, nbytes = edge_cost_matrix(partitions[u], k_u, partitions[v], k_v, cluster, values, opts, shared=True)
        if (u, v) in edge_cost:
            sec, nbytes = sec + edge_cost[(u, v)], nbytes + edge_bytes[(u, v)]
        edge_cost[(u, v)], edge_bytes[(u, v)] = sec, nbytes
    vectors = {  # per node cache entry: (seconds, memory bytes) of every strategy, shared (read-only) by its nodes
        entry: (
            _frozen([c.time_s for c in priced]),
            _frozen([float(c.memory_bytes(opts.optimizer_states)) for c in priced]),
        )
        for entry, _, priced, _ in node_cache.values()
    }
    cg = CostGraph(
        nodes=tuple(graph.nodes),
        node_cost={n: vectors[space[n]][0] for n in costs},
        edge_cost=edge_cost,
        node_memory={n: vectors[space[n]][1] for n in costs},
        node_key={n: node_key(graph.nodes[n]) for n in graph.nodes},
    )
    seconds = time.perf_counter() - start
    log.info(
        "priced %d nodes (%d distinct) and %d edges (%d distinct) in %.2f s",
        len(costs),
        len(node_cache),
        len(edge_cost),
        len(edge_cache),
        seconds,
    )
    return PricedGraph(cg, mesh, strategies, costs, edge_bytes, seconds, scatter)
