"""Past three device digits the search runs on every grouping of the digits into three and keeps the cheapest
plan (``planning.groupings.search_meshes``): each grouping is a coarsening of the full mesh, priced as the full mesh
prices the same plan; groupings that relabel devices of each other are searched once; the plan kept is the best
of them, so it is never worse than the leading grouping the planner used to search alone."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time
import types

import pytest

from primepar_fx import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, PartitionSeq, Prime
from primepar_fx.planning.forced import random_assignment
from primepar_fx.planning.groupings import Grouped, search_meshes
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import plan_graph
from primepar_fx.planning.workers import can_fork
from primepar_fx.pricing.fixed import price_fixed

BATCH, SEQ = 16, 64
VALUES = {B: BATCH, S: SEQ}


@functools.cache
def graph():
    config = dataclasses.replace(get_config("llama-tiny"), layers=1)
    args, kwargs = example_inputs(config, 2, 16)
    return analyze(build(config, device="meta"), args, kwargs, name="llama-tiny")


def runs_of(full: DeviceMesh, grouping: DeviceMesh) -> list[int]:
    """How many digits of ``full`` each digit of ``grouping`` merges (consecutive, in order)."""
    out, k = [], 0
    for radix in grouping.digits:
        n, prod = 0, 1
        while prod < radix:
            prod *= full.digits[k + n]
            n += 1
        assert prod == radix
        out.append(n)
        k += n
    assert k == len(full.digits)
    return out


def test_groupings_of_32_devices_are_every_coarsening_into_three_less_relabelings():
    spec = load_cluster("v100-paper")  # 8 nodes x 4: digits 2,2,2 across nodes, 2,2 inside
    full = spec.mesh(32)
    meshes = search_meshes(full, Grouped.ALL, spec)
    assert [m.digits for m in meshes] == [(8, 2, 2), (2, 2, 8), (2, 4, 4), (2, 8, 2), (4, 4, 2)]
    assert meshes[0] == full.grouped(3) == search_meshes(full, Grouped.LEADING, spec)[0]
    for mesh in meshes:
        runs_of(full, mesh)
    assert search_meshes(full, Grouped.FULL, spec) == [full, *meshes]  # the full mesh asked for, then the groupings
    at8 = spec.mesh(8)
    assert search_meshes(at8, Grouped.ALL, spec) == search_meshes(at8, Grouped.FULL, spec) == [at8]
    assert [Grouped.of(v) for v in (None, "all", True, "leading", False, "full")] == [
        Grouped.ALL, Grouped.ALL, Grouped.LEADING, Grouped.LEADING, Grouped.FULL, Grouped.FULL,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="grouped must be"):
        Grouped.of("some")
    # finer: the groupings into three, then those into four (one relabeling left out: 2x4x2x2 of 4x2x2x2)
    finer = search_meshes(full, Grouped.ALL, spec, 4)
    assert [m.digits for m in finer] == [m.digits for m in meshes] + [(4, 2, 2, 2), (2, 2, 2, 4), (2, 2, 4, 2)]
    for mesh in finer:
        runs_of(full, mesh)
    assert search_meshes(full, Grouped.ALL, spec, 5) == search_meshes(full, Grouped.FULL, spec)  # all five digits
    with pytest.raises(ValueError, match="at least 3 digits"):
        search_meshes(full, Grouped.ALL, spec, 2)
    for bad, match in (({"group_digits": 2}, ">= 3"), ({"group_digits": 4, "grouped": "leading"}, "not to grouped")):
        with pytest.raises(ValueError, match=match):
            PlanOptions.make(cluster=spec, world_size=32, **bad)
    with pytest.raises(ValueError, match="grouped must be"):
        PlanOptions.make(cluster=spec, world_size=32, grouped="some")


def test_two_groupings_that_relabel_devices_have_the_same_split_only_optimum():
    """(2, 4, 4) and (4, 2, 4) at 32 devices: two inter-node digits and one intra-node digit of 4, in another
    order. Their plans of splits alone relabel each other's, so their split-only optima are equal; (2, 4, 4) also
    has the pair 4x4 that a P(S x S) takes and (4, 2, 4) none, so only (2, 4, 4) is searched, which is exact
    because (4, 2, 4)'s optimum is its split-only one."""
    spec = load_cluster("v100-paper")
    kw = dict(world_size=32, cluster=spec, batch=BATCH, seq=SEQ, baselines=False, grouped=False, method="dp")
    a = plan_graph(graph(), digits=(2, 4, 4), allow_prime=False, **kw)
    b = plan_graph(graph(), digits=(4, 2, 4), allow_prime=False, **kw)
    assert a.search.objective == pytest.approx(b.search.objective, rel=1e-12)
    assert plan_graph(graph(), digits=(4, 2, 4), **kw).search.objective == b.search.objective
    assert plan_graph(graph(), digits=(2, 4, 4), **kw).search.objective <= a.search.objective


def test_of_groupings_with_the_same_digits_the_one_a_p_s_x_s_can_pair_is_kept():
    """The one searched of two groupings that relabel each other's splits is the one with a pair of consecutive
    equal digits for P(S x S) (the other's plans are relabelings of its split-only ones): ``8x4x4`` over
    ``4x8x4`` at 128 V100s, ``4x4x2`` over ``4x2x4`` at 32 A100s in nodes of 8 (the first met of each was kept
    before); groupings with different pairs are both searched."""
    from primepar_fx.planning.groupings import _level_parts, _prime_pairs

    v100, a100 = load_cluster("v100-paper"), load_cluster("a100-dgx")
    at128 = [m.digits for m in search_meshes(v100.mesh(128), Grouped.ALL, v100)]
    assert (8, 4, 4) in at128 and (4, 8, 4) not in at128 and len(at128) == 11
    at32 = [m.digits for m in search_meshes(a100.mesh(32), Grouped.ALL, a100)]
    assert (4, 4, 2) in at32 and (4, 2, 4) not in at32 and len(at32) == 5
    for spec, n in ((v100, 64), (v100, 128), (a100, 32), (a100, 128)):
        full = spec.mesh(n)
        levels = [spec.group_level(full, (p,)) for p in range(len(full.digits))]
        every = []  # every grouping into three: its digits and its (radix, network levels) per digit
        for cut in itertools.combinations(range(1, len(full.digits)), 2):
            spans = zip((0, *cut), (*cut, len(full.digits)))
            every.append([(math.prod(full.digits[a:b]), _level_parts(full, levels, a, b)) for a, b in spans])
        kept = {m.digits for m in search_meshes(full, Grouped.ALL, spec)}
        searched = [runs for runs in every if tuple(r for r, _ in runs) in kept]
        for runs in every:  # each one left out: the splits of one kept, and its P(S x S) pair too if it has one
            twins = [t for t in searched if sorted(t) == sorted(runs)]
            assert twins, (n, runs)
            assert not _prime_pairs(runs) or any(_prime_pairs(t) == _prime_pairs(runs) for t in twins), (n, runs)


def test_the_plan_is_the_best_grouping_and_each_grouping_is_its_own_search():
    spec = load_cluster("v100-edr")
    spec = dataclasses.replace(spec, num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, baselines=False, method="dp")
    plan = plan_graph(graph(), **kw)
    listed = plan.search.groupings
    assert [t.digits for t in listed] == [m.digits for m in search_meshes(spec.mesh(16), Grouped.ALL, spec)]
    tried = [t for t in listed if t.objective is not None]
    best = min(t.objective for t in tried)
    assert plan.search.objective == best and plan.digits == next(t.digits for t in tried if t.objective == best)
    worst = max(tried, key=lambda t: t.objective)
    for t in (tried[0], worst):  # a listed optimum is what searching that grouping alone gives
        alone = plan_graph(graph(), digits=tuple(t.digits), grouped=False, **kw)
        assert alone.search.objective == pytest.approx(t.objective, rel=1e-12)
    for t in listed:  # a grouping left unsearched (its fastest plan no faster than the best) is no better alone
        assert t.bound <= (t.objective or math.inf) * (1 + 1e-12)
        if t.objective is None:
            assert t.bound >= best
            alone = plan_graph(graph(), digits=tuple(t.digits), grouped=False, **kw)
            assert alone.search.objective >= best * (1 - 1e-12)
    leading = plan_graph(graph(), grouped="leading", **kw)
    assert leading.digits == (4, 2, 2) and leading.search.groupings is None
    assert plan.predicted.step_time_s <= leading.predicted.step_time_s * (1 + 1e-12)


def _narrow_the_full_mesh(monkeypatch, limit: int) -> None:
    """The search of every pricing with a node of more than 200 strategies (the full 16-device mesh here, not a
    grouping) with DP tables of at most ``limit`` entries and no ILP: narrowed below the limit."""
    import primepar_fx.pricing.priced as priced_module
    from primepar_fx.search import solve
    from primepar_fx.search.dp import DPOptions

    def narrowed(search_graph, method="auto", **kw):
        if max(search_graph.strategies(n) for n in search_graph.nodes) > 200:
            kw.update(options=DPOptions(max_table_entries=limit), ilp_max_pairs=0, ilp_max_variables=10)
        return solve(search_graph, method=method, **kw)

    monkeypatch.setattr(priced_module, "solve", narrowed)


def test_the_full_mesh_asked_for_is_searched_with_the_groupings_and_the_cheapest_plan_kept(monkeypatch):
    """``grouped=False`` past three digits: the full mesh first, then the groupings. Searched exactly, the full
    mesh's plan is no worse than any grouping's here (a grouping's plans of splits are plans on it) and a tie keeps
    it; where its tables are too large and the search narrows them, its plan (not proven) can lose to a grouping's,
    which is then kept: the plan of the full space is never worse than a grouping's."""
    spec = dataclasses.replace(load_cluster("v100-edr"), num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, baselines=False, grouped=False, workers=1)
    exact = plan_graph(graph(), **kw)
    listed = exact.search.groupings
    assert [t.digits for t in listed] == [spec.mesh(16).digits] + [
        m.digits for m in search_meshes(spec.mesh(16), Grouped.ALL, spec)
    ]
    assert exact.digits == spec.mesh(16).digits and exact.search.proven_optimal
    assert all(exact.search.objective <= t.bound * (1 + 1e-12) for t in listed[1:])

    _narrow_the_full_mesh(monkeypatch, 1000)
    plan = plan_graph(graph(), **kw)
    full, *groupings = plan.search.groupings
    assert full.objective > exact.search.objective * (1 + 1e-9)  # narrowed: worse than the optimum
    assert plan.digits != spec.mesh(16).digits and plan.search.objective == pytest.approx(
        min(t.objective for t in groupings if t.objective is not None), rel=1e-12
    )
    assert plan.search.objective == pytest.approx(exact.search.objective, rel=1e-12)


@pytest.mark.parametrize("digits", [(2, 4, 2), (2, 2, 4)])
def test_a_plan_on_any_grouping_costs_the_same_written_out_on_every_digit(digits):
    """A grouping's digit that spans nodes and the devices inside one (4 = 2 nodes x 2 GPUs in (2, 4, 2)) is
    priced as the full mesh prices the same split written out on each digit it merges."""
    spec = load_cluster("v100-paper")
    spec = dataclasses.replace(spec, num_devices=16)
    full, mesh = spec.mesh(16), DeviceMesh(digits)
    runs = runs_of(full, mesh)
    opts = CostOptions(dtype="fp32")
    split_only = 0
    for seed in range(6):
        assignment = random_assignment(graph(), mesh, VALUES, seed)
        if any(isinstance(e, Prime) for seq in assignment.values() for e in seq.elements):
            continue  # P(S x S) on a merged digit has no written-out form
        split_only += 1
        written = {
            n: PartitionSeq(tuple(e for e, k in zip(seq.elements, runs) for _ in range(k)))
            for n, seq in assignment.items()
        }
        ours = price_fixed(graph(), assignment, mesh, spec, VALUES, opts).predicted
        theirs = price_fixed(graph(), written, full, spec, VALUES, opts).predicted
        assert theirs.step_time_s == pytest.approx(ours.step_time_s, rel=1e-9)
        assert (theirs.comm_bytes, theirs.peak_memory_bytes) == (ours.comm_bytes, ours.peak_memory_bytes)
    assert split_only >= 2 and math.prod(digits) == 16


def test_a_grouping_is_searched_on_the_pricing_its_bound_was_read_off(monkeypatch):
    """Under a budget each grouping is priced for its bound (its fastest plan) and then searched; the search reads
    the bound's pricing instead of pricing the grouping again: fewer pricings, the same plan as pricing again."""
    from primepar_fx.planning import meshes, state

    spec = dataclasses.replace(load_cluster("v100-edr"), num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, baselines=False, method="dp")
    calls, real = [], meshes.price_graph

    def counted(*args, **kwargs):
        calls.append(args[1].digits)
        return real(*args, **kwargs)

    monkeypatch.setattr(meshes, "price_graph", counted)
    kept = plan_graph(graph(), **kw)
    reused = len(calls)
    assert any(t.bound is not None for t in kept.search.groupings)
    calls.clear()
    monkeypatch.setattr(state, "KEEP_PRICED", 0)  # nothing kept: every searched grouping priced again
    again = plan_graph(graph(), **kw)
    searched = sum(t.objective is not None for t in again.search.groupings)
    assert len(calls) - reused >= searched >= 1
    assert kept.search.objective == again.search.objective and kept.digits == again.digits
    assert [n.partition for n in kept.nodes] == [n.partition for n in again.nodes]


def test_groupings_searched_in_worker_processes_give_the_plan_of_one_process(tmp_path, monkeypatch):
    """With workers the groupings' bounds are found in forked processes (planning.workers) and the fixed
    baselines priced in another; without a budget the bound is the search, so only the best grouping is searched
    again, on its bound's pricing wherever it was priced (a worker sends its cheapest back): every grouping is
    priced once. The plan and its baselines are the one-process ones exactly."""
    if not can_fork():
        pytest.skip("no fork on this platform: planning runs in one process")
    import primepar_fx.planning.meshes as meshes
    import primepar_fx.planning.state as state

    log, price_graph = tmp_path / "priced.txt", meshes.price_graph

    def logged(graph, mesh, *args, **kwargs):  # noqa: ANN001, ANN202 -- in every process, forks included
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {list(mesh.digits)}\n")
        return price_graph(graph, mesh, *args, **kwargs)

    spec = dataclasses.replace(load_cluster("v100-edr"), num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, method="dp", memory_budget=None)
    one = plan_graph(graph(), **kw, workers=1)
    monkeypatch.setattr(meshes, "price_graph", logged)
    two = plan_graph(graph(), **kw, workers=2)  # the baselines priced in a fork meanwhile
    priced = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert sorted(d for _, d in priced) == sorted(str(list(t.digits)) for t in two.search.groupings)
    by_worker = {d for pid, d in priced if int(pid) != os.getpid()}
    assert by_worker and by_worker != {d for _, d in priced}  # both processes priced some
    assert two.search.objective == one.search.objective and two.digits == one.digits
    assert two.to_dict()["nodes"] == one.to_dict()["nodes"]
    assert two.to_dict()["baselines"] == one.to_dict()["baselines"] and "megatron" in two.baselines
    listed = two.search.groupings
    assert [t.digits for t in listed] == [t.digits for t in one.search.groupings]
    best = min(t.bound for t in listed)
    assert two.search.objective == best  # no budget binds this tiny model: the best bound is the plan
    searched = [t for t in listed if t.objective is not None]  # the best; the others (ties too) skipped
    assert len(searched) == 1 and searched[0].bound == best and two.digits == searched[0].digits
    assert two.search.search_s >= 0 and two.search.pricing_s > 0
    # the best grouping second of two: this process takes the first, the worker the best, whose pricing comes back
    worse = list(max(listed, key=lambda t: t.bound).digits)
    two_meshes = [DeviceMesh(tuple(worse)), DeviceMesh(tuple(one.digits))]
    monkeypatch.setattr(state, "search_meshes", lambda *_: two_meshes)
    log.unlink()
    again = plan_graph(graph(), **kw, workers=2)
    priced = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert sorted(d for _, d in priced) == sorted([str(worse), str(list(one.digits))])  # each once
    assert [d for pid, d in priced if int(pid) != os.getpid()] == [str(list(one.digits))]
    assert again.to_dict()["nodes"] == one.to_dict()["nodes"] and again.search.objective == one.search.objective


def test_a_counts_probe_finds_each_groupings_fastest_plan_in_worker_processes_as_one_process_does(
    tmp_path, monkeypatch
):
    """Under a budget that the fastest plan does not meet, the search at one micro-batch probes the next count: its
    fastest plan on each grouping, where it fits as it is, is the plan to beat. With workers the groupings are
    probed side by side (both processes price some of them), and the plan is the one-process plan exactly."""
    if not can_fork():
        pytest.skip("no fork on this platform: planning runs in one process")
    import primepar_fx.planning.meshes as meshes

    spec = dataclasses.replace(load_cluster("v100-edr"), num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, method="dp")
    fastest = plan_graph(graph(), **kw, memory_budget=None, workers=1)
    budget = int(0.7 * fastest.to_dict()["predicted"]["peak_memory_bytes"])  # binds at one micro-batch
    one = plan_graph(graph(), **kw, memory_budget=budget, workers=1)
    log, price_graph = tmp_path / "priced.txt", meshes.price_graph

    def logged(graph, mesh, *args, **kwargs):  # noqa: ANN001, ANN202 -- in every process, forks included
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {args[1][B]}\n")  # the batch it prices: B / micro-batches
        return price_graph(graph, mesh, *args, **kwargs)

    monkeypatch.setattr(meshes, "price_graph", logged)
    two = plan_graph(graph(), **kw, memory_budget=budget, workers=2)
    assert one.search.micro_batches_tried == two.search.micro_batches_tried == (1, 2)
    probed = {pid for pid, b in (line.split() for line in log.read_text().splitlines()) if int(b) == BATCH // 2}
    assert len(probed) == 2 and str(os.getpid()) in probed  # the count of 2 was probed in both processes
    assert two.to_dict()["nodes"] == one.to_dict()["nodes"] and two.search.objective == one.search.objective
    assert two.to_dict()["baselines"] == one.to_dict()["baselines"]


def test_the_groupings_lever_searches_run_side_by_side_and_find_the_plan_of_one_process(tmp_path, monkeypatch):
    """Under a budget every grouping whose fastest plan does not fit weighs the memory levers (many DP runs); with
    workers, once the plan to beat is known, the groupings are searched in both processes, each cut off at the
    cheapest plan any has found (planning.workers.search_forked). The plan is the one-process plan exactly."""
    if not can_fork():
        pytest.skip("no fork on this platform: planning runs in one process")
    import primepar_fx.planning.meshes as meshes

    spec = dataclasses.replace(load_cluster("v100-edr"), num_devices=16)
    kw = dict(world_size=16, cluster=spec, batch=BATCH, seq=SEQ, method="dp")
    fastest = plan_graph(graph(), **kw, memory_budget=None, workers=1)
    budget = int(0.6 * fastest.to_dict()["predicted"]["peak_memory_bytes"])
    one = plan_graph(graph(), **kw, memory_budget=budget, workers=1)
    log, choose_levers = tmp_path / "levers.txt", meshes.choose_levers

    def logged(graph, priced, values, costs, opts, cutoff=None, **kwargs):  # noqa: ANN001, ANN202 -- every process
        if not kwargs.get("free_only"):
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {costs.micro_batches} {list(priced.mesh.digits)}\n")
        return choose_levers(graph, priced, values, costs, opts, cutoff, **kwargs)

    monkeypatch.setattr(meshes, "choose_levers", logged)
    two = plan_graph(graph(), **kw, memory_budget=budget, workers=2)
    searched = [line.split(" ", 2) for line in log.read_text().splitlines()]
    assert {pid for pid, _, _ in searched} > {str(os.getpid())}  # a worker searched levers too
    assert two.to_dict()["nodes"] == one.to_dict()["nodes"] and two.search.objective == one.search.objective
    assert two.digits == one.digits and two.recompute == one.recompute
    assert two.search.micro_batches_tried == one.search.micro_batches_tried
    assert two.to_dict()["baselines"] == one.to_dict()["baselines"]


@dataclasses.dataclass
class FakePricing:
    """Stands for a PricedGraph in KeptPricings: its size and the process that made it."""

    nbytes: int
    pid: int

    def array_nbytes(self) -> int:
        return self.nbytes


@pytest.mark.parametrize("workers", [1, 2])
def test_pricings_a_worker_makes_for_a_count_come_back_and_are_kept_here(workers, monkeypatch):
    """A count's probe prices every grouping side by side: what a worker priced for that count comes back with
    its results (``counts.Probe``), so that the count's search reads it instead of pricing it again; what it priced
    for another count does not. The probe is the cheapest mesh's fastest plan that fits."""
    if workers > 1 and not can_fork():
        pytest.skip("no fork on this platform")
    from primepar_fx.planning import counts
    from primepar_fx.planning.meshes import Outcome
    from primepar_fx.planning.state import KeptPricings, Planning

    meshes = [DeviceMesh((2, 2, 4)), DeviceMesh((4, 2, 2)), DeviceMesh((2, 4, 2))]
    opts = PlanOptions.make(cluster="cpu-gloo", world_size=16, batch=8, seq=8, workers=workers)
    state = Planning(None, opts, meshes, [1, 2, 4], KeptPricings(entries=10))  # type: ignore[arg-type]

    def search(state, m, bound=None, *, free_only=False, meshes=None):  # noqa: ANN001, ANN202 -- a mesh's probe
        time.sleep(0.3)  # (the meshes spread over the processes)
        i = state.meshes.index(meshes[0])
        state.pricings.put((m, meshes[0], "costs"), FakePricing(10 + i, os.getpid()))
        state.pricings.put((4, meshes[0], "costs"), FakePricing(20 + i, os.getpid()))  # another count's: stays there
        fits = i > 0  # the first mesh's fastest plan does not fit as it is
        return Outcome(found=types.SimpleNamespace(step_objective=5.0 - i) if fits else None, cut=not fits)

    monkeypatch.setattr(counts, "search_count", search)
    assert counts.probe(state, 2) == 3.0 and state.probes == {2: 3.0}
    at_2 = {mesh: state.pricings.get((2, mesh, "costs")) for mesh in meshes}
    assert all(p is not None for p in at_2.values()) and state.pricings.held >= 10 + 11 + 12
    if workers > 1:
        assert len({p.pid for p in at_2.values()}) == 2  # both processes priced some, and this one keeps them all
    made_here = {mesh for mesh, p in at_2.items() if p.pid == os.getpid()}
    assert {m for m in meshes if state.pricings.get((4, m, "costs")) is not None} == made_here
