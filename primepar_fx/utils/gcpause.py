"""Pause Python's cyclic garbage collector around planning work that allocates many short-lived objects.

Capture (``torch.export``) and pricing allocate millions of small objects while a large graph stays alive, and each
full collection walks all of them, again and again, for a noticeable share of planning time (numbers in
``docs/benchmarks/measured_in_code.md``). The work creates little cyclic garbage, so collection waits until it ends.
Reference counting still frees everything else at once. What cyclic garbage there is (a search's closures and
solver state) adds up over a long budgeted search, where one mesh's lever search weighs dozens of policies, to
gigabytes on a large model, so such loops call :func:`collect` between units of work.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the collector's previous state is restored after it.

    The outermost block (the collector was on, nothing frozen) also freezes what is alive when it starts
    (``gc.freeze``: the model, its capture, imported modules), so that a :func:`collect` inside walks only what the
    block allocated; the frozen objects are handed back to the collector when the block ends."""
    was_enabled = gc.isenabled()
    freeze = was_enabled and gc.get_freeze_count() == 0
    gc.disable()
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def collect() -> int:
    """A cyclic collection of the young generations now, paused or not: for a long loop inside :func:`paused`,
    between units of work. The garbage a unit leaves (a search's closures and solver state) was allocated during it,
    so it is young; the survivors are moved to the oldest generation, so the next call walks only what was allocated
    since (a full collection walks every priced graph kept, at every call: docs/benchmarks/measured_in_code.md). A
    cycle reaching into older objects waits for the collection after planning. Returns the number of unreachable
    objects found."""
    return gc.collect(1)


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: run ``fn`` inside :func:`paused`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return wrapper
