"""The search problem: one partition strategy per operator, minimising node plus edge costs (paper Eq. 10).

A :class:`CostGraph` holds, for every operator ``i`` in topological order, a cost vector ``n_i(p)`` over its
``P_i`` strategies (the intra-operator cost, Eq. 7) and, for every data-flow edge ``u -> v``, a ``P_u x P_v``
matrix ``e_uv(p, q)`` (the inter-operator cost, Eq. 8-9). Optionally it holds the memory ``m_i(p)`` one device
needs for operator ``i`` under strategy ``p`` (additive over operators).

Objective, for a choice ``p = (p_i)``::

    C(p) = sum_i n_i(p_i) + sum_(u,v) e_uv(p_u, p_v) + alpha * M(p),        M(p) = sum_i m_i(p_i)

subject, when a budget ``B`` is given, to ``M(p) <= B``. ``+inf`` marks a forbidden strategy or pair.

This module holds the data (:class:`CostGraph`, :class:`Solution`), the errors, :func:`evaluate` and
:func:`plan_memory` (the exact objective and memory of a choice, used to re-check every solver's answer) and
:func:`reduce_graph`, which drops forbidden strategies before either solver runs.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np


class SearchError(RuntimeError):
    """Base class of the search's errors."""


class InfeasibleGraph(SearchError):
    """Every choice of strategies has infinite cost (forbidden strategies or pairs leave nothing)."""


class CutOff(SearchError):
    """No plan within the budget is cheaper than the caller's ``cutoff`` (a plan it already has): the search
    stopped without one. ``bound``: the lower bound it proved (at least ``cutoff``), where it has one."""

    def __init__(self, cutoff: float, bound: float | None = None) -> None:
        self.cutoff, self.bound = cutoff, bound
        super().__init__(f"no plan within the budget is cheaper than the cutoff {cutoff:.6g}")


class InfeasibleBudget(SearchError):
    """No plan fits the memory budget; ``min_memory`` is the smallest memory any finite-cost plan needs.

    ``floor``: set when no plan was searched because a lower bound already exceeds the budget (the training state
    split over every device, say); ``min_memory`` is then that bound, and ``floor`` says what it counts."""

    def __init__(self, budget: float, min_memory: float, floor: str | None = None) -> None:
        self.budget = budget
        self.min_memory = min_memory
        self.floor = floor
        need = math.ceil(min_memory) if math.isfinite(min_memory) else min_memory
        what = (
            f"at least {need:,} bytes ({min_memory / 2**20:.3f} MiB) per device are needed for {floor}"
            if floor
            else f"the smallest achievable memory per device is {need:,} bytes ({min_memory / 2**20:.3f} MiB)"
        )
        super().__init__(
            f"memory budget {budget:,.0f} bytes ({budget / 2**20:.3f} MiB) is infeasible: {what}; raise the budget "
            "to at least that, or allow more devices"
        )


class TableTooLarge(SearchError):
    """The dynamic program would need a table larger than its limit (use method='ilp' or 'auto').

    ``nodes``: the nodes of that table (the one eliminated first), where the DP named them; ``entries``: its size,
    the smallest table the elimination could go on with (0 where unknown)."""

    def __init__(self, message: str, nodes: tuple[str, ...] = (), entries: int = 0) -> None:
        super().__init__(message)
        self.nodes = nodes
        self.entries = entries


def _float64(value: object) -> np.ndarray:
    """``value`` as a float64 array: itself when it is one. ``np.asarray(dtype=float64)`` returns a new view of an
    array whose dtype is equal but not numpy's own instance (as after unpickling), and the search and the share
    nodes tell shared arrays apart by identity."""
    if isinstance(value, np.ndarray) and value.dtype == np.float64:
        return value
    return np.asarray(value, dtype=np.float64)


def _as_vector(name: str, what: str, value: object) -> np.ndarray:
    arr = _float64(value)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} of node {name!r} must be a non-empty 1-D array, got shape {arr.shape}")
    return arr


def _check_values(arr: np.ndarray, what: str, *, allow_inf: bool) -> None:
    low = arr.min()  # one pass: NaN propagates through min
    if np.isnan(low):
        raise ValueError(f"{what} contains NaN")
    if low == -np.inf:
        raise ValueError(f"{what} contains -inf (only +inf, meaning forbidden, is allowed)")
    if not allow_inf and arr.max() == np.inf:
        raise ValueError(f"{what} contains +inf; memory must be finite")


class _Same:
    """The type of :data:`SAME`."""

    def __repr__(self) -> str:
        return "SAME"


#: :meth:`CostGraph.derive`'s default for a field that may be ``None``: the graph's own value
SAME = _Same()


@dataclass(frozen=True)
class CostGraph:
    """Operators in topological order with their strategy costs; see the module docstring for the objective.

    ``node_key`` is a structural signature used to find repeated layers: nodes with equal keys are expected to
    have equal cost vectors (the search still compares the arrays before it shares any work).
    """

    nodes: tuple[str, ...]
    node_cost: Mapping[str, np.ndarray]
    edge_cost: Mapping[tuple[str, str], np.ndarray]
    node_memory: Mapping[str, np.ndarray] | None = None
    node_key: Mapping[str, Hashable] | None = None
    index: Mapping[str, int] = field(init=False, repr=False, compare=False)
    succ: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    pred: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        if len(index) != len(nodes):
            raise ValueError("node names must be unique")
        costs = self._checked_costs(nodes)
        memory = self._checked_memory(nodes, costs)
        edges = self._checked_edges(index, costs)
        succ: dict[str, list[str]] = {n: [] for n in nodes}
        pred: dict[str, list[str]] = {n: [] for n in nodes}
        for u, v in sorted(edges, key=lambda e: (index[e[0]], index[e[1]])):
            succ[u].append(v)
            pred[v].append(u)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "node_cost", costs)
        object.__setattr__(self, "node_memory", memory)
        object.__setattr__(self, "edge_cost", edges)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "succ", {n: tuple(s) for n, s in succ.items()})
        object.__setattr__(self, "pred", {n: tuple(p) for n, p in pred.items()})
        if self.node_key is not None:
            missing = [n for n in nodes if n not in self.node_key]
            if missing:
                raise ValueError(f"node_key lacks {len(missing)} node(s), e.g. {missing[:3]}")

    def _checked_costs(self, nodes: tuple[str, ...]) -> dict[str, np.ndarray]:
        extra = set(self.node_cost) - set(nodes)
        if extra:
            raise ValueError(f"node_cost names unknown node(s) {sorted(extra)[:3]}")
        costs, seen = {}, set()
        for n in nodes:
            if n not in self.node_cost:
                raise ValueError(f"node {n!r} has no node_cost")
            arr = _as_vector(n, "node_cost", self.node_cost[n])
            if id(arr) not in seen:  # nodes of identical layers share one array: check it once
                _check_values(arr, f"node_cost[{n!r}]", allow_inf=True)
                seen.add(id(arr))
            costs[n] = arr
        return costs

    def _checked_memory(self, nodes: tuple[str, ...], costs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        if self.node_memory is None:
            return None
        memory, seen = {}, set()
        for n in nodes:
            arr = _as_vector(n, "node_memory", self.node_memory.get(n, np.zeros(costs[n].shape)))
            if arr.shape != costs[n].shape:
                raise ValueError(f"node_memory[{n!r}] has shape {arr.shape}, node_cost has {costs[n].shape}")
            if id(arr) not in seen:
                _check_values(arr, f"node_memory[{n!r}]", allow_inf=False)
                seen.add(id(arr))
            memory[n] = arr
        return memory

    def _checked_edges(self, index: dict[str, int], costs: dict[str, np.ndarray]) -> dict[tuple[str, str], np.ndarray]:
        edges, seen = {}, set()
        for (u, v), value in self.edge_cost.items():
            if u not in index or v not in index:
                raise ValueError(f"edge ({u!r}, {v!r}) names a node that is not in the graph")
            if index[u] >= index[v]:
                raise ValueError(f"edge ({u!r}, {v!r}) goes backwards: nodes must be in topological order")
            arr = _float64(value)
            want = (costs[u].size, costs[v].size)
            if arr.shape != want:
                raise ValueError(f"edge_cost[({u!r}, {v!r})] has shape {arr.shape}, expected {want}")
            if id(arr) not in seen:
                _check_values(arr, f"edge_cost[({u!r}, {v!r})]", allow_inf=True)
                seen.add(id(arr))
            edges[(u, v)] = arr
        return edges

    def strategies(self, node: str) -> int:
        return int(self.node_cost[node].size)

    def memory_of(self, node: str) -> np.ndarray:
        """Memory vector of ``node`` (zeros when the graph carries no memory)."""
        if self.node_memory is None:
            return np.zeros(self.node_cost[node].shape)
        return self.node_memory[node]

    def derive(
        self,
        *,
        node_cost: Mapping[str, np.ndarray] | None = None,
        edge_cost: Mapping[tuple[str, str], np.ndarray] | None = None,
        node_memory: Mapping[str, np.ndarray] | None | _Same = SAME,
        node_key: Mapping[str, Hashable] | None | _Same = SAME,
        checked: tuple[str, ...] = ("node_cost", "edge_cost", "node_memory"),
    ) -> CostGraph:
        """This graph's nodes with other arrays (each field left out stays as it is) and its edges or some of them,
        built without the checks of a new graph: the node index is this graph's and the adjacency is this graph's,
        less the edges left out. The budgeted search derives hundreds of graphs from one pricing (sub-spaces, folds,
        memory graphs, recomputation policies), and checking each node and edge again was a noticeable share of its
        time (docs/benchmarks/measured_in_code.md).

        ``checked``: the fields whose arrays that this graph does not hold (by identity) have their values checked
        (float64, the node's or edge's shape, no NaN, no ``-inf``, memory finite), each distinct array once. A
        caller leaves out a field whose arrays cannot break these by construction: slices of this graph's arrays,
        sums of them, ``0``/``+inf`` masks. The edges must be a subset of this graph's (checked)."""
        costs = self.node_cost if node_cost is None else {n: node_cost[n] for n in self.nodes}
        edges = self.edge_cost if edge_cost is None else dict(edge_cost)
        memory = self.node_memory if isinstance(node_memory, _Same) else node_memory
        if memory is not None and memory is not self.node_memory:  # a node left out holds nothing, as in a new graph
            memory = {n: memory[n] if n in memory else np.zeros(costs[n].shape) for n in self.nodes}
        if edge_cost is not None and not edges.keys() <= self.edge_cost.keys():
            extra = sorted(edges.keys() - self.edge_cost.keys())
            raise ValueError(f"a derived graph's edges must be the graph's; {extra[:3]} are not")
        own: set[int] = set()
        if checked:
            own = {id(a) for a in self.node_cost.values()} | {id(a) for a in self.edge_cost.values()}
            own |= {id(a) for a in (self.node_memory or {}).values()}
        if "node_cost" in checked and node_cost is not None:
            for n, arr in costs.items():
                if id(arr) not in own:
                    _check_new(arr, f"node_cost[{n!r}]", None, allow_inf=True)
                    own.add(id(arr))
        if "node_memory" in checked and memory is not None and memory is not self.node_memory:
            for n, arr in memory.items():
                if id(arr) not in own:
                    _check_new(arr, f"node_memory[{n!r}]", costs[n].shape, allow_inf=False)
                    own.add(id(arr))
        if "edge_cost" in checked and edge_cost is not None:
            for (u, v), arr in edges.items():
                if id(arr) not in own:
                    _check_new(arr, f"edge_cost[({u!r}, {v!r})]", (costs[u].size, costs[v].size), allow_inf=True)
                    own.add(id(arr))
        out = object.__new__(CostGraph)
        if len(edges) == len(self.edge_cost):  # a subset of the same size: the same edges
            succ, pred = self.succ, self.pred
        else:
            succ = {u: tuple(v for v in vs if (u, v) in edges) for u, vs in self.succ.items()}
            pred = {v: tuple(u for u in us if (u, v) in edges) for v, us in self.pred.items()}
        key = self.node_key if isinstance(node_key, _Same) else node_key
        for name, value in (
            ("nodes", self.nodes),
            ("node_cost", costs),
            ("edge_cost", edges),
            ("node_memory", memory),
            ("node_key", key),
            ("index", self.index),
            ("succ", succ),
            ("pred", pred),
        ):
            object.__setattr__(out, name, value)
        if key is not None and key is not self.node_key:
            missing = [n for n in self.nodes if n not in key]
            if missing:
                raise ValueError(f"node_key lacks {len(missing)} node(s), e.g. {missing[:3]}")
        return out


def _check_new(arr: np.ndarray, what: str, shape: tuple[int, ...] | None, *, allow_inf: bool) -> None:
    """A derived graph's new array: float64, of ``shape`` (``None``: a non-empty vector), with valid values."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float64:
        raise ValueError(f"{what} must be a float64 array, got {getattr(arr, 'dtype', type(arr).__name__)}")
    wrong = arr.ndim != 1 or arr.size == 0 if shape is None else arr.shape != shape
    if wrong:
        raise ValueError(f"{what} has shape {arr.shape}, expected {shape or 'a non-empty 1-D array'}")
    _check_values(arr, what, allow_inf=allow_inf)


@dataclass(frozen=True)
class Solution:
    """A plan: one strategy index per node, its objective ``cost`` (including ``alpha * memory``) and memory.

    ``bound`` is a proven lower bound on the optimum; ``proven_optimal`` means ``cost`` meets it.
    """

    choice: dict[str, int]
    cost: float
    memory: float
    method: str
    proven_optimal: bool
    seconds: float
    bound: float = -math.inf
    #: under a budget, the DP's Lagrange multipliers that bracketed it (hints for a search of a similar budget)
    multipliers: tuple[float, ...] = ()


def evaluate(graph: CostGraph, choice: Mapping[str, int], alpha: float = 0.0) -> float:
    """The objective ``C(p)`` of a full choice, summed exactly (``math.fsum``); +inf if anything is forbidden."""
    missing = [n for n in graph.nodes if n not in choice]
    if missing:
        raise ValueError(f"choice lacks {len(missing)} node(s), e.g. {missing[:3]}")
    terms = [float(graph.node_cost[n][choice[n]]) for n in graph.nodes]
    terms += [float(e[choice[u], choice[v]]) for (u, v), e in graph.edge_cost.items()]
    if any(math.isinf(t) for t in terms):
        return math.inf
    total = math.fsum(terms)
    return total + alpha * plan_memory(graph, choice) if alpha else total


def plan_memory(graph: CostGraph, choice: Mapping[str, int]) -> float:
    """``M(p)``: memory per device of a full choice (0 when the graph carries no memory)."""
    if graph.node_memory is None:
        return 0.0
    return math.fsum(float(graph.node_memory[n][choice[n]]) for n in graph.nodes)


@dataclass(frozen=True)
class Reduced:
    """A graph without forbidden strategies, and for each node the original index of each kept strategy."""

    graph: CostGraph
    kept: Mapping[str, np.ndarray]

    def lift(self, choice: Mapping[str, int]) -> dict[str, int]:
        """Map a choice on the reduced graph back to original strategy indices."""
        return {n: int(self.kept[n][p]) for n, p in choice.items()}


def _arc_consistent(graph: CostGraph) -> dict[str, np.ndarray]:
    """Boolean masks of strategies that have finite cost and a finite partner on every incident edge."""
    # identical layers share their arrays, so each distinct array is tested once and each distinct (array, masks)
    # revised once: the memos are keyed by array identity (graph holds every array meanwhile) and the masks' bytes
    finite_of: dict[int, np.ndarray | None] = {}
    for a in graph.edge_cost.values():
        if id(a) not in finite_of:
            finite_of[id(a)] = np.isfinite(a) if a.max() == np.inf else None
    finite = {e: f for e, a in graph.edge_cost.items() if (f := finite_of[id(a)]) is not None}
    alive = {n: np.isfinite(graph.node_cost[n]) for n in graph.nodes}
    revised: dict[tuple[int, bytes, bytes], tuple[np.ndarray, np.ndarray]] = {}
    changed = True
    while changed:
        changed = False
        for (u, v), ok in finite.items():
            key = (id(ok), alive[u].tobytes(), alive[v].tobytes())
            if key not in revised:
                pair = ok & alive[u][:, None] & alive[v][None, :]
                row, col = pair.any(axis=1), pair.any(axis=0)
                revised[key] = row, col
            row, col = revised[key]
            if (alive[u] & ~row).any() or (alive[v] & ~col).any():
                alive[u] = alive[u] & row
                alive[v] = alive[v] & col
                changed = True
    dead = [n for n, a in alive.items() if not a.any()]
    if dead:
        raise InfeasibleGraph(f"node {dead[0]!r} has no strategy with finite cost compatible with its neighbours")
    return alive


def reduce_graph(graph: CostGraph) -> Reduced:
    """Drop strategies with +inf cost, and those left without a finite partner on some edge (arc consistency).

    Arrays of nodes and edges that lose nothing are kept as the same objects, and arrays shared between nodes
    stay shared (:func:`restrict`), so repeated layers stay cheap to recognise. Raises :class:`InfeasibleGraph`
    if a node loses every strategy.
    """
    alive = _arc_consistent(graph)
    kept = {n: np.flatnonzero(a) for n, a in alive.items()}
    if all(a.all() for a in alive.values()):
        return Reduced(graph, kept)
    return Reduced(restrict(graph, kept), kept)


def restrict(
    graph: CostGraph,
    kept: Mapping[str, np.ndarray],
    node_memory: Mapping[str, np.ndarray] | None = None,
) -> CostGraph:
    """``graph`` on the strategies ``kept[n]`` of each node (original indices, in order; a node left out keeps
    all), with ``node_memory`` in place of the graph's when given.

    Sharing is kept: nodes whose arrays are one object and whose kept indices are equal get one sub-array, so the
    DP still finds identical layers by identity (:mod:`~primepar_fx.search.structure`) and checks, proxies and
    compares each distinct array once. A node that keeps every strategy keeps its arrays as they are.
    """
    canonical: dict[bytes, np.ndarray] = {}
    index: dict[str, np.ndarray | None] = {}
    for n in graph.nodes:
        k = kept.get(n)
        if k is None or (len(k) == graph.strategies(n) and bool((k == np.arange(len(k))).all())):
            index[n] = None
        else:
            k = np.asarray(k, dtype=np.intp)
            index[n] = canonical.setdefault(k.tobytes(), k)
    memo: dict[tuple[int, ...], np.ndarray] = {}  # the ids stay valid: graph and index hold every array meanwhile

    def take(arr: np.ndarray, *nodes: str) -> np.ndarray:
        picks = [index[n] for n in nodes]
        if all(p is None for p in picks):
            return arr
        key = (id(arr), *(-1 if p is None else id(p) for p in picks))
        if key not in memo:
            if len(picks) == 1:
                memo[key] = arr[picks[0]]
            else:
                rows = np.arange(arr.shape[0]) if picks[0] is None else picks[0]
                cols = np.arange(arr.shape[1]) if picks[1] is None else picks[1]
                memo[key] = arr[np.ix_(rows, cols)]
        return memo[key]

    memory = graph.node_memory if node_memory is None else node_memory
    return graph.derive(  # slices of checked arrays: only a memory given here is new
        node_cost={n: take(graph.node_cost[n], n) for n in graph.nodes},
        edge_cost={(u, v): take(a, u, v) for (u, v), a in graph.edge_cost.items()},
        node_memory=None if memory is None else {n: take(memory[n], n) for n in graph.nodes},
        checked=() if node_memory is None else ("node_memory",),
    )


def fold_fixed(graph: CostGraph) -> CostGraph:
    """``graph`` with the edges of every node that has one strategy folded into their other ends' node costs:
    ``e_uv(0, q)`` added to ``v``'s cost where ``u`` has one strategy (``e_uv(p, 0)`` to ``u``'s where ``v`` has), the
    edge dropped. Every plan costs the same in both graphs, so the minimum and its minimisers are the same; the
    fixed node keeps its own cost and memory, now with no edge.

    Such nodes (replicated constants: rotary tables, masks, labels) sit next to many nodes of a layer, and the DP's
    elimination of one of them holds a table over all its neighbours at once (a two-layer model at real sizes on 8
    devices: 2.9e8 entries over a rotary table's four neighbours, none once folded). Nodes whose costs and edges
    are one array each keep sharing one array (identical layers stay recognisable by identity)."""
    fixed = {n for n in graph.nodes if graph.strategies(n) == 1}
    if not any(u in fixed or v in fixed for u, v in graph.edge_cost):
        return graph
    costs, edges = dict(graph.node_cost), {}
    folded: dict[tuple[int, int, bool], np.ndarray] = {}  # the ids stay valid: graph and folded hold the arrays
    for (u, v), arr in graph.edge_cost.items():
        if u not in fixed and v not in fixed:
            edges[(u, v)] = arr
            continue
        into_v = u in fixed and v not in fixed
        end = v if into_v else u
        key = (id(costs[end]), id(arr), into_v)
        if key not in folded:
            folded[key] = costs[end] + (arr[0] if into_v else arr[:, 0])
        costs[end] = folded[key]
    return graph.derive(node_cost=costs, edge_cost=edges, checked=())  # sums of checked arrays
