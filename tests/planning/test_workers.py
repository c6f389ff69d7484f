"""Planning pieces in forked workers (``planning.workers``): ``run_forked`` gives every item's result once, the
same as in one process, this process's items in order first; a worker's error comes back as a message for the
caller to run again here; where there is nothing to share out, no process is forked; with ``cheapest_whole`` a
worker sends its cheapest result whole and the others light. ``Forked`` runs one job
beside the caller: its value, its error or its death as a message, or stopped when no longer needed.
``search_forked`` is a branch and bound over such workers that finds what one process finds."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import pytest

from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.workers import Forked, can_fork, default_workers, in_worker, run_forked, search_forked

forking = pytest.mark.skipif(not can_fork(), reason="no fork on this platform")
STATE = {"scale": 3}  # set before the fork: a worker sees the planner's memory as it was


def square(i: int) -> tuple[int, int]:
    return i * i * STATE["scale"], os.getpid()


@forking
@pytest.mark.parametrize("workers", [2, 3, 8])
def test_every_item_once_with_the_one_process_result(workers):
    got = list(run_forked(square, range(7), workers))
    assert sorted(i for i, _, _ in got) == list(range(7))
    assert all(ok and value[0] == i * i * 3 for i, ok, value in got)
    here = [i for i, _, value in got if value[1] == os.getpid()]
    assert here[0] == 0 and here == sorted(here) and [i for i, _, _ in got[: len(here)]] == here  # its, first


def slow_square(i: int) -> tuple[int, int]:
    time.sleep(0.2)
    return square(i)


@forking
def test_the_work_is_shared_between_this_process_and_the_workers():
    got = list(run_forked(slow_square, range(6), 3))
    assert sorted(i for i, _, _ in got) == list(range(6))
    assert len({value[1] for _, _, value in got}) == 3  # each process took items while any were left


@dataclasses.dataclass
class Priced:
    """A stand-in for a result that is sent light (its cost, what it found dropped) unless it is a worker's
    cheapest: ``cost``, the heavy ``plan``, and who made it."""

    cost: float | None
    plan: str | None
    pid: int

    def light(self) -> Priced:
        return dataclasses.replace(self, plan=None)


def priced(i: int) -> Priced:
    time.sleep(0.1)  # the items spread over the processes
    return Priced([5.0, 4.0, 6.0, 4.0, None, 1.0][i], f"plan {i}", os.getpid())


@forking
def test_a_worker_sends_its_cheapest_result_whole_and_the_others_light():
    got = {i: value for i, ok, value in run_forked(priced, range(6), 3, cheapest_whole=True)}
    assert sorted(got) == list(range(6)) and all(v.cost == priced(i).cost for i, v in got.items())
    assert all(v.plan == f"plan {i}" for i, v in got.items() if v.pid == os.getpid())  # this process's: as they are
    for pid in {v.pid for v in got.values()} - {os.getpid()}:
        own = {i: v for i, v in got.items() if v.pid == pid}
        costed = [(v.cost, i) for i, v in own.items() if v.cost is not None]
        whole = [i for i, v in own.items() if v.plan is not None]
        assert whole == ([min(costed)[1]] if costed else [])  # the first of its cheapest, alone


@forking
def test_a_job_knows_whether_it_runs_in_a_worker():
    got = {i: (pid, inside) for i, _, (pid, inside) in run_forked(where_it_runs, range(4), 2)}
    assert all(inside == (pid != os.getpid()) for pid, inside in got.values())
    assert any(inside for _, inside in got.values()) and not in_worker()
    assert Forked(in_worker).result() == (True, True)


def where_it_runs(i: int) -> tuple[int, bool]:
    time.sleep(0.2)
    return os.getpid(), in_worker()


def fails_on_odd(i: int) -> int:
    if i % 2:
        raise ValueError(f"item {i} is odd")
    return i


@forking
def test_a_worker_error_comes_back_as_its_message():
    for _ in range(3):  # which process takes which item varies: a worker's error is a message, this one's raised
        try:
            got = {i: (ok, value) for i, ok, value in run_forked(fails_on_odd, range(4), 2)}
        except ValueError as exc:
            assert re.fullmatch("item [13] is odd", str(exc))
            continue
        assert got[0] == (True, 0) and got[2] == (True, 2)
        assert got[1] == (False, "ValueError: item 1 is odd") and got[3] == (False, "ValueError: item 3 is odd")
    with pytest.raises(ValueError, match="item 1 is odd"):  # this process takes the first item: raised as it is
        list(run_forked(fails_on_odd, [1, 2], 2))


PLANNER = os.getpid()


def dies_in_a_worker(i: int) -> int:
    if os.getpid() != PLANNER:
        os._exit(7)
    time.sleep(0.5)  # long enough for the worker to take the other item
    return i


@forking
def test_the_items_of_a_worker_that_died_come_back_as_failed():
    got = {i: (ok, value) for i, ok, value in run_forked(dies_in_a_worker, [0, 1], 2)}
    assert sorted(got) == [0, 1]
    done = [i for i, (ok, _) in got.items() if ok]
    lost = [i for i, (ok, _) in got.items() if not ok]
    assert len(done) == len(lost) == 1 and got[done[0]] == (True, done[0])
    assert got[lost[0]] == (False, "its worker process ended without a result")


@pytest.mark.parametrize(("items", "workers"), [(range(5), 1), ([4], 4), ([], 3)])
def test_one_process_when_there_is_nothing_to_share(items, workers):
    got = list(run_forked(square, items, workers))
    assert got == [(i, True, (i * i * 3, os.getpid())) for i in items]


def test_workers_are_a_whole_number_of_at_least_one():
    assert default_workers() >= 1
    spec = PlanOptions.make(cluster="cpu-gloo", world_size=2).cluster
    assert PlanOptions(cluster=spec).workers == 1  # the library's default: compile() plans in one process per rank
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="workers must be a whole number"):
            PlanOptions(cluster=spec, workers=bad)


@forking
def test_a_forked_job_returns_its_value_or_its_error():
    job = Forked(lambda: square(5))
    ok, (value, pid) = job.result()
    assert ok and value == 75 and pid != os.getpid()
    job.stop()  # after the result: nothing left to stop
    assert Forked(lambda: fails_on_odd(3)).result() == (False, "ValueError: item 3 is odd")
    assert Forked(lambda: os._exit(3)).result() == (False, "the worker process ended without a result (exit code 3)")


@forking
def test_a_forked_job_can_run_at_a_lower_priority():
    assert Forked(lambda: os.nice(0), nice=5).result() == (True, os.nice(0) + 5)
    assert Forked(lambda: os.nice(0)).result() == (True, os.nice(0))


@forking
def test_a_forked_job_no_longer_needed_is_stopped():
    job = Forked(lambda: time.sleep(60))
    start = time.perf_counter()
    job.stop()
    assert time.perf_counter() - start < 10 and not job._process.is_alive()


@dataclasses.dataclass
class Plan:
    """A stand-in for a mesh's search result (``planning.meshes.MeshResult``): its cost, the plan, who found it."""

    cost: float | None
    plan: str | None
    pid: int

    def light(self) -> Plan:
        return dataclasses.replace(self, plan=None)


def branch_and_bound(costs: list[float], workers: int, **kw):
    """``search_forked`` over items whose plan costs ``costs[i]`` (found where it beats the cutoff, as a lever
    search does), each bounded by itself: {item: result or None where skipped}, and the cutoffs each saw."""
    seen = {}

    def search(i: int, cutoff) -> Plan:
        time.sleep(0.05)  # the items spread over the processes
        limit = seen[i] = cutoff()
        return Plan(costs[i], f"plan {i}", os.getpid()) if costs[i] < limit else Plan(None, None, os.getpid())

    got = dict(search_forked(range(len(costs)), search, bound=lambda i: costs[i], workers=workers, **kw))
    return got, seen


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_branch_and_bound_side_by_side_finds_the_first_cheapest_plan_whole(workers):
    if workers > 1 and not can_fork():
        pytest.skip("no fork on this platform")
    costs = [5.0, 3.0, 6.0, 3.0, 4.0, 3.0, 8.0]
    got, _ = branch_and_bound(costs, workers, best=math.inf, ceiling=math.inf)
    assert sorted(got) == list(range(len(costs)))
    found = {i: r for i, r in got.items() if r is not None and r.cost is not None}
    assert min(found, key=lambda i: (found[i].cost, i)) == 1 and found[1].plan == "plan 1"  # the first of the 3s
    for pid in {r.pid for r in found.values()} - {os.getpid()}:  # a worker sends its cheapest whole, the rest light
        whole = [i for i, r in found.items() if r.pid == pid and r.plan is not None]
        assert whole == [min((r.cost, i) for i, r in found.items() if r.pid == pid)[1]]
    if workers == 1:  # one after another: an item is searched only where its bound beats the plans before it
        assert [i for i in range(len(costs)) if got[i] is not None] == [0, 1]
        assert found.keys() == {0, 1}


def test_the_callers_plan_skips_and_its_ceiling_and_each_plan_found_cut_off_what_follows():
    got, seen = branch_and_bound([5.0, 3.0, 6.0, 3.5], 1, best=4.0, ceiling=2.5)
    assert got[0] is None and got[2] is None  # bounds no cheaper than the caller's plan: skipped
    assert seen == {1: 2.5, 3: 2.5} and got[1].cost is None and got[3].cost is None  # cut off at the ceiling
    got, seen = branch_and_bound([3.0, 2.0, 2.5], 1, best=math.inf, ceiling=10.0)
    assert seen == {0: 10.0, 1: 3.0} and got[1].cost == 2.0 and got[2] is None


@forking
def test_an_earlier_item_as_cheap_as_a_later_ones_plan_is_kept_as_one_process_keeps_it():
    """The worker's item (the second) finds 3.0 while this process's first item is searching: the first's cutoff is
    then just above 3.0, so its own plan of 3.0 is found, and it comes first, as one process would keep it."""
    seen = {}

    def search(i: int, cutoff) -> Plan:
        if i == 0:
            start = time.monotonic()
            while cutoff() == math.inf and time.monotonic() - start < 30:  # until the worker has found its plan
                time.sleep(0.01)
        limit = seen[i] = cutoff()
        return Plan(3.0, f"plan {i}", os.getpid()) if 3.0 < limit else Plan(None, None, os.getpid())

    got = dict(search_forked([0, 1], search, bound=lambda i: 2.0, best=math.inf, ceiling=math.inf, workers=2))
    assert seen[0] == math.nextafter(3.0, math.inf)
    assert got[0].cost == got[1].cost == 3.0 and got[0].plan == "plan 0"
    assert got[1].plan == "plan 1" and got[1].pid != os.getpid()  # the worker's cheapest: sent whole
