"""The search under the reported peak (``levers.peak``): one budgeted search per ring-buffer cap, and the
Lagrangian bound of a relaxation of every cap at once that spares those searches when a caller's plan beats them."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.frontend.symbols import B, S
from primepar_fx.levers import peak
from primepar_fx.models import build, example_inputs
from primepar_fx.planning.options import resolve_cluster
from primepar_fx.pricing.price import price_graph
from primepar_fx.search import CutOff, DPSolver, budget_bound, least_memory, solve


@functools.cache
def priced():
    """llama-tiny on 8 devices at S=512: P(S x S) strategies with ring buffers of several sizes."""
    model = build("llama-tiny", device="meta")
    args, kwargs = example_inputs(model.config, 2, 16, device="meta")
    graph = analyze(model, args, kwargs, name="llama-tiny")
    spec = resolve_cluster("v100-paper")
    return price_graph(graph, spec.mesh(8), spec, {B: 8, S: 512}, CostOptions())


@functools.cache
def budget_and_plain():
    """A budget between the least peak and the fastest plan's, and the search's plan under it (no cutoff)."""
    p = priced()
    graph, buffers = p.search_graph, peak.ring_buffers(p)
    fastest = p.fastest("dp")
    least = peak.least_peak(graph, buffers)
    budget = least + 0.3 * (peak.plan_peak(p, fastest.choice) - least)
    return budget, peak.solve_for_peak(p, memory_budget=budget, method="dp")


def test_the_space_has_several_caps_and_the_budget_binds():
    p = priced()
    caps = {float(b) for arr in peak.ring_buffers(p).values() for b in arr}
    budget, plain = budget_and_plain()
    assert len(caps) >= 3
    assert plain.memory <= budget < peak.plan_peak(p, p.fastest("dp").choice)
    assert plain.cost > p.fastest("dp").cost


def test_the_bound_of_every_cap_is_below_the_plan_and_stops_at_the_cutoff():
    p = priced()
    graph, buffers = p.search_graph, peak.ring_buffers(p)
    budget, plain = budget_and_plain()
    static = peak.static_part(graph, buffers)
    args = (static, buffers, budget)
    known = (p.fastest("dp").choice, least_memory(static))
    bound = peak._every_cap_bound(*args, math.inf, *known)
    assert p.fastest("dp").cost <= bound <= plain.cost * (1 + 1e-12)
    assert bound == peak._every_cap_bound(*args, math.inf, p.fastest("dp").choice, least_memory(static))
    # the known plans only save DP runs: without them the same bound
    lowest = max(float(b.min()) for b in buffers.values())
    assert budget_bound(static, budget - lowest) == pytest.approx(bound, rel=1e-11)
    # a cutoff it reaches stops it there (at most the full bound)
    assert peak._every_cap_bound(*args, p.fastest("dp").cost, *known) <= bound


def test_a_cutoff_the_bound_reaches_spares_every_caps_search(monkeypatch):
    p = priced()
    graph, buffers = p.search_graph, peak.ring_buffers(p)
    budget, plain = budget_and_plain()
    static = peak.static_part(graph, buffers)
    bound = peak._every_cap_bound(static, buffers, budget, math.inf, p.fastest("dp").choice, least_memory(static))
    built = []
    real = peak.Search
    monkeypatch.setattr(peak, "Search", lambda *a, **k: built.append(1) or real(*a, **k))
    below = (p.fastest("dp").cost + bound) / 2  # beats every plan within the budget: the bound proves it
    with pytest.raises(CutOff):
        peak.solve_for_peak(p, memory_budget=budget, method="dp", cutoff=below)
    assert built == []
    # a cutoff above the plan: the caps are searched and the plan is the plan without a cutoff
    above = peak.solve_for_peak(p, memory_budget=budget, method="dp", cutoff=plain.cost * 1.001)
    assert built and (above.choice, above.cost) == (plain.choice, plain.cost)


def test_budget_bound_is_inf_where_nothing_fits_and_below_the_optimum_otherwise():
    graph = priced().cost_graph
    least = least_memory(graph)[1]
    assert budget_bound(graph, least * 0.5) == math.inf
    budget = least * 1.05
    optimum = solve(graph, method="dp", memory_budget=budget)
    assert solve(graph, method="dp").cost <= budget_bound(graph, budget) <= optimum.cost * (1 + 1e-12)
    assert np.isfinite(budget_bound(graph, budget))


def test_a_cap_that_holds_the_fastest_plan_takes_it_as_its_fastest_without_a_dp_run(monkeypatch):
    p = priced()
    budget, plain = budget_and_plain()
    buffers, fastest = peak.ring_buffers(p), p.fastest("dp")
    caps = {float(b) for arr in buffers.values() for b in arr if b <= budget}
    holding = {c for c in caps if all(buffers[n][q] <= c for n, q in fastest.choice.items())}
    assert holding  # caps that hold it
    runs = []
    real = DPSolver.minimise
    monkeypatch.setattr(DPSolver, "minimise", lambda self, weight=0.0: runs.append(weight) or real(self, weight))

    def unweighted_runs() -> int:
        runs.clear()
        found = peak.solve_for_peak(p, memory_budget=budget, method="dp")
        assert (found.choice, found.cost) == (plain.choice, plain.cost)
        return runs.count(0.0)

    taken = unweighted_runs()
    monkeypatch.setattr(peak.Search, "know_minimum", lambda self, choice: False)  # every cap's fastest searched
    assert taken < unweighted_runs()
