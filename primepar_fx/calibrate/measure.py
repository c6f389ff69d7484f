"""Calibration: measure this machine and fit the linear cost models of a :class:`ClusterSpec` (paper §4).

    primepar-fx calibrate [--world-size N] [--backend gloo|nccl] [--base NAME|PATH] [--quick] [--reps R]
                          [--timeout S] -o spec.toml|spec.json

* **Compute** (:func:`measure_compute`, in this process, on CPU or one CUDA device): matrix products of square and
  skinny shapes fit ``t = flops_coeff * flops + bytes_coeff * bytes + fixed`` for ``matmul`` (reused for
  ``attention``); memory-bound kernels of 2^16..2^22 elements fit ``bytes_coeff * bytes + fixed`` for
  ``pointwise`` (add, mul, gelu), ``norm`` (layer_norm, softmax), ``reduce`` (sum), ``loss`` (cross_entropy) and
  ``embedding`` (the rules give those families no FLOPs). ``bytes`` is the inputs plus the outputs, as the cost
  model counts them. Each time is a median over reps after warm-up; each fit is a non-negative least squares on
  relative residuals (:func:`~primepar_fx.calibrate.fitting.nnls`), so small kernels weigh as much as large ones.
  fp32 under the plain family key; on CUDA also bf16 under ``family:bf16``. On CPU the kernels run on one rank's
  share of the cores.
* **Communication** (:func:`measure_collectives`): ``world_size`` spawned processes on a free loopback port time
  every kind of :data:`COLLECTIVES` (p2p is a ring shift with ``batch_isend_irecv``) at 4 KiB..4 MiB per device:
  a barrier before each call, sizes interleaved within a rep, the minimum over ranks per call (the last rank out
  of the barrier sees no skew), the median over reps after warm-up. Rank 0 sends the samples back through a
  queue; the parent enforces the timeout and names the step each rank was in if one hangs or dies.
  :func:`~primepar_fx.cost.latency.fit_collective` turns them into per-bus-byte, per-ring-step coefficients of
  level 0 (all ranks share one node).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import platform
import queue as queue_mod
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from primepar_fx.calibrate.fitting import fit_compute, fit_quality, rounded, with_efficiency
from primepar_fx.cost.cluster import ClusterSpec, dtype_key, load_cluster
from primepar_fx.cost.latency import COLLECTIVES, ComputeModel, LinearLatency, fit_collective
from primepar_fx.runtime.process import exit_worker, free_port, release

log = logging.getLogger(__name__)

KiB = 1 << 10
COLLECTIVE_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB, 4096 * KiB)
QUICK_COLLECTIVE_SIZES = (4 * KiB, 64 * KiB, 1024 * KiB, 4096 * KiB)
#: the transfer and the side of the matrix product :func:`time_overlap` runs beside each other
OVERLAP_BYTES, OVERLAP_SIDE = 1024 * KiB, 256
MEMORY_SIZES = tuple(1 << p for p in range(16, 23))
QUICK_MEMORY_SIZES = (1 << 16, 1 << 19, 1 << 22)
MATMUL_SHAPES = (
    *((n, n, n) for n in (64, 128, 256, 384, 512, 768, 1024)),
    (4096, 64, 256),
    (4096, 256, 64),
    (256, 4096, 256),
    (2048, 1024, 64),
    (64, 1024, 2048),
    (8192, 128, 128),
)
QUICK_MATMUL_SHAPES = ((64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (4096, 64, 256))
DEFAULT_REPS, QUICK_REPS, WARMUP = 20, 5, 2
_ROW = 1024  # the last dim of the memory-bound kernels (norm / softmax / loss / embedding width)
_TARGET_S = 1e-3  # a timed rep repeats a kernel until it takes about this long


class CalibrationError(RuntimeError):
    """A calibration step failed or hung (the message names the step and the rank)."""


@dataclass(frozen=True, slots=True)
class FitReport:
    """How well one fitted model explains its samples (``R²`` and the largest ``|pred - t| / t``)."""

    name: str
    model: ComputeModel | LinearLatency
    r2: float
    max_rel: float
    samples: int


# ---------------------------------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar when tqdm is importable and stderr is a terminal, else INFO log lines."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.bar = total, desc, 0, None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, leave=False, disable=None)
            if self.bar.disable:
                self.bar = None
        except ImportError:
            pass

    def step(self, note: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update()
        else:
            log.info("%s %d/%d: %s", self.desc, self.done, self.total, note)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------------- compute
def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _time(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds per call over ``reps`` timed reps, after warm-up; short kernels repeat within a rep."""
    for _ in range(WARMUP):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    inner = max(1, min(100, int(_TARGET_S / max(time.perf_counter() - t0, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


Kernel = tuple[str, str, Callable[[], Any], float, float]  # family, name, call, flops, bytes


def _memory_kernels(numel: int, dtype: torch.dtype, device: torch.device) -> list[Kernel]:
    """The memory-bound kernels on ``numel`` elements laid out as rows of :data:`_ROW`."""
    item = torch.finfo(dtype).bits // 8
    rows = max(1, numel // _ROW)
    n = rows * _ROW
    x, y = torch.randn(rows, _ROW, dtype=dtype, device=device), torch.randn(rows, _ROW, dtype=dtype, device=device)
    w, bias = torch.ones(_ROW, dtype=dtype, device=device), torch.zeros(_ROW, dtype=dtype, device=device)
    idx, target = torch.randint(0, rows, (rows,), device=device), torch.randint(0, _ROW, (rows,), device=device)
    kernels: list[Kernel] = [
        ("pointwise", f"add {n}", lambda: torch.add(x, y), 0.0, 3 * n * item),
        ("pointwise", f"mul {n}", lambda: torch.mul(x, y), 0.0, 3 * n * item),
        ("pointwise", f"gelu {n}", lambda: F.gelu(x), 0.0, 2 * n * item),
        ("norm", f"layer_norm {n}", lambda: F.layer_norm(x, (_ROW,), w, bias), 0.0, (2 * n + 2 * _ROW) * item),
        ("norm", f"softmax {n}", lambda: torch.softmax(x, -1), 0.0, 2 * n * item),
        ("reduce", f"sum {n}", lambda: x.sum(-1), 0.0, (n + rows) * item),
        ("loss", f"cross_entropy {n}", lambda: F.cross_entropy(x, target), 0.0, (n + 1) * item + 8 * rows),
        ("embedding", f"embedding {n}", lambda: F.embedding(idx, x), 0.0, 2 * n * item + 8 * rows),
    ]
    for _ in range(WARMUP):  # warm the allocator for this size first: the first kernel would pay its page faults
        for _, _, fn, _, _ in kernels:
            fn()
    return kernels


def _kernels(
    shapes: Sequence[tuple[int, int, int]], sizes: Sequence[int], dtype: torch.dtype, device: torch.device
) -> Iterator[Kernel]:
    """Every kernel to time, built lazily (one memory size's tensors alive at a time)."""
    item = torch.finfo(dtype).bits // 8
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        nbytes = (m * k + k * n + m * n) * item
        yield "matmul", f"mm {m}x{k}x{n}", functools.partial(torch.mm, a, b), 2.0 * m * k * n, nbytes
    for numel in sizes:
        yield from _memory_kernels(numel, dtype, device)


def measure_compute(
    device: torch.device | str,
    quick: bool = False,
    reps: int | None = None,
    *,
    threads: int | None = None,
    report: list[FitReport] | None = None,
    efficiency: bool = False,
) -> dict[str, ComputeModel]:
    """Time compute kernels on ``device`` and fit one :class:`ComputeModel` per op family.

    Keys are families (fp32) and, on CUDA, ``family:bf16``; ``attention`` reuses ``matmul``. ``threads`` sets
    torch's CPU threads for the measurement (restored after). Fit quality is appended to ``report``.
    ``efficiency=True`` gives the matrix-product models an efficiency table by size (:func:`with_efficiency`).
    """
    device = torch.device(device)
    reps = reps or (QUICK_REPS if quick else DEFAULT_REPS)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    shapes, sizes = (QUICK_MATMUL_SHAPES, QUICK_MEMORY_SIZES) if quick else (MATMUL_SHAPES, MEMORY_SIZES)
    sync, old_threads = _sync(device), torch.get_num_threads()
    samples: dict[str, list[tuple[float, float, float]]] = {}
    progress = Progress(len(dtypes) * (len(shapes) + 8 * len(sizes)), f"compute on {device}")
    try:
        if threads:
            torch.set_num_threads(threads)
        with torch.inference_mode():
            for dtype in dtypes:
                suffix = "" if dtype == torch.float32 else f":{dtype_key(dtype)}"
                for family, name, fn, flops, nbytes in _kernels(shapes, sizes, dtype, device):
                    seconds = _time(fn, reps, sync)
                    samples.setdefault(family + suffix, []).append((flops, nbytes, seconds))
                    progress.step(f"{name} {dtype_key(dtype)}: {seconds * 1e6:.1f} us")
    finally:
        progress.close()
        torch.set_num_threads(old_threads)
    models: dict[str, ComputeModel] = {}
    for key, rows in samples.items():
        model = rounded(fit_compute(rows, use_flops=key.startswith("matmul")))
        if efficiency and key.startswith("matmul"):
            model = with_efficiency(model, rows)
        models[key] = model
        if report is not None:
            r2, max_rel = fit_quality([model(f, n) for f, n, _ in rows], [t for *_, t in rows])
            report.append(FitReport(key, model, r2, max_rel, len(rows)))
        if key.startswith("matmul"):
            models[key.replace("matmul", "attention")] = model
    return models


# ---------------------------------------------------------------------------------------------------- collectives


def collective_call(
    kind: str, nbytes: int, rank: int, world: int, device: torch.device, group: Any = None, group_size: int = 0
) -> tuple[Callable, int]:
    """A closure running one ``kind`` collective and the bytes per device it moves (cluster.py convention).

    ``group`` (of ``group_size`` ranks): a group collective over that process group instead of the world; the ring
    shift (``p2p``) always runs over the world."""
    import torch.distributed as dist

    g = group_size if group is not None else world
    numel = max(g, nbytes // 4 // g * g)  # fp32, divisible by the group size
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // g, device=device)
    if kind == "all-reduce":
        return lambda: dist.all_reduce(full, group=group), numel * 4
    if kind == "all-gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=group), numel * 4
    if kind == "reduce-scatter":
        return lambda: dist.reduce_scatter_tensor(part, full, group=group), numel * 4
    if kind == "all-to-all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group), numel * 4
    recv = torch.empty_like(full)

    def shift() -> None:
        ops = [dist.P2POp(dist.isend, full, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return shift, numel * 4


def _worker(
    rank: int, world: int, backend: str, port: int, sizes: Sequence[int], reps: int, timeout: float, q: Any
) -> None:
    """One rank: time every collective kind at every size, and :func:`time_overlap`; rank 0 puts
    ``("result", 0, (samples, overlap))`` on ``q``."""
    import torch.distributed as dist

    try:
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor / reduce_scatter_tensor renames
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        q.put(("step", rank, "init_process_group"))
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        sync = _sync(device)
        samples: dict[str, list[tuple[int, float]]] = {}
        for kind in COLLECTIVES:
            calls = [collective_call(kind, size, rank, world, device) for size in sizes]
            for (fn, _), size in zip(calls, sizes):
                q.put(("step", rank, f"{kind} {size} B warm-up"))
                for _ in range(WARMUP):
                    fn()
            times = torch.zeros(len(sizes), reps, dtype=torch.float64)
            for r in range(reps):  # sizes interleaved: a burst of load on the machine hits every size alike
                q.put(("step", rank, f"{kind} rep {r + 1}/{reps}"))
                for i, (fn, _) in enumerate(calls):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[i, r] = time.perf_counter() - t0
            times = times.to(device)
            dist.all_reduce(times, op=dist.ReduceOp.MIN)  # the last rank out of the barrier: no barrier skew
            samples[kind] = [(nbytes, float(t)) for (_, nbytes), t in zip(calls, times.median(dim=1).values.cpu())]
        q.put(("step", rank, "a transfer beside a product"))
        overlap = time_overlap(rank, world, device, reps)
        q.put(("step", rank, "destroy_process_group"))
        release()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            q.put(("result", 0, (samples, overlap)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        raise
    q.close()
    q.join_thread()  # the result is in the pipe before the process leaves without teardown
    exit_worker(0)


def _slowest(seconds: list[float], device: torch.device) -> float:
    """The median of ``seconds`` of the slowest rank (collective)."""
    import torch.distributed as dist

    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.cpu().tolist())


def time_overlap(rank: int, world: int, device: torch.device, reps: int) -> float:
    """How much of a transfer a matrix product beside it hides, measured as a collective matmul runs it (the
    :attr:`~primepar_fx.cost.cluster.ClusterSpec.matmul_overlap` fraction, 0 to 1): every rank sends
    :data:`OVERLAP_BYTES` to the next rank of a ring and receives the previous one's, alone (``x``), a run of
    products of about that long alone (``c``), and both, the transfer posted before the products and waited after
    them (``b``); the slowest rank's medians give ``(c + x - b) / min(c, x)``. Where ranks share cores (a rank that
    waits hands its core to another) it is near 0; on GPUs with their own copy engines near 1. Collective."""
    import torch.distributed as dist

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out_buf = torch.ones(OVERLAP_BYTES // 4, device=device)
    in_buf = torch.empty_like(out_buf)
    a = torch.randn(OVERLAP_SIDE, OVERLAP_SIDE, device=device)

    def post() -> list:
        ops = [dist.P2POp(dist.isend, out_buf, (rank + 1) % world), dist.P2POp(dist.irecv, in_buf, (rank - 1) % world)]
        return dist.batch_isend_irecv(ops)

    def timed(fn: Any) -> list[float]:
        out = []
        for r in range(-1, reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= 0:
                out.append(time.perf_counter() - t0)
        return out

    def transfer() -> None:
        for w in post():
            w.wait()

    x = _slowest(timed(transfer), device)
    one = _slowest(timed(lambda: a @ a), device)
    count = torch.tensor([max(1, round(x / max(one, 1e-9)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank the same run of products
    products = int(count.item())

    def compute() -> None:
        for _ in range(products):
            a @ a

    def both() -> None:
        works = post()
        compute()
        for w in works:
            w.wait()

    c = _slowest(timed(compute), device)
    b = _slowest(timed(both), device)
    return min(1.0, max(0.0, (c + x - b) / max(min(c, x), 1e-9)))


def measure_collectives(
    world_size: int,
    backend: str = "gloo",
    quick: bool = False,
    reps: int | None = None,
    timeout: float = 120.0,
    *,
    report: list[FitReport] | None = None,
    overlap: list[float] | None = None,
) -> dict[str, LinearLatency]:
    """Time every collective kind over ``world_size`` local processes; fit one :class:`LinearLatency` per kind.
    ``overlap``: gets :func:`time_overlap`'s fraction appended.

    Raises :class:`CalibrationError` naming each rank's step if the ranks are not done within ``timeout`` seconds
    (start-up included) or if a rank fails.
    """
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to time collectives, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPU(s)")
    reps = reps or (QUICK_REPS if quick else DEFAULT_REPS)
    sizes = QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port, deadline = free_port(), time.monotonic() + timeout
    args = (world_size, backend, port, sizes, reps, timeout, q)
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(world_size)]
    steps = dict.fromkeys(range(world_size), "start-up (spawn, import torch)")
    progress = Progress(len(COLLECTIVES) * reps, f"{backend} collectives x{world_size}")
    result: tuple[dict[str, list[tuple[int, float]]], float] | None = None
    try:
        for p in procs:
            p.start()
        while result is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                where = "; ".join(f"rank {r}: {s}" for r, s in steps.items())
                raise CalibrationError(f"collective calibration hung: not done after {timeout:g} s ({where})")
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                r, code = dead[0]
                raise CalibrationError(f"rank {r} exited with code {code} during {steps[r]!r}")
            try:
                tag, rank, payload = q.get(timeout=min(remaining, 0.2))
            except queue_mod.Empty:
                continue
            if tag == "error":
                raise CalibrationError(f"rank {rank} failed during {steps[rank]!r}:\n{payload}")
            if tag == "result":
                result = payload
                continue
            steps[rank] = payload
            if rank == 0 and " rep " in payload:
                progress.step(payload)
        for p in procs:  # every rank is past its last collective: give them a moment to exit
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        progress.close()
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    samples, hidden = result
    if overlap is not None:
        overlap.append(hidden)
    fits: dict[str, LinearLatency] = {}
    for kind, rows in samples.items():
        fit = rounded(fit_collective(kind, world_size, rows))
        fits[kind] = fit
        if report is not None:
            pred = [fit.collective(kind, world_size, n) for n, _ in rows]
            r2, max_rel = fit_quality(pred, [t for _, t in rows])
            report.append(FitReport(kind, fit, r2, max_rel, len(rows)))
    return fits


# ---------------------------------------------------------------------------------------------------- calibrate
def default_backend(world_size: int = 1) -> str:
    """nccl when there is a GPU for every rank, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def resize_spec(base: ClusterSpec, world_size: int) -> ClusterSpec:
    """``base`` with at least ``world_size`` devices (the calibrated ranks share one node)."""
    if base.num_nodes == 1:
        n = max(base.num_devices, world_size)
        return dataclasses.replace(base, num_devices=n, devices_per_node=n)
    if base.devices_per_node < world_size:
        log.warning(
            "base %r has %d devices per node, fewer than the %d calibrated (one node) ranks",
            base.name,
            base.devices_per_node,
            world_size,
        )
    dpn = base.devices_per_node
    return dataclasses.replace(base, num_devices=max(base.num_devices, -(-world_size // dpn) * dpn))


def calibrate(
    world_size: int = 2,
    backend: str | None = None,
    base: str | ClusterSpec = "cpu-gloo",
    quick: bool = False,
    reps: int | None = None,
    timeout: float = 120.0,
    *,
    report: list[FitReport] | None = None,
    efficiency: bool = False,
) -> ClusterSpec:
    """Measure compute, level-0 collectives and the matmul overlap here and return ``base`` with them merged in
    (``calibrated``);
    ``efficiency=True`` gives the matrix products an efficiency table by size (:func:`with_efficiency`)."""
    backend = backend or default_backend(world_size)
    spec = resize_spec(base if isinstance(base, ClusterSpec) else load_cluster(base), world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda" and spec.name == "cpu-gloo":
        log.warning(
            "calibrating a GPU against the cpu-gloo base: uncalibrated fields (peak FLOP/s, memory) are "
            "the CPU guesses; pass --base a100-dgx / h100-dgx or a spec file"
        )
    threads = max(1, (os.cpu_count() or 1) // world_size) if device.type == "cpu" else None
    t0 = time.perf_counter()
    compute = measure_compute(device, quick, reps, threads=threads, report=report, efficiency=efficiency)
    log.info("compute calibrated in %.1f s", time.perf_counter() - t0)
    t0 = time.perf_counter()
    hidden: list[float] = []
    collectives = measure_collectives(world_size, backend, quick, reps, timeout, report=report, overlap=hidden)
    log.info("collectives calibrated in %.1f s", time.perf_counter() - t0)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()}-core CPU"
    source = (
        f"primepar-fx calibrate on {platform.node() or 'unknown host'} ({where}, torch {torch.__version__}) at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {backend}, world size {world_size}, "
        f"{reps or (QUICK_REPS if quick else DEFAULT_REPS)} reps{', quick' if quick else ''}"
    )
    base = spec.description.split(". ")[0].rstrip(".")
    note = (
        f"Compute and the collectives inside a node measured here (see source); every other field is the base spec "
        f"{spec.name!r}: {base}."
    )
    spec = dataclasses.replace(spec, description=note, matmul_overlap=round(hidden[0], 2))
    return spec.with_calibration(source=source, collectives={0: collectives}, compute=compute)


def write_spec(spec: ClusterSpec, path: str | os.PathLike[str]) -> Path:
    """Write ``spec`` as TOML when ``path`` ends in ``.toml``, else as JSON; return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(spec.to_toml() if p.suffix == ".toml" else spec.to_json(), encoding="utf-8")
    return p


def report_table(report: Sequence[FitReport], tablefmt: str = "simple") -> str:
    """The fitted coefficients, the rates they imply and the fit quality, one row per model."""
    from tabulate import tabulate

    rows = []
    for r in report:
        m = r.model
        flops = m.flops_coeff if isinstance(m, ComputeModel) else None
        rates = [f"{1e-9 / flops:.3g} GFLOP/s"] if flops else []
        rates += [f"{1e-9 / m.bytes_coeff:.3g} GB/s"] if m.bytes_coeff else []
        rows.append(
            [
                r.name,
                "-" if flops is None else f"{flops:.4g}",
                f"{m.bytes_coeff:.4g}",
                f"{m.fixed * 1e6:.4g}",
                ", ".join(rates) or "-",
                f"{r.r2:.4f}",
                f"{r.max_rel:.1%}",
                r.samples,
            ]
        )
    head = ["model", "s/FLOP", "s/byte", "fixed (us)", "rate", "R²", "max |rel resid|", "samples"]
    return tabulate(rows, headers=head, tablefmt=tablefmt, disable_numparse=True)


# ---------------------------------------------------------------------------------------------------- CLI
def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``calibrate`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("calibrate", help="measure this machine's compute and collectives into a cluster spec")
    p.add_argument("--world-size", "-n", type=int, default=2, help="ranks for the collectives (default 2)")
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        help="default: nccl if there is a GPU per rank, else gloo; compute is timed on the GPU with nccl, else the CPU",
    )
    p.add_argument("--base", default="cpu-gloo", help="preset name or spec file to start from (default cpu-gloo)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and reps (a rough fit in seconds)")
    p.add_argument("--reps", type=int, help=f"timed reps per point (default {DEFAULT_REPS}, {QUICK_REPS} with --quick)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the collective step may take (default 120)")
    p.add_argument(
        "--efficiency",
        action="store_true",
        help="give matrix products an efficiency table by size (small calls slower per FLOP) instead of one rate",
    )
    p.add_argument("--format", default="simple", help="tabulate table format (simple, github, ...)")
    p.add_argument("-o", "--output", required=True, help="where to write the spec (.toml, else JSON)")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``primepar-fx calibrate``: measure, write the spec, print the fits; 1 if a step hung or failed."""
    cap = (os.cpu_count() or 1) * 2
    if not 2 <= args.world_size <= cap:
        raise ValueError(f"--world-size must be 2..{cap} (twice the cores), got {args.world_size}")
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    report: list[FitReport] = []
    t0 = time.perf_counter()
    try:
        spec = calibrate(
            args.world_size,
            args.backend,
            args.base,
            args.quick,
            args.reps,
            args.timeout,
            report=report,
            efficiency=args.efficiency,
        )
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    path = write_spec(spec, args.output)
    print(report_table(report, args.format))
    print(f"\n{spec.source}")
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    return 0
