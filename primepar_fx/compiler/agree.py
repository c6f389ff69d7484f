"""The plan every rank runs: resolved on rank 0, broadcast, checked on every rank.

:func:`~primepar_fx.compile` and the ``torch.compile`` backend first check their options on every rank
(:meth:`~primepar_fx.planning.options.PlanOptions.make` and :func:`~primepar_fx.planning.options.parse_plan`), before
any capture. Rank 0 then makes the plan (:func:`resolve_plan`: a search, a forced
plan, a Plan or a plan JSON) and broadcasts it as JSON text in a tensor (nothing is pickled); every rank checks that
it fits its world size, its graph and its sizes (:func:`agree_plan`). When rank 0 cannot make the plan, every other
rank raises with rank 0's message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import sympy
import torch
import torch.distributed as dist

from primepar_fx.calibrate.machine import machine_spec, one_host
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionError
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.options import PlanOptions, parse_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.record.plan import Plan
from primepar_fx.runtime.groups import ProcessGroups, set_p2p_timeout

log = logging.getLogger(__name__)


def world_rank() -> tuple[int, int]:
    """``(world size, rank)`` of the default process group, ``(1, 0)`` without one (the ``torch.compile`` path)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def checked_world(world_size: int | None) -> tuple[int, int]:
    """``(world size, rank)`` for :func:`compile`: a process group is required unless ``world_size=1``."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if world_size is not None and world_size != world:
            raise ValueError(f"world_size={world_size} but the default process group has {world} ranks")
        return world, rank
    if world_size == 1:
        return 1, 0
    wanted = "" if world_size is None else f" of {world_size} ranks"
    raise RuntimeError(
        f"primepar_fx.compile needs an initialised torch.distributed process group{wanted}: call "
        "torch.distributed.init_process_group on every rank first (torchrun sets up its environment), or pass "
        "world_size=1 to run the model as one process"
    )


def _broadcast_text(text: str | None, rank: int, world: int, *, failure: str | None = None) -> str:
    """Rank 0's ``text`` on every rank, sent as UTF-8 bytes in a tensor (no pickling).

    Rank 0 sends ``failure`` instead when it could not make the text; every other rank then raises with it.
    """
    if world == 1:
        assert text is not None
        return text
    device = comm_device()
    payload = (failure if failure is not None else text or "").encode() if rank == 0 else b""
    head = torch.tensor([len(payload), int(failure is not None)], dtype=torch.int64, device=device)
    dist.broadcast(head, 0)
    buf = torch.zeros(int(head[0]), dtype=torch.uint8, device=device)
    if rank == 0 and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    received = bytes(buf.cpu().tolist()).decode()
    if int(head[1]) and rank != 0:  # rank 0 raises its own error
        raise RuntimeError(f"rank 0 could not make the plan: {received}")
    return received


def resolve_plan(graph: OpGraph, plan: Any, options: PlanOptions) -> Plan:
    """A :class:`Plan` from ``None`` (search), a Plan, a plan JSON (a path, or the text itself) or a forced-plan
    name (:func:`~primepar_fx.planning.options.parse_plan`), for ``options``' cluster and world size."""
    kind, value = parse_plan(plan)
    if kind == "search":
        return plan_graph(graph, options)
    if kind == "plan":
        return value
    if kind == "file":
        return Plan.load(value)
    if kind == "json":
        return Plan.from_json(value)
    return forced_plan(graph, value, options)


def check_runnable(plan: Plan, *, pipelines: bool = True, what: str = "the runtime") -> None:
    """Raise ``NotImplementedError`` for a plan ``what`` cannot run: with ``pipelines=False`` (the ``torch.compile``
    backend and the graph dump), one with pipeline stages (``compile`` runs them:
    :mod:`~primepar_fx.compiler.pipelined`)."""
    if plan.pipeline is not None and not pipelines:
        raise NotImplementedError(
            f"the plan runs as a pipeline of {plan.pipeline.describe()}, which {what} does not run: compile it with "
            "primepar_fx.compile (module.step runs the pipeline), or make the plan with stages=1 "
            "(primepar-fx plan --stages 1)"
        )


def check_plan_fits(graph: OpGraph, plan: Plan, values: Mapping[sympy.Symbol, int]) -> None:
    """Raise :class:`PartitionError` naming the node and the dim when ``plan`` cannot run at sizes ``values``."""
    mesh = DeviceMesh(tuple(plan.digits))
    at = ", ".join(f"{k}={v}" for k, v in values.items())
    for node in plan.nodes:
        opnode = graph.nodes[node.name]
        try:
            OpPartition(opnode.dims, node.seq, mesh).check_divisible(dict(values))
        except PartitionError as e:
            raise PartitionError(f"plan node {node.name!r} ({node.op}) cannot run at {at}: {e}") from None


def compile_options(
    *, cluster: Any = None, memory_budget: object = None, dtype: object = None, fallback: str | None = None
) -> PlanOptions:
    """The options of a plan made to run here (``compile``, the backend, ``primepar-fx dump``): the cluster defaults
    to this machine's (:func:`~primepar_fx.planning.options.default_cluster`), the dtype to the model's, and a search
    is the DP without baselines."""
    return PlanOptions.make(
        cluster=cluster,
        running=True,
        memory_budget=memory_budget,
        dtype=dtype,
        fallback=fallback,
        method="dp",
        baselines=False,
        stages=1,  # a search made to run here cuts no stages: a pipelined plan is given (plan=...)
    )


def with_machine_cluster(options: PlanOptions, plan: Any, *, measure: bool) -> PlanOptions:
    """``options`` priced on this machine as measured (:func:`~primepar_fx.calibrate.machine.machine_spec`: cached,
    else measured once on every rank) where ``measure`` (the caller gave no cluster), ``PRIMEPAR_CLUSTER`` names
    none, the ranks share one host and rank 0 will price a plan (a search or a forced plan). Collective: every rank
    calls it, and rank 0's ``plan`` and ``measure`` decide for all (another rank may pass ``plan=None``, rank 0's
    being broadcast); only rank 0's options change (only rank 0 plans)."""
    world, rank = world_rank()
    if world < 2 or os.environ.get("PRIMEPAR_CLUSTER") or not one_host(world):
        return options
    # rank 0's plan and cluster are the ones every rank runs (the others may pass plan=None), so its answer holds
    wanted = torch.tensor([int(measure and parse_plan(plan)[0] in ("search", "forced"))], device=comm_device())
    dist.broadcast(wanted, 0)
    if not int(wanted.item()):
        return options
    spec = machine_spec(world, rank, options.cluster)
    return options if spec is None else options.replace(cluster=spec)


def agree_plan(graph: OpGraph, plan: Any, options: PlanOptions, *, pipelines: bool = True, what: str = "") -> Plan:
    """Rank 0 resolves the plan (:func:`resolve_plan`) and broadcasts it; every rank checks it fits.

    Every check runs on every rank, before any process group or module exists, so a bad plan fails everywhere
    with the same message and leaves nothing half-built. ``options.world_size`` is set to the process group's.
    """
    world, rank = world_rank()
    options = options.replace(world_size=world)
    text = None
    if rank == 0:
        try:
            text = resolve_plan(graph, plan, options).to_json(indent=None)
        except Exception as e:
            if world > 1:
                _broadcast_text(None, rank, world, failure=f"{type(e).__name__}: {e}")
            raise
    chosen = Plan.from_json(_broadcast_text(text, rank, world))
    check_runnable(chosen, pipelines=pipelines, what=what or "the runtime")
    if chosen.world_size != world:
        raise ValueError(
            f"the plan is for {chosen.world_size} devices (digits {list(chosen.digits)}) but the process group has "
            f"{world} ranks; make a plan for {world} devices or run on {chosen.world_size} ranks"
        )
    chosen.check_model((n.name, n.op) for n in graph.nodes.values())
    batch = graph.captured.example_batch
    if chosen.pipeline is not None:  # each stage graph is built for one micro-batch
        m = chosen.pipeline.micro_batches
        if batch % m:
            raise ValueError(f"the example's batch of {batch} does not split into the plan's {m} micro-batches")
        batch //= m
    check_plan_fits(graph, chosen, {B: batch, S: graph.captured.example_seq})
    return chosen


def comm_device() -> torch.device:
    """Where the default process group's tensors live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_sizes_everywhere(sizes: tuple[int, int], world: int) -> None:
    """Every rank must run the same sizes (it must see the same inputs); raise on every rank if they differ. One
    all-reduce (MAX) of ``(B, S, -B, -S)``: the largest and the smallest of each at once."""
    if world == 1:
        return
    b, s = sizes
    seen = torch.tensor([b, s, -b, -s], dtype=torch.int64, device=comm_device())
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    (high_b, high_s), (low_b, low_s) = seen[:2].tolist(), (-seen[2:]).tolist()
    if (low_b, low_s) != (high_b, high_s):
        raise ValueError(
            f"the ranks got inputs of different sizes (B in [{low_b}, {high_b}], S in [{low_s}, {high_s}]; this "
            f"rank: B={b}, S={s}); every rank must get the same global inputs"
        )


def timeout_text(timeout: timedelta | None) -> str:
    if timeout is None:
        return "timeout of the process group"
    return f"timeout {timeout.total_seconds():g} s"


#: ``(digits, rank, id(world), timeout)`` -> (the world group, held so that its id is not reused, its groups)
_GROUPS: dict[tuple, tuple[object, ProcessGroups]] = {}


def groups_for(mesh: DeviceMesh, rank: int, timeout: timedelta | None = None) -> ProcessGroups:
    """One :class:`ProcessGroups` per mesh, default process group and timeout: recompiling creates no new groups."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (mesh.digits, rank, id(world), timeout)
    if key not in _GROUPS:
        _GROUPS[key] = (world, ProcessGroups(mesh, rank, timeout=timeout or default_timeout()))
    return _GROUPS[key][1]


def default_timeout() -> timedelta | None:
    """The default process group's timeout (what ``init_process_group(timeout=...)`` set), if it can be read."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(comm_device()).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def set_default_timeout(timeout: timedelta) -> None:
    """Set the default process group's timeout (its point-to-point transfers carry the compiled module's data), and
    bound the module's point-to-point waits by it (:func:`~primepar_fx.runtime.groups.set_p2p_timeout`: gloo's
    sends and receives keep the timeout the group was created with otherwise)."""
    set_p2p_timeout(timeout)
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.warning("this torch cannot change the default process group's timeout; set it in init_process_group")
        return
    setter(timeout)
