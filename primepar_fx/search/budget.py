"""A hard memory budget for the DP, by Lagrangian relaxation.

Problem, with ``C(p)`` the objective of :mod:`primepar_fx.search.problem` (``alpha * M`` included)::

    OPT = min_p C(p)   subject to   M(p) <= B

Relaxation: for a multiplier ``lam >= 0``, ``L(lam) = min_p C(p) + lam * (M(p) - B)`` is one DP run with memory
weight ``alpha + lam`` (:meth:`~primepar_fx.search.dp.DPSolver.minimise`), and ``L(lam) <= OPT`` (weak duality):
every run yields a proven lower bound.

Multiplier search (bisection on the breakpoints of the concave dual): keep the cheapest plan known to break the
budget (``lo``; at first the unconstrained optimum) and one known to fit (``hi``; at first the least-memory plan,
or the best fitting plan of the multipliers a caller hints, e.g. those that bracketed a similar budget).
Each plan is a line ``C + lam * M`` in ``lam``; try the ``lam`` where the two lines cross. If the DP finds nothing
below the crossing, that ``lam`` maximises the dual and the search stops; otherwise the new plan replaces ``lo``
or ``hi``. Each step discards a plan for good, so this ends; in practice within a few runs.

Guarantees:

* The returned plan never exceeds the budget: every candidate's memory is re-summed exactly (``math.fsum``).
* If even the least-memory plan exceeds ``B``, :class:`~primepar_fx.search.problem.InfeasibleBudget` reports that
  least memory, found exactly by a DP that minimises memory alone (forbidden pairs stay forbidden).
* ``proven_optimal`` holds when the plan's cost meets the best lower bound. It can fail: the budget-constrained
  optimum need not minimise ``C + lam * M`` for any ``lam`` (a *duality gap*). Then the plans seen are crossed over
  between cut points (:func:`_crossover`) and polished by single-node moves (:func:`_polish`), within budget; the
  plan is returned with its gap (``bound``). :func:`primepar_fx.search.solve` with ``method="auto"`` then asks the
  ILP to close the gap when the ILP is small enough. How often the DP plan is optimal, and how far above the
  optimum it lands otherwise, is recorded in ``docs/benchmarks/measured_in_code.md``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from primepar_fx.search.dp import DPOptions, DPResult, DPSolver
from primepar_fx.search.problem import (
    CostGraph,
    CutOff,
    InfeasibleBudget,
    InfeasibleGraph,
    Reduced,
    TableTooLarge,
    evaluate,
    plan_memory,
    reduce_graph,
    restrict,
)
from primepar_fx.search.structure import Structure

log = logging.getLogger(__name__)

#: relative tolerance for "the DP found nothing below the crossing" and for "the gap is closed"
TOLERANCE = 1e-9


@dataclass(frozen=True)
class BudgetResult:
    """A plan within the memory budget: strategies, cost, memory, the best proven lower bound on the cost and the
    number of DP runs it took."""

    choice: dict[str, int]
    cost: float
    memory: float
    bound: float
    runs: int
    #: the Lagrange multipliers that bracketed the budget at the end (the last plan over it, the last within it;
    #: empty when the free plan fit): hints for a search of a similar budget
    multipliers: tuple[float, ...] = ()

    @property
    def proven_optimal(self) -> bool:
        return self.cost - self.bound <= TOLERANCE * max(1.0, abs(self.cost))


@dataclass(frozen=True)
class _Plan:
    choice: dict[str, int]
    cost: float
    memory: float


def memory_graph(graph: CostGraph) -> CostGraph:
    """The graph whose optimum is the least memory: node cost = memory, edge cost = 0, ``+inf`` kept where
    forbidden; an edge that forbids nothing is left out (it adds nothing to any plan). Arrays shared between nodes
    stay shared, so repeated layers are still found cheaply."""
    made: dict[tuple[int, ...], np.ndarray | None] = {}
    mem = {n: graph.memory_of(n) for n in graph.nodes}  # held, so the ids below stay unique

    def node(n: str) -> np.ndarray:
        key = (id(graph.node_cost[n]), id(mem[n]))
        if key not in made:
            made[key] = np.where(np.isfinite(graph.node_cost[n]), mem[n], np.inf)
        return made[key]  # type: ignore[return-value]

    def edge(a: np.ndarray) -> np.ndarray | None:
        if (id(a),) not in made:  # costs are checked: no NaN, no -inf, so the largest is +inf where one is
            made[(id(a),)] = np.where(np.isfinite(a), 0.0, np.inf) if a.size and a.max() == np.inf else None
        return made[(id(a),)]

    nodes = {n: node(n) for n in graph.nodes}
    edges = {e: m for e, a in graph.edge_cost.items() if (m := edge(a)) is not None}
    return graph.derive(node_cost=nodes, edge_cost=edges, node_memory=None, checked=())  # checked memory, 0, +inf


def budget_bound(
    graph: CostGraph,
    budget: float,
    cutoff: float = math.inf,
    *,
    alpha: float = 0.0,
    options: DPOptions | None = None,
    hints: Sequence[float] = (),
    first: dict[str, int] | None = None,
    least: tuple[dict[str, int], float] | None = None,
) -> float:
    """A proven lower bound on the cheapest plan of ``graph`` within ``budget`` (forbidden strategies allowed): the
    Lagrangian search of :func:`solve_budget_dp` without its primal heuristics, stopped as soon as the bound reaches
    ``cutoff``. ``inf`` where no plan fits the budget (or none is finite); ``-inf`` (no bound) where the DP's tables
    are too large. ``first``: a plan of least objective at weight ``alpha``; ``least``: :func:`least_memory`'s
    answer; when the caller has them (read where no strategy is forbidden, so that their indices hold)."""
    try:
        reduced = reduce_graph(graph).graph
        if reduced is not graph:
            first = least = None
        found = solve_budget_dp(
            reduced,
            budget,
            alpha=alpha,
            options=options,
            cutoff=cutoff,
            hints=hints,
            primal=False,
            first=None if first is None else DPResult(first, evaluate(graph, first, alpha)),
            least=least,
        )
        return found.bound
    except CutOff as stopped:
        return stopped.bound  # type: ignore[return-value]
    except (InfeasibleBudget, InfeasibleGraph):
        return math.inf
    except TableTooLarge:
        return -math.inf


def least_memory(graph: CostGraph, options: DPOptions | None = None) -> tuple[dict[str, int], float]:
    """The least memory per device of any finite-cost plan, and such a plan (exact, by the DP on
    :func:`lean_memory_graph`, which is far smaller than ``graph``'s DP)."""
    reduced = reduce_graph(memory_graph(graph))
    lean = lean_memory_graph(reduced.graph)
    choice = reduced.lift(lean.lift(DPSolver(lean.graph, options).minimise().choice))
    return choice, plan_memory(graph, choice)


#: passes of :func:`lean_memory_graph` at most (each can only shrink what the last left; two reach the fixpoint in
#: the models measured)
LEAN_PASSES = 4


def lean_memory_graph(graph: CostGraph) -> Reduced:
    """``graph`` (a :func:`memory_graph`, arc consistent: :func:`~primepar_fx.search.problem.reduce_graph`) with the
    same least memory, and a plan of it, on far fewer strategies and edges.

    Its edges only forbid (0 or ``+inf``), so an edge that forbids nothing is dropped, and at each node the
    strategies that allow the same strategies of every neighbour are interchangeable: only the one of least memory
    (the first of equals) is kept. Replacing every node's strategy by its kept one at once keeps a plan feasible
    (each keeps its neighbours' allowed sets, against every strategy of theirs) and its memory no larger, so the
    optimum is unchanged. Repeated until nothing shrinks (a smaller neighbour can make more strategies alike).
    Nodes whose arrays are one object and whose edges' arrays are too get one kept array, so the DP still finds
    identical layers."""
    kept_all = {n: np.arange(graph.strategies(n)) for n in graph.nodes}
    for _ in range(LEAN_PASSES):
        graph = graph.derive(
            edge_cost={e: a for e, a in graph.edge_cost.items() if a.max() == np.inf}, node_memory=None
        )
        allowed: dict[int, np.ndarray] = {}  # the finite masks by array identity (the graph holds every array)
        classes: dict[tuple, np.ndarray] = {}
        kept: dict[str, np.ndarray] = {}
        for n in graph.nodes:
            sides = [(graph.edge_cost[(n, v)], False) for v in graph.succ[n]]
            sides += [(graph.edge_cost[(u, n)], True) for u in graph.pred[n]]
            key = (id(graph.node_cost[n]), *((id(a), t) for a, t in sides))
            if key not in classes:
                masks = [allowed.setdefault(id(a), np.isfinite(a)) for a, _ in sides]
                classes[key] = _least_of_classes(
                    graph.node_cost[n], [m.T if t else m for m, (_, t) in zip(masks, sides)]
                )
            kept[n] = classes[key]
        if all(len(kept[n]) == graph.strategies(n) for n in graph.nodes):
            break
        kept_all = {n: kept_all[n][kept[n]] for n in graph.nodes}
        graph = restrict(graph, kept)
    return Reduced(graph, kept_all)


def _least_of_classes(memory: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
    """The strategies (indices, ascending) of least ``memory``, the first of equals, among those whose rows of every
    ``masks[k]`` (``[strategy, neighbour's strategy]``) are equal."""
    if not masks:
        return np.array([int(np.argmin(memory))])
    pattern = np.ascontiguousarray(np.concatenate(masks, axis=1))
    rows = pattern.view(np.dtype((np.void, pattern.shape[1]))).reshape(-1)
    _, cls = np.unique(rows, return_inverse=True)
    order = np.lexsort((np.arange(len(memory)), memory, cls.reshape(-1)))  # by class, then memory, then index
    first = order[np.r_[True, np.diff(cls.reshape(-1)[order]) != 0]]
    return np.sort(first)


def solve_budget_dp(
    graph: CostGraph,
    budget: float,
    *,
    alpha: float = 0.0,
    options: DPOptions | None = None,
    max_runs: int = 64,
    cutoff: float = math.inf,
    solver: DPSolver | None = None,
    first: DPResult | None = None,
    hints: Sequence[float] = (),
    primal: bool = True,
    least: tuple[dict[str, int], float] | None = None,
) -> BudgetResult:
    """The cheapest plan within ``budget`` the Lagrangian search finds, with a proven lower bound.

    ``cutoff``: the caller has a plan of that cost already. Once the lower bound reaches it, no plan here can be
    cheaper, so the search stops with what it has (its cost is then >= ``cutoff``, and not proven optimal), or
    raises :class:`CutOff` (with the bound) where it has no plan within the budget yet.
    ``solver``: a :class:`DPSolver` of ``graph`` already built; ``first``: its minimum at weight ``alpha``, when
    the caller has it (:class:`~primepar_fx.search.solve.Search` keeps both). ``hints``: multipliers to try first
    (:attr:`BudgetResult.multipliers` of a search of a similar budget); a hint whose plan fits replaces the
    least-memory plan as the first plan within budget, so a good hint saves that run and most of the bisection.
    The guarantees (within budget, a proven bound) hold with any hints; where a duality gap remains, the plan the
    crossover makes from fewer plans seen may differ (by no more than the gap). ``primal=False``: where a gap
    remains, the plans seen are not crossed over and polished (:func:`budget_bound` wants the bound only).
    ``least``: :func:`least_memory` of ``graph``, when the caller has it."""
    search = _Bracket(graph, budget, alpha, solver or DPSolver(graph, options), first)
    lo = search.lo
    if lo.memory <= budget:
        return BudgetResult(lo.choice, lo.cost, lo.memory, lo.cost, 1)
    search.try_hints(hints, max_runs)
    if search.hi is None and search.bound >= cutoff:  # nothing within the budget can beat the caller's plan: said
        raise CutOff(cutoff, search.bound)  # before the least-memory plan's DP run (it only gives a plan that does not)
    if search.hi is None:
        search.fit_least_memory(options, least)
    search.bisect(max_runs, cutoff)
    result = search.result()
    if result.proven_optimal or search.bound >= cutoff or not primal:
        return result
    return search.result(search.improved())


@dataclass
class _Bracket:
    """The multiplier search of :func:`solve_budget_dp`: the plans its runs found (``seen``), how many runs, the best
    lower bound, the cheapest plan known to break the budget (``lo``) and the one known to fit (``hi``) with the
    multipliers they were found at (0: not by a multiplier), and the cheapest plan within the budget (``best``).
    Making one runs the DP once, at ``lam = 0`` (``lo``)."""

    graph: CostGraph
    budget: float
    alpha: float
    solver: DPSolver
    #: the solver's minimum at weight ``alpha``, when the caller has it
    first: DPResult | None
    seen: list[_Plan] = field(default_factory=list)
    runs: int = 0
    lo: _Plan = field(init=False)
    bound: float = field(init=False)
    hi: _Plan | None = None
    best: _Plan | None = None
    lam_lo: float = 0.0
    lam_hi: float = 0.0

    def __post_init__(self) -> None:
        self.lo = self.run(0.0)
        self.bound = self.lo.cost

    def run(self, lam: float) -> _Plan:
        """The DP's plan at multiplier ``lam`` (``first`` at 0 where the caller gave it), counted and kept."""
        if lam == 0.0 and self.first is not None:
            choice = self.first.choice
        else:
            choice = self.solver.minimise(self.alpha + lam).choice
        self.seen.append(_Plan(choice, evaluate(self.graph, choice, self.alpha), plan_memory(self.graph, choice)))
        self.runs += 1
        return self.seen[-1]

    def try_hints(self, hints: Sequence[float], max_runs: int) -> None:
        """Run the multipliers that bracketed a similar budget, larger (leaner) first: the cheapest plan that fits
        becomes ``hi``, a costlier plan over the budget ``lo`` (the crossing moves closer)."""
        for lam in sorted(hints, reverse=True):
            if not (math.isfinite(lam) and lam > 0) or self.runs >= max_runs:
                continue
            plan = self.run(lam)
            self.bound = max(self.bound, plan.cost + lam * plan.memory - lam * self.budget)
            log.debug("budget: hint lam=%.6g cost=%.6g memory=%.6g bound=%.6g", lam, plan.cost, plan.memory, self.bound)
            if plan.memory <= self.budget:
                if self.hi is None or plan.cost < self.hi.cost:
                    self.hi, self.lam_hi = plan, lam
            elif plan.cost > self.lo.cost:
                self.lo, self.lam_lo = plan, lam

    def fit_least_memory(self, options: DPOptions | None, least: tuple[dict[str, int], float] | None) -> None:
        """``hi``: the least-memory plan (``least`` where the caller has it); :class:`InfeasibleBudget` where even it
        breaks the budget."""
        choice, smallest = least_memory(self.graph, options) if least is None else least
        if smallest > self.budget:
            raise InfeasibleBudget(self.budget, smallest)
        self.hi = _Plan(choice, evaluate(self.graph, choice, self.alpha), smallest)
        self.seen.append(self.hi)
        self.runs += 1

    def bisect(self, max_runs: int, cutoff: float) -> None:
        """Try the multiplier where the lines of ``lo`` and ``hi`` cross, each new plan replacing one of them, until
        the DP finds nothing below the crossing (that multiplier maximises the dual), the gap closes, the bound
        reaches ``cutoff`` or ``max_runs`` runs are spent."""
        assert self.hi is not None  # a hint's plan, or the least-memory plan
        best = self.best = self.hi
        while (
            self.runs < max_runs
            and best.cost - self.bound > TOLERANCE * max(1.0, abs(best.cost))
            and self.bound < cutoff
        ):
            lo, hi = self.lo, self.hi
            lam = (hi.cost - lo.cost) / (lo.memory - hi.memory)
            plan = self.run(lam)
            value, crossing = plan.cost + lam * plan.memory, hi.cost + lam * hi.memory
            self.bound = max(self.bound, value - lam * self.budget)
            if plan.memory <= self.budget and plan.cost < best.cost:
                best = self.best = plan
            log.debug("budget: lam=%.6g cost=%.6g memory=%.6g bound=%.6g", lam, plan.cost, plan.memory, self.bound)
            if value >= crossing - TOLERANCE * max(1.0, abs(crossing)):
                break  # nothing below the crossing: lam maximises the dual
            if plan.memory <= self.budget:
                self.hi, self.lam_hi = plan, lam
            else:
                self.lo, self.lam_lo = plan, lam

    def improved(self) -> _Plan:
        """Where a duality gap remains: ``best``, or the plans seen crossed over where the DP cuts if that is cheaper
        (:func:`_crossover`), polished by single-node moves (:func:`_polish`); within the budget."""
        assert self.best is not None
        px, best = self.solver.proxied, self.best  # the crossover cuts on the graph with its proxies
        seen = [_Plan(px.extend(p.choice), p.cost, p.memory) for p in self.seen]
        mixed = _crossover(px.graph, self.solver.structure, seen, self.budget, self.alpha)
        if mixed is not None:
            mixed = _Plan(px.strip(mixed.choice), mixed.cost, mixed.memory)
        if mixed is not None and mixed.cost < best.cost:
            log.debug("budget: crossing plans over lowers the cost from %.6g to %.6g", best.cost, mixed.cost)
            best = mixed
        return _polish(self.graph, best, self.budget, self.alpha)

    def result(self, plan: _Plan | None = None) -> BudgetResult:
        """``plan`` (by default ``best``) with the bound, the runs and the multipliers that bracket the budget."""
        plan = plan or self.best
        assert plan is not None
        multipliers = tuple(x for x in (self.lam_lo, self.lam_hi) if x > 0)
        return BudgetResult(plan.choice, plan.cost, plan.memory, self.bound, self.runs, multipliers)


def _polish(graph: CostGraph, plan: _Plan, budget: float, alpha: float, passes: int = 3) -> _Plan:
    """Local search: move single nodes to a cheaper strategy while the budget holds (heuristic, primal only)."""
    choice, memory = dict(plan.choice), plan.memory
    for _ in range(passes):
        moved = False
        for n in graph.nodes:
            mem, p = graph.memory_of(n), choice[n]
            local = graph.node_cost[n] + alpha * mem
            for u in graph.pred[n]:
                local = local + graph.edge_cost[u, n][choice[u], :]
            for v in graph.succ[n]:
                local = local + graph.edge_cost[n, v][:, choice[v]]
            local = np.where(memory - mem[p] + mem <= budget, local, np.inf)
            q = int(np.argmin(local))
            if local[q] < local[p] - TOLERANCE * max(1.0, abs(local[p])):
                memory, choice[n], moved = memory - mem[p] + mem[q], q, True
        if not moved:
            break
    memory = plan_memory(graph, choice)
    if memory > budget:  # drift in the running sum: keep the plan we had
        return plan
    cost = evaluate(graph, choice, alpha)
    return _Plan(choice, cost, memory) if cost < plan.cost else plan


@dataclass(frozen=True)
class _Prefix:
    """Running sums of a plan along the DP order, and per cut the cost of handing over to another plan."""

    cost: np.ndarray  # cost[k + 1] = cost of positions 0..k (node, incoming edges, edges to globals)
    memory: np.ndarray


def _prefix(graph: CostGraph, structure: Structure, plan: dict[str, int], alpha: float) -> _Prefix:
    glob = set(structure.globals)
    cost, mem = np.zeros(len(structure.order) + 1), np.zeros(len(structure.order) + 1)
    for k, n in enumerate(structure.order):
        mem[k + 1] = float(graph.memory_of(n)[plan[n]])
        edges = [graph.edge_cost[u, n][plan[u], plan[n]] for u in graph.pred[n]]
        edges += [graph.edge_cost[n, v][plan[n], plan[v]] for v in graph.succ[n] if v in glob]
        cost[k + 1] = float(graph.node_cost[n][plan[n]]) + alpha * mem[k + 1] + math.fsum(edges)
    return _Prefix(np.cumsum(cost), np.cumsum(mem))


def _handover(graph: CostGraph, cut: str, left: dict[str, int], right: dict[str, int], glob: set[str]) -> float:
    """Extra cost when ``cut`` keeps ``left``'s strategy and the nodes after it take ``right``'s."""
    out = [
        graph.edge_cost[cut, v][left[cut], right[v]] - graph.edge_cost[cut, v][right[cut], right[v]]
        for v in graph.succ[cut]
        if v not in glob
    ]
    return math.fsum(out)


def _crossover(graph: CostGraph, structure: Structure, plans: list[_Plan], budget: float, alpha: float):
    """Two-point crossover of every pair of plans seen: ``A`` outside and ``B`` inside a range of cuts.

    At a cut no edge jumps over, so cost and memory of the mix are prefix sums plus the handover edges at the two
    cuts, all exact; every pair of cuts is tried at once with numpy. This lets ``k`` of ``L`` identical layers use
    the low-memory strategy, which no single Lagrangian plan does (ties at the final multiplier break the same way
    in every layer). A heuristic for the primal side only: the bound is unchanged.
    """
    order, glob = structure.order, set(structure.globals)
    plans = [p for k, p in enumerate(plans) if all(p.choice != q.choice for q in plans[:k])]
    if not order or len(plans) < 2:
        return None
    starts = {s.nodes[0] for s in structure.segments}
    cuts = [-1] + [k for k, n in enumerate(order) if n in starts]
    cuts.append(len(order) - 1)
    idx = np.array(cuts) + 1  # into the prefix arrays
    best, prefixes = None, {}

    def prefix(k: int, choice: dict[str, int]) -> _Prefix:
        key = (k, *(choice[g] for g in structure.globals))
        if key not in prefixes:
            prefixes[key] = _prefix(graph, structure, choice, alpha)
        return prefixes[key]

    for (ka, a_plan), (kb, b_plan) in itertools.permutations(enumerate(plans), 2):
        inner = dict(b_plan.choice) | {g: a_plan.choice[g] for g in glob}  # the mix keeps A's global strategies
        pa, pb = prefix(ka, a_plan.choice), prefix(kb, inner)
        into = np.array([0.0] + [_handover(graph, order[c], a_plan.choice, inner, glob) for c in cuts[1:]])
        back = np.array([0.0] + [_handover(graph, order[c], inner, a_plan.choice, glob) for c in cuts[1:]])
        with np.errstate(invalid="ignore"):  # inf - inf where a plan is infinite past a cut (a proxy's edges)
            inner_c = pb.cost[idx][None, :] - pb.cost[idx][:, None]
            cost = pa.cost[idx][:, None] + inner_c + (pa.cost[-1] - pa.cost[idx])[None, :] + into[:, None]
            cost = np.nan_to_num(cost + back[None, :], nan=np.inf)
        inner_m = pb.memory[idx][None, :] - pb.memory[idx][:, None]
        memory = pa.memory[idx][:, None] + inner_m + (pa.memory[-1] - pa.memory[idx])[None, :]
        ok = np.triu(memory <= budget, 1)
        if not ok.any():
            continue
        i, j = np.unravel_index(np.argmin(np.where(ok, cost, np.inf)), cost.shape)
        if best is None or cost[i, j] < best[0]:
            mixed = dict(a_plan.choice)
            mixed.update({n: inner[n] for n in order[cuts[i] + 1 : cuts[j] + 1]})
            best = (cost[i, j], mixed)
    if best is None:
        return None
    memory = plan_memory(graph, best[1])
    return _Plan(best[1], evaluate(graph, best[1], alpha), memory) if memory <= budget else None
