"""Run a function on N gloo ranks in fresh processes, with a deadline (tests, benchmarks, examples).

``spawn(fn, world_size, *args)`` starts ``world_size`` processes; each initialises a gloo process group on a free
local port, calls ``fn(rank, world_size, *args)`` and tears the group down. An exception on any rank is re-raised
here with that rank's traceback; a run past ``timeout`` seconds kills every rank and raises ``TimeoutError``, so a
deadlock cannot hang a test suite. What ``fn`` returns on rank 0 is returned (it must be JSON-serialisable: it
travels as JSON through a temporary file). ``pg_timeout`` (seconds) is the process group's own timeout, how long a
collective waits for a missing rank (torch's default when ``None``).

``spawn_each`` is for fault tests: a rank may die or raise without stopping the others, no barrier ends the run, and
every rank's result comes back (``None`` for a rank that did not return one).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from primepar_fx.runtime.process import exit_worker, free_port, release


def _init(rank: int, world: int, port: int, pg_timeout: float | None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    extra = {"timeout": timedelta(seconds=pg_timeout)} if pg_timeout is not None else {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra)


def _entry(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple, pg_timeout: float | None = None
) -> None:
    _init(rank, world, port, pg_timeout)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        del result
        release()  # compiled modules and their groups go now, not during interpreter teardown
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker(0)  # success only: an exception above reaches torch's spawn wrapper, which reports it


def _start(
    entry: Callable[..., None], world_size: int, out: str, fn: Callable[..., Any], args: tuple, pg_timeout: float | None
) -> Any:
    return mp.start_processes(
        entry,
        args=(world_size, free_port(), out, fn, args, pg_timeout),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )


def _wait(ctx: Any, world_size: int, timeout: float, done: Callable[[float], bool]) -> None:
    """Wait until ``done(seconds_left)``; past ``timeout`` kill every rank still alive and raise ``TimeoutError``."""
    deadline = time.monotonic() + timeout
    while not done(deadline - time.monotonic()):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, pg_timeout: float | None = None
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; rank 0's result (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = _start(_entry, world_size, out, fn, args, pg_timeout)
        _wait(ctx, world_size, timeout, lambda left: ctx.join(timeout=max(0.1, min(5.0, left))))
        if not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)


def _entry_each(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple, pg_timeout: float | None
) -> None:
    _init(rank, world, port, pg_timeout)
    result = fn(rank, world, *args)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    exit_worker(0)  # no teardown: the other ranks may be dead or blocked


def spawn_each(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, pg_timeout: float | None = None
) -> list[Any]:
    """Every rank's result of ``fn(rank, world_size, *args)``, ``None`` where a rank died first (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = _start(_entry_each, world_size, out, fn, args, pg_timeout)

        def done(left: float) -> bool:
            time.sleep(0.2)
            return not any(p.is_alive() for p in ctx.processes)

        _wait(ctx, world_size, timeout, done)
        results = []
        for rank in range(world_size):
            try:
                with open(f"{out}.{rank}") as f:
                    results.append(json.load(f))
            except FileNotFoundError:
                results.append(None)
        return results
