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
import functools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import sympy
import torch
from torch import fx
from tqdm.auto import tqdm

from primepar_fx.cost.blocks import CostOptions, zero_gather_share
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.matmul_overlap import EdgeSides, OverlapSaving, feeds_linears, linear_into, overlap_saving
from primepar_fx.cost.model import (
    NodeCost,
    direction_key,
    edge_cost_matrix,
    node_cost,
    price_directions,
    weights_read_in_backward,
    zero_gather_price,
)
from primepar_fx.cost.redistribute import LayoutPairs, check_edge, consumer_sides, pairs_of, producer_sides
from primepar_fx.cost.scatter import ScatterSaving, fusable_backward, fusable_forward, graph_facts, scatter_saving
from primepar_fx.cost.share import input_all_reduce_latency, input_all_reduce_price, signature
from primepar_fx.frontend.symbols import META_DTYPES
from primepar_fx.graph import OpGraph, OpNode
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Replicate, enumerate_sequences
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import bound_partition
from primepar_fx.pricing.deferred import deferred_sums
from primepar_fx.pricing.priced import Apart, PricedGraph, ShareFlow, TiedSaving, frozen
from primepar_fx.pricing.zero3 import kept_inputs, kept_whole
from primepar_fx.search import CostGraph
from primepar_fx.utils.gcpause import gc_paused
from primepar_fx.utils.machine import physical_memory, usable_cores
from primepar_fx.utils.malloc import steady_malloc
from primepar_fx.utils.units import format_bytes

log = logging.getLogger(__name__)

#: bytes the pricing holds at its peak per entry of a distinct edge matrix (its seconds and bytes, both directions
#: and Forward alone, the net of a fused reduce-scatter, the consumers' share, and the re-layouts' temporaries, which
#: grow with the world): a little above the most measured, the growth of resident memory during pricing per entry
#: (docs/benchmarks/measured_in_code.md)
BYTES_PER_ENTRY = 150


class SpaceTooLarge(ValueError):
    """The edge matrices of a partition space would not fit this machine's memory (raised before they are priced)."""


def relayout_threads() -> int:
    """Threads for pricing re-layouts: one per core this process may use, at most two (more gain little: the rest
    of the work holds the GIL)."""
    return min(2, usable_cores())


def node_key(node: OpNode) -> tuple:
    """What makes two nodes price alike: their dims and their op, by name (a pricing holding it can be pickled to
    another process, which an ``OpOverload`` cannot)."""
    return node.dims, _op_key(node.target)


@functools.lru_cache(maxsize=1024)
def _op_key(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', repr(target))}"


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

    The steps, each a method of :class:`_Pricing`: bind every node's sequences and price them
    (:meth:`~_Pricing.bind_nodes`), find the data-flow edges and the distinct re-layouts and reduce-scatter fusions
    they need (:meth:`~_Pricing.find_flows`; first, that their matrices fit this machine's memory, else
    :class:`SpaceTooLarge`: :meth:`~_Pricing.check_size`), price those (:meth:`~_Pricing.price_relayouts`), fill
    in each edge's matrices (:meth:`~_Pricing.edge_matrices`, :meth:`~_Pricing.add_shared_parameters`) and assemble the
    :class:`CostGraph` (:meth:`~_Pricing.cost_graph`).
    """
    start = time.perf_counter()
    steady_malloc()  # the first pricing of a process as fast as the next (utils.malloc)
    levels = tuple(cluster.group_level(mesh, (p,)) for p in range(len(mesh.digits))) if canonical else None
    space = _Space(allow_prime, levels, fixed, replicate_constants, restrict)
    pricing = _Pricing(graph, mesh, cluster, values, opts, space)
    pricing.bind_nodes(progress)
    pricing.find_flows(physical_memory())
    pricing.price_relayouts(relayout_threads() if workers is None else workers)
    pricing.edge_matrices(progress)
    pricing.add_shared_parameters()
    flows = [(u, v, k_in, k_out) for u, v, k_in, k_out, _, _ in pricing.flows]
    deferred = deferred_sums(graph, flows, pricing.partitions, cluster, values, opts.itemsize)
    for edge, saving in deferred.items():  # the sum waits for the end of backward (pricing.deferred)
        pricing.edge_cost[edge] = frozen(pricing.edge_cost[edge] - saving.seconds)
    cg = pricing.cost_graph()
    seconds = time.perf_counter() - start
    log.info(
        "priced %d nodes (%d distinct) and %d edges (%d distinct) in %.2f s",
        len(pricing.costs),
        len(pricing.node_cache),
        len(pricing.edge_cost),
        len(pricing.edge_cache),
        seconds,
    )
    return PricedGraph(
        cg,
        mesh,
        pricing.strategies,
        pricing.costs,
        pricing.edge_bytes,
        seconds,
        pricing.scatter,
        pricing.share_flows,
        pricing.fanout(),
        pricing.tied,
        deferred,
        overlap=pricing.overlap,
    )


def _summed(a: ScatterSaving, b: ScatterSaving) -> ScatterSaving:
    """Two savings of one pair of nodes, e.g. a data-flow edge's and a shared parameter's."""
    return ScatterSaving(*(frozen(getattr(a, f.name) + getattr(b, f.name)) for f in dataclasses.fields(ScatterSaving)))


@dataclass(frozen=True)
class _Space:
    """Which sequences each node is priced on: the options of :func:`price_graph` that say so."""

    allow_prime: bool
    levels: tuple | None  # the network level of each device digit, for the canonical subspace; None: the full one
    fixed: Mapping[str, PartitionSeq | Sequence[PartitionSeq]] | None
    replicate_constants: bool
    restrict: Callable[[str, list[PartitionSeq]], list[PartitionSeq]] | None


#: a node cache entry: (its number, the sequences, their costs, their bound partitions)
_NodeEntry = tuple[int, list[PartitionSeq], list[NodeCost], list[OpPartition]]
#: a data-flow edge: (producer, consumer, input index, output index, edge cache key, scatter key or None)
_Flow = tuple[str, str, int, int, tuple, tuple | None]


@dataclass(eq=False)
class _Pricing:
    """One :func:`price_graph` call: its inputs and the tables its steps fill, in the order they run.

    Identical layers produce identical work, so most tables are memos keyed by structure rather than by node: a
    node's key and sequences, an edge's two node cache entries and tensor, a direction's layouts.
    """

    graph: OpGraph
    mesh: DeviceMesh
    cluster: ClusterSpec
    values: dict[sympy.Symbol, int]
    opts: CostOptions
    space: _Space
    # bind_nodes: per node its sequences, their costs and bound partitions, and the number of its node cache entry
    strategies: dict[str, list[PartitionSeq]] = field(default_factory=dict)
    costs: dict[str, list[NodeCost]] = field(default_factory=dict)
    partitions: dict[str, list[OpPartition]] = field(default_factory=dict)
    entry: dict[str, int] = field(default_factory=dict)  # node -> its node cache entry number, a cheap edge key
    node_cache: dict[tuple, _NodeEntry] = field(default_factory=dict)
    legal: dict[tuple, list[PartitionSeq]] = field(default_factory=dict)  # node key -> its enumerated sequences
    # find_flows: every data-flow edge, each distinct edge key's layouts and the directions they re-lay out, and
    # the edges where an all-reduce may fuse with the re-layout
    flows: list[_Flow] = field(default_factory=list)
    layouts: dict[tuple, tuple] = field(default_factory=dict)  # edge key -> (pairs, direction keys)
    directions: dict[tuple, LayoutPairs] = field(default_factory=dict)
    fusions: dict[tuple, tuple] = field(default_factory=dict)  # scatter key -> what scatter_saving needs
    sides: dict[tuple, tuple] = field(default_factory=dict)  # (entry, output) or (entry, input, None) -> its sides
    fusable_cache: dict[tuple, tuple[int, tuple] | None] = field(default_factory=dict)
    # price_relayouts: each scatter key's saving (None: no pair of strategies fuses)
    scatter_cache: dict[tuple, ScatterSaving | None] = field(default_factory=dict)
    # edge_matrices and add_shared_parameters: the result per edge, and its memo per edge key
    edge_cost: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    edge_bytes: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    edge_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    forward_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # Forward alone
    net_cache: dict[tuple, np.ndarray] = field(default_factory=dict)  # scatter key -> edge seconds net of saving
    scatter: dict[tuple[str, str], ScatterSaving] = field(default_factory=dict)
    share_flows: dict[tuple[str, str], ShareFlow] = field(default_factory=dict)
    signatures: dict[Hashable, int] = field(default_factory=dict)  # a consumer signature -> its number
    consumer_share: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    tied: dict[tuple[str, str], TiedSaving] = field(default_factory=dict)  # add_shared_parameters
    latency: dict[tuple, np.ndarray] = field(default_factory=dict)  # (node cache entry, input) -> _latency
    # edge_matrices: the re-layouts overlapped with linears (cost.matmul_overlap), per edge and memoized per edge key
    overlap: dict[tuple[str, str], OverlapSaving] = field(default_factory=dict)
    overlap_cache: dict[tuple, tuple[OverlapSaving, np.ndarray] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vkey = values_key(self.values)
        #: ZeRO-3's parameters kept whole from Forward to Backward (gathered once a micro-batch)
        self.kept = kept_whole(self.graph) if self.opts.zero == 3 else frozenset()

    # ---------------------------------------------------------------------------------------------- the nodes
    def bind_nodes(self, progress: bool) -> None:
        """Step 1: each node's sequences, bound to its dims on the mesh and priced (Eq. 7), once per distinct key."""
        nodes = tqdm(self.graph.nodes.items(), desc="pricing nodes", disable=not progress, leave=False)
        for name, node in nodes:
            self._bind(name, node, self._sequences(name, node))

    def _sequences(self, name: str, node: OpNode) -> list[PartitionSeq]:
        """The sequences ``name`` is priced on: its pinned ones, replicated for a constant, else its legal ones
        (narrowed by ``restrict``)."""
        space = self.space
        if space.fixed is not None and name in space.fixed:
            pinned = space.fixed[name]
            seqs = [pinned] if isinstance(pinned, PartitionSeq) else list(pinned)
        elif space.replicate_constants and not node.requires_grad:
            seqs = [PartitionSeq(tuple(Replicate() for _ in self.mesh.digits))]
        else:
            if node_key(node) not in self.legal:
                self.legal[node_key(node)] = enumerate_sequences(
                    node.dims, self.mesh, values=self.values, allow_prime=space.allow_prime, levels=space.levels
                )
            legal = self.legal[node_key(node)]
            seqs = legal if space.restrict is None else space.restrict(name, legal)
        if not seqs:
            raise ValueError(f"node {name} ({node.op}) has no legal partition on device digits {self.mesh.digits}")
        return seqs

    def _bind(self, name: str, node: OpNode, seqs: list[PartitionSeq]) -> None:
        nk = node_key(node)
        kept = self._kept_of(name)
        key = (nk, None if seqs is self.legal.get(nk) else tuple(seqs), kept)  # None: the legal sequences
        if key not in self.node_cache:
            bound = [bound_partition((node.dims, s, self.mesh)) for s in seqs]
            priced = [node_cost(p, node.target, self.cluster, self.values, self.opts, kept) for p in bound]
            self.node_cache[key] = (len(self.node_cache), seqs, priced, bound)
        self.entry[name], self.strategies[name], self.costs[name], self.partitions[name] = self.node_cache[key]

    # ---------------------------------------------------------------------------------------------- the edges
    def find_flows(self, memory: int | None = None) -> None:
        """Step 2: every data-flow edge with its cache key (and the edges where an all-reduce may fuse with the
        re-layout); once :meth:`check_size` has passed them against ``memory``, each distinct key's layouts and
        the directions they re-lay out."""
        for u, v, data in self.graph.graph.edges(data=True):
            pu, pv = self.graph.nodes[u], self.graph.nodes[v]
            k_in, k_out = data["dst_in"], out_index(pv)
            if pv.dims.inputs[k_in] is None or not pu.dims.outputs:
                continue
            item = tensor_itemsize(self.graph.fx_node(u), k_out, self.opts)
            self._add_flow(u, v, k_in, k_out, (self.entry[u], self.entry[v], k_out, k_in, item))
        self.check_size(memory)
        for u, v, k_in, k_out, key, _ in self.flows:
            if key not in self.layouts:
                self._add_layouts(u, v, k_in, k_out, key)

    def check_size(self, memory: int | None) -> None:
        """Before any edge is laid out or priced: that the distinct edge matrices fit in ``memory`` bytes, else one
        clear error (the full 32-device mesh of llama2-70b would need ~48 GiB; docs/benchmarks/search_time.md)."""
        sizes: dict[tuple, int] = {}
        for u, v, _, _, key, _ in self.flows:
            sizes.setdefault(key, len(self.strategies[u]) * len(self.strategies[v]))
        need = sum(sizes.values()) * BYTES_PER_ENTRY
        if memory is not None and need > memory:
            widest = max(self.strategies, key=lambda n: len(self.strategies[n]))
            raise SpaceTooLarge(
                f"the partition space on device digits {self.mesh.digits} is too large to price here: its "
                f"{len(sizes)} distinct edge matrices have {sum(sizes.values()):,} entries (about "
                f"{format_bytes(need)}; node {widest} alone has {len(self.strategies[widest])} strategies), more "
                f"than this machine's {format_bytes(memory)}. Search the groupings of the digits (the default past "
                f"3 digits), fewer digits, or the canonical subspace"
            )

    def _add_flow(self, u: str, v: str, k_in: int, k_out: int, key: tuple) -> None:
        """Record edge ``u -> v`` and, when an all-reduce at either end may fuse with its re-layout, what pricing
        the fusion needs (once per scatter key)."""
        pu, pv = self.graph.nodes[u], self.graph.nodes[v]
        fwd = self._fusable_all(u, None) if k_out == 0 else None
        bwd = self._fusable_all(v, k_in) if pv.requires_grad and pu.requires_grad else None
        skey = None if fwd is None and bwd is None else (key, fwd and fwd[0], bwd and bwd[0])
        self.flows.append((u, v, k_in, k_out, key, skey))
        if skey is not None and skey not in self.fusions:
            self.fusions[skey] = (
                self.partitions[u],
                k_out,
                self.partitions[v],
                k_in,
                fwd[1] if fwd else [None] * len(self.strategies[u]),
                bwd[1] if bwd else [None] * len(self.strategies[v]),
            )

    def _fusable_all(self, name: str, k: int | None) -> tuple[int, tuple] | None:
        """Per strategy of ``name``: its Forward output all-reduce (``k=None``) or input ``k``'s gradient all-reduce
        that may fuse with a re-layout (:mod:`primepar_fx.cost.scatter`), with the number of its cache entry (a
        cheap key); ``None`` when no strategy has one."""
        fx_node = self.graph.fx_node(name)
        key = (self.entry[name], k, graph_facts(fx_node, k))  # the answer depends on the partitions and these only
        if key not in self.fusable_cache:
            if k is None:
                found = tuple(fusable_forward(p, fx_node) for p in self.partitions[name])
            else:
                found = tuple(fusable_backward(p, fx_node, k) for p in self.partitions[name])
            self.fusable_cache[key] = (len(self.fusable_cache), found) if any(found) else None
        return self.fusable_cache[key]

    def _add_layouts(self, u: str, v: str, k_in: int, k_out: int, key: tuple) -> None:
        """The layout pairs of a new edge key and the keys of the directions they re-lay out (found, not priced)."""
        eu, ev, vkey = self.entry[u], self.entry[v], self.vkey
        check_edge(self.partitions[u][0], k_out, self.partitions[v][0], k_in, vkey)
        if (eu, k_out) not in self.sides:  # a node's layouts, shared by its edges
            self.sides[eu, k_out] = producer_sides(self.partitions[u], k_out, vkey)
        if (ev, k_in, None) not in self.sides:
            self.sides[ev, k_in, None] = consumer_sides(self.partitions[v], k_in, vkey)
        pairs = pairs_of(self.sides[eu, k_out], self.sides[ev, k_in, None])
        dkeys = tuple(None if d is None else direction_key(d, self.mesh, self.cluster, key[-1]) for d in pairs)
        self.layouts[key] = pairs, dkeys
        self.directions.update((k, d) for k, d in zip(dkeys, pairs) if k is not None)

    def price_relayouts(self, workers: int) -> None:
        """Step 3: the distinct re-layout directions on up to ``workers`` threads, the reduce-scatter savings
        meanwhile on this one.

        The worker threads write only the shared direction table (:func:`~primepar_fx.cost.model.price_directions`
        says what else they share); :meth:`_savings` writes only ``scatter_cache`` and numbers no new index set,
        since every layout it reads was found in :meth:`find_flows`, which must have run to its end first.
        """
        price_directions(self.directions, self.mesh, self.cluster, workers=workers, alongside=self._savings)

    def _savings(self) -> None:
        for skey, args in self.fusions.items():
            self.scatter_cache[skey] = scatter_saving(*args, self.cluster, self.values, self.opts)

    def edge_matrices(self, progress: bool) -> None:
        """Step 4: each edge's (seconds, bytes) matrices (Eq. 8-9) from the priced directions, once per edge key;
        the seconds net of the reduce-scatter saving where an all-reduce fuses with the re-layout."""
        flows = tqdm(self.flows, desc="pricing edges", disable=not progress, leave=False)
        for u, v, k_in, k_out, key, skey in flows:
            if key not in self.edge_cache:  # both directions, and the Forward one alone (for recomputation)
                pairs, dkeys = self.layouts[key]
                for cache, both in ((self.edge_cache, True), (self.forward_cache, False)):
                    cache[key] = edge_cost_matrix(
                        self.partitions[u],
                        k_out,
                        self.partitions[v],
                        k_in,
                        self.cluster,
                        self.values,
                        self.opts,
                        itemsize=key[-1],
                        pairs=pairs if both else (pairs[0], None),
                        keys=dkeys if both else (dkeys[0], None),
                    )
            self.edge_cost[(u, v)], self.edge_bytes[(u, v)] = self.edge_cache[key]
            if skey is not None and self.scatter_cache[skey] is not None:
                saving = self.scatter[(u, v)] = self.scatter_cache[skey]
                if skey not in self.net_cache:  # one array per scatter key, shared like the edge cache's
                    self.net_cache[skey] = frozen(self.edge_cost[(u, v)] - saving.forward_s - saving.backward_s)
                self.edge_cost[(u, v)] = self.net_cache[skey]
            self._overlap(u, v, k_in, k_out, key, skey)
            self.share_flows[(u, v)] = ShareFlow(
                k_in,
                self.edge_cost[(u, v)],
                self.edge_bytes[(u, v)],
                *self._consumer_share(v, k_in, key[-1]),
                *self.forward_cache[key],
            )

    def _overlap(self, u: str, v: str, k_in: int, k_out: int, key: tuple, skey: tuple | None) -> None:
        """The edge's seconds net of what overlapping its re-layouts with the linears beside them hides
        (:mod:`primepar_fx.cost.matmul_overlap`), before the share flows read them; once per edge key and graph
        facts."""
        graph = self.graph

        def readers(name: str) -> list:
            return [(graph.nodes[w].target, graph.input_names(w)) for w in graph.graph.successors(name)]

        gather = k_in == 0 and feeds_linears(u, readers(u))
        scatter = skey is not None and linear_into(u, graph.nodes[u].target, readers(u))
        memo = (key, skey, gather, scatter)
        if memo not in self.overlap_cache:
            self.overlap_cache[memo] = self._overlap_saving(u, v, k_in, k_out, key, skey, gather, scatter)
        found = self.overlap_cache[memo]
        if found is not None:
            self.overlap[(u, v)], self.edge_cost[(u, v)] = found

    def _overlap_saving(
        self, u: str, v: str, k_in: int, k_out: int, key: tuple, skey: tuple | None, gather: bool, scatter: bool
    ) -> tuple[OverlapSaving, np.ndarray] | None:
        if not (gather or scatter):
            return None
        mesh, nodes = self.mesh, self.graph.nodes
        sides = EdgeSides(
            self.partitions[u], self.costs[u], nodes[u].target, k_out,
            self.partitions[v], self.costs[v], nodes[v].target, k_in, gather, scatter,
        )  # fmt: skip
        both, fwd = self.edge_cache[key], self.forward_cache[key]
        fused = self.scatter_cache[skey] if skey is not None else None
        nothing = ([None] * len(sides.producers), [None] * len(sides.consumers))
        fusables = self.fusions[skey][4:] if skey is not None else nothing
        groups = tuple(
            np.array([1 if f is None else self.cluster.group_size(mesh, f.collective.digits) for f in side], float)
            for side in fusables
        )
        backward = (both[0] - fwd[0], both[1] - fwd[1])
        share = self.cluster.matmul_overlap
        saving = overlap_saving(sides, fwd, backward, fused, groups, self.vkey, key[-1], share)  # type: ignore[arg-type]
        return None if saving is None else (saving, frozen(self.edge_cost[(u, v)] - saving.seconds))

    def _consumer_share(self, v: str, k_in: int, item: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per strategy of ``v``: the number of its :func:`~primepar_fx.cost.share.signature` on input ``k_in``,
        and the seconds and bytes of that input's gradient all-reduces (once per node cache entry)."""
        key = (self.entry[v], k_in, item)
        if key not in self.consumer_share:
            target = self.graph.nodes[v].target
            numbers, seconds, nbytes = [], [], []
            for part in self.partitions[v]:
                sig = signature(part, target, k_in, self.vkey)
                numbers.append(self.signatures.setdefault(sig, len(self.signatures)))
                s, b = input_all_reduce_price(
                    part, target, k_in, self.cluster, self.vkey, self.opts.itemsize, self.opts.micro_batches
                )
                seconds.append(s)
                nbytes.append(b)
            self.consumer_share[key] = (
                frozen(numbers, np.int64),
                frozen(seconds),
                frozen(nbytes, np.int64),
            )
        return self.consumer_share[key]

    def fanout(self) -> dict[str, tuple[str, ...]]:
        """Producer -> its consumers in graph order, where at least two consumers read one output of it once each
        (the tensors :mod:`primepar_fx.cost.share` may re-lay out once for all of them)."""
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        groups: dict[tuple[str, int], list[str]] = {}
        for u, v, _, k_out, _, _ in self.flows:
            groups.setdefault((u, k_out), []).append(v)
        out: dict[str, tuple[str, ...]] = {}
        for (u, _), vs in groups.items():
            if len(self.graph.nodes[u].dims.outputs) > 1:
                continue  # only getitems read a multi-output node, one output each
            if len(vs) < 2 or any(self.graph.input_names(v).count(u) > 1 for v in vs):
                continue
            out[u] = tuple(sorted(vs, key=position.__getitem__))
        return out

    def add_shared_parameters(self) -> None:
        """Step 5: a parameter several nodes read is stored in its first reader's layout; each later reader pays
        for re-laying it out, added to the edge between the two (made if there is none). Where the later reader
        sums its gradient into the first's all-reduce (:class:`TiedSaving`), the edge is that all-reduce's seconds
        cheaper; where it does not, both readers' gradient all-reduces stay in the graph (the runtime buckets a
        parameter's gradient only when it has one all-reduce) and the edge adds the latency their bucketed price
        left out (with three or more readers that do not share, the first reader's is counted once per pair)."""
        stored: set[tuple[str, int]] = set()  # (first reader, input) whose Apart one pair carries
        for u, k_u, v, k_v in shared_parameters(self.graph):
            sec, nbytes = edge_cost_matrix(
                self.partitions[u], k_u, self.partitions[v], k_v, self.cluster, self.values, self.opts, shared=True
            )
            saving = self._tied_saving(u, k_u, v, k_v, first=(u, k_u) not in stored)
            stored.add((u, k_u))
            # unless v sums into u's all-reduce, both stay in the graph: each pays its latency, not a bucket's
            latency = self._latency(u, k_u)[:, None] + self._latency(v, k_v)[None, :]
            if saving is not None:
                self.tied[(u, v)] = saving
                sec = sec - np.where(saving.shared, saving.reduce_s[None, :], -latency) + saving.apart_s()
            elif latency.any():
                sec = sec + latency
            fix = self._kept_block(u, k_u, v, k_v)
            if fix is not None:  # (only where the pair shares: else nothing is gathered, TiedSaving.apart_u)
                shares = saving.shared if saving is not None else False
                sec, nbytes = sec + np.where(shares, fix[0], 0.0), nbytes + np.where(shares, fix[1], 0)
            found = self._tied_scatter(u, k_u, v, k_v, saving)
            if found is not None:
                fused, net = found
                sec = sec - net
                known = self.scatter.get((u, v))  # (a data-flow edge between the two as well: both savings)
                self.scatter[(u, v)] = fused if known is None else _summed(known, fused)
            if (u, v) in self.edge_cost:
                sec, nbytes = sec + self.edge_cost[(u, v)], nbytes + self.edge_bytes[(u, v)]
            self.edge_cost[(u, v)], self.edge_bytes[(u, v)] = sec, nbytes

    def _tied_scatter(
        self, u: str, k_u: int, v: str, k_v: int, tied: TiedSaving | None
    ) -> tuple[ScatterSaving, np.ndarray] | None:
        """Where ``v`` keeps its own all-reduce of the shared parameter's gradient (not summed into ``u``'s), the
        runtime fuses it with the re-layout back to ``u``'s storage layout into a reduce-scatter when that
        re-layout only slices (:func:`~primepar_fx.passes.collectives.fuse_reduce_scatters`). Returns the saving
        per pair as the summary reports it, and the seconds off the edge; None when no pair fuses.

        The all-reduce is a parameter's: priced at its share of a micro-batch, bucketed on ``v``, its own message's
        latency and its other runs (every micro-batch, :class:`Apart`) on this edge
        (:meth:`add_shared_parameters`). The fused pairs lose both: the edge the whole difference of the lone
        all-reduce and the reduce-scatter, the node's collective seconds that less the latency, which was never the
        node's."""
        fusable = self._fusable_all(v, k_v)
        if fusable is None:
            return None
        saving = scatter_saving(
            self.partitions[u],
            k_u,
            self.partitions[v],
            k_v,
            [None] * len(self.partitions[u]),
            fusable[1],
            self.cluster,
            self.values,
            self.opts,
            shared=True,
        )
        if saving is None:
            return None
        keep = 1.0 if tied is None else ~tied.shared  # summed into u's all-reduce: v has none of its own
        # (a shared parameter's edge has no Forward all-reduce: backward fields only.) In the graph, the fused pair
        # runs every micro-batch, as the lone all-reduce did (TiedSaving.apart_v prices that): no share of one
        scattered = np.round(saving.backward_scattered * keep)
        if not scattered.any():
            return None
        net = frozen(saving.backward_s * keep)
        latency = np.where(scattered > 0, self._latency(v, k_v)[None, :], 0.0)
        fused = dataclasses.replace(
            saving,
            backward_s=frozen(net - latency),
            backward_bytes=frozen(np.round(saving.backward_bytes * keep)),
            backward_scattered=frozen(scattered),
        )
        return fused, net

    def _tied_saving(self, u: str, k_u: int, v: str, k_v: int, first: bool) -> TiedSaving | None:
        """Where ``v``'s all-reduce of the gradient of the parameter it shares with ``u`` is ``u``'s, and what
        each reader costs where it is not (:class:`TiedSaving`, :class:`Apart`); None when there is neither. Never
        shared when any reader reads the parameter twice (the runtime then keeps every reader's own chain,
        :func:`~primepar_fx.passes.share.share_relayouts`). ``first``: ``v`` is the parameter's first
        later reader, whose pair carries ``u``'s :class:`Apart` (with three readers or more, exact where the later
        readers share alike, as the copies of one layer do)."""
        fqn = self.graph.nodes[u].params[sorted(self.graph.nodes[u].dims.weights).index(k_u)]
        item = self.opts.itemsize
        sig_u = self._consumer_share(u, k_u, item)[0]
        sig_v, reduce_s, reduce_bytes = self._consumer_share(v, k_v, item)
        shared = (sig_u[:, None] == sig_v[None, :]) & (reduce_bytes > 0)[None, :]
        if any(node.params.count(fqn) > 1 for node in self.graph.nodes.values()):
            shared[:] = False
        shared.flags.writeable = False
        apart_u = self._apart(u, k_u) if first else None
        apart_v = self._apart(v, k_v)
        if not shared.any():
            if apart_u is None and apart_v is None:
                return None
            return TiedSaving(shared, frozen(np.zeros(len(sig_v))), frozen(np.zeros(len(sig_v)), np.int64),
                              apart_u, apart_v)  # fmt: skip
        if self.opts.zero in (1, 3):  # nor its extra all-gathers (ZeRO stage 1: after the step; 3: before use)
            # (stage 3 gathers the one parameter before Backward if either reads it: v keeps that one if u does not)
            nu, nv = self.graph.nodes[u], self.graph.nodes[v]
            read_u = k_u in weights_read_in_backward(nu.dims, nu.target) and k_u not in self._kept_of(u)
            read_v = k_v in weights_read_in_backward(nv.dims, nv.target) and k_v not in self._kept_of(v)
            share = zero_gather_share(self.opts, read_u and read_v)
            gathers = [zero_gather_price(part, k_v, self.cluster, self.vkey, item) for part in self.partitions[v]]
            # no more seconds than v's cost has for them: stage 3 hides some behind v's compute
            paid = [dict(c.zero_gather_s).get(k_v, 0.0) for c in self.costs[v]]
            gathers = [(min(s * share, p), int(round(b * share))) for (s, b), p in zip(gathers, paid)]
            reduce_s = frozen(reduce_s + np.array([g[0] for g in gathers]))
            reduce_bytes = frozen(reduce_bytes + np.array([g[1] for g in gathers], np.int64), np.int64)
        return TiedSaving(shared, reduce_s, reduce_bytes, apart_u, apart_v)

    def _apart(self, name: str, k: int) -> Apart | None:
        """:class:`Apart` of reader ``name`` of a tied parameter (its weight input ``k``): with micro-batches, its
        gradient all-reduces every micro-batch beyond the share of one its cost has; with ZeRO stages 1 and 3, less
        the all-gathers its cost has (:attr:`~primepar_fx.cost.model.NodeCost.zero_gather_s`). ``None`` where that
        is nothing."""
        m, item = self.opts.micro_batches, self.opts.itemsize
        seconds, gathered, reduced = np.zeros(len(self.costs[name])), np.zeros(len(self.costs[name]), np.int64), None
        if m > 1:
            once = self._consumer_share(name, k, item)  # a share of one all-reduce a step
            every = [input_all_reduce_price(part, self.graph.nodes[name].target, k, self.cluster, self.vkey, item)
                     for part in self.partitions[name]]  # fmt: skip
            reduced = np.array([b for _, b in every], np.int64) - once[2]
            seconds += np.array([s for s, _ in every]) - once[1]
        if self.opts.zero in (1, 3):
            seconds -= [dict(c.zero_gather_s).get(k, 0.0) for c in self.costs[name]]
            gathered += [dict(c.zero_gather_bytes).get(k, 0) for c in self.costs[name]]
        reduced = np.zeros(len(seconds), np.int64) if reduced is None else reduced
        if not (seconds.any() or gathered.any() or reduced.any()):
            return None
        return Apart(frozen(seconds), frozen(gathered, np.int64), frozen(reduced, np.int64))

    def _kept_block(self, u: str, k_u: int, v: str, k_v: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A parameter ZeRO-3 keeps whole that ``v`` reads in Backward, first read by ``u``: ``v``'s cost has one
        gather of its own block off (:func:`~primepar_fx.cost.model.node_cost`'s ``kept``), but the gather the
        runtime saves is of the block it stores, ``u``'s. Per pair of strategies, the seconds and bytes that correct
        the one to the other (zero where both read the same block); ``None`` where there is nothing to correct."""
        nv = self.graph.nodes[v]
        if k_v not in self._kept_of(v) or k_v not in weights_read_in_backward(nv.dims, nv.target):
            return None
        item = self.opts.itemsize
        gu = [zero_gather_price(part, k_u, self.cluster, self.vkey, item) for part in self.partitions[u]]
        gv = [zero_gather_price(part, k_v, self.cluster, self.vkey, item) for part in self.partitions[v]]
        seconds = np.array([g[0] for g in gv])[None, :] - np.array([g[0] for g in gu])[:, None]
        nbytes = np.array([g[1] for g in gv], np.int64)[None, :] - np.array([g[1] for g in gu], np.int64)[:, None]
        return seconds, nbytes

    def _kept_of(self, name: str) -> tuple[int, ...]:
        return kept_inputs(self.graph, name, self.kept) if self.kept else ()

    def _latency(self, v: str, k_in: int) -> np.ndarray:
        """Per strategy of ``v``: :func:`~primepar_fx.cost.share.input_all_reduce_latency` of input ``k_in``."""
        key = (self.entry[v], k_in)
        if key not in self.latency:
            target = self.graph.nodes[v].target
            self.latency[key] = frozen(
                [
                    input_all_reduce_latency(part, target, k_in, self.cluster, self.vkey, self.opts.itemsize)
                    for part in self.partitions[v]
                ]
            )
        return self.latency[key]

    def cost_graph(self) -> CostGraph:
        """Step 6: the search's :class:`CostGraph`; the nodes of one cache entry share their (read-only) vectors."""
        vectors = {  # per node cache entry: (seconds, memory bytes) of every strategy
            entry: (
                frozen([c.time_s for c in priced]),
                frozen([float(c.memory_bytes(self.opts)) for c in priced]),
            )
            for entry, _, priced, _ in self.node_cache.values()
        }
        return CostGraph(
            nodes=tuple(self.graph.nodes),
            node_cost={n: vectors[self.entry[n]][0] for n in self.costs},
            edge_cost=self.edge_cost,
            node_memory={n: vectors[self.entry[n]][1] for n in self.costs},
            node_key={n: node_key(self.graph.nodes[n]) for n in self.graph.nodes},
        )
