"""What pricing a graph gives the search and the summary: :class:`PricedGraph` (the cost graph, every node's
strategies and costs, every edge's bytes, and the savings the runtime's fusions and sharing make), and the records
it keeps per edge (:class:`ShareFlow`, :class:`TiedSaving`, :class:`NotRun`). :mod:`primepar_fx.pricing.price`
builds it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.matmul_overlap import OverlapSaving
from primepar_fx.cost.model import NodeCost
from primepar_fx.cost.scatter import ScatterSaving
from primepar_fx.partition import DeviceMesh, PartitionSeq
from primepar_fx.pricing.deferred import DeferredSaving
from primepar_fx.pricing.sharing import add_share_nodes
from primepar_fx.search import CostGraph, Solution, plan_memory, solve


@dataclass
class PricedGraph:
    """The priced graph (:attr:`cost_graph`: node and edge costs, Eq. 7-9), the search problem
    (:attr:`search_graph`) and what is needed to read its answer back."""

    cost_graph: CostGraph
    mesh: DeviceMesh
    strategies: dict[str, list[PartitionSeq]]
    node_costs: dict[str, list[NodeCost]]
    edge_bytes: dict[tuple[str, str], np.ndarray]
    seconds: float
    #: edges where an all-reduce and the re-layout after it fuse into a reduce-scatter, for some strategy pairs;
    #: ``edge_cost`` already has the seconds saved subtracted (:mod:`primepar_fx.cost.scatter`)
    scatter: dict[tuple[str, str], ScatterSaving] = field(default_factory=dict)
    #: every data-flow edge's own re-layout and its consumer's side of sharing it (:mod:`primepar_fx.cost.share`)
    flows: dict[tuple[str, str], ShareFlow] = field(default_factory=dict)
    #: producer -> its consumers in graph order, where they may share one re-layout (:func:`shared_consumers`)
    fanout: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: tied parameters: (first reader, later reader) -> where the later one's gradient all-reduce is the first's;
    #: ``edge_cost`` already has its seconds subtracted (:func:`shared_parameter_gradients`)
    tied: dict[tuple[str, str], TiedSaving] = field(default_factory=dict)
    #: input-gradient sums that wait for the end of backward (:mod:`primepar_fx.pricing.deferred`); ``edge_cost``
    #: already has their seconds subtracted
    deferred: dict[tuple[str, str], DeferredSaving] = field(default_factory=dict)
    #: recomputed edges whose producer's Forward all-reduce runs again fused into a reduce-scatter
    #: (:mod:`primepar_fx.levers.recompute`): ``edge_cost`` already has the seconds saved subtracted, and the
    #: summary takes the bytes saved off the producer's recomputation
    rescattered: dict[tuple[str, str], ScatterSaving] = field(default_factory=dict)
    #: edges whose re-layouts the runtime overlaps with the linears beside them
    #: (:mod:`primepar_fx.cost.matmul_overlap`); ``edge_cost`` and the flows' seconds already have the seconds hidden
    #: subtracted
    overlap: dict[tuple[str, str], OverlapSaving] = field(default_factory=dict)

    @functools.cached_property
    def search_graph(self) -> CostGraph:
        """What the search solves: :attr:`cost_graph` with a virtual node per tensor whose consumers may share one
        re-layout (:mod:`primepar_fx.pricing.sharing`), so that the objective of a choice is its predicted step
        time. A solution's choice names these nodes too; :func:`~primepar_fx.pricing.summary.summarize` ignores
        them."""
        return add_share_nodes(self.cost_graph, self.flows, self.fanout)

    def fastest(self, method: str = "auto") -> Solution:
        """The fastest plan of :attr:`search_graph`: :func:`~primepar_fx.search.solve` without a budget or a memory
        weight, solved once per ``method`` and kept with this pricing (a grouping's bound and the search that reads
        its pricing ask for the same one; a worker's pricing comes back with it). :meth:`with_memory` keeps it (it does
        not read memory; its memory is read again), :meth:`subset` does not (another space)."""
        memo = self.__dict__.setdefault("_fastest", {})
        if method not in memo:
            memo[method] = solve(self.search_graph, method=method)  # type: ignore[arg-type]
        return memo[method]

    def array_nbytes(self) -> int:
        """The bytes of this pricing's arrays (an array that identical layers share counted once): node vectors,
        edge matrices and the flows' and savings' matrices, i.e. nearly all it holds."""
        seen: dict[int, int] = {}
        cg = self.cost_graph
        tables = (cg.node_cost, cg.node_memory or {}, cg.edge_cost, self.edge_bytes)
        arrays = [a for table in tables for a in table.values()]
        for group in (self.flows, self.scatter, self.tied, self.deferred, self.overlap):
            arrays += [getattr(item, f.name) for item in group.values() for f in dataclasses.fields(item)]
        for a in arrays:
            if isinstance(a, np.ndarray):
                seen.setdefault(id(a), a.nbytes)
        return sum(seen.values())

    def with_memory(self, opts: CostOptions) -> PricedGraph:
        """This pricing with every node's memory read again under ``opts`` (another ZeRO stage: each strategy's
        seconds and bytes stay, :class:`~primepar_fx.cost.blocks.CostOptions`)."""
        vectors: dict[int, np.ndarray] = {}
        memory = {}
        for name in self.cost_graph.node_cost:
            costs = self.node_costs[name]
            if id(costs) not in vectors:
                vectors[id(costs)] = frozen([float(c.memory_bytes(opts)) for c in costs])
            memory[name] = vectors[id(costs)]
        graph = self.cost_graph.derive(node_memory=memory)
        out = dataclasses.replace(self, cost_graph=graph)
        built = self.__dict__.get("search_graph")
        if built is not None and built.node_memory is not None:  # the same but for its memory (virtual nodes: none)
            held = {**built.node_memory, **memory}
            searched = built.derive(node_memory={n: held[n] for n in built.nodes})
            out.__dict__["search_graph"] = searched
            # the fastest plan (no budget, no memory weight) does not read memory: kept, its memory read again
            out.__dict__["_fastest"] = {
                m: dataclasses.replace(sol, memory=plan_memory(searched, sol.choice))
                for m, sol in self.__dict__.get("_fastest", {}).items()
            }
        return out

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
        sub = cg.derive(  # slices of checked arrays
            node_cost={n: take(c, rows[n]) for n, c in cg.node_cost.items()},
            edge_cost={(u, v): take(m, rows[u], rows[v]) for (u, v), m in cg.edge_cost.items()},
            node_memory=None if cg.node_memory is None else {n: take(m, rows[n]) for n, m in cg.node_memory.items()},
            checked=(),
        )

        def savings(of: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
            """Savings whose every field is a matrix over (u's strategies, v's strategies), narrowed."""
            return {
                (u, v): type(s)(*(take(getattr(s, f.name), rows[u], rows[v]) for f in dataclasses.fields(s)))
                for (u, v), s in of.items()
            }

        flows = {
            (u, v): ShareFlow(
                f.k_in,
                take(f.seconds, rows[u], rows[v]),
                take(f.nbytes, rows[u], rows[v]),
                take(f.signature, rows[v]),
                take(f.reduce_s, rows[v]),
                take(f.reduce_bytes, rows[v]),
                take(f.forward_s, rows[u], rows[v]),
                take(f.forward_bytes, rows[u], rows[v]),
            )
            for (u, v), f in self.flows.items()
        }
        tied = {(u, v): t.narrowed(take, rows[u], rows[v]) for (u, v), t in self.tied.items()}
        return PricedGraph(
            sub,
            self.mesh,
            {n: pick(s, n) for n, s in self.strategies.items()},
            {n: pick(c, n) for n, c in self.node_costs.items()},
            {(u, v): take(b, rows[u], rows[v]) for (u, v), b in self.edge_bytes.items()},
            self.seconds,
            savings(self.scatter),
            flows,
            self.fanout,
            tied,
            savings(self.deferred),
            savings(self.rescattered),
            savings(self.overlap),
        )

    def shared_consumers(self, choice: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Producer -> the consumers whose edges and input all-reduces do not run under ``choice`` because every
        consumer of the producer shares the first one's re-layout (:mod:`primepar_fx.cost.share`)."""
        out = {}
        for u, group in self.fanout.items():
            signatures = {int(self.flows[(u, v)].signature[choice[v]]) for v in group}
            if len(signatures) == 1:
                out[u] = group[1:]
        return out

    def not_run(self, choice: Mapping[str, int]) -> list[NotRun]:
        """What :meth:`shared_consumers` leaves out under ``choice``, one :class:`NotRun` per consumer left out."""
        out = []
        for u, vs in self.shared_consumers(choice).items():
            for v in vs:
                f, i, j = self.flows[(u, v)], choice[u], choice[v]
                out.append(
                    NotRun(
                        u, v, float(f.seconds[i, j]), int(f.nbytes[i, j]), float(f.reduce_s[j]), int(f.reduce_bytes[j])
                    )
                )
        for (u, v), t in self.tied.items():
            i, j = choice[u], choice[v]
            if t.shared[i, j]:
                out.append(NotRun(u, v, 0.0, 0, float(t.reduce_s[j]), int(t.reduce_bytes[j]), tied=True))
        return out

    def apart(self, choice: Mapping[str, int]) -> list[tuple[str, str, float, int, int]]:
        """``(node, later reader, seconds, all-gather bytes, all-reduce bytes)``: what readers of a tied parameter
        that do not share add under ``choice`` (:class:`Apart`); the seconds are already on the edge cost."""
        out = []
        for (u, v), t in self.tied.items():
            out += [(node, v, *rest) for node, *rest in t.apart(u, v, choice[u], choice[v])]
        return out


@dataclass(frozen=True, slots=True)
class NotRun:
    """An edge ``u -> v`` whose re-layout (``relayout_s``, ``relayout_bytes`` summed over devices) and whose
    consumer's input-gradient all-reduce (``reduce_s``, ``reduce_bytes`` per device) do not run: ``v`` shares
    another consumer's (:mod:`primepar_fx.cost.share`). ``tied``: ``u`` and ``v`` read one parameter and ``v``'s
    gradient of it is all-reduced with ``u``'s (:class:`TiedSaving`); its seconds are already off the edge cost."""

    u: str
    v: str
    relayout_s: float
    relayout_bytes: int
    reduce_s: float
    reduce_bytes: int
    tied: bool = False


@dataclass(frozen=True)
class TiedSaving:
    """A parameter read by ``u`` first and by ``v`` later (tied embeddings), for the strategy pairs where both
    need it in the layout ``u`` stores it in and all-reduce its gradient over the same digits
    (:func:`~primepar_fx.cost.share.signature` equal): the runtime sums ``v``'s gradient into ``u``'s and
    all-reduces the sum once (:func:`~primepar_fx.passes.share.share_relayouts`). ``shared[i, j]``: whether it does
    for ``u``'s strategy ``i`` and ``v``'s ``j``; per strategy of ``v`` the seconds and bytes (per device) of the
    all-reduce it no longer runs."""

    shared: np.ndarray
    reduce_s: np.ndarray
    reduce_bytes: np.ndarray
    #: where the pair does not share, the parameter keeps a gradient all-reduce per reader in the graph, so no
    #: gradient bucket holds it (:mod:`~primepar_fx.passes.gradsync`): the all-reduces run every micro-batch, not
    #: once a step, and ZeRO (stages 1 and 3) neither shards it nor all-gathers it. Per strategy of ``u`` (``None``
    #: on every pair but its first later reader's) and of ``v``: :class:`Apart`.
    apart_u: Apart | None = None
    apart_v: Apart | None = None

    def apart_s(self) -> np.ndarray:
        """Per strategy pair, the seconds :class:`Apart` adds (zero where the pair shares)."""
        u = self.apart_u.seconds[:, None] if self.apart_u is not None else 0.0
        v = self.apart_v.seconds[None, :] if self.apart_v is not None else 0.0
        return np.where(self.shared, 0.0, u + v)

    def apart(self, u: str, v: str, i: int, j: int) -> list[tuple[str, float, int, int]]:
        """``(node, seconds, all-gather bytes, all-reduce bytes)`` that :class:`Apart` adds to ``u`` and ``v``
        under their strategies ``i`` and ``j``: none where the pair shares."""
        if self.shared[i, j]:
            return []
        out = []
        for node, apart, k in ((u, self.apart_u, i), (v, self.apart_v, j)):
            if apart is not None:
                out.append((node, float(apart.seconds[k]), int(apart.gathered[k]), int(apart.reduced[k])))
        return out

    def narrowed(self, take: Callable[..., np.ndarray], rows_u: np.ndarray, rows_v: np.ndarray) -> TiedSaving:
        """This saving for the strategies ``rows_u`` of ``u`` and ``rows_v`` of ``v`` only (``take(array, *rows)``:
        :meth:`PricedGraph.subset`'s)."""

        def pick(apart: Apart | None, rows: np.ndarray) -> Apart | None:
            return None if apart is None else Apart(*(take(a, rows) for a in dataclasses.astuple(apart)))

        return TiedSaving(
            take(self.shared, rows_u, rows_v),
            take(self.reduce_s, rows_v),
            take(self.reduce_bytes, rows_v),
            pick(self.apart_u, rows_u),
            pick(self.apart_v, rows_v),
        )


@dataclass(frozen=True)
class Apart:
    """What a reader of a tied parameter costs, per strategy, beyond its own price where the readers do not share
    (:class:`TiedSaving`): ``seconds`` (per micro-batch) its gradient all-reduces add, every micro-batch where it
    priced a share of one a step, less its ZeRO all-gathers; the bytes of those all-gathers, which do not run
    (``gathered``, per device), and of the all-reduces' extra runs (``reduced``). Its optimizer state is priced
    sharded still (the search prices memory per node)."""

    seconds: np.ndarray
    gathered: np.ndarray
    reduced: np.ndarray


@dataclass(frozen=True)
class ShareFlow:
    """One data-flow edge as :mod:`primepar_fx.cost.share` needs it: its own re-layout's seconds (net of a
    reduce-scatter saving) and bytes per strategy pair, and per consumer strategy the number of its
    :func:`~primepar_fx.cost.share.signature` (equal numbers: equal signatures, across the edges of one pricing) and
    the seconds and bytes of its input-gradient all-reduces; and the seconds and bytes of the re-layout's Forward
    direction alone (what runs again when its consumer is recomputed, :mod:`primepar_fx.levers.recompute`)."""

    k_in: int
    seconds: np.ndarray
    nbytes: np.ndarray
    signature: np.ndarray
    reduce_s: np.ndarray
    reduce_bytes: np.ndarray
    forward_s: np.ndarray
    forward_bytes: np.ndarray


def frozen(values: Any, dtype: Any = np.float64) -> np.ndarray:
    """A read-only array of ``values`` (a copy): the priced arrays are shared between nodes and must not change."""
    out = np.array(values, dtype=dtype)
    out.flags.writeable = False
    return out
