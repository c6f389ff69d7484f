"""Segmented dynamic programming (paper §5, Eq. 11-14): the exact minimum of the search objective.

Objective (Eq. 10), for strategies ``p``, with a memory weight ``w >= 0`` (``alpha``, or ``alpha`` plus a
Lagrange multiplier when :mod:`primepar_fx.search.budget` enforces a budget)::

    min_p  sum_i [n_i(p_i) + w * m_i(p_i)] + sum_(u,v) e_uv(p_u, p_v)

There are no other constraints: one strategy per node is the DP's variable domain, and ``+inf`` entries forbid.

How the minimum is computed:

0. *Nodes of one strategy* (replicated constants: rotary tables, masks) are folded away first
   (:func:`~primepar_fx.search.problem.fold_fixed`): each of their edges becomes a node cost of its other end, so
   they tie no neighbours together in one elimination table. This is conditioning (below) on a node with one
   state, for every such node, whatever its fan-out.
1. *Conditioning on global nodes* (:func:`~primepar_fx.search.structure.select_globals`). Each joint strategy
   ``a`` of the global nodes is tried: the globals' own costs become a constant and every edge
   ``e_{g,v}`` becomes the node cost ``e_{g,v}(a_g, .)`` of ``v``. The best ``a`` wins, so the result is exact.
   This keeps the layers identical and separable. Segment tables that touch no global are computed once; those
   that do are recomputed per ``a`` incrementally (only the engine steps downstream of the changed node costs).
   This is faster than the engine's fallback for globals it does not condition, which keeps a global as an extra
   table axis in one segment spanning all layers (measurements in ``docs/benchmarks/measured_in_code.md``).
   A long edge with few distinct rows, such as a tied embedding's from the first node to the LM head, is first
   routed through a *proxy* node with one state per distinct row (:mod:`~primepar_fx.search.proxy`), which is
   made global, so the layers between its ends stay separable and can be merged. The schedule below weighs the work
   that is repeated for every joint strategy of the globals. The joint strategies are not a Python loop but one
   more axis of the chain's arrays (``V[a, p]``; ``DPOptions.batch_globals``, the loop kept as the reference): the
   arithmetic is the same, the Python around it runs once (a tied embedding's proxy has up to 64 states, and the
   loop spent most of its time in that Python).
2. *Segments* between cut points (:mod:`~primepar_fx.search.structure`). A segment's table ``C_ij(p_i, p_j)``
   comes from the elimination engine (:mod:`~primepar_fx.search.engine`, Eq. 11-12 inside a segment).
3. *Chaining* (Eq. 11 at segment granularity): a vector ``V_j(p_j)``, the cheapest cost of everything up to cut
   ``j``, is carried left to right: ``V_k = min_{p_j} V_j(p_j) + C_jk(p_j, p_k)``. A segment that occurs once is
   folded straight into the vector (the engine with ``V_j`` as a node cost: ``O(P^2)`` per chain node instead of
   ``O(P^3)``).
4. *Identical layers* (Eq. 13-14). A segment class that occurs many times has its ``C_ij`` computed once. A stack
   of ``L`` identical layers is either chained (``L`` vector-matrix products) or, as in the paper, merged into
   ``C_{0,L}`` by repeated squaring (:func:`~primepar_fx.search.minplus.power`). ``layer_merge="auto"`` picks the
   cheapest of: folding every copy, chaining shared tables, repeated squaring, by the planned table sizes.
5. *Back-tracking*: the argmins of the chain, of every min-plus product and of every engine step give each node's
   strategy in every layer.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from primepar_fx.search import engine, minplus
from primepar_fx.search.problem import CostGraph, InfeasibleGraph, TableTooLarge, fold_fixed
from primepar_fx.search.proxy import add_proxies
from primepar_fx.search.structure import Segment, Stack, Structure, analyse

log = logging.getLogger(__name__)

try:  # progress bars are optional
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # pragma: no cover
    _tqdm = None

#: Python overhead of one numpy-level operation, as the number of table entries that take as long to process:
#: the schedule charges it per operation, so many tiny operations do not look free
OVERHEAD = 15_000


@dataclass(frozen=True)
class DPOptions:
    """Knobs of the DP. ``layer_merge``: "auto" (cheapest), "power" (Eq. 14 squaring), "none" (no sharing)."""

    layer_merge: Literal["auto", "power", "none"] = "auto"
    max_table_entries: int = 200_000_000  # work per elimination step (run in chunks, so not all held at once)
    chunk_entries: int = 1 << 16
    min_fanout: int = 3
    max_global_states: int = 16
    max_global_product: int = 64
    max_period: int = 256
    progress: bool = False
    #: route long edges with at most this many distinct rows (or columns) through a global proxy node
    #: (:mod:`~primepar_fx.search.proxy`); 0 never does. A tied embedding's edge has a row per layout the table
    #: is stored in and per way its gradient is reduced (64 of 125 for bloom-176b on 8 GPUs): left unproxied, it
    #: holds the whole model in one segment, many times slower there (docs/benchmarks/measured_in_code.md)
    max_proxy_states: int = 128
    #: run the joint strategies of the globals as one axis of the chain's arrays (one pass) rather than one pass
    #: each (the reference; the same minimum and choice, slower: the Python around each pass is repeated)
    batch_globals: bool = True

    def __post_init__(self) -> None:
        if self.layer_merge not in ("auto", "power", "none"):
            raise ValueError(f"layer_merge must be 'auto', 'power' or 'none', got {self.layer_merge!r}")
        if self.max_table_entries < 1 or self.chunk_entries < 1:
            raise ValueError("max_table_entries and chunk_entries must be positive")


@dataclass(frozen=True)
class DPResult:
    """The DP's plan: the strategy per node and the objective value it reaches (exact minimum)."""

    choice: dict[str, int]
    value: float


@dataclass(frozen=True)
class _Caches:
    """Tables computed during one pass: ``shared`` across joint strategies of the globals, ``local`` to one."""

    shared: dict
    local: dict


@dataclass(frozen=True)
class _Item:
    """One step of the chain: fold segment ``seg`` ("fold"), apply its class table ("table"), or a stack."""

    kind: Literal["fold", "table", "stack"]
    seg: int
    stack: Stack | None = None


def _progress(it: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    if enabled and _tqdm is not None and total > 1:
        return _tqdm(it, total=total, desc=desc, leave=False)
    return it


class DPSolver:
    """Analyses a graph once, then minimises it for any memory weight (see the module docstring)."""

    def __init__(self, graph: CostGraph, options: DPOptions | None = None) -> None:
        self.options = options = options or DPOptions()
        graph = fold_fixed(graph)  # (a node of one strategy links its neighbours for nothing: its edges are costs)
        #: the graph the DP runs on: ``graph`` with its proxies; choices are reported on ``graph``'s nodes
        wide = frozenset(
            n
            for n in graph.nodes
            if len(graph.succ[n]) >= options.min_fanout and graph.strategies(n) <= options.max_global_states
        )  # the candidates for globals, whose edges do not count against cuts
        self.proxied = add_proxies(graph, max_states=options.max_proxy_states, skip=wide)
        self.graph = graph = self.proxied.graph
        self.structure: Structure = analyse(
            graph,
            min_fanout=options.min_fanout,
            max_global_states=options.max_global_states,
            max_global_product=options.max_global_product,
            max_period=options.max_period,
            forced=tuple(self.proxied.proxies),
        )
        self._plans: dict[tuple[int, bool], engine.Elimination] = {}
        self._chunk = options.chunk_entries
        gset = set(self.structure.globals)
        self._global_edges = [e for e in graph.edge_cost if e[0] in gset and e[1] in gset]
        #: joint strategies of the globals: the chain runs once for each, the tables of untouched classes once
        self._repeats = self._states(self.structure.globals)
        self.items = self._schedule()
        #: False once a fold with the globals' axis (:meth:`_forward_batched`) passed ``max_table_entries``
        self._batched: bool | None = None

    # ----------------------------------------------------------------------------------------- planning
    def _plan(self, seg: Segment, matrix: bool) -> engine.Elimination:
        """Engine plan for ``seg``: keep both ends (``matrix``) or fold an incoming vector and keep the end."""
        key = (seg.cls, matrix)
        if key not in self._plans:
            g, nodes = self.graph, seg.nodes
            rel = {n: i for i, n in enumerate(nodes)}
            scopes = [(i,) for i in range(1, len(nodes))] + [(rel[u], rel[v]) for u, v in seg.edges]
            keep = (0, len(nodes) - 1) if matrix else (len(nodes) - 1,)
            if not matrix:
                scopes.append((0,))
            domains = [g.strategies(n) for n in nodes]
            limit = self.options.max_table_entries
            self._plans[key] = engine.plan_elimination(domains, scopes, keep, limit=limit, names=nodes)
        return self._plans[key]

    def _deps(self, segs) -> tuple[str, ...]:
        """The globals any of ``segs`` touches, in DP order."""
        found = {x for s in segs for x in self.structure.class_deps[s.cls]}
        return tuple(x for x in self.structure.globals if x in found)

    def _states(self, globals_: tuple[str, ...]) -> int:
        """Joint strategies of ``globals_``: how many times work that depends on them is done."""
        return math.prod(self.graph.strategies(x) for x in globals_)

    def _ends(self, seg: Segment) -> int:
        return self.graph.strategies(seg.nodes[0]) * self.graph.strategies(seg.nodes[-1])

    def _costs(self, segs: list[Segment]) -> dict[str, float]:
        """Estimated work (table entries) of folding every segment, or of one table per class chained (and the
        tables alone, the base of squaring), over all joint strategies of the globals: folds and the chain run once
        per joint strategy, a class's table once unless it touches a global. ``inf`` where the engine's limit
        forbids the plan."""

        def work(seg: Segment, matrix: bool) -> float:
            try:
                return self._plan(seg, matrix).work + OVERHEAD
            except TableTooLarge:
                return math.inf

        def runs(seg: Segment) -> int:
            return self._states(self.structure.class_deps[seg.cls])

        tables = sum(work(s, True) * runs(s) for s in {s.cls: s for s in segs}.values())
        chain = tables + self._repeats * sum(self._ends(s) + OVERHEAD for s in segs)
        return {"fold": self._repeats * sum(work(s, False) for s in segs), "table": chain, "power": tables}

    def _stack_power_cost(self, stack: Stack, segs: list[Segment], base: float) -> float:
        """Work of Eq. 14: chain one layer's tables, square ``log2(count)`` times, apply to the vector."""
        p0 = self.graph.strategies(segs[0].nodes[0])
        chain = sum(p0 * self._ends(s) + OVERHEAD for s in segs[1 : stack.period])
        n_products = stack.count.bit_length() - 1 + bin(stack.count).count("1") - 1
        once = chain + n_products * (p0**3 + OVERHEAD)
        runs = self._states(self._deps(segs[: stack.period]))
        return base + once * runs + self._repeats * (p0 * p0 + OVERHEAD)

    def _schedule(self) -> list[_Item]:
        """Decide, for every segment, how the chain consumes it (module docstring, point 4)."""
        segs, mode = self.structure.segments, self.options.layer_merge
        members: dict[int, list[Segment]] = {}
        for s in segs:
            members.setdefault(s.cls, []).append(s)
        kind_of = {}
        for cls, group in members.items():
            costs = self._costs(group)
            if math.isinf(costs["fold"]) and math.isinf(costs["table"]):
                self._plan(group[0], False)  # raises TableTooLarge with the offending node
            shared = mode != "none" and costs["table"] < costs["fold"]  # across layers, or across global states
            kind_of[cls] = "table" if shared or math.isinf(costs["fold"]) else "fold"
        items, stacks = [], {st.first: st for st in self.structure.stacks} if mode != "none" else {}
        k = 0
        while k < len(segs):
            st = stacks.get(k)
            if st is not None and self._use_power(st, mode):
                items.append(_Item("stack", k, st))
                k += st.period * st.count
                continue
            items.append(_Item(kind_of[segs[k].cls], k))
            k += 1
        log.debug("DP schedule: %s", {kind: sum(i.kind == kind for i in items) for kind in ("fold", "table", "stack")})
        return items

    def _use_power(self, st: Stack, mode: str) -> bool:
        segs = list(self.structure.segments[st.first : st.first + st.period * st.count])
        costs = self._costs(segs)
        if math.isinf(costs["power"]):
            return False
        if mode == "power":
            return True
        return self._stack_power_cost(st, segs, costs["power"]) < min(costs["fold"], costs["table"])

    # --------------------------------------------------------------------------------------- execution
    def minimise(self, memory_weight: float = 0.0) -> DPResult:
        """The exact minimiser of ``cost + memory_weight * memory`` (+inf entries forbidden)."""
        g, st = self.graph, self.structure
        mem = g.node_memory if memory_weight and g.node_memory is not None else None
        base = {n: g.node_cost[n] if mem is None else g.node_cost[n] + memory_weight * mem[n] for n in g.nodes}
        states = list(itertools.product(*(range(g.strategies(x)) for x in st.globals)))
        found = None
        if len(states) > 1 and self.options.batch_globals and self._batched is not False:
            try:
                found = self._forward_batched(base, states)
            except TableTooLarge:  # a fold with the states' axis passes the limit: one state at a time from now
                self._batched = False
        if found is None:
            found = self._forward_states(base, states)
        value, assign, last, trace = found
        if math.isinf(value):
            raise InfeasibleGraph("every choice of strategies has infinite cost")
        choice = dict(assign)
        choice.update(self._backtrack(last, trace))
        return DPResult(self.proxied.strip(choice), value)

    def _forward_states(self, base: Mapping[str, np.ndarray], states: list[tuple[int, ...]]):
        """The chain run once per joint strategy of the globals, the cheapest kept: ``(value, assignment of the
        globals, argmin of the last vector, trace)``."""
        shared: dict = {}  # tables of classes that touch no global: the same for every joint strategy
        local: dict = {}  # tables of classes that touch globals, keyed by those globals' strategies
        best: tuple[float, dict[str, int], int, list] = (math.inf, {}, -1, [])
        for a in _progress(states, len(states), "global strategies", self.options.progress):
            assign = dict(zip(self.structure.globals, a))
            const = self._global_constant(base, assign)
            if math.isinf(const):
                continue
            value, last, trace = self._forward(self._conditioned(base, assign), assign, _Caches(shared, local))
            if value + const < best[0]:
                best = (value + const, assign, last, trace)
        return best

    def _global_constant(self, base: Mapping[str, np.ndarray], assign: dict[str, int]) -> float:
        g = self.graph
        terms = [float(base[x][p]) for x, p in assign.items()]
        terms += [float(g.edge_cost[u, v][assign[u], assign[v]]) for u, v in self._global_edges]
        return math.inf if any(math.isinf(t) for t in terms) else math.fsum(terms)

    def _conditioned(self, base: Mapping[str, np.ndarray], assign: dict[str, int]) -> dict[str, np.ndarray]:
        """Node costs with the globals' edges folded in (module docstring, point 1)."""
        if not assign:
            return dict(base)
        out = dict(base)
        for n, edges in self.structure.touches.items():
            for u, v in edges:
                e = self.graph.edge_cost[(u, v)]
                out[n] = out[n] + (e[assign[u], :] if v == n else e[:, assign[v]])
        return out

    def _tables(self, seg: Segment, unary: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return [unary[n] for n in seg.nodes[1:]] + [self.graph.edge_cost[e] for e in seg.edges]

    def _class_table(self, seg: Segment, unary, assign, caches: _Caches) -> engine.Result:
        """``C_ij`` of ``seg``'s class (Eq. 11-13 inside the segment), computed once per strategy of the globals it
        touches (once in all when it touches none).

        A class next to a global is re-run incrementally from its first run: only engine steps downstream of the
        conditioned node costs are recomputed.
        """
        deps = self.structure.class_deps[seg.cls]
        if not deps:
            if seg.cls not in caches.shared:
                caches.shared[seg.cls] = engine.run(self._plan(seg, True), self._tables(seg, unary), chunk=self._chunk)
            return caches.shared[seg.cls]
        key = (seg.cls, *(assign[x] for x in deps))
        if key not in caches.local:
            plan, tables, ref = self._plan(seg, True), self._tables(seg, unary), caches.shared.get(("ref", seg.cls))
            if ref is None:
                ref = caches.shared["ref", seg.cls] = engine.run(plan, tables, chunk=self._chunk, keep_outputs=True)
                caches.local[key] = ref
            else:
                touched = [i - 1 for i, n in enumerate(seg.nodes) if i and self.structure.touches[n]]
                caches.local[key] = engine.run(plan, tables, chunk=self._chunk, base=ref, changed=touched)
        return caches.local[key]

    def _stack_term(self, stack: Stack, unary, assign, caches: _Caches) -> minplus.Term:
        """``C_{0,L}`` of a stack: one layer's segment tables chained, then ``count`` copies by squaring (Eq. 14)."""
        segs = self.structure.segments[stack.first : stack.first + stack.period]
        deps = self._deps(segs)
        cache = caches.local if deps else caches.shared
        key = ("stack", stack.first, *(assign[x] for x in deps))
        if key not in cache:
            chunk = self._chunk
            leaves = [minplus.leaf(self._class_table(s, unary, assign, caches).table) for s in segs]
            cache[key] = minplus.power(minplus.chain(leaves, chunk=chunk), stack.count, chunk=chunk)
        return cache[key]

    def _forward(self, unary, assign, caches: _Caches) -> tuple[float, int, list]:
        """Carry the vector ``V`` along the chain of items; returns min value, argmin and the trace."""
        order, segs = self.structure.order, self.structure.segments
        if not order:
            return 0.0, -1, []
        v, trace, chunk = unary[order[0]], [], self._chunk
        for item in self.items:
            seg = segs[item.seg]
            if item.kind == "fold":
                plan = self._plan(seg, False)
                res = engine.run(plan, [*self._tables(seg, unary), v], chunk=chunk)
                v, data = res.table, (plan, res.records, ())
            elif item.kind == "table":
                res = self._class_table(seg, unary, assign, caches)
                v, arg = minplus.vecmat(v, res.table)
                data = (arg, res)
            else:
                term = self._stack_term(item.stack, unary, assign, caches)
                v, arg = minplus.vecmat(v, term.table)
                period = segs[item.seg : item.seg + item.stack.period]
                data = (arg, term, [self._class_table(s, unary, assign, caches) for s in period])
            trace.append((item, data))
        last = int(np.argmin(v))
        return float(v[last]), last, trace

    # ------------------------------------------------------------------------- the globals as one axis
    def _forward_batched(self, base: Mapping[str, np.ndarray], states: list[tuple[int, ...]]):
        """What :meth:`_forward_states` finds, with the joint strategies of the globals as an axis of the chain's
        vector instead of an outer loop: the vector is ``V[a, p]``, a fold runs once on tables with that axis
        (the engine eliminates as before and keeps the axis), a class table or stack term is applied to every row
        (one table per state where the class touches a global). The arithmetic per state is the loop's; the
        Python around it runs once instead of once per state, which is what the loop spends its time on (64
        states for a tied embedding's proxy). The chain stays one vector until the first node a global touches.
        """
        st, segs, chunk = self.structure, self.structure.segments, self._chunk
        rows = {x: np.array([a[i] for a in states], dtype=np.intp) for i, x in enumerate(st.globals)}
        batched = {}  # the node costs the globals' edges add to, one row per state (as _conditioned adds them)
        for n, edges in st.touches.items():
            if edges:
                out = np.broadcast_to(base[n], (len(states), base[n].shape[0]))
                for u, v in edges:
                    e = self.graph.edge_cost[(u, v)]
                    out = out + (e[rows[u], :] if v == n else e[:, rows[v]].T)
                batched[n] = out
        assigns = [dict(zip(st.globals, a)) for a in states]
        consts = np.array([self._global_constant(base, assign) for assign in assigns])
        caches = _Caches({}, {})
        per_state: dict[int, dict] = {}

        def unary_of(a: int, deps: tuple[str, ...] = ("",)) -> Mapping[str, np.ndarray]:
            """State ``a``'s node costs, for a class table (``base`` where the class touches no global)."""
            if not deps:
                return base
            if a not in per_state:
                per_state[a] = {**base, **{n: t[a] for n, t in batched.items()}}
            return per_state[a]

        order = st.order
        if not order:
            return float(consts.min()), assigns[int(consts.argmin())], -1, []
        first = order[0]
        v = batched.get(first, base[first])
        trace = []
        for item in self.items:
            seg = segs[item.seg]
            if item.kind == "fold":
                touched = tuple(bool(st.touches[n]) for n in seg.nodes[1:])
                if v.ndim == 1 and not any(touched):
                    plan = self._plan(seg, False)
                    res = engine.run(plan, [*self._tables(seg, base), v], chunk=chunk)
                    v, data = res.table, ("one", plan, res.records)
                else:
                    plan = self._batched_plan(seg, touched, v.ndim == 2, len(states))
                    tables = [batched.get(n, base[n]) for n in seg.nodes[1:]]
                    tables += [self.graph.edge_cost[e] for e in seg.edges]
                    res = engine.run(plan, [*tables, v], chunk=chunk)
                    v, data = res.table, ("rows", plan, res.records)
            else:
                deps = self._deps(segs[item.seg : item.seg + (item.stack.period if item.stack else 1)])
                if item.kind == "table":
                    made = [self._class_table(seg, unary_of(a, deps), assigns[a], caches) for a in _each(deps, states)]
                    terms = [r.table for r in made]
                else:
                    period = segs[item.seg : item.seg + item.stack.period]
                    made = [
                        (
                            self._stack_term(item.stack, unary_of(a, deps), assigns[a], caches),
                            [self._class_table(s, unary_of(a, deps), assigns[a], caches) for s in period],
                        )
                        for a in _each(deps, states)
                    ]
                    terms = [term.table for term, _ in made]
                v, arg = _vecmat_rows(v, terms, chunk)
                data = ("table", arg, made)
            trace.append((item, data))
        if v.ndim == 1:
            v = np.broadcast_to(v, (len(states), v.shape[0]))
        lasts = v.argmin(axis=1)
        totals = v[np.arange(len(states)), lasts] + consts
        a = int(np.argmin(totals))
        return float(totals[a]), assigns[a], int(lasts[a]), [(item, _row(data, a)) for item, data in trace]

    def _batched_plan(self, seg: Segment, touched: tuple[bool, ...], rows_in: bool, states: int) -> engine.Elimination:
        """The engine plan folding ``seg`` with the states' axis: variable ``len(nodes)`` (kept, with the end)
        is the joint strategy of the globals; it is in the scope of the incoming vector (``rows_in``) and of the
        node costs a global touches."""
        key = (seg.cls, "rows", rows_in, states)
        if key not in self._plans:
            g, nodes = self.graph, seg.nodes
            rel = {n: i for i, n in enumerate(nodes)}
            b = len(nodes)
            scopes = [(b, i) if hit else (i,) for i, hit in zip(range(1, len(nodes)), touched)]
            scopes += [(rel[u], rel[v]) for u, v in seg.edges]
            scopes.append((b, 0) if rows_in else (0,))
            domains = [g.strategies(n) for n in nodes] + [states]
            limit = self.options.max_table_entries
            self._plans[key] = engine.plan_elimination(
                domains, scopes, (b, len(nodes) - 1), limit=limit, names=[*nodes, "(globals)"]
            )
        return self._plans[key]

    def _backtrack(self, last: int, trace: list) -> dict[str, int]:
        segs, choice, q = self.structure.segments, {}, last
        for item, data in reversed(trace):
            seg = segs[item.seg]
            if item.kind == "fold":
                plan, records, state = data
                values = engine.backtrack(plan, records, (*state, q))
                q = self._assign(choice, seg, values)
            elif item.kind == "table":
                arg, res = data
                p = int(arg[q])
                self._assign(choice, seg, engine.backtrack(self._plan(seg, True), res.records, (p, q)))
                q = p
            else:
                q = self._backtrack_stack(choice, item.stack, data, q)
        if self.structure.order:
            choice[self.structure.order[0]] = q
        return choice

    def _backtrack_stack(self, choice: dict[str, int], stack: Stack, data, q: int) -> int:
        arg, term, records = data
        p = int(arg[q])
        cuts = minplus.boundaries(term, p, q)
        for j, seg in enumerate(self.structure.segments[stack.first : stack.first + stack.period * stack.count]):
            res = records[j % stack.period]
            values = engine.backtrack(self._plan(seg, True), res.records, (cuts[j], cuts[j + 1]))
            self._assign(choice, seg, values)
        return p

    @staticmethod
    def _assign(choice: dict[str, int], seg: Segment, values: list[int]) -> int:
        for n, p in zip(seg.nodes[1:], values[1:]):
            choice[n] = p
        return values[0]


def _each(deps: tuple[str, ...], states: list[tuple[int, ...]]) -> range:
    """The states a class table is made for: every one where it touches a global, else the first (shared)."""
    return range(len(states) if deps else 1)


def _vecmat_rows(v: np.ndarray, tables: list[np.ndarray], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~primepar_fx.search.minplus.vecmat` of every row of ``v`` (a vector is every row's) with its
    state's table (one table: every state's): ``(w, argmin)``, rows by state, or a vector where both are one."""
    if len(tables) == 1:
        if v.ndim == 1:
            return minplus.vecmat(v, tables[0])
        return minplus.minplus(v, tables[0], chunk=chunk)
    pairs = [minplus.vecmat(v[a] if v.ndim == 2 else v, t) for a, t in enumerate(tables)]
    return np.stack([w for w, _ in pairs]), np.stack([j for _, j in pairs])


def _row(data: tuple, a: int) -> tuple:
    """A batched trace entry as :meth:`DPSolver._backtrack` reads it, for state ``a``."""
    if data[0] == "one":
        return data[1], data[2], ()
    if data[0] == "rows":
        return data[1], data[2], (a,)
    _, arg, made = data
    arg = arg[a] if arg.ndim == 2 else arg
    got = made[a] if len(made) > 1 else made[0]
    return (arg, got) if not isinstance(got, tuple) else (arg, *got)
