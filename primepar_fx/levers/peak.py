"""The search under a memory budget as the plan reports its peak: static memory plus the largest ring buffer.

A node's modelled memory is its static part (parameters with their gradients and optimizer state, stashed
activations) plus its ring's receive buffer. Buffers are live one node at a time, so the plan's peak counts only
the largest one while the search adds memory over nodes: :func:`solve_for_peak` tries the buffer sizes as caps,
and :func:`least_peak` finds the least peak any plan has, fast, when a budget cannot be met.
"""

from __future__ import annotations

import math
import time

import numpy as np

from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.search import (
    CostGraph,
    CutOff,
    InfeasibleBudget,
    Search,
    Solution,
    budget_bound,
    least_memory,
    restrict,
    solve,
)


def solve_for_peak(
    priced: PricedGraph,
    *,
    memory_budget: float | None,
    alpha: float = 0.0,
    method: str = "auto",
    cutoff: float = math.inf,
) -> Solution:
    """:func:`~primepar_fx.search.solve` under the budget the plan reports: ``static + max buffer <= budget``.

    A node's modelled memory is its static part (parameters with their gradients and optimizer state, stashed
    activations) plus its ring's receive buffer. Buffers are live one node at a time, so the plan's peak
    (:func:`summarize`) counts only the largest one, while the search adds memory over nodes. For a budget, every
    distinct buffer size is tried as the cap ``C``: strategies with a larger buffer are dropped and the static part
    must fit ``budget - C``. The best of these is optimal for the reported peak (up to 24 caps are tried; more
    distinct sizes are thinned to quantiles, and the solution is then not marked proven).

    ``cutoff``: the caller has a plan of that cost. Under a budget the caps whose plans cannot be cheaper are not
    searched; when no plan within the budget is cheaper, :class:`~primepar_fx.search.CutOff` is raised (the fastest
    plan, when it fits, is returned whatever its cost).
    """
    graph = priced.search_graph
    if memory_budget is None and alpha == 0:
        return priced.fastest(method)
    if memory_budget is None or alpha > 0:
        return solve(graph, memory_budget=memory_budget, alpha=alpha, method=method)  # type: ignore[arg-type]
    start = time.perf_counter()
    caps = _CapSearch(priced, memory_budget, cutoff, method)
    if caps.peak(caps.free.choice) <= memory_budget:  # the common case: the fastest plan already fits
        return caps.free
    static = static_part(graph, caps.buffers)
    leanest = least_memory(static)  # the plan of least static memory, and that memory
    least = least_peak(graph, caps.buffers, memory_budget, leanest)
    if least > memory_budget:  # no cap can fit: said at once, with the exact least peak
        raise InfeasibleBudget(memory_budget, least)
    if cutoff < math.inf and len(caps.caps) > 1:
        if _every_cap_bound(static, caps.buffers, memory_budget, cutoff, caps.free.choice, leanest) >= cutoff:
            raise CutOff(cutoff)
    # smaller caps first: where the budget binds, the static room a small cap leaves tends to be worth more than the
    # larger ring buffers a larger one allows, so the best plan is likely found early and bounds the caps after it
    for cap in caps.caps:
        if cap > memory_budget:
            break  # so are the caps after it
        caps.search(cap)
    if caps.best is None:
        if caps.cut:
            raise CutOff(cutoff)
        raise InfeasibleBudget(memory_budget, caps.smallest)
    cost, choice, sol = caps.best
    proven = sol.proven_optimal and caps.exhaustive
    return Solution(choice, cost, caps.peak(choice), sol.method, proven, time.perf_counter() - start, sol.bound)


#: the most ring-buffer caps searched; more distinct buffer sizes are thinned to quantiles
MAX_CAPS = 24


class _CapSearch:
    """:func:`solve_for_peak`'s search over ring-buffer caps: the caps, the best plan found under any, the least
    memory a cap's plans need where none fits, and whether a cap was cut off by the caller's plan."""

    def __init__(self, priced: PricedGraph, budget: float, cutoff: float, method: str) -> None:
        self.graph, self.budget, self.cutoff, self.method = priced.search_graph, budget, cutoff, method
        self.buffers = ring_buffers(priced)
        caps = sorted({float(b) for arr in self.buffers.values() for b in arr})
        self.exhaustive = len(caps) <= MAX_CAPS
        if not self.exhaustive:
            caps = sorted({float(np.quantile(caps, q, method="higher")) for q in np.linspace(0, 1, MAX_CAPS)})
        self.caps = caps
        self.free = priced.fastest(method)
        self.best: tuple[float, dict[str, int], Solution] | None = None
        self.smallest, self.cut = math.inf, False
        self.hints: tuple[float, ...] = ()

    def peak(self, choice: dict[str, int]) -> float:
        """The peak ``choice`` reports: its static memory plus its largest ring buffer."""
        return max(float(b[choice[n]]) for n, b in self.buffers.items()) + sum(
            float(self.graph.node_memory[n][choice[n]] - self.buffers[n][choice[n]])  # type: ignore[index]
            for n in self.graph.nodes
        )

    def search(self, cap: float) -> None:
        """The plans whose ring buffers are at most ``cap``, their static part within ``budget - cap``; the best
        kept where it beats the best so far and the caller's."""
        graph, buffers, free = self.graph, self.buffers, self.free
        keep = {n: np.flatnonzero(buffers[n] <= cap) for n in graph.nodes}
        if any(len(k) == 0 for k in keep.values()):
            return
        search = Search(static_part(graph, buffers, keep), method=self.method)  # type: ignore[arg-type]
        if free.proven_optimal and all(buffers[n][p] <= cap for n, p in free.choice.items()):
            # the fastest plan of all lies within this cap, so it is this cap's fastest too: no DP run for it
            search.know_minimum({n: int(np.searchsorted(keep[n], p)) for n, p in free.choice.items()})
        relaxed = search.solve()  # a lower bound for this cap, in milliseconds
        limit = self.cutoff if self.best is None else min(self.best[0], self.cutoff)
        if relaxed.cost >= limit:  # (a larger cap keeps more strategies: its relaxed optimum may still be lower)
            self.cut = self.cut or self.best is None
            return
        if relaxed.memory <= self.budget - cap:
            sol = relaxed
        else:
            try:
                # a cap that cannot beat the best (or the caller's) stops early
                sol = search.solve(memory_budget=self.budget - cap, cutoff=limit, hints=self.hints)
                self.hints = sol.multipliers or self.hints  # the next cap's budget is a little smaller, its plans alike
            except InfeasibleBudget as exc:
                self.smallest = min(self.smallest, exc.min_memory + cap)
                return
            except CutOff:  # nothing within this cap beats the limit, proven before a plan within it was found
                self.cut = self.cut or limit >= self.cutoff
                return
        if sol.cost >= self.cutoff:
            self.cut = True
            return
        choice = {n: int(keep[n][i]) for n, i in sol.choice.items()}
        if self.best is None or sol.cost < self.best[0]:
            self.best = (sol.cost, choice, sol)


def _every_cap_bound(
    static: CostGraph,
    buffers: dict[str, np.ndarray],
    budget: float,
    cutoff: float,
    fastest: dict[str, int],
    leanest: tuple[dict[str, int], float],
) -> float:
    """A lower bound on the cost of every plan whose reported peak fits ``budget``, reaching ``cutoff`` when it can.

    Every plan's largest buffer is at least the smallest any plan can have (each node's smallest, the largest of
    those), so its static part fits ``budget`` less that: one budget over every strategy, a relaxation of every cap's
    problem at once. Its Lagrangian bound takes a few DP runs; where it reaches ``cutoff``, none of the caps' searches
    (a few runs each, for each of up to 24 caps) could return a plan that beats the caller's, and they are not run.
    A margin of 1e-12 keeps rounding on the safe side. ``static``: :func:`static_part` of the search graph, whose
    ``fastest`` plan and plan of least static memory (``leanest``: the plan and its memory) the caller has."""
    lowest = max((float(b.min()) for b in buffers.values() if len(b)), default=0.0)
    stop = cutoff + 2e-12 * abs(cutoff)  # searched a little past the cutoff, for the margin below
    bound = budget_bound(static, budget - lowest, stop, first=fastest, least=leanest)
    return bound - 1e-12 * abs(bound) if math.isfinite(bound) else bound


def plan_peak(priced: PricedGraph, choice: dict[str, int]) -> float:
    """The peak a plan reports for ``choice``: every node's static memory plus the largest ring buffer."""
    graph, buffers = priced.search_graph, ring_buffers(priced)
    return max((float(b[choice[n]]) for n, b in buffers.items()), default=0.0) + sum(
        float(graph.node_memory[n][choice[n]] - buffers[n][choice[n]])  # type: ignore[index]
        for n in graph.nodes
    )


def ring_buffers(priced: PricedGraph, graph: CostGraph | None = None) -> dict[str, np.ndarray]:
    """Each node's ring receive buffer per strategy, for the nodes of ``graph`` (default: the search graph; a
    virtual node of :mod:`pricing.sharing` has none). Equal vectors are one array, so the graphs built from them
    keep identical layers shared."""
    graph = priced.search_graph if graph is None else graph
    interned: dict[bytes, np.ndarray] = {}
    of_costs: dict[int, np.ndarray] = {}  # identical layers share their cost lists: each read once

    def intern(arr: np.ndarray) -> np.ndarray:
        return interned.setdefault(arr.tobytes(), arr)

    def of(costs: list) -> np.ndarray:
        if id(costs) not in of_costs:  # (the ids stay valid: priced holds every list meanwhile)
            of_costs[id(costs)] = intern(np.array([c.buffer_bytes for c in costs], dtype=float))
        return of_costs[id(costs)]

    return {
        n: of(priced.node_costs[n]) if n in priced.node_costs else intern(np.zeros(graph.strategies(n)))
        for n in graph.nodes
    }


def static_part(
    graph: CostGraph, buffers: dict[str, np.ndarray], keep: dict[str, np.ndarray] | None = None
) -> CostGraph:
    """``graph`` with each node's memory less its ring buffer, on the strategies ``keep`` (default: all). Arrays
    shared between nodes stay shared (:func:`~primepar_fx.search.restrict`)."""
    static: dict[tuple[int, int], np.ndarray] = {}
    memory = {}
    for n in graph.nodes:
        mem, buf = graph.node_memory[n], buffers[n]  # type: ignore[index]
        key = (id(mem), id(buf))
        if key not in static:
            static[key] = mem - buf
        memory[n] = static[key]
    return restrict(graph, keep or {}, memory)


def least_peak(
    graph: CostGraph,
    buffers: dict[str, np.ndarray],
    budget: float = math.inf,
    leanest: tuple[dict[str, int], float] | None = None,
) -> float:
    """The least reported peak (static memory + the largest ring buffer) of any plan, or a lower bound of it when
    that bound fits ``budget`` (then the budgeted search decides).

    The least static memory over all plans (one memory-only DP) plus the smallest largest buffer any plan can
    have bounds the peak from below; when that already exceeds the budget the distinct buffer sizes are walked
    upwards as caps, each a memory-only DP on the strategies whose buffer fits it, until the bound with the cap
    reaches the best peak found: a few DP runs where the budgeted search would run several per cap.
    """
    return least_plan(graph, buffers, budget, leanest)[0]


def least_plan(
    graph: CostGraph,
    buffers: dict[str, np.ndarray],
    budget: float = -math.inf,
    leanest: tuple[dict[str, int], float] | None = None,
) -> tuple[float, dict[str, int] | None]:
    """:func:`least_peak` with a plan that has it (``None`` when only the lower bound was needed: it fits
    ``budget``); with the default ``budget`` the exact least peak and its plan. ``leanest``: :func:`least_memory`
    of :func:`static_part` of ``graph`` and ``buffers``, when the caller has it."""
    _, floor = least_memory(static_part(graph, buffers)) if leanest is None else leanest
    lowest_cap = max((float(b.min()) for b in buffers.values() if len(b)), default=0.0)
    if floor + lowest_cap <= budget:
        return floor + lowest_cap, None
    best: tuple[float, dict[str, int] | None] = (math.inf, None)
    for cap in sorted({float(b) for arr in buffers.values() for b in arr if b >= lowest_cap}):
        if floor + cap >= best[0]:
            break
        keep = {n: np.flatnonzero(buffers[n] <= cap) for n in graph.nodes}
        choice, memory = least_memory(static_part(graph, buffers, keep))
        if memory + cap < best[0]:
            best = (memory + cap, {n: int(keep[n][i]) for n, i in choice.items()})
    return best
