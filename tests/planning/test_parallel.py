"""Planning pieces in forked workers (``planning.parallel``): ``run_forked`` gives every item's result once, the
same as in one process, this process's items in order first; a worker's error comes back as a message for the
caller to run again here; where there is nothing to share out, no process is forked. ``Forked`` runs one job
beside the caller: its value, its error or its death as a message, or stopped when no longer needed."""

from __future__ import annotations

import os
import re
import time

import pytest

from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.parallel import Forked, can_fork, default_workers, run_forked

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


def largest_marked(done: list) -> list:
    """A worker's results with its largest item's value marked (what it keeps of its best item goes back)."""
    top = max(i for i, _, _ in done)
    return [(i, ok, (*value, "kept") if i == top else value) for i, ok, value in done]


@forking
def test_a_worker_finishes_its_results_before_sending_them():
    got = {i: value for i, ok, value in run_forked(slow_square, range(6), 3, finish=largest_marked)}
    assert sorted(got) == list(range(6)) and all(v[0] == i * i * 3 for i, v in got.items())
    workers = {v[1] for v in got.values()} - {os.getpid()}
    marked = {v[1]: i for i, v in got.items() if v[-1] == "kept"}
    assert set(marked) == workers  # one per worker, on its largest item; none on this process's
    assert all(i == max(j for j, v in got.items() if v[1] == pid) for pid, i in marked.items())


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
