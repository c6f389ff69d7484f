"""Run a function on N gloo ranks in fresh processes, with a deadline (tests, benchmarks, examples).

``spawn(fn, world_size, *args)`` starts ``world_size`` processes; each initialises a gloo process group on a free
local port, calls ``fn(rank, world_size, *args)`` and tears the group down. An exception on any rank is re-raised
here with that rank's traceback; a run past ``timeout`` seconds kills every rank and raises ``TimeoutError``, so a
deadlock cannot hang a test suite. What ``fn`` returns on rank 0 is returned (it must be JSON-serialisable: it
travels as JSON through a temporary file).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; rank 0's result (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(
            _entry, args=(world_size, free_port(), out, fn, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
        if not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)
