"""Independent pieces of planning run in forked worker processes: each grouping of the device digits is priced and
searched on its own (:func:`~primepar_fx.planning.planner.plan_graph`), and pricing is mostly Python, which one
process runs on one core. A worker is a fork of the planner, so it starts with the captured graph and the options
in memory (nothing goes to it; what comes back, a few numbers or the baselines' plans, is pickled through a pipe),
and prices exactly as the planner would: the same code on the same inputs, so the same numbers.

Only where ``fork`` exists (Linux; not Windows, and not macOS's default), and only when asked: the planner's
default is one process, which is what :func:`primepar_fx.compile` uses on every rank of a job (a rank forking
planners beside the other ranks of its host would only compete with them for the cores); the ``plan`` command
and :func:`primepar_fx.plan` ask for one process per core (:func:`default_workers`).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

from primepar_fx.utils.machine import usable_cores


def can_fork() -> bool:
    """Whether worker processes can be forked here."""
    return "fork" in multiprocessing.get_all_start_methods()


def default_workers() -> int:
    """One worker per core this process may run on (the planner itself is one of them)."""
    return usable_cores()


def run_forked(
    job: Callable[[int], Any],
    items: Sequence[int],
    workers: int,
    *,
    finish: Callable[[list[tuple[int, bool, Any]]], list[tuple[int, bool, Any]]] | None = None,
) -> Iterator[tuple[int, bool, Any]]:
    """``job(i)`` for each ``i`` of ``items``, in this process and ``workers - 1`` forked ones, each taking the
    next item not yet taken until none is left (so a process that prices faster takes more). Yields ``(i, True,
    result)``, or ``(i, False, message)`` where the job raised in a worker or its worker died (the caller runs it
    again here, to raise it with its own type or get it). This process takes the first item and yields its items
    first, in order, as each is done; the workers' after. ``workers <= 1``, a single item, or no ``fork``: every
    item here, in order.

    ``finish``: run in a worker on its ``(i, ok, result)`` list once it has no item left, and what it returns is
    sent instead, e.g. with what the worker kept of its best item attached (only the worker knows which that is,
    and sending every item's would cost more than it saves)."""
    items = list(items)
    if workers <= 1 or len(items) <= 1 or not can_fork():
        for i in items:
            yield i, True, job(i)
        return
    ctx = multiprocessing.get_context("fork")
    taken = ctx.Value("i", 0)  # how many items have been taken, under its lock

    def take() -> int | None:
        with taken.get_lock():
            k = taken.value
            taken.value = k + 1
        return items[k] if k < len(items) else None

    def work() -> list[tuple[int, bool, Any]]:
        done = []
        while (i := take()) is not None:
            try:
                done.append((i, True, job(i)))
            except Exception as exc:  # noqa: BLE001 -- reported to the caller, which runs it again to raise it
                done.append((i, False, f"{type(exc).__name__}: {exc}"))
        return done if finish is None else finish(done)

    first = take()  # this process's first item is the first of all: taken before any worker can
    forks = [Forked(work) for _ in range(min(workers, len(items)) - 1)]
    try:
        seen, i = set(), first
        while i is not None:
            seen.add(i)
            yield i, True, job(i)
            i = take()
        for fork in forks:
            ok, done = fork.result()
            for i, fine, value in done if ok else ():
                seen.add(i)
                yield i, fine, value
        for i in items:
            if i not in seen:  # taken by a worker that died before it sent its results
                yield i, False, "its worker process ended without a result"
    finally:
        for fork in forks:
            fork.stop()


class Found(Protocol):
    """What :func:`search_forked` needs of a search's result."""

    @property
    def cost(self) -> float | None:
        """The cost of the plan found, or ``None`` where nothing (better) was."""

    def portable(self) -> Found:
        """This, made fit to send to another process (what does not pickle left out, for the receiver to restore)."""

    def lite(self) -> Found:
        """This without its plan (its cost and what it says of its search kept): what a worker sends of a result
        that another of its results beats."""


R = TypeVar("R", bound=Found)


def search_forked(
    items: Sequence[int],
    search: Callable[[int, Callable[[], float]], R],
    *,
    bound: Callable[[int], float | None],
    best: float,
    ceiling: float,
    workers: int,
) -> Iterator[tuple[int, R | None]]:
    """A branch and bound over ``items`` on ``workers`` processes (this one included, as :func:`run_forked`):
    ``search(i, cutoff)`` finds item ``i``'s plan, or says that it found none cheaper than ``cutoff()``, which is
    the cheapest found so far by any process, or ``ceiling`` (a plan the caller has) where that is cheaper. The
    cheapest found is shared (a value in shared memory that each process lowers as it finds a cheaper plan), so an
    item whose ``bound(i)`` is no cheaper than it is skipped, as it would be one after another. ``best``: the
    cheapest the caller found before.

    Yields ``(i, result)``, ``None`` for a skipped item; a worker sends its cheapest result whole
    (:meth:`Found.portable`: the first of equal costs in the order of ``items``) and the others
    :meth:`Found.lite`, so the cheapest of all, the first of equal costs in that order, arrives whole. An item
    whose worker raised or died is searched here again (to raise here, or to get it). Which results are found
    can depend on the timing (a search that starts after a cheaper plan is found is cut off sooner), but the
    cheapest is what one process finds: every search is exact below its cutoff, and each cutoff is at least it.
    """
    forks = workers > 1 and len(items) > 1 and can_fork()
    # the cheapest plan found and the position in ``items`` of its item (-1: the caller's), under one lock
    shared = multiprocessing.get_context("fork").Array("d", [best, -1.0]) if forks else [best, -1.0]
    position = {i: k for k, i in enumerate(items)}

    def locked() -> contextlib.AbstractContextManager:
        return shared.get_lock() if forks else contextlib.nullcontext()  # type: ignore[union-attr]

    def cheapest() -> tuple[float, float]:
        with locked():  # the two read together
            return shared[0], shared[1]

    def job(i: int) -> R | None:
        cost, source = cheapest()
        lower = bound(i)
        if lower is not None and (lower > cost or (lower == cost and source < position[i])):
            return None  # its fastest plan is no cheaper than a plan found (one process: found before it)

        def cutoff() -> float:  # a plan as cheap as one found for an item after this one beats it (it comes first)
            cost, source = cheapest()
            return min(cost if source < position[i] else math.nextafter(cost, math.inf), ceiling)

        found = search(i, cutoff)
        if found.cost is not None:
            with locked():
                if (found.cost, position[i]) < (shared[0], shared[1]):
                    shared[0], shared[1] = found.cost, position[i]
        return found

    def send(done: list[tuple[int, bool, Any]]) -> list[tuple[int, bool, Any]]:
        costed = [(value.cost, position[i], i) for i, ok, value in done if ok and value is not None]
        whole = min(((c, k, i) for c, k, i in costed if c is not None), default=(None, None, None))[2]
        return [
            (i, ok, value.portable() if i == whole else value.lite()) if ok and value is not None else (i, ok, value)
            for i, ok, value in done
        ]

    for i, ok, value in run_forked(job, items, workers, finish=send):
        yield i, value if ok else job(i)


class Forked:
    """``job()`` in one forked process, started at once, beside whatever this process does meanwhile.

    :meth:`result` waits for it: ``(True, value)``, or ``(False, message)`` where it raised or the process died
    (the caller runs the job here then, to raise or get it as one process would); :meth:`stop` ends the process
    early, where the caller no longer needs it (e.g. it raised first). One or the other must be called.

    ``nice``: added to the process's niceness, so that a job the caller needs only at the end takes the cores
    the caller's own workers leave idle rather than slowing them down."""

    def __init__(self, job: Callable[[], Any], *, nice: int = 0) -> None:
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_send_result, args=(job, send, nice), daemon=True)
        self._process.start()
        send.close()  # the child holds its own end: a child that dies closes the pipe, and recv says so

    def result(self) -> tuple[bool, Any]:
        try:
            out = self._recv.recv()
        except EOFError:
            self._process.join()
            out = False, f"the worker process ended without a result (exit code {self._process.exitcode})"
        self._process.join()  # it ends once it has sent
        self._recv.close()
        return out

    def stop(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._recv.close()


def _send_result(job: Callable[[], Any], send: Connection, nice: int = 0) -> None:
    if nice:
        os.nice(nice)
    try:
        out: tuple[bool, Any] = (True, job())
    except Exception as exc:  # noqa: BLE001 -- reported to the caller, which runs the job again to raise it
        out = (False, f"{type(exc).__name__}: {exc}")
    send.send(out)
    send.close()
