"""How long gloo's collectives take against the point-to-point reduce-scatter the runtime runs under gloo.

ZeRO's gradient buckets and the graph's fused reduce-scatters run point to point under gloo
(``primepar_fx.runtime.collectives.reduce_scatter_flat``, ``ReduceScatter``) because gloo's own
``reduce_scatter_single`` writes an all-reduce's bytes to its sockets. This prints, per size, the median time of
each call over the world (slowest rank, between barriers, the calls interleaved) and the bytes each rank wrote
(``wchar``), so the choice can be checked on any machine::

    python bench/gloo_collectives.py                  # 4 ranks, 256 KiB .. 16 MiB
    python bench/gloo_collectives.py --world-size 8 --sizes 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from measure import reduce, wire_bytes
from tabulate import tabulate

from primepar_fx.runtime.collectives import reduce_scatter_flat
from primepar_fx.runtime.testing import spawn


def _calls(numel: int, world: int) -> dict:
    """One closure per call, over a flat fp32 tensor of ``numel`` elements (a multiple of ``world``)."""
    full, part = torch.randn(numel), torch.empty(numel // world)
    ranks = tuple(range(world))
    return {
        "all_reduce": lambda: dist.all_reduce(full.clone()),
        "reduce_scatter_single (gloo)": lambda: dist.reduce_scatter_single(part, full),
        "reduce_scatter_flat (point to point)": lambda: reduce_scatter_flat(part, full, None, ranks).wait(),
        "all_gather_single": lambda: dist.all_gather_single(full, part),
    }


def bench_rank(rank: int, world: int, sizes_mib: list[float], steps: int) -> list[list]:
    """Every call at every size, interleaved; rank 0 gets ``[size, call, ms, KiB written]`` rows."""
    torch.set_num_threads(1)
    rows = []
    for mib in sizes_mib:
        numel = max(world, int(mib * 2**20) // 4 // world * world)
        calls = _calls(numel, world)
        times: dict[str, list[float]] = {k: [] for k in calls}
        wrote: dict[str, list[int]] = {k: [] for k in calls}
        for i in range(steps + 2):
            for name, call in calls.items():
                dist.barrier()
                w0, t0 = wire_bytes(), time.perf_counter()
                call()
                dt, dw = time.perf_counter() - t0, wire_bytes() - w0
                if i >= 2:
                    times[name].append(reduce([dt], dist.ReduceOp.MAX)[0])
                    wrote[name].append(dw)
        for name in calls:
            rows.append(
                [f"{mib:g} MiB", name, statistics.median(times[name]) * 1e3, statistics.median(wrote[name]) / 1024]
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1, 4, 16], help="MiB of the flat tensor")
    p.add_argument("--steps", type=int, default=10, help="timed calls of each (after 2 untimed)")
    args = p.parse_args()
    rows = spawn(bench_rank, args.world_size, args.sizes, args.steps, timeout=600.0)
    print(f"{args.world_size} gloo ranks, one thread each; median of {args.steps} interleaved calls, slowest rank")
    print(tabulate(rows, ["size", "call", "ms", "KiB written / rank"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
