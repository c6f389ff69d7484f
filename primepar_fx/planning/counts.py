"""The micro-batch counts searched in turn, the fastest plan kept (:func:`search_counts`).

Under a budget the counts of :func:`~primepar_fx.levers.choices.micro_batch_tries` are tried in order: fewer
micro-batches run larger ones, faster, but hold more. A count whose plan fits without recomputation or ZeRO-3 ends
the search (more micro-batches would only run smaller ones); a slower count does not (the step is not unimodal in
the count). A count that needs the levers weighs many DP runs, each bounded by the plan to beat
(:class:`~primepar_fx.planning.state.Bound`), which is, in this order, found lazily (only once a count's search
needs it):

1. the best plan found so far (with fewer micro-batches, or with the most, searched ahead);
2. else the fastest plan of the first later count but the last whose fastest plan fits as it is (a *probe*: each
   mesh's fastest plan, without the levers; the probes run side by side on the workers, and their pricings come
   back for the count's own search);
3. else the plan of the last count, the most micro-batches, searched whole ahead of its turn: it holds the least,
   so its plan is the likeliest to fit with few levers.

A count whose probe found a fitting plan takes the fastest plan that fits as it is, without the levers (nothing at
that count is faster), and a count whose probe is no faster than the plan found ends the search.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from primepar_fx.planning.meshes import search_count
from primepar_fx.planning.state import Bound, Found, Planning
from primepar_fx.planning.workers import in_worker, run_forked
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.search import InfeasibleBudget


def search_counts(state: Planning) -> Found:
    """The fastest plan over the micro-batch counts (module docstring), also kept as ``state.best``; raises
    :class:`~primepar_fx.search.InfeasibleBudget` with the least memory any count needs where nothing fits."""
    for i, m in enumerate(state.tries):
        state.searched.append(m)
        if m not in state.ahead and _probed_no_faster(state, m):
            break  # its fastest plan fits as it is and is no faster than the plan found: nor are more counts'
        got = _count_plan(state, i)
        if got is None or (state.best is not None and got.step_objective >= state.best.step_objective):
            continue  # slower; more micro-batches still may not be (the step is not unimodal in the count)
        state.best = got
        if not got.uses_levers:
            break  # it fits holding every activation: more micro-batches would only run smaller ones
    for got in state.ahead.values():  # a count searched ahead that the loop did not reach
        if got is not None and (state.best is None or got.step_objective < state.best.step_objective):
            state.best = got
    if state.best is None:
        raise InfeasibleBudget(state.opts.memory_budget, min(state.min_memory))  # type: ignore[arg-type]
    return state.best


def _probed_no_faster(state: Planning, m: int) -> bool:
    probed = state.probes.get(m)
    return probed is not None and state.best is not None and probed >= state.best.step_objective


def _count_plan(state: Planning, i: int) -> Found | None:
    """The plan of the ``i``-th count: searched ahead, its fastest where its probe found that it fits as it is, or
    searched with the levers under the plan to beat (:func:`plan_to_beat`); ``None`` where nothing (better) fits."""
    m = state.tries[i]
    if m in state.ahead:
        return state.ahead[m]
    if state.probes.get(m) is not None:
        return search_count(state, m, free_only=True).found
    return _searched(state, m, Bound(m, functools.partial(plan_to_beat, state, i), known=state.has_plan()))


def _searched(state: Planning, m: int, bound: Bound | None = None) -> Found | None:
    """Count ``m`` searched with the levers; where nothing fits (and nothing was cut off by the plan to beat), the
    least memory it needs is kept for the error."""
    outcome = search_count(state, m, bound)
    if outcome.found is None and not outcome.cut:
        state.min_memory.append(outcome.min_memory)
    return outcome.found


def plan_to_beat(state: Planning, i: int) -> float:
    """The per-step objective the search at the ``i``-th count must beat (the module docstring's order); run only
    when that search needs the levers."""
    known = [g.step_objective for g in (state.best, *state.ahead.values()) if g is not None]
    if known:
        return min(known)
    if not state.probing:
        return math.inf
    for later in state.tries[i + 1 : -1]:  # the last count is searched whole (below)
        objective = probe(state, later)
        if objective is not None:
            return objective
    last = state.tries[-1]
    if i + 1 < len(state.tries):
        if last not in state.ahead:
            state.ahead[last] = _searched(state, last)
        if state.ahead[last] is not None:
            return state.ahead[last].step_objective  # type: ignore[union-attr]
    return math.inf


@dataclass
class Probe:
    """One mesh's fastest plan at a count where it fits as it is (its per-step objective, else ``None``), and, from
    a worker, the pricings it made, for the count's search to read instead of pricing again."""

    objective: float | None
    pricings: list[tuple[tuple, PricedGraph]]


def probe(state: Planning, m: int) -> float | None:
    """Count ``m``'s fastest plan's per-step objective where it fits as it is, over every mesh (side by side on the
    workers), found once."""
    if m not in state.probes:
        job = functools.partial(_probe_mesh, state, m)
        found: list[float] = []
        for i, ok, value in run_forked(job, range(len(state.meshes)), state.workers):
            got = value if ok else job(i)  # a worker's error: here again, to raise here or to get it
            for key, priced in got.pricings:
                state.pricings.put(key, priced)
            if got.objective is not None:
                found.append(got.objective)
        state.probes[m] = min(found, default=None)
    return state.probes[m]


def _probe_mesh(state: Planning, m: int, i: int) -> Probe:
    mesh = state.meshes[i]
    found = search_count(state, m, free_only=True, meshes=[mesh]).found
    made = state.pricings.made(m, mesh) if in_worker() else []  # this process keeps its own already
    return Probe(None if found is None else found.step_objective, made)
