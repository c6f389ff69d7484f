"""The search's entry point: :func:`solve` picks a strategy per operator (paper §5).

Objective and constraints are those of :mod:`primepar_fx.search.problem`: minimise
``sum n_i + sum e_uv + alpha * M`` with one strategy per node, ``+inf`` entries forbidden, and optionally the hard
budget ``M <= memory_budget``. The methods:

* ``"dp"`` -- the segmented DP (:mod:`~primepar_fx.search.dp`, exact); with a budget, its Lagrangian search
  (:mod:`~primepar_fx.search.budget`), which always returns a plan within budget and proves optimality unless the
  relaxation has a duality gap.
* ``"ilp"`` -- the ILP (:mod:`~primepar_fx.search.ilp`), with the budget as a constraint.
* ``"auto"`` -- the DP; if its tables would be too large, the ILP; if that is too large too and there is no
  budget, the DP with a limit :data:`AUTO_TABLE_STRETCH` times larger where the table fits that (:func:`solve`; a
  :class:`Search` only where asked, ``table_stretch``); else the DP on a narrower space (the nodes of the tables
  too large keep their locally cheapest strategies: a plan, not proven optimal, ``method="dp-narrowed"``), and
  from that plan, without a budget, with HiGHS and up to ``ilp_max_pairs`` edge pairs, the ILP by column
  generation (:mod:`~primepar_fx.search.colgen`: exact; ``method="dp-narrowed+ilp"``); with a budget and an
  unclosed duality gap, the ILP as well when it is small enough (``ilp_max_variables``), for at most
  :data:`GAP_ILP_SECONDS` unless ``time_limit`` says otherwise, keeping the better plan.

Forbidden strategies are dropped first (:func:`~primepar_fx.search.problem.reduce_graph`); every answer is then
re-evaluated exactly on the original graph and re-checked against the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from primepar_fx.search.budget import least_memory, solve_budget_dp
from primepar_fx.search.dp import DPOptions, DPResult, DPSolver
from primepar_fx.search.ilp import IlpInfeasible, ilp_size, solve_ilp, solver_name
from primepar_fx.search.problem import (
    CostGraph,
    InfeasibleBudget,
    InfeasibleGraph,
    Reduced,
    SearchError,
    Solution,
    TableTooLarge,
    evaluate,
    plan_memory,
    reduce_graph,
    restrict,
)

log = logging.getLogger(__name__)

Method = Literal["dp", "ilp", "auto"]


def _ilp(red: Reduced, budget: float | None, alpha: float, time_limit: float | None) -> tuple[dict, bool]:
    try:
        res = solve_ilp(red.graph, alpha=alpha, memory_budget=budget, time_limit=time_limit)
    except IlpInfeasible:
        least = solve_ilp(red.graph, minimise_memory=True, time_limit=time_limit)
        raise InfeasibleBudget(budget, plan_memory(red.graph, least.choice)) from None
    return res.choice, res.proven_optimal


#: the longest (seconds) ``auto``'s ILP may run to close the duality gap of the DP's Lagrangian search under a
#: budget, where the search has no ``time_limit``: it refines a plan that fits already (the gap is stated by the
#: bound), and a memory-constrained ILP can take minutes to prove even on a two-layer model (measured in
#: docs/planning.md), many times in one plan's lever search
GAP_ILP_SECONDS = 3.0

#: the most edge pairs (finite entries of the edge matrices) ``auto`` lets the ILP by column generation price after
#: a narrowed DP (each round prices them all, in time proportional to their number:
#: docs/benchmarks/measured_in_code.md)
ILP_MAX_PAIRS = 50_000_000


class Search:
    """One graph, reduced and (for the DP) analysed once, then searched as often as the caller needs: free, under
    several budgets, with several cutoffs (:meth:`solve`). The DP's plan for a memory weight is kept, so a budgeted
    search after a free one starts from it instead of running it again. :func:`solve` is one such search.

    ``ilp_max_pairs``: where ``auto`` narrows the DP, the most edge pairs the ILP by column generation may then
    price (module docstring); 0 (the default here; :func:`solve`'s is :data:`ILP_MAX_PAIRS`) leaves the narrowed
    plan as it is: callers that search many related graphs (the memory caps of ``levers.peak``) keep it fast.
    ``table_stretch``: where ``auto``'s DP tables pass the limit and there is no budget, it first runs the DP with
    a limit this many times larger; 1 (the default here; :func:`solve`'s is :data:`AUTO_TABLE_STRETCH`) does not,
    for the same callers (timings of both in docs/benchmarks/measured_in_code.md)."""

    def __init__(
        self,
        graph: CostGraph,
        *,
        method: Method = "auto",
        options: DPOptions | None = None,
        time_limit: float | None = None,
        ilp_max_variables: int = 200_000,
        ilp_max_pairs: int = 0,
        table_stretch: int = 1,
    ) -> None:
        if method not in ("dp", "ilp", "auto"):
            raise ValueError(f"method must be 'dp', 'ilp' or 'auto', got {method!r}")
        if isinstance(table_stretch, bool) or not isinstance(table_stretch, int) or table_stretch < 1:
            raise ValueError(f"table_stretch must be a whole number >= 1, got {table_stretch!r}")
        self.graph, self.method, self.options = graph, method, options
        self.time_limit, self.ilp_max_variables, self.ilp_max_pairs = time_limit, ilp_max_variables, ilp_max_pairs
        self.table_stretch = table_stretch
        self.reduced = reduce_graph(graph)
        self._solver: DPSolver | TableTooLarge | None = None
        self._minima: dict[float, DPResult] = {}
        self._multipliers: tuple[float, ...] = ()
        self._narrowed_nodes = 0  # how many nodes the last narrowed search narrowed

    def solve(
        self,
        *,
        memory_budget: float | None = None,
        alpha: float = 0.0,
        cutoff: float = math.inf,
        hints: Sequence[float] = (),
    ) -> Solution:
        """The cheapest plan (module docstring); ``cutoff`` (with a budget, DP and auto): the caller already has a
        plan of that cost, so the search may stop as soon as it proves that nothing here is cheaper; the plan it
        returns then costs at least ``cutoff`` (within budget, not proven optimal), or, where it has none within the
        budget yet, it raises :class:`~primepar_fx.search.CutOff`. Below the cutoff the answer is
        the same as without it. ``hints``: Lagrange multipliers for the DP's budgeted search to try first
        (:attr:`Solution.multipliers` of a search of a similar budget; :func:`~primepar_fx.search.solve_budget_dp`)."""
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
        if memory_budget is not None and math.isnan(memory_budget):
            raise ValueError("memory_budget is NaN")
        start, red, method = time.perf_counter(), self.reduced, self.method
        self._multipliers = ()
        if method == "dp":
            choice, proven, bound = self._dp(memory_budget, alpha, cutoff, hints)
        elif method == "ilp":
            choice, proven = _ilp(red, memory_budget, alpha, self.time_limit)
            bound = -math.inf
        else:
            choice, proven, bound, method = self._auto(memory_budget, alpha, cutoff, hints)
        choice = red.lift(choice)
        graph = self.graph
        cost, memory = evaluate(graph, choice, alpha), plan_memory(graph, choice)
        if memory_budget is not None and memory > memory_budget:
            raise SearchError(f"internal error: the {method} plan needs {memory:.6g} > budget {memory_budget:.6g}")
        bound = cost if proven else bound
        seconds = time.perf_counter() - start
        return Solution(choice, cost, memory, method, proven, seconds, bound, self._multipliers)

    def know_minimum(self, choice: Mapping[str, int]) -> bool:
        """Take ``choice`` (a strategy index of :attr:`graph` per node) as the DP's minimum at weight 0, where the
        caller has proven it: e.g. the fastest plan of a larger space that lies in this one (a subset's optimum
        is then that plan), so that neither the unbudgeted search nor a budgeted one (whose first run it is)
        runs the DP for it. ``False`` (nothing taken) where the choice is not in this search's space."""
        red = self.reduced
        mapped = {}
        for n, p in choice.items():
            kept = red.kept.get(n)
            if kept is None:
                return False
            i = int(np.searchsorted(kept, p))
            if i == len(kept) or kept[i] != p:
                return False
            mapped[n] = i
        if set(mapped) != set(red.graph.nodes):
            return False
        self._minima[0.0] = DPResult(mapped, evaluate(red.graph, mapped))
        return True

    def _dp_solver(self) -> DPSolver:
        if self._solver is None:
            try:
                self._solver = DPSolver(self.reduced.graph, self.options)
            except TableTooLarge as err:
                self._solver = err
        if isinstance(self._solver, TableTooLarge):
            raise self._solver
        return self._solver

    def _minimum(self, weight: float) -> DPResult:
        if weight not in self._minima:
            self._minima[weight] = self._dp_solver().minimise(weight)
        return self._minima[weight]

    def _dp(
        self, budget: float | None, alpha: float, cutoff: float = math.inf, hints: Sequence[float] = ()
    ) -> tuple[dict, bool, float]:
        """DP plan on the reduced graph, whether it is proven optimal, and its lower bound."""
        graph = self.reduced.graph
        if budget is None:
            res = self._minimum(alpha)
            return res.choice, True, evaluate(graph, res.choice, alpha)
        res = solve_budget_dp(
            graph,
            budget,
            alpha=alpha,
            options=self.options,
            cutoff=cutoff,
            solver=self._dp_solver(),
            first=self._minimum(alpha),
            hints=hints,
        )
        self._multipliers = res.multipliers
        log.info("DP under budget: %d runs, cost %.6g, bound %.6g", res.runs, res.cost, res.bound)
        return res.choice, res.proven_optimal, res.bound

    def _auto(
        self, budget: float | None, alpha: float, cutoff: float = math.inf, hints: Sequence[float] = ()
    ) -> tuple[dict, bool, float, str]:
        red = self.reduced
        try:
            choice, proven, bound = self._dp(budget, alpha, cutoff, hints)
        except TableTooLarge as err:
            size = ilp_size(red.graph)
            if size <= self.ilp_max_variables:
                log.info("DP tables too large (%s); solving the ILP instead", err)
                return (*_ilp(red, budget, alpha, self.time_limit), -math.inf, "ilp")
            stretched = self._stretched(err, budget, alpha)
            if stretched is not None:
                return (*stretched, "dp")
            narrowed = self._narrowed(err, budget, alpha, cutoff, hints)
            if narrowed is None:
                raise TableTooLarge(
                    f"{err}; the ILP fallback would need {size:,} variables (limit {self.ilp_max_variables:,}), so "
                    "neither solver can take this graph: use a smaller world size, canonical=True, or raise the limits"
                ) from None
            # unbudgeted only: a budget's Lagrangian search narrows and solves many times
            proved = self._generated(narrowed[0], budget, alpha) if budget is None else None
            if proved is not None and proved[1]:
                return (*proved, -math.inf, "dp-narrowed+ilp")
            where = err.nodes[0] if err.nodes else "?"
            # a plan's memory levers search many related graphs: said once a process, at info level after
            (log.info if where in _NARROWED_SAID else log.warning)(
                "the DP's tables were too large and the ILP too (%s); %d nodes were narrowed to their locally "
                "cheapest strategies: the plan is not proven optimal",
                where,
                self._narrowed_nodes,
            )
            _NARROWED_SAID.add(where)
            if proved is not None:  # the column generation stopped (a time limit) with a plan at least as good
                return (*proved, -math.inf, "dp-narrowed+ilp")
            return (*narrowed, -math.inf, "dp-narrowed")
        if proven or bound >= cutoff or ilp_size(red.graph, past=self.ilp_max_variables) > self.ilp_max_variables:
            return choice, proven, bound, "dp"
        limit = GAP_ILP_SECONDS if self.time_limit is None else self.time_limit
        try:
            ilp_choice, ilp_proven = _ilp(red, budget, alpha, limit)
        except SearchError as err:  # the time limit before any plan: the DP's stands, its gap stated by its bound
            log.info("the ILP closing the DP's duality gap stopped without a plan (%s)", err)
            return choice, proven, bound, "dp"
        if evaluate(red.graph, ilp_choice, alpha) < evaluate(red.graph, choice, alpha):
            choice = ilp_choice
        return choice, ilp_proven, bound, "dp+ilp"

    def _stretched(self, err: TableTooLarge, budget: float | None, alpha: float) -> tuple[dict, bool, float] | None:
        """The exact DP once more with ``table_stretch`` times the table limit, where ``err``'s table fits that and
        there is no budget (whose search runs the DP many times); ``None`` where it does not apply or a later table
        is too large even so."""
        options = self.options or DPOptions()
        limit = self.table_stretch * options.max_table_entries
        if budget is not None or self.table_stretch == 1 or not 0 < err.entries <= limit:
            return None
        try:
            res = DPSolver(self.reduced.graph, dataclasses.replace(options, max_table_entries=limit)).minimise(alpha)
        except TableTooLarge as again:
            log.info("the DP with its limit raised to %.1e: %s", limit, again)
            return None
        log.info("the DP's limit raised to %.1e for a table of %s entries: exact", limit, f"{err.entries:,}")
        return res.choice, True, evaluate(self.reduced.graph, res.choice, alpha)

    def _generated(self, start: dict[str, int], budget: float | None, alpha: float) -> tuple[dict, bool] | None:
        """The ILP by column generation from the plan ``start`` (:mod:`~primepar_fx.search.colgen`, HiGHS): the
        better of its plan and ``start``, and whether it is proven optimal; ``None`` without HiGHS or where the
        graph's edge pairs (which every round prices) are more than ``ilp_max_pairs``."""
        graph = self.reduced.graph
        if solver_name() != "highs" or ilp_size(graph, past=self.ilp_max_pairs) > self.ilp_max_pairs:
            return None
        try:
            res = solve_ilp(graph, alpha=alpha, memory_budget=budget, time_limit=self.time_limit, start=start)
        except SearchError as err:  # a time limit before the LP's optimum: the narrowed plan stands
            log.info("the ILP by column generation stopped without a plan (%s)", err)
            return start, False
        log.info("the ILP by column generation from the narrowed plan: proven %s", res.proven_optimal)
        if evaluate(graph, res.choice, alpha) <= evaluate(graph, start, alpha):
            return res.choice, res.proven_optimal
        return start, False

    def _narrowed(
        self, err: TableTooLarge, budget: float | None, alpha: float, cutoff: float, hints: Sequence[float]
    ) -> tuple[dict[str, int], bool] | None:
        """The DP on a narrower space, where its tables are too large and the ILP too: the nodes of the table that
        failed (and every node with the same key: the same node of the other layers) keep only their locally
        cheapest strategies (:func:`_local_order`), halving the largest domains until that table holds half the
        limit, and the DP runs again; up to :data:`NARROW_ROUNDS` tables. The plan is feasible but not proven
        optimal; ``None`` where the failing table names no node of the graph or a node is down to one strategy."""
        graph = self.reduced.graph
        limit = (self.options or DPOptions()).max_table_entries
        keys = graph.node_key or {}
        alike: dict[object, list[str]] = {}
        for n in graph.nodes:
            alike.setdefault(keys.get(n, n), []).append(n)
        kept: dict[str, np.ndarray] = {}
        for _ in range(NARROW_ROUNDS):
            names = [n for n in err.nodes if n in graph.index]
            if not names:
                return None
            sizes = {n: len(kept[n]) if n in kept else graph.strategies(n) for n in names}
            while math.prod(sizes.values()) > limit // 2:
                widest = max(sizes, key=lambda n: sizes[n])
                if sizes[widest] <= 1:
                    return None
                sizes[widest] //= 2
            for n, k in sizes.items():
                for m in alike[keys.get(n, n)]:
                    if m not in kept or len(kept[m]) > k:
                        kept[m] = np.sort(_local_order(graph, m, kept, alpha)[:k])
            try:
                sol = Search(restrict(graph, kept), method="dp", options=self.options).solve(
                    memory_budget=budget, alpha=alpha, cutoff=cutoff, hints=hints
                )
            except TableTooLarge as again:
                err = again
                continue
            except InfeasibleGraph:
                return None
            self._narrowed_nodes = len(kept)
            return {n: int(kept[n][p]) if n in kept else p for n, p in sol.choice.items()}, False
        return None


#: where the DP's tables pass its limit and there is no budget, ``auto`` first runs the DP once more with a limit this
#: many times larger (the limit bounds one step's work, run in chunks, not its memory): on the configs measured, the
#: exact DP on a table just past the limit was faster than the narrowed DP and the ILP by column generation that
#: proves its plan (docs/benchmarks/measured_in_code.md)
AUTO_TABLE_STRETCH = 5

#: the nodes whose tables too large :meth:`Search._auto` has warned of, in this process
_NARROWED_SAID: set[str] = set()

#: how many tables too large :meth:`Search._narrowed` narrows before it gives up: each round only plans the DP's
#: eliminations again (they fail before any arithmetic), so rounds are cheap. MiniMax's default config (lightning
#: attention), two layers on 8 GPUs, meets 17 to 32 such tables (its plan then proven optimal by the ILP)
NARROW_ROUNDS = 64


def _local_order(graph: CostGraph, node: str, kept: dict[str, np.ndarray], alpha: float) -> np.ndarray:
    """``node``'s strategies, cheapest first by what each costs locally: its own cost (and ``alpha`` times its
    memory) plus, on each edge, the cheapest partner among the neighbour's strategies still kept."""
    score = np.array(graph.node_cost[node], dtype=np.float64)
    if alpha and graph.node_memory is not None:
        score = score + alpha * graph.node_memory[node]
    for m in graph.succ[node]:
        edge = graph.edge_cost[(node, m)]
        score = score + (edge[:, kept[m]] if m in kept else edge).min(axis=1)
    for m in graph.pred[node]:
        edge = graph.edge_cost[(m, node)]
        score = score + (edge[kept[m]] if m in kept else edge).min(axis=0)
    return np.argsort(score, kind="stable")


def solve(
    graph: CostGraph,
    *,
    memory_budget: float | None = None,
    alpha: float = 0.0,
    method: Method = "auto",
    options: DPOptions | None = None,
    time_limit: float | None = None,
    ilp_max_variables: int = 200_000,
    cutoff: float = math.inf,
    ilp_max_pairs: int | None = None,
    table_stretch: int = AUTO_TABLE_STRETCH,
) -> Solution:
    """The cheapest plan (see the module docstring); ``time_limit`` (seconds) applies to the ILP only.

    ``cutoff`` (with a budget, DP and auto): the caller already has a plan of that cost. The search may stop as
    soon as it proves that nothing here is cheaper; the plan it returns then costs at least ``cutoff`` (within
    budget, not proven optimal). Below the cutoff the answer is the same as without it. :class:`Search` runs
    several searches of one graph."""
    if method not in ("dp", "ilp", "auto"):
        raise ValueError(f"method must be 'dp', 'ilp' or 'auto', got {method!r}")
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    if memory_budget is not None and math.isnan(memory_budget):
        raise ValueError("memory_budget is NaN")
    pairs = ILP_MAX_PAIRS if ilp_max_pairs is None else ilp_max_pairs
    search = Search(
        graph,
        method=method,
        options=options,
        time_limit=time_limit,
        ilp_max_variables=ilp_max_variables,
        ilp_max_pairs=pairs,
        table_stretch=table_stretch,
    )
    return search.solve(memory_budget=memory_budget, alpha=alpha, cutoff=cutoff)


def smallest_memory(graph: CostGraph, options: DPOptions | None = None) -> float:
    """The least memory per device of any finite-cost plan (exact, by the DP)."""
    return least_memory(reduce_graph(graph).graph, options)[1]
