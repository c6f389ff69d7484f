"""The memory levers of one priced mesh: its ZeRO stage and recomputation, weighed against the budget.

:func:`choose_levers` is what the planner runs on each mesh and micro-batch count it searches
(:mod:`primepar_fx.planning.planner`): the fastest plan where it fits as it is, else ZeRO-2 and the recomputation
policies of :func:`~primepar_fx.levers.recompute.choose_recompute`, and ZeRO-3 where nothing fits at stage 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.graph import OpGraph
from primepar_fx.levers.peak import plan_peak, solve_for_peak
from primepar_fx.levers.recompute import Chosen, choose_recompute
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.search import CutOff, InfeasibleBudget


@dataclass(frozen=True, slots=True)
class LeverOptions:
    """What a plan's options ask of the levers (:class:`~primepar_fx.planning.options.PlanOptions` checks them):
    ``recompute`` a mode of :data:`~primepar_fx.levers.choices.CHOICES`, ``zero`` a stage or ``"auto"``, the
    per-device ``memory_budget`` in bytes (``None``: none), the objective's ``alpha`` (seconds per byte) and the
    search ``method``."""

    recompute: str = "auto"
    zero: str | int = "auto"
    memory_budget: float | None = None
    alpha: float = 0.0
    method: str = "auto"


def choose_levers(
    graph: OpGraph,
    priced: PricedGraph,
    values: dict,
    costs: CostOptions,
    opts: LeverOptions,
    cutoff: Callable[[], float] | None = None,
    *,
    free_only: bool = False,
    reprice: Callable[[CostOptions], PricedGraph] | None = None,
) -> tuple[Chosen, int]:
    """The plan's recomputation and solution on one mesh, and its ZeRO stage.

    A stage asked for is priced as it is. ``"auto"``: stage 0 when the fastest plan fits the budget without it;
    else stage 2, which moves the bytes of stage 0 in the same time and holds less, so every plan that fits at
    stage 0 fits at stage 2 as fast (it is the stage to weigh against recomputation and slower partitions); and
    where nothing fits at stage 2, stage 3 (the parameters split too, gathered around their uses: more bytes
    sent, so it is the last resort), priced again by ``reprice(costs)``.
    ``priced`` is priced at ``costs``' stage. ``cutoff()``: the objective of a plan the caller has (asked only
    when the levers are searched; :class:`~primepar_fx.search.CutOff` when nothing that fits beats it).
    ``free_only``: :class:`~primepar_fx.search.CutOff` where the fastest plan does not fit as it is.
    """

    def choose(p: PricedGraph, c: CostOptions) -> Chosen:
        return choose_recompute(
            graph,
            p,
            values,
            c,
            choice=opts.recompute,
            memory_budget=opts.memory_budget,
            alpha=opts.alpha,
            method=opts.method,
            cutoff=math.inf if cutoff is None else cutoff(),
        )

    if opts.zero != "auto":
        return choose(priced, costs), costs.zero
    if opts.memory_budget is None and opts.alpha == 0:  # nothing to weigh stage 2's memory against
        return choose(priced, costs), 0
    whole = dataclasses.replace(costs, zero=0)
    if opts.alpha == 0:
        priced.fastest(opts.method)  # found once: the pricing at stage 0 below keeps it, and its search graph
    unsharded = priced.with_memory(whole)
    free = solve_for_peak(unsharded, memory_budget=None, alpha=opts.alpha, method=opts.method)
    if opts.alpha == 0:  # the fastest plan fits as it is, or with its replicas' state split
        if plan_peak(unsharded, free.choice) <= opts.memory_budget:  # type: ignore[operator]
            return Chosen(free, unsharded, None), 0
        if plan_peak(priced, free.choice) <= opts.memory_budget:  # type: ignore[operator]
            return Chosen(free, priced, None), costs.zero
    if free_only:
        raise CutOff(math.inf)
    try:
        return choose(priced, costs), costs.zero
    except InfeasibleBudget as exc:
        if reprice is None:
            raise
        third = dataclasses.replace(costs, zero=3)
        try:
            return choose(reprice(third), third), 3
        except InfeasibleBudget as at_three:  # the least either needs
            raise InfeasibleBudget(opts.memory_budget, min(exc.min_memory, at_three.min_memory)) from None  # type: ignore[arg-type]
