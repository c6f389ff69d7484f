"""Activation recomputation in the search (issue 18 item 1): priced per layer, chosen with the partitions."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from torch import nn

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph.layers import layer_units
from primepar_fx.levers import recompute as recompute_module
from primepar_fx.levers.peak import plan_peak
from primepar_fx.levers.recompute import choose_recompute, layer_pricing, restricted
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.options import resolve_cluster
from primepar_fx.planning.planner import plan_graph
from primepar_fx.pricing.price import price_graph
from primepar_fx.record.fields import PlanError
from primepar_fx.record.levers import Recompute
from primepar_fx.record.plan import Plan
from primepar_fx.search import InfeasibleBudget, solve


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum()


#: cpu-gloo without pricing the transfers the runtime overlaps with linears (cost.matmul_overlap): these tests weigh
#: recomputation on the plans and budgets of that landscape (with it priced, plans with fewer ring buffers win)
CLUSTER = dataclasses.replace(resolve_cluster("cpu-gloo"), matmul_overlap=0.0)
SIZES = {"world_size": 4, "cluster": CLUSTER, "batch": 8, "seq": 64, "method": "dp", "baselines": False}


@functools.cache
def graph():
    config = dataclasses.replace(get_config("llama-tiny"), layers=4)
    args, kwargs = example_inputs(config, 2, 16, device="meta")
    return analyze(build(config, device="meta"), args, kwargs, name="llama-tiny-4")


@functools.cache
def plan(**kwargs) -> Plan:
    """Plans without ZeRO or micro-batches unless asked (recomputation is what these tests weigh)."""
    return plan_graph(graph(), **{**SIZES, "memory_budget": None, "zero": 0, "micro_batches": 1, **kwargs})


@functools.cache
def layers():
    spec = CLUSTER
    values = {B: SIZES["batch"], S: SIZES["seq"]}
    priced = price_graph(graph(), spec.mesh(4), spec, values, CostOptions())
    return layer_pricing(graph(), priced, values, CostOptions())


def test_full_recomputation_keeps_only_what_enters_each_layer() -> None:
    lp = layers()
    policy = Recompute.uniform(lp.units.stack, len(lp.units), "full")
    applied = lp.apply(policy)
    choice = solve(lp.priced.search_graph, method="dp").choice
    for i, unit in enumerate(lp.units.units):
        kept = sum(applied.node_costs[n][choice[n]].stash_bytes for n in unit)
        entering = lp.how("full", i)
        again = [n for n, (a, _) in entering.items() if a]
        assert kept < sum(lp.priced.node_costs[n][choice[n]].stash_bytes for n in unit)
        assert kept == sum(lp._input_bytes(n, keep)[choice[n]] for n, (_, keep) in entering.items() if keep)
        # Forward runs again up to the last node that keeps a tensor (the down projection), not the residual add
        assert again and again[-1].startswith("linear") and unit[-1].startswith("add")
        for n in unit:
            before, after = lp.priced.node_costs[n][choice[n]], applied.node_costs[n][choice[n]]
            how = entering[n][0]
            expected = before.time_s + (before.forward_s if how == "all" else before.phase_s[0] if how else 0.0)
            assert after.time_s == pytest.approx(expected, rel=1e-12), n
    # the nodes outside the stack keep their costs
    for n in lp.prefix + lp.post:
        assert applied.node_costs[n] is lp.priced.node_costs[n]


def test_dp_optimum_equals_ilp_optimum_with_recomputation() -> None:
    lp = layers()
    applied = lp.apply(Recompute.uniform(lp.units.stack, len(lp.units), "full", 2))
    dp = solve(applied.search_graph, method="dp")
    ilp = solve(applied.search_graph, method="ilp")
    assert dp.cost == pytest.approx(ilp.cost, rel=1e-9)
    assert dp.memory == pytest.approx(ilp.memory, rel=1e-9)


def test_the_peak_is_the_largest_moment_of_the_step_not_a_sum() -> None:
    lp = layers()
    count = len(lp.units)
    choice = solve(lp.priced.search_graph, method="dp").choice
    base = lp.priced.node_costs
    for first in (1, count):
        policy = Recompute.uniform(lp.units.stack, count, "full", first)
        applied = lp.apply(policy)
        kept = {n: applied.node_costs[n][choice[n]].stash_bytes for n in graph().nodes}
        # Backward reaches layer first-1 with the layers after it and the nodes after the stack freed
        freed = sum(kept[n] for n in lp.post) + sum(kept[n] for u in lp.units.units[first:] for n in u)
        back = sum(base[n][choice[n]].stash_bytes for n in lp.units.units[first - 1])
        assert lp.extra_peak(policy, applied, choice) == max(0, back - freed)
    # with a layer left as it was, the end of Forward is the peak
    assert lp.extra_peak(Recompute.uniform(lp.units.stack, count, "full", 1), lp.apply(
        Recompute.uniform(lp.units.stack, count, "full", 1)), choice) == 0  # fmt: skip


def test_auto_recomputes_only_when_the_budget_needs_it() -> None:
    free = plan(recompute="none")
    assert plan(memory_budget=free.predicted.peak_memory_bytes).recompute is None
    full = plan(recompute="full")
    assert full.recompute.layers == ("full",) * 4
    assert full.predicted.peak_memory_bytes < free.predicted.peak_memory_bytes
    assert full.predicted.step_time_s > free.predicted.step_time_s
    # a budget between the two: the plan fits, with some layers recomputed and no slower than all of them
    budget = (free.predicted.peak_memory_bytes + full.predicted.peak_memory_bytes) // 2
    mid = plan(memory_budget=budget)
    assert mid.predicted.peak_memory_bytes <= budget
    assert mid.recompute is not None and mid.recompute.active
    assert mid.predicted.step_time_s <= full.predicted.step_time_s
    assert "recompute full on" in mid.summary_table().splitlines()[0]


@pytest.mark.parametrize("share", [0.35, 0.75])
def test_auto_is_the_fastest_of_every_policy_it_may_skip(share: float) -> None:
    """Auto skips a policy whose fastest plan without a budget is no faster than the best found, and stops
    recomputing more layers once such a bound fits: the answer is still the fastest over no recomputation,
    selective, and full on every number of first layers (each searched under the budget)."""
    from primepar_fx.levers.recompute import _solve_policy

    lp, free, full = layers(), plan(recompute="none"), plan(recompute="full")
    low, high = full.predicted.peak_memory_bytes, free.predicted.peak_memory_bytes
    budget = int(low + share * (high - low))
    spec, values = CLUSTER, {B: SIZES["batch"], S: SIZES["seq"]}
    priced = price_graph(graph(), spec.mesh(4), spec, values, CostOptions())
    auto = choose_recompute(
        graph(), priced, values, CostOptions(), choice="auto", memory_budget=budget, alpha=0.0, method="dp"
    )
    stack, count = lp.units.stack, len(lp.units)
    policies = [Recompute.uniform(stack, count, "none"), Recompute.uniform(stack, count, "selective")]
    policies += [Recompute.uniform(stack, count, "full", k) for k in range(1, count + 1)]
    costs = []
    for policy in policies:
        try:
            costs.append(_solve_policy(lp, policy, budget, 0.0, "dp").solution.cost)
        except InfeasibleBudget:
            pass
    assert auto.solution.memory <= budget
    assert auto.solution.cost == pytest.approx(min(costs), rel=1e-9)


def test_zero_auto_is_stage_2_only_where_the_plan_needs_it() -> None:
    free = plan(recompute="none")
    assert free.zero == 0
    # where the fastest plan fits, auto keeps it unsharded
    assert plan(zero="auto", memory_budget=free.predicted.peak_memory_bytes).zero == 0
    # stage 2 splits gradients and optimizer state over replicas at no time: the same plan needs less memory
    sharded = plan(recompute="none", zero=2)
    assert sharded.predicted.step_time_s == pytest.approx(free.predicted.step_time_s)
    assert sharded.predicted.comm_bytes == free.predicted.comm_bytes
    assert sharded.predicted.peak_memory_bytes < free.predicted.peak_memory_bytes
    # stage 1 sends an all-gather after the step on top
    assert plan(recompute="none", zero=1).predicted.comm_bytes > free.predicted.comm_bytes
    # a budget stage 2 meets without recomputation, but stage 0 does not: auto is no slower than either
    budget = sharded.predicted.peak_memory_bytes
    auto = plan(zero="auto", memory_budget=budget)
    assert auto.predicted.peak_memory_bytes <= budget
    assert auto.predicted.step_time_s <= plan(zero=0, memory_budget=budget).predicted.step_time_s * (1 + 1e-9)
    assert auto.zero == 2 and "ZeRO-2" in auto.summary_table().splitlines()[0]
    assert Plan.from_json(auto.to_json()).zero == 2


def test_zero_auto_is_stage_3_only_where_nothing_fits_at_stage_2() -> None:
    """Stage 3 sends more, so auto takes it only as the last resort: under a budget no stage-2 plan meets (with
    any recomputation), it searches stage 3 and fits; where stage 2 fits, it stays there. (A Llama whose sizes
    split only in halves, so that its least plans still replicate the parameters.)"""
    config = dataclasses.replace(
        get_config("llama-tiny"), hidden=54, heads=3, kv_heads=3, ffn_hidden=135, vocab_size=251
    )
    args, kwargs = example_inputs(config, 2, 16, device="meta")
    odd = analyze(build(config, device="meta"), args, kwargs, name="llama-odd")

    def search(**kw) -> Plan:
        return plan_graph(odd, **{**SIZES, "micro_batches": 1, **kw})

    floor = odd.param_count() * 16 / SIZES["world_size"]  # the state over every device: searched from there up
    least = {}
    for stage in (2, 3):
        with pytest.raises(InfeasibleBudget) as info:
            search(zero=stage, memory_budget=floor)
        least[stage] = info.value.min_memory
    assert least[3] < least[2]
    budget = (least[2] + least[3]) // 2
    auto = search(zero="auto", memory_budget=budget)
    assert auto.zero == 3 and auto.predicted.peak_memory_bytes <= budget
    assert search(zero="auto", memory_budget=least[2]).zero == 2
    with pytest.raises(InfeasibleBudget) as info:  # below both: the least either needs
        search(zero="auto", memory_budget=floor)
    assert info.value.min_memory == least[3]


def test_no_plan_fits_even_recomputing_every_layer() -> None:
    full = plan(recompute="full")
    with pytest.raises(InfeasibleBudget) as info:
        plan(memory_budget=full.predicted.peak_memory_bytes // 4)
    smallest = info.value.min_memory  # the real peak of the plan of least memory with every layer recomputed
    assert full.predicted.peak_memory_bytes // 4 < smallest <= full.predicted.peak_memory_bytes
    lean = plan(memory_budget=int(smallest))
    assert lean.predicted.peak_memory_bytes <= smallest and lean.recompute.layers == ("full",) * 4


def test_forced_plans_take_a_recomputation_mode() -> None:
    for name in ("data_parallel", "megatron", "prime"):
        none = forced_plan(graph(), name, **{**SIZES, "memory_budget": None})
        full = forced_plan(graph(), name, **{**SIZES, "memory_budget": None, "recompute": "full"})
        assert full.recompute == Recompute.uniform("blocks", 4, "full") and none.recompute is None
        assert full.predicted.peak_memory_bytes < none.predicted.peak_memory_bytes, name
        assert full.predicted.step_time_s > none.predicted.step_time_s, name


def test_the_plan_records_its_recomputation() -> None:
    p = plan(recompute="full")
    data = json.loads(p.to_json())
    assert data["format"] == "primepar-plan/2"
    assert data["recompute"] == {"stack": "blocks", "layers": ["full"] * 4}
    assert Plan.from_json(p.to_json()) == p
    with pytest.raises(PlanError, match="plan.recompute.*must be one of"):
        Plan.from_dict({**data, "recompute": {"stack": "blocks", "layers": ["some"]}})
    with pytest.raises(PlanError, match="plan.recompute.*keys 'stack' and 'layers'"):
        Plan.from_dict({**data, "recompute": ["full"]})
    with pytest.raises(PlanError, match="'primepar-plan/1' is no longer read.*memory levers"):
        Plan.from_dict({**data, "format": "primepar-plan/1"})
    assert "recompute" not in json.loads(plan(recompute="none").to_json())


def test_recompute_options_are_checked() -> None:
    with pytest.raises(ValueError, match="recompute must be one of"):
        plan_graph(graph(), **SIZES, recompute="some")
    units = layer_units(graph())
    assert units is not None
    flat = analyze(_Flat(), (torch.randn(2, 4, 8),))
    with pytest.raises(ValueError, match="no layer stack"):
        plan_graph(flat, world_size=2, cluster="cpu-gloo", baselines=False, recompute="full", memory_budget=None)
    lp = layers()
    assert not choose_recompute(
        graph(), lp.priced, {B: 8, S: 64}, CostOptions(), choice="selective", memory_budget=None, alpha=0.0,
        method="dp",
    ).recompute  # fmt: skip  # llama's fused attention keeps no scores: nothing to recompute selectively
    assert plan_peak(lp.priced, solve(lp.priced.search_graph, method="dp").choice) > 0


def _lever_cutoffs(monkeypatch) -> list[float]:
    """The ``cutoff`` of every lever search the planner runs from now on, in the order they are called."""
    import primepar_fx.levers.choose as choose

    cutoffs = []
    original = choose.choose_recompute

    def spy(*args, **kwargs):
        cutoffs.append(kwargs["cutoff"])
        return original(*args, **kwargs)

    monkeypatch.setattr(choose, "choose_recompute", spy)
    return cutoffs


def _fastest_fixed(budget: float, counts: tuple[int, ...]):
    """The fastest of the plans with each of ``counts`` micro-batches forced (those that fit the budget)."""
    fixed = []
    for m in counts:
        try:
            fixed.append(plan_graph(graph(), **{**SIZES, "memory_budget": budget, "micro_batches": m}))
        except InfeasibleBudget:
            pass
    return min(fixed, key=lambda p: p.predicted.step_time_s)


@pytest.mark.parametrize("budget", [5_000_000, 4_440_000])
def test_auto_micro_batches_give_the_fastest_fixed_count_and_the_next_count_bounds_the_lever_search(
    budget, monkeypatch
) -> None:
    """Where one batch needs recomputation to fit, the lever search at one micro-batch is told the step of two
    micro-batches' fastest plan when that fits as it is (a probe), and skips what cannot beat it; the plan is still
    the fastest of the counts searched one by one."""
    cutoffs = _lever_cutoffs(monkeypatch)
    auto = plan_graph(graph(), **{**SIZES, "memory_budget": budget})
    probe = plan_graph(graph(), **{**SIZES, "memory_budget": None, "micro_batches": 2, "zero": 2})
    assert probe.recompute is None and probe.predicted.peak_memory_bytes <= budget
    assert cutoffs[0] == pytest.approx(probe.predicted.step_time_s, rel=1e-12)  # the probe's step
    fastest = _fastest_fixed(budget, (1, 2))
    assert auto.predicted.step_time_s == pytest.approx(fastest.predicted.step_time_s, rel=1e-12)
    assert auto.micro_batches == fastest.micro_batches and auto.predicted.peak_memory_bytes <= budget
    tried = auto.search.micro_batches_tried  # one batch, the probe of two, and on while slower counts may not be
    assert tried[:2] == (1, 2) and set(tried) <= {1, 2, 4, 8} and auto.micro_batches in tried
    assert probe.search.micro_batches_tried == (2,)


def test_where_no_later_counts_fastest_plan_fits_the_most_micro_batches_are_searched_ahead_and_bound_the_first(
    monkeypatch,
) -> None:
    """At 3.8 MB no count's fastest plan fits as it is (the least of them holds 3.9 MB, at four micro-batches), so
    the probes bound nothing: the last count, eight micro-batches, is searched whole ahead of its turn, and the lever
    search at one micro-batch is told its step. The plan is still the fastest of the counts searched one by one."""
    budget = 3_800_000
    cutoffs = _lever_cutoffs(monkeypatch)
    auto = plan_graph(graph(), **{**SIZES, "memory_budget": budget})
    monkeypatch.undo()
    fixed = {m: plan_graph(graph(), **{**SIZES, "memory_budget": budget, "micro_batches": m}) for m in (1, 2, 4, 8)}
    for m in (1, 2, 4, 8):  # no fastest plan fits as it is: every probe fails
        fastest = plan_graph(graph(), **{**SIZES, "memory_budget": None, "micro_batches": m, "zero": 2})
        assert fastest.predicted.peak_memory_bytes > budget
    # the first lever search is the one ahead, at eight micro-batches, unbounded; the next, one micro-batch's, is
    # told its step
    assert cutoffs[0] == math.inf and cutoffs[1] == pytest.approx(fixed[8].predicted.step_time_s, rel=1e-12)
    best = min(fixed.values(), key=lambda p: p.predicted.step_time_s)
    assert auto.predicted.step_time_s == pytest.approx(best.predicted.step_time_s, rel=1e-12)
    assert auto.micro_batches == best.micro_batches == 1 and auto.predicted.peak_memory_bytes <= budget
    assert 8 in auto.search.micro_batches_tried


@pytest.mark.parametrize("budget", [4_300_000, 5_000_000])
def test_a_count_whose_fastest_plan_fits_but_is_slower_than_the_plan_found_ends_the_search(budget, monkeypatch):
    """One micro-batch with recomputation beats the fastest plan of a larger count that fits as it is (a probe):
    that count is not searched again, nor are the counts after it (more micro-batches only run smaller ones), and
    the plan is still the fastest of every count planned on its own."""
    import primepar_fx.planning.counts as counts

    searched = []
    original = counts.search_count

    def spy(state, m, bound=None, **kwargs):
        searched.append((m, kwargs.get("free_only", False)))
        return original(state, m, bound, **kwargs)

    monkeypatch.setattr(counts, "search_count", spy)
    auto = plan_graph(graph(), **{**SIZES, "memory_budget": budget})
    monkeypatch.undo()
    probes = [m for m, free in searched if free]  # each later count's fastest plan, up to the first that fits
    assert auto.micro_batches == 1 and auto.recompute is not None
    assert len(probes) == len(set(probes))  # the count that fits is not searched again after its probe
    assert max(m for m, _ in searched) == max(probes)  # nor any count after it
    best = _fastest_fixed(budget, (1, 2, 4, 8))
    assert auto.predicted.step_time_s == pytest.approx(best.predicted.step_time_s, rel=1e-12)


@pytest.mark.parametrize("budget", [5_000_000, 4_440_000])
def test_a_count_probed_and_then_searched_is_priced_once(budget, monkeypatch) -> None:
    """Two micro-batches' probe and then their search price the same mesh at the same sizes: the second reads the
    first's pricing (the plan is the one a fresh pricing gives: test above)."""
    import primepar_fx.planning.meshes as meshes

    priced = []
    original = meshes.price_graph

    def spy(graph, mesh, cluster, values, opts, **kwargs):
        priced.append((mesh, tuple(sorted(values.items(), key=str)), opts))
        return original(graph, mesh, cluster, values, opts, **kwargs)

    monkeypatch.setattr(meshes, "price_graph", spy)
    auto = plan_graph(graph(), **{**SIZES, "memory_budget": budget})
    assert 2 in auto.search.micro_batches_tried and len(priced) == len(set(priced))
    assert {values[0][1] for _, values, _ in priced} >= {8, 4}  # B of one and of two micro-batches


def test_the_fewest_layers_that_fit_are_bisected_not_stepped() -> None:
    """After a number of layers recomputed in full with which nothing fits, the lever search finds the fewest
    with which a plan fits by bisection (a budgeted search per probe, a few probes) instead of trying every
    number above: the same number the searches one by one give."""
    from primepar_fx.levers.recompute import _fewest_fitting, _least_real, _solve_policy

    config = dataclasses.replace(get_config("llama-tiny"), layers=8)
    args, kwargs = example_inputs(config, 2, 16, device="meta")
    g = analyze(build(config, device="meta"), args, kwargs, name="llama-tiny-8")
    spec, values = CLUSTER, {B: SIZES["batch"], S: SIZES["seq"]}
    lp = layer_pricing(g, price_graph(g, spec.mesh(4), spec, values, CostOptions()), values, CostOptions())
    stack, count = lp.units.stack, len(lp.units)

    @functools.cache
    def fits(k: int, budget: float) -> bool:
        try:
            _solve_policy(lp, Recompute.uniform(stack, count, "full", k), budget, 0.0, "dp")
        except InfeasibleBudget:
            return False
        return True

    def least(k: int) -> float:  # the real peak of the plan of least reported peak
        policy = Recompute.uniform(stack, count, "full", k)
        return _least_real(lp, policy, lp.apply(policy))[0]

    peaks = [least(1), least(count)]
    checked = 0
    for share in (0.3, 0.6):
        budget = peaks[1] + share * (peaks[0] - peaks[1])
        one_by_one = [k for k in range(1, count + 1) if fits(k, budget)]
        calls: list[int] = []

        def full_on(k: int, budget: float = budget, calls: list[int] = calls) -> tuple[None, bool, bool]:
            calls.append(k)
            return None, True, not fits(k, budget)

        for unfit in range(1, count):
            if fits(unfit, budget):
                continue
            want = min((k for k in one_by_one if k > unfit), default=None)
            assert _fewest_fitting(lp, budget, unfit, full_on) == want
            assert len(set(calls)) <= 4  # log2(8) + 1, where stepping would try up to 7
            calls.clear()
            checked += 1
    assert checked >= 2


def test_a_subspace_is_searched_under_the_plans_recomputation_and_budget(monkeypatch) -> None:
    """``restricted`` on every strategy is the search itself; on the split-only subspace under a budget, its plan
    keeps to the subspace and its real peak (Backward's recomputation included) fits. A budget one byte short of
    the fastest plan's real peak takes two searches: the second below that plan's reported peak (lowering it by
    the byte it overshoots returned the same plan until the rounds ran out)."""
    lp, values = layers(), {B: SIZES["batch"], S: SIZES["seq"]}
    policy = Recompute.uniform(lp.units.stack, len(lp.units), "full")
    applied = lp.apply(policy)
    kw = {"alpha": 0.0, "method": "dp", "recompute": policy, "layers": lp}
    whole = choose_recompute(
        graph(), lp.priced, values, CostOptions(), choice="full", memory_budget=None, alpha=0.0, method="dp"
    )
    same, fits = restricted(graph(), applied, lambda s: True, values, CostOptions(), memory_budget=None, **kw)
    assert fits and same.solution.choice == whole.solution.choice and same.extra_peak == whole.extra_peak

    def split(seq) -> bool:
        return seq.prime is None

    free, fits = restricted(graph(), applied, split, values, CostOptions(), memory_budget=None, **kw)
    assert fits and free.extra_peak > 0  # the last layer's whole stash comes back above the end of Forward
    reported = plan_peak(free.priced, free.solution.choice)
    budget = reported + free.extra_peak - 1  # the fastest split-only plan no longer fits once its extra peak counts
    limits = []
    search = recompute_module.solve_for_peak

    def searched(priced, **options):
        limits.append(options["memory_budget"])
        return search(priced, **options)

    monkeypatch.setattr(recompute_module, "solve_for_peak", searched)
    got, fits = restricted(graph(), applied, split, values, CostOptions(), memory_budget=budget, **kw)
    assert limits == [budget, reported - 1]
    assert fits and all(seqs[got.solution.choice[n]].prime is None for n, seqs in got.priced.strategies.items())
    assert plan_peak(got.priced, got.solution.choice) + got.extra_peak <= budget
    assert got.solution.cost >= free.solution.cost


def test_a_budgeted_plan_is_never_slower_than_its_split_only_baseline() -> None:
    """The split-only baseline is our search on a subspace, under the same levers; where the budgeted search lands
    above it (a duality gap), the planner keeps its plan, so no budget leaves ours slower than a baseline that fits."""
    free, full = plan(recompute="none"), plan(recompute="full")
    low, high = full.predicted.peak_memory_bytes, free.predicted.peak_memory_bytes
    for share in (0.0, 0.02, 0.05, 0.1, 0.3):
        budget = int(low + share * (high - low))
        ours = plan_graph(graph(), **{**SIZES, "baselines": True, "zero": 0, "micro_batches": 1}, memory_budget=budget)
        split = ours.baselines["split_only"]
        assert split.config["fits_budget"]
        assert ours.predicted.step_time_s <= split.predicted.step_time_s * (1 + 1e-12), share
        if ours.search.split_only_kept:
            assert ours.predicted == split.predicted and not ours.search.proven_optimal


def test_a_plan_sent_from_a_worker_without_its_graph_reads_as_before_once_the_graph_is_given_back() -> None:
    """A worker process sends its plan back pickled (planning.workers.search_forked): the captured graph does not
    pickle, so the plan's recomputation pricing leaves it (and its memos) out, and the planner gives it back. The
    plan read then (a policy's costs, its split-only subspace) is the plan before it was sent."""
    import pickle

    lp, free, full = layers(), plan(recompute="none"), plan(recompute="full")
    budget = (full.predicted.peak_memory_bytes + free.predicted.peak_memory_bytes) // 2
    spec, values = CLUSTER, {B: SIZES["batch"], S: SIZES["seq"]}
    priced = price_graph(graph(), spec.mesh(4), spec, values, CostOptions())
    opts = dict(memory_budget=budget, alpha=0.0, method="dp")
    chosen = choose_recompute(graph(), priced, values, CostOptions(), choice="full", **opts)
    assert chosen.recompute.active and chosen.layers is not None
    with pytest.raises(Exception):  # noqa: B017 -- the graph does not pickle (whatever torch raises)
        pickle.dumps(graph())
    sent = pickle.loads(pickle.dumps(chosen))  # pickled without the graph
    assert chosen.layers.graph is graph() and sent.layers.graph is None  # the plan sent from is left whole
    sent.attach(graph())
    split_only = lambda seq: not seq.prime  # noqa: E731
    again = restricted(
        graph(), sent.priced, split_only, values, CostOptions(), recompute=sent.recompute, layers=sent.layers, **opts
    )
    before = restricted(
        graph(),
        chosen.priced,
        split_only,
        values,
        CostOptions(),
        recompute=chosen.recompute,
        layers=chosen.layers,
        **opts,
    )
    assert again[1] == before[1] and again[0].solution.choice == before[0].solution.choice
    assert again[0].solution.cost == before[0].solution.cost
    policy = Recompute.uniform(lp.units.stack, len(lp.units), "full", 1)
    a, b = sent.layers.apply(policy).search_graph, chosen.layers.apply(policy).search_graph
    assert a.node_cost.keys() == b.node_cost.keys() and all((a.node_cost[n] == b.node_cost[n]).all() for n in a.nodes)
    with pytest.raises(ValueError, match="another graph"):
        sent.attach(object())  # type: ignore[arg-type]
