"""The default cluster of ``compile()``: this machine, measured on the running process group once, then cached.

A preset prices a message at what some other machine charges for it (``cpu-gloo`` says 0.1 ms where loopback gloo
on two shared cores takes milliseconds), so a plan searched on it can be the wrong plan here. When ``compile()``
is given no cluster (and ``PRIMEPAR_CLUSTER`` names none), it prices on :func:`machine_spec` instead:

* **measured where it runs.** Every rank of the default process group takes part. Each collective kind of
  :data:`~primepar_fx.cost.latency.COLLECTIVES` is timed at :data:`SIZES` bytes per device as a step pays for it:
  a burst of back-to-back calls after one barrier, the mean per call, the median over reps, the *slowest* rank's
  (a rank waits for its last peer; with ranks sharing cores, that wait is most of a message's cost). Group
  collectives are timed over the world and over groups of every smaller size that divides it (all such groups
  at once), so the fit tells a call's fixed latency from its latency per ring step: on gloo a 2-rank all-reduce
  costs about half a 4-rank one, not the third that per-step latency alone would say. The compute
  kernels of :func:`~primepar_fx.calibrate.measure.measure_compute` (the quick set) run on every rank at once with
  the threads the ranks run with, so they share the cores as a step's do. So is how much of a transfer the
  compute beside it hides (:func:`~primepar_fx.calibrate.measure.time_overlap`, the spec's ``matmul_overlap``:
  how a collective matmul is priced; near 0 where ranks share cores). It takes a few seconds, with a progress bar
  on rank 0.
* **fitted** into the base preset of :func:`~primepar_fx.planning.options.default_cluster`'s rule (this machine's
  GPU preset, else ``cpu-gloo``): compute models per op family, the collectives of level 0 and ``matmul_overlap``,
  as ``primepar-fx calibrate`` does; every other field is the preset's.
* **cached** as a JSON spec under ``$PRIMEPAR_CACHE_DIR`` (default ``$XDG_CACHE_HOME/primepar_fx``, else
  ``~/.cache/primepar_fx``), one file per host, backend, world size and torch version, and reused after: rank 0
  decides and tells the others, so every rank measures or none does. Delete the file to measure again.

Only ranks on one host are measured (``LOCAL_WORLD_SIZE``, set by ``torchrun``, must equal the world size where it
is set): across nodes, level 0 is the node, which a world group cannot time alone, and the preset is used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primepar_fx.calibrate.fitting import rounded
from primepar_fx.calibrate.measure import Progress, collective_call, measure_compute, resize_spec, time_overlap
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.cost.latency import COLLECTIVES, fit_collective

log = logging.getLogger(__name__)

KiB = 1 << 10
#: bytes per device each collective is timed at
SIZES = (4 * KiB, 128 * KiB, 1024 * KiB)
#: timed reps (after one warm-up burst) and calls per burst
REPS, BURST = 3, 4
CACHE_ENV = "PRIMEPAR_CACHE_DIR"
#: bumped when what is measured changes, so an older cached spec is measured again (2: several group sizes; 3: the
#: matmul overlap)
CACHE_VERSION = 3


def cache_dir() -> Path:
    """Where measured specs are kept (module docstring)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "primepar_fx"


def cache_path(world_size: int, backend: str) -> Path:
    """The cached spec of this host for ``world_size`` ranks on ``backend`` under this torch."""
    key = f"machine-v{CACHE_VERSION}-{platform.node() or 'host'}-{backend}-w{world_size}-torch{torch.__version__}"
    return cache_dir() / (re.sub(r"[^A-Za-z0-9_.+-]", "_", key) + ".json")


def one_host(world_size: int) -> bool:
    """Whether every rank runs on this host (``LOCAL_WORLD_SIZE`` where torchrun sets it; else assumed)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return local is None or int(local) == world_size


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_sizes(world: int) -> list[int]:
    """The group sizes timed for ``world`` ranks: the world and its proper divisors from 2 (a plan's digits make
    groups of those sizes)."""
    return [g for g in range(2, world + 1) if world % g == 0]


def _groups(rank: int, world: int) -> dict[int, Any]:
    """``{g: this rank's process group of g consecutive ranks}`` for :func:`group_sizes` (``None``: the world).
    Every rank creates every group, as ``new_group`` requires."""
    out: dict[int, Any] = {}
    for g in group_sizes(world):
        if g == world:
            out[g] = None
            continue
        for first in range(0, world, g):
            pg = dist.new_group(list(range(first, first + g)))
            if first <= rank < first + g:
                out[g] = pg
    return out


def _time_collectives(rank: int, world: int, device: torch.device, progress: Progress | None) -> dict:
    """``{kind: {group size: [(bytes per device, seconds per call)]}}``, the slowest rank's (module docstring).

    Each group collective is timed at every size of :func:`group_sizes`, all groups of a size at once (as a
    plan's collectives over one digit run); the ring shift over the world only."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    groups = _groups(rank, world)
    samples: dict[str, dict[int, list[tuple[int, float]]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor / reduce_scatter_tensor renames
        for kind in COLLECTIVES:
            sizes = {world: None} if kind == "p2p" else groups
            calls = [
                (g, collective_call(kind, size, rank, world, device, group, g))
                for g, group in sizes.items()
                for size in (SIZES if g == world else SIZES[:: len(SIZES) - 1])  # subgroups: smallest and largest
            ]
            times = torch.zeros(len(calls), REPS, dtype=torch.float64)
            for r in range(-1, REPS):  # rep -1 warms up
                for i, (_, (fn, _)) in enumerate(calls):  # sizes and groups interleaved
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(BURST):
                        fn()
                    sync()
                    if r >= 0:
                        times[i, r] = (time.perf_counter() - t0) / BURST
            times = times.to(device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            medians = [statistics.median(row) for row in times.cpu().tolist()]
            samples[kind] = {}
            for (g, (_, nbytes)), t in zip(calls, medians):
                samples[kind].setdefault(g, []).append((nbytes, t))
            if progress is not None:
                progress.step(f"{kind}: {samples[kind][world][-1][1] * 1e3:.2f} ms at {SIZES[-1] // KiB} KiB")
    return samples


def measure_machine(base: ClusterSpec, world_size: int, rank: int) -> ClusterSpec | None:
    """Measure on every rank of the default process group (collective); rank 0 gets the fitted spec."""
    device = _device()
    progress = Progress(len(COLLECTIVES), f"measuring {world_size} ranks") if rank == 0 else None
    t0 = time.perf_counter()
    try:
        samples = _time_collectives(rank, world_size, device, progress)
        compute = measure_compute(device, quick=True, reps=REPS)  # every rank at once: the cores are shared
        overlap = time_overlap(rank, world_size, device, REPS) if world_size > 1 else 1.0
        dist.barrier()
    finally:
        if progress is not None:
            progress.close()
    if rank != 0:
        return None
    collectives = {kind: rounded(fit_collective(kind, by_size)) for kind, by_size in samples.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()}-core CPU"
    source = (
        f"primepar_fx measured {world_size} {dist.get_backend()} ranks on {platform.node() or 'unknown host'} "
        f"({where}, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M:%S')} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    spec = resize_spec(base, world_size)
    spec = spec.with_calibration(source=source, collectives={0: collectives}, compute=compute)
    return dataclasses.replace(
        spec,
        name=f"{base.name}-measured",
        description=f"This machine as compile() measured it (see source); every other field is {base.name!r}'s.",
        matmul_overlap=round(overlap, 2),
    )


def machine_spec(world_size: int, rank: int, base: str | ClusterSpec) -> ClusterSpec | None:
    """This machine's spec for the running process group: read from the cache, or measured and cached.

    Collective (every rank calls it). Rank 0 returns the spec; the others return ``None`` (only rank 0 plans).
    """
    base_spec = base if isinstance(base, ClusterSpec) else load_cluster(base)
    path = cache_path(world_size, dist.get_backend())
    cached = None
    if rank == 0 and path.exists():
        try:
            cached = load_cluster(path)
        except (OSError, ValueError) as e:
            log.warning("ignoring the cached machine spec %s (%s); measuring again", path, e)
    hit = torch.tensor([int(cached is not None)], device=_device())
    dist.broadcast(hit, 0)
    if int(hit.item()):
        log.info("rank %d: pricing on the measured machine spec %s", rank, path)
        return cached
    log.info("no measured spec for this machine at %s: measuring it once (a few seconds)", path)
    spec = measure_machine(base_spec, world_size, rank)
    if spec is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(spec.to_json(), encoding="utf-8")
        tmp.replace(path)  # whole or not at all, even with two jobs measuring at once
        log.info("wrote %s", path)
    return spec
