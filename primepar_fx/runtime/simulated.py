"""Many ranks simulated in one process: each rank a thread, its collectives and transfers carried out in memory.

Real gloo processes stop fitting a 2-core machine past 16 ranks, so plans at the sizes users run them (32 to 128
devices) would never be executed. ``simulate(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on one
thread per rank, each with its own default process group of the ``"primepar-sim"`` backend
(:class:`SimulatedGroup`), and returns every rank's result. The compiled modules run unchanged: the same graphs,
the same ``torch.distributed`` calls (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``,
``broadcast``, ``barrier``, ``new_group``, ``batch_isend_irecv``), only the transport differs.

Why threads and not ``torch.distributed._local_tensor``: ``LocalTensorMode`` runs *one* SPMD program whose tensors
hold every rank's value. Our compiled step is a different program on each rank (the rank's slice offsets, its ring
peers and its re-layout messages are constants of its graph), so it cannot be carried by one program over
``LocalTensor`` values. Threads run each rank's own graph. The per-thread ``torch.distributed`` state (default group,
group names) is torch's own thread-local world, from ``torch.testing._internal.distributed.multi_threaded_pg``.

How messages move:

* a **collective** is matched by its place in each rank's sequence on one group (the k-th call of every member is
  one collective, as on a real backend). Every member must issue the same kind with the same shapes, or all of them
  fail with a message naming both ranks' calls (a real backend would hang or corrupt). Issuing never blocks: the
  last member to arrive carries out the collective for all of them and completes their ``Work``; ``wait`` blocks
  until then. So an asynchronous collective stays asynchronous, and a program that reads a result before waiting
  reads what it would read on a real backend before the data arrived.
* a **point-to-point** message is matched by (sender, receiver, tag) in order, as gloo matches them. A send is
  copied when posted (so the sender may reuse its buffer at once, which gloo does not promise: see below); a
  receive completes when its message is there.

What it does not exercise (the real-rank tests keep these): timing of any kind (no overlap is real here; one thread
runs at a time under the GIL), the process group's timeouts and the death of a rank (a rank that raises aborts the
run: every pending ``wait`` of the others raises at once), gloo's own limits (its message sizes, its buffers
being read after ``isend`` returns), separate memory (every rank's tensors live in one process; per-rank peak
memory is not measured), and the ``torchrun`` environment. Each rank thread sees the process's single RNG state
and intra-op thread pool.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: the backend name :func:`simulate` initialises every rank's default group with
BACKEND = "primepar-sim"


class SimulationError(RuntimeError):
    """The simulated ranks disagree (mismatched collectives), or a rank failed and the others were stopped;
    ``rank``: the rank that failed first, where one did."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class _SimWork(dist.Work):
    """The ``Work`` of a simulated call: ``wait`` blocks until it is carried out and raises what failed it."""

    def __init__(self) -> None:
        super().__init__()
        self._event = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def wait(self, timeout: Any = None) -> bool:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None


def _done() -> _SimWork:
    work = _SimWork()
    work.finish()
    return work


@dataclass
class _Call:
    """One member's part of a collective: what it asked for, its tensors and its completion."""

    rank: int  # the member's rank in the group
    kind: str
    args: tuple
    work: _SimWork = field(default_factory=_SimWork)

    def describe(self) -> str:
        shapes = [tuple(t.shape) for t in self.args if isinstance(t, torch.Tensor)]
        return f"{self.kind} of shapes {shapes}"


_REDUCE = {
    dist.ReduceOp.SUM: lambda ts: torch.stack(ts).sum(0),
    dist.ReduceOp.MAX: lambda ts: torch.stack(ts).amax(0),
    dist.ReduceOp.MIN: lambda ts: torch.stack(ts).amin(0),
    dist.ReduceOp.PRODUCT: lambda ts: torch.stack(ts).prod(0),
    dist.ReduceOp.AVG: lambda ts: torch.stack(ts).mean(0),
}


def _reduce(op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    op = getattr(op, "op", op)  # a ReduceOp of the options holds its RedOpType
    try:
        return _REDUCE[op](tensors)
    except KeyError:
        raise SimulationError(f"reduce op {op} is not simulated (SUM, MAX, MIN, PRODUCT, AVG are)") from None


def _carry_out(calls: list[_Call]) -> None:
    """Carry out one collective whose members have all arrived (``calls`` in group-rank order)."""
    first = calls[0]
    for c in calls[1:]:
        same = c.kind == first.kind and [getattr(t, "shape", t) for t in c.args[:2]] == [
            getattr(t, "shape", t) for t in first.args[:2]
        ]
        if not same:
            raise SimulationError(
                f"mismatched collective: group rank {first.rank} issued {first.describe()}, group rank {c.rank} "
                f"issued {c.describe()}"
            )
    with torch.no_grad():
        if first.kind == "allreduce":
            total = _reduce(first.args[1], [c.args[0] for c in calls])
            for c in calls:
                c.args[0].copy_(total)
        elif first.kind == "allgather":
            whole = torch.cat([c.args[1].reshape(-1) for c in calls])
            for c in calls:
                c.args[0].view(-1).copy_(whole)
        elif first.kind == "reduce_scatter":
            total = _reduce(first.args[2], [c.args[1].reshape(-1) for c in calls])
            for i, part in enumerate(total.chunk(len(calls))):
                calls[i].args[0].view(-1).copy_(part)
        elif first.kind == "broadcast":
            source = calls[first.args[1]].args[0]
            for c in calls:
                if c.args[0] is not source:
                    c.args[0].copy_(source)
        # "barrier": nothing to move


class _World:
    """Everything the simulated ranks share: pending collectives per group, messages per (sender, receiver, tag),
    and the abort state. One lock guards it all (the work under it is small copies)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[tuple[Any, int], list[_Call | None]] = {}
        self.sent: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.waiting: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.failed: BaseException | None = None

    def join(self, group: Any, seq: int, size: int, call: _Call) -> Any:
        """Add ``call`` as the ``seq``-th collective of ``group``; the last member carries it out."""
        with self.lock:
            self._check()
            calls = self.pending.setdefault((group, seq), [None] * size)
            calls[call.rank] = call
            if any(c is None for c in calls):
                return call.work
            del self.pending[(group, seq)]
        error: BaseException | None = None
        try:
            _carry_out(calls)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 (every member's wait raises it)
            error = e
        for c in calls:
            c.work.finish(error)  # type: ignore[union-attr]
        return call.work

    def send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> Any:
        with self.lock:
            self._check()
            queue = self.waiting[(src, dst, tag)]
            if queue:
                into, work = queue.popleft()
            else:
                self.sent[(src, dst, tag)].append(tensor.detach().clone())
                return _done()
        _deliver(into, tensor, work)
        return _done()

    def recv(self, src: int, dst: int, tag: int, into: torch.Tensor) -> Any:
        work = _SimWork()
        with self.lock:
            self._check()
            queue = self.sent[(src, dst, tag)]
            if not queue:
                self.waiting[(src, dst, tag)].append((into, work))
                return work
            message = queue.popleft()
        _deliver(into, message, work)
        return work

    def abort(self, error: BaseException) -> None:
        """Stop the run: every pending ``wait`` raises, and so does every later call."""
        with self.lock:
            if self.failed is None:
                self.failed = error
            works = [c.work for calls in self.pending.values() for c in calls if c is not None]
            works += [work for q in self.waiting.values() for _, work in q]
            self.pending.clear()
            self.waiting.clear()
        stop = SimulationError(f"another simulated rank failed: {type(error).__name__}: {error}")
        for work in works:
            work.finish(stop)

    def unmatched(self) -> list[str]:
        """What is left over after a run: collectives some member never joined, messages never received."""
        left = [f"collective #{seq} of group {g}" for (g, seq), calls in self.pending.items() if calls]
        left += [f"{len(q)} message(s) {s}->{d} tag {t} never received" for (s, d, t), q in self.sent.items() if q]
        left += [f"{len(q)} receive(s) {s}->{d} tag {t} never sent" for (s, d, t), q in self.waiting.items() if q]
        return left

    def _check(self) -> None:
        if self.failed is not None:
            raise SimulationError(f"another simulated rank failed: {type(self.failed).__name__}: {self.failed}")


def _deliver(into: torch.Tensor, message: torch.Tensor, work: _SimWork) -> None:
    if into.shape != message.shape or into.dtype != message.dtype:
        wrong = f"a message of {tuple(message.shape)} {message.dtype} for a receive of {tuple(into.shape)} {into.dtype}"
        work.finish(SimulationError(wrong))
        return
    with torch.no_grad():
        into.copy_(message)
    work.finish()


_WORLD: _World | None = None


class SimulatedGroup(dist.ProcessGroup):
    """A process group of simulated ranks (module docstring): collectives and point-to-point messages between the
    threads of :func:`simulate`, matched and carried out in memory."""

    def __init__(self, opts: Any) -> None:
        super().__init__(opts.group_rank, opts.group_size)
        if _WORLD is None:
            raise RuntimeError(f"the {BACKEND!r} backend runs only inside primepar_fx.runtime.simulated.simulate")
        self._world, self._name = _WORLD, (opts.group_id, tuple(opts.global_ranks_in_group))
        self._rank, self._size = opts.group_rank, opts.group_size
        self._ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        self._seq = 0

    def _join(self, kind: str, *args: Any) -> Any:
        seq, self._seq = self._seq, self._seq + 1
        return self._world.join(self._name, seq, self._size, _Call(self._rank, kind, args))

    # the calls torch.distributed makes on a group ----------------------------------------------------------------
    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        (tensor,) = tensors
        return self._join("allreduce", tensor, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        works = [self._join("allreduce", t, op) for t in tensors]
        return works[-1] if works else _done()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"all_gather_single: output of {output.numel()} for {self._size} x {input.numel()}")
        return self._join("allgather", output, input)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.all_gather_single(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_single: input of {input.numel()} for {self._size} x {output.numel()}")
        return self._join("reduce_scatter", output, input, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        (tensor,) = tensors
        return self._join("broadcast", tensor, opts.rootRank if opts is not None else 0)

    def barrier(self, opts: Any = None) -> Any:
        return self._join("barrier")

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        (tensor,) = tensors
        return self._world.send(self._ranks[self._rank], self._ranks[dst], tag, tensor)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        (tensor,) = tensors
        return self._world.recv(self._ranks[src], self._ranks[self._rank], tag, tensor)


def _create(opts: Any, backend_options: Any = None) -> SimulatedGroup:
    return SimulatedGroup(opts)


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


_REGISTRY = ("_register_process_group", "_unregister_process_group", "_unregister_all_process_groups")


def _unregistered(*args: Any) -> None:
    return None


@contextlib.contextmanager
def _simulated_world() -> Iterator[_World]:
    """torch's thread-local ``torch.distributed`` state and a fresh :class:`_World`, for the length of one run."""
    from torch.testing._internal.distributed import multi_threaded_pg

    global _WORLD
    if _WORLD is not None:
        raise RuntimeError("simulate() is already running in this process (one simulation at a time)")
    if dist.is_initialized():
        raise RuntimeError("simulate() needs a process without a default process group of its own")
    _WORLD = _World()
    multi_threaded_pg._install_threaded_pg()
    c10d = dist.distributed_c10d
    # the names of groups are registered process-wide in C++; every simulated rank names its groups alike ("0" the
    # default group, then in creation order), so the registry is left out while the ranks share the process (only
    # functional collectives look groups up by name, and the compiled modules make none)
    registry = {n: getattr(c10d, n) for n in _REGISTRY}
    for name in _REGISTRY:
        setattr(c10d, name, _unregistered)
    hook = sys.excepthook  # each rank's init_process_group wraps it with its "[rankN]:" prefix: one run, N wraps
    try:
        yield _WORLD
    finally:
        sys.excepthook = hook
        for name, f in registry.items():
            setattr(c10d, name, f)
        multi_threaded_pg._uninstall_threaded_pg()
        _WORLD = None


def simulate(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, check_drained: bool = True
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` simulated ranks (module docstring); every rank's result,
    in rank order.

    The first exception of any rank stops the others and is re-raised here, naming the rank; a run past
    ``timeout`` seconds raises ``TimeoutError`` (the threads still blocked are released). ``check_drained``: raise
    if a collective or message is left unmatched when every rank has returned.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    with _simulated_world() as world:
        store = dist.HashStore()

        def rank_main(rank: int) -> None:
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store,
                                    timeout=timedelta(seconds=timeout))  # fmt: skip
            try:
                results[rank] = fn(rank, world_size, *args)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                errors.append((rank, e))
                world.abort(e)
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"sim-rank-{r}", daemon=True)
                   for r in range(world_size)]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            world.abort(TimeoutError(f"{world_size} simulated ranks did not finish within {timeout:.0f} s"))
            for t in threads:
                t.join(10.0)
            raise TimeoutError(f"{world_size} simulated ranks did not finish within {timeout:.0f} s")
        if errors:
            first = min(errors, key=lambda e: isinstance(e[1], SimulationError))  # the cause before its echoes
            rank, error = first
            raise SimulationError(f"simulated rank {rank} of {world_size} failed: {error}", rank) from error
        left = world.unmatched() if check_drained else []
        if left:
            raise SimulationError(f"{world_size} simulated ranks returned with work unmatched: {'; '.join(left[:5])}")
    return results
