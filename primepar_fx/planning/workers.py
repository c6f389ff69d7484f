"""Independent pieces of planning run in forked worker processes: the one helper for every such use.

Each grouping of the device digits is priced and searched on its own, and pricing is mostly Python, which one
process runs on one core. A worker is a fork of the planner, so it starts with the captured graph and the options
in memory (nothing goes to it) and prices exactly as the planner would: the same code on the same inputs, so the
same numbers. What comes back is pickled through a pipe, one way for every use: a job's return value. The pieces:

* :class:`Forked`: one job in one process, beside whatever the planner does meanwhile (the baselines' plans);
* :func:`run_forked`: a job per item, shared out between the planner and its workers (the groupings' bounds, the
  micro-batch probes); with ``cheapest_whole`` a worker sends its cheapest result whole and the others
  :meth:`Light.light` (what the planner needs of them is their cost, not their plans or pricings);
* :func:`search_forked`: a branch and bound over items on :func:`run_forked` (the groupings' lever searches).

A result holding what does not pickle (the captured graph) leaves it out when pickled, and the planner gives it
back (:meth:`~primepar_fx.levers.recompute.Chosen.attach`).

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


class Light(Protocol):
    """A result that a worker may send back without its heavy part (:func:`run_forked` with ``cheapest_whole``)."""

    @property
    def cost(self) -> float | None:
        """Its cost, or ``None`` where it found nothing (better)."""

    def light(self) -> Light:
        """This without its heavy part (a plan, a pricing), its cost and what it says of its work kept."""


def in_worker() -> bool:
    """Whether this process is a worker of :func:`run_forked` (or a :class:`Forked` job), not the planner."""
    return _IN_WORKER


_IN_WORKER = False


def run_forked(
    job: Callable[[int], Any], items: Sequence[int], workers: int, *, cheapest_whole: bool = False
) -> Iterator[tuple[int, bool, Any]]:
    """``job(i)`` for each ``i`` of ``items``, in this process and ``workers - 1`` forked ones, each taking the
    next item not yet taken until none is left (so a process that works faster takes more). Yields ``(i, True,
    result)``, or ``(i, False, message)`` where the job raised in a worker or its worker died (the caller runs it
    again here, to raise it with its own type or get it). This process takes the first item and yields its items
    first, in order, as each is done; the workers' after. ``workers <= 1``, a single item, or no ``fork``: every
    item here, in order.

    What comes back: a worker sends its results together when it has no item left, each as ``job`` returned it.
    With ``cheapest_whole`` (results that are :class:`Light` or ``None``), only a worker's cheapest result (the
    first of equal costs in the order of ``items``) travels whole, the others :meth:`Light.light`: a worker
    lightens a result as soon as a cheaper one is found, so it holds one whole result at a time. This process's
    own results are yielded as they are."""
    items = list(items)
    if workers <= 1 or len(items) <= 1 or not can_fork():
        for i in items:
            yield i, True, job(i)
        return
    taken = multiprocessing.get_context("fork").Value("i", 0)  # how many items have been taken, under its lock

    def take() -> int | None:
        with taken.get_lock():
            k = taken.value
            taken.value = k + 1
        return items[k] if k < len(items) else None

    def work() -> list[tuple[int, bool, Any]]:
        kept = _Kept(cheapest_whole)
        while (i := take()) is not None:
            try:
                kept.add(i, job(i))
            except Exception as exc:  # noqa: BLE001 -- reported to the caller, which runs it again to raise it
                kept.failed(i, f"{type(exc).__name__}: {exc}")
        return kept.done

    first = take()  # this process's first item is the first of all: taken before any worker can
    forks = [Forked(work) for _ in range(min(workers, len(items)) - 1)]
    try:
        yield from _gathered(job, items, first, take, forks)
    finally:
        for fork in forks:
            fork.stop()


def _gathered(
    job: Callable[[int], Any], items: list[int], first: int | None, take: Callable[[], int | None], forks: list
) -> Iterator[tuple[int, bool, Any]]:
    """This process's items (from ``first``), then the workers' results, then a failure for each item a worker
    took and died before sending."""
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


class _Kept:
    """A worker's results, in the order it took its items; with ``cheapest_whole``, the cheapest kept whole."""

    def __init__(self, cheapest_whole: bool) -> None:
        self.cheapest_whole = cheapest_whole
        self.done: list[tuple[int, bool, Any]] = []
        self.whole: int | None = None  # the position in done of the one whole result

    def add(self, i: int, value: Any) -> None:
        if self.cheapest_whole and value is not None:
            if value.cost is not None and (self.whole is None or value.cost < self.done[self.whole][2].cost):
                if self.whole is not None:  # the items come in order: a tie keeps the earlier
                    j, ok, old = self.done[self.whole]
                    self.done[self.whole] = (j, ok, old.light())
                self.whole = len(self.done)
            else:
                value = value.light()
        self.done.append((i, True, value))

    def failed(self, i: int, message: str) -> None:
        self.done.append((i, False, message))


R = TypeVar("R", bound=Light)


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

    Yields ``(i, result)``, ``None`` for a skipped item; a worker sends its cheapest result whole and the others
    light (:func:`run_forked`'s ``cheapest_whole``), so the cheapest of all, the first of equal costs in the order
    of ``items``, arrives whole. An item whose worker raised or died is searched here again (to raise here, or to
    get it). Which results are found can depend on the timing (a search that starts after a cheaper plan is found
    is cut off sooner), but the cheapest is what one process finds: every search is exact below its cutoff, and
    each cutoff is at least it.
    """
    shared = _Cheapest(best, forks=workers > 1 and len(items) > 1 and can_fork())
    position = {i: k for k, i in enumerate(items)}

    def job(i: int) -> R | None:
        cost, source = shared.read()
        lower = bound(i)
        if lower is not None and (lower > cost or (lower == cost and source < position[i])):
            return None  # its fastest plan is no cheaper than a plan found (one process: found before it)

        def cutoff() -> float:  # a plan as cheap as one found for an item after this one beats it (it comes first)
            cost, source = shared.read()
            return min(cost if source < position[i] else math.nextafter(cost, math.inf), ceiling)

        found = search(i, cutoff)
        if found.cost is not None:
            shared.lower(found.cost, position[i])
        return found

    for i, ok, value in run_forked(job, items, workers, cheapest_whole=True):
        yield i, value if ok else job(i)


class _Cheapest:
    """The cheapest plan found by any process and the position of its item (-1: the caller's), read and lowered
    together: in shared memory under one lock where there are workers."""

    def __init__(self, best: float, *, forks: bool) -> None:
        self.forks = forks
        self.values = multiprocessing.get_context("fork").Array("d", [best, -1.0]) if forks else [best, -1.0]

    def _locked(self) -> contextlib.AbstractContextManager:
        return self.values.get_lock() if self.forks else contextlib.nullcontext()  # type: ignore[union-attr]

    def read(self) -> tuple[float, float]:
        with self._locked():
            return self.values[0], self.values[1]

    def lower(self, cost: float, position: int) -> None:
        with self._locked():
            if (cost, position) < (self.values[0], self.values[1]):
                self.values[0], self.values[1] = cost, position


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
    global _IN_WORKER
    _IN_WORKER = True
    if nice:
        os.nice(nice)
    try:
        out: tuple[bool, Any] = (True, job())
    except Exception as exc:  # noqa: BLE001 -- reported to the caller, which runs the job again to raise it
        out = (False, f"{type(exc).__name__}: {exc}")
    send.send(out)
    send.close()
