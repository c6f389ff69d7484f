"""Measuring training steps on gloo ranks, shared by the step-time benchmarks.

* :func:`timed_step` / :func:`interleave`: one step between two barriers, with where the main thread spent it
  (:class:`Timing`); the systems' steps interleaved, one of each in turn with the order rotating, so load from
  other processes falls on all of them alike.
* :func:`wire_bytes`: bytes this process has written to files and sockets (``wchar`` of ``/proc/self/io``), which
  counts what gloo really puts on the loopback TCP connections (its ``writev`` calls), headers included.
* :class:`CommCounter`: a dispatch mode that prices every c10d collective a step calls (DTensor's functional
  collectives, FSDP2's and DDP's ``c10d`` ops, primepar's ``all_reduce`` and point-to-point transfers) with the
  ring-algorithm bus volume of the cost model and ``CommStats`` (all-reduce ``2 (g-1)/g`` of the tensor,
  all-gather ``(g-1)/g`` of the output, reduce-scatter and all-to-all ``(g-1)/g`` of the input, a send its bytes).
* :func:`memory_probe`: per-rank memory of one step: parameters, gradients and optimizer state from the tensors,
  the bytes autograd saves for backward (``saved_tensors_hooks``, each storage once, parameters excluded), and the
  allocator's peak over the step (``torch.profiler`` memory events).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import primepar_fx


def code_version() -> str:
    """The git commit of the primepar_fx that ran, and whether its package had uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(primepar_fx.__file__)))

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "primepar_fx")
    except (OSError, subprocess.CalledProcessError):
        return "primepar_fx from outside a git checkout"
    return f"primepar_fx at commit {head}" + (" with uncommitted changes" if dirty else "")


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, no GPU; {code_version()}"
    )


def reduce(values: list[float], op: dist.ReduceOp) -> list[float]:
    """``values`` reduced elementwise over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 and DTensor parameters); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of this rank's part of ``tensors`` (``None`` counts nothing)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def held_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds between steps: under primepar's ZeRO-3 the chunks of its units
    (``module.parameters()`` are views of storage freed between uses), else this rank's part of every parameter."""
    units = getattr(getattr(module, "zero3", None), "units", ())
    inside = {id(p) for u in units for p in u.params}
    rest = tensor_bytes(p for p in module.parameters() if id(p) not in inside)
    return rest + tensor_bytes(u.local for u in units)


def wire_bytes() -> int:
    """Bytes this process has written so far (``wchar``: files, pipes and sockets, every thread)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


class Timing(NamedTuple):
    """Seconds of one step on this rank: wall-clock, and where its main thread spent them (``/proc`` schedstat)."""

    wall: float
    compute: float  # the main thread on a core
    queued: float  # the main thread runnable, waiting for a core (other ranks and processes had them)
    blocked: float  # the main thread asleep: in collectives and transfers, waiting for peers, at the barriers
    comm_cpu: float  # the other threads on a core (gloo's threads: copies, reductions, socket calls)


def _schedstat() -> tuple[float, float]:
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, queued, _ = (int(x) for x in f.read().split())
    return on_cpu / 1e9, queued / 1e9


def timed_step(step: Callable[[], Any], distributed: bool = True) -> Timing:
    """One ``step()`` between two barriers (without barriers when not ``distributed``)."""
    if distributed:
        dist.barrier()
    t0, (c0, q0), p0 = time.perf_counter(), _schedstat(), time.process_time()
    step()
    if distributed:
        dist.barrier()
    wall, (c1, q1), p1 = time.perf_counter() - t0, _schedstat(), time.process_time()
    compute, queued = c1 - c0, q1 - q0
    return Timing(wall, compute, queued, max(0.0, wall - compute - queued), max(0.0, p1 - p0 - compute))


def interleave(labels: list[str], warmup: int, steps: int, run: Callable[[str, bool], None]) -> None:
    """``run(label, timed)`` for one step of each label in turn (order rotating), ``warmup + steps`` rounds."""
    for i in range(warmup + steps):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            run(label, i >= warmup)


def write_page(saved: dict, out: str, markdown: Callable, chart: Callable) -> None:
    """A benchmark's page ``out``, its chart (``.png``, when ``chart(saved, path)`` makes one) and the run's figures
    (``.json``, from which ``markdown(saved, png)`` writes the page again without running anything)."""
    stem = os.path.splitext(out)[0]
    with open(stem + ".json", "w") as f:
        json.dump(saved, f, indent=1)
    png = os.path.basename(stem + ".png") if chart(saved, stem + ".png") else None
    with open(out, "w") as f:
        f.write(markdown(saved, png) + "\n")
    print(f"wrote {out}")


def run_options(p: Any, *, steps: int, warmup: int, page: str, timeout: float) -> None:
    """The options every rank benchmark takes (steps, world size, ``--quick``, the page, ``--render``)."""
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 steps; prints, writes nothing")
    p.add_argument("--out", default=None, help=f"markdown page (default {page})")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds the ranks may take")
    p.add_argument("--render", metavar="JSON", help="write the page from a run's saved figures (no ranks)")


def page_for(args: Any, page: str, markdown: Callable, chart: Callable) -> str | None:
    """Where to write (``None`` for ``--quick`` without ``--out``), after applying ``--quick``; with ``--render``,
    writes the page from the saved figures and returns ``None`` (nothing left to do)."""
    if args.quick:
        args.steps, args.warmup = 2, 1
    if args.render:
        with open(args.render) as f:
            write_page(json.load(f), args.out or page, markdown, chart)
        return None
    return args.out or (None if args.quick else page)


def pyplot():
    """matplotlib's pyplot with a file backend, or ``None`` (and a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no chart (pip install -e ".[bench]")')
        return None
    return plt


def save_chart(plt: Any, fig: Any, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


# ------------------------------------------------------------------------------------------------ bytes by op
def _group_size(group: Any) -> int:
    if isinstance(group, str):  # functional collectives name their group
        return dist.distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, torch.ScriptObject):  # a c10d op's ProcessGroup argument
        group = dist.ProcessGroup.unbox(group)
    return group.size()


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(y) for y in x)


def _all_reduce(g: int) -> float:
    return 2 * (g - 1) / g


def _share(g: int) -> float:
    return (g - 1) / g


def _copies(g: int) -> float:  # an all-gather priced by its input: (g-1)/g of an output g times as large
    return g - 1.0


def _once(g: int) -> float:
    return 1.0


_F = "_c10d_functional."
#: op name -> (argument holding the measured tensor(s), argument holding the group or its size, bus factor of g)
_BUS: dict[str, tuple[int, int, Callable[[int], float]]] = {}
for _names, _arg, _grp, _f in [
    (("c10d.allreduce_",), 0, 1, _all_reduce),
    (
        (_F + "all_reduce", _F + "all_reduce_", _F + "all_reduce_coalesced", _F + "all_reduce_coalesced_"),
        0,
        2,
        _all_reduce,
    ),
    (("c10d._allgather_base_", "c10d.allgather_"), 0, 2, _share),  # the output
    (
        (_F + "all_gather_into_tensor", _F + "all_gather_into_tensor_coalesced", _F + "all_gather_into_tensor_out"),
        0,
        1,
        _copies,
    ),
    (("c10d._reduce_scatter_base_", "c10d.reduce_scatter_", "c10d.alltoall_base_"), 1, 2, _share),  # the input
    ((_F + "reduce_scatter_tensor", _F + "reduce_scatter_tensor_coalesced"), 0, 2, _share),
    ((_F + "all_to_all_single",), 0, 3, _share),
    (("c10d.broadcast_",), 0, 1, _share),
    (("c10d.send",), 0, 1, _once),
]:
    for _name in _names:
        _BUS[_name] = (_arg, _grp, _f)
_FREE = {"c10d.recv_", "c10d.recv_any_source_", "c10d.barrier", "c10d.monitored_barrier_"}
_FREE |= {_F + "wait_tensor", _F + "_wrap_tensor_autograd"}


class CommCounter(TorchDispatchMode):
    """Bytes and calls of every c10d op run under it (module docstring); ``unknown`` names ops it cannot price."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0.0
        self.calls = 0
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        if func.namespace in ("c10d", "_c10d_functional") and name not in _FREE:
            if name in _BUS:
                arg, grp, factor = _BUS[name]
                group = args[grp]
                size = group if isinstance(group, int) else _group_size(group)
                self.bytes += factor(size) * _nbytes(args[arg])
                self.calls += 1
            else:
                self.unknown.add(name)
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------ memory
def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside a wrapper subclass (a DTensor's shard, an async collective's result); else ``[t]``."""
    if hasattr(type(t), "__tensor_flatten__") and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [x for y in inner if isinstance(y, torch.Tensor) for x in _plain(y)]
    return [t]


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the storages autograd saves for backward, each once; parameters (and views of them) excluded."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            for inner in _plain(t):
                storage = inner.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def allocator_peak(step: Callable[[], Any]) -> int:
    """Most bytes the CPU allocator held during ``step()`` above what it held at the start (profiler events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def memory_probe(
    module: nn.Module, opt: torch.optim.Optimizer, forward: Callable[[], torch.Tensor], extra_state: int = 0
) -> dict[str, int]:
    """Per-rank memory of one training step of ``module`` (module docstring), in bytes.

    ``forward()`` returns the loss. ``extra_state``: bytes the system holds between steps beyond parameters and
    optimizer state (DDP's gradient buckets), added to the allocator's peak.
    """
    opt.zero_grad(set_to_none=True)
    saved = SavedBytes()
    with saved:
        loss = forward()
    loss.backward()
    opt.step()
    params = held_param_bytes(module)
    grads = tensor_bytes(p.grad for p in module.parameters())
    grads += tensor_bytes(s.master.grad for s in getattr(opt, "shards", ()))  # ZeRO-2's reduce-scattered chunks
    state = tensor_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    # a ZeRO optimizer's fp32 chunks (none beside an fp32 ZeRO-3 chunk, stepped in place: counted with the params)
    state += tensor_bytes(s.master for s in getattr(opt, "shards", ()) if not getattr(s, "in_place", False))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward().backward()
        opt.step()

    opt.zero_grad(set_to_none=True)  # the gradients are freed before the profile starts: its peak includes them
    peak = params + state + extra_state + allocator_peak(step)
    return {"params": params, "grads": grads, "optimizer": state, "activations": saved.total, "peak": peak}


def describe(plan) -> str:
    """A few words on a plan: the Megatron configuration, or how many nodes use P(S x S) or replicate."""
    from primepar_fx.partition import PartitionSeq, Replicate

    if plan.search.config is not None:
        return plan.search.config["name"].removeprefix("megatron ")
    seqs = [PartitionSeq.parse(n.partition) for n in plan.nodes]
    replicated = sum(all(isinstance(e, Replicate) for e in q.elements) for q in seqs)
    if replicated == len(seqs):
        return "all replicated"
    primes = sum(q.prime is not None for q in seqs)
    return f"{primes}/{len(seqs)} nodes P(SxS), {replicated} replicated"
