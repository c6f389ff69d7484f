"""Pause Python's cyclic garbage collector around planning work that allocates many short-lived objects.

Capture (``torch.export``) and pricing allocate millions of small objects while a large graph stays alive, and each
full collection walks all of them, again and again, for a noticeable share of planning time (numbers in
``docs/benchmarks/measured_in_code.md``). The work creates little cyclic garbage, so collection waits until it ends.
Reference counting still frees everything else at once. What cyclic garbage there is (a search's closures and
solver state) adds up over a long budgeted search, where one mesh's lever search weighs dozens of policies (a
70B plan's grew past 24 GB of it), so such loops call :func:`collect` between units of work.
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
    """No automatic cyclic collection inside the block; the collector's previous state is restored after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect() -> None:
    """A full cyclic collection now, paused or not: for a long loop inside :func:`paused`, between units of work."""
    gc.collect()


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: run ``fn`` inside :func:`paused`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return wrapper
