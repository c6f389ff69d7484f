"""Every planning option as one frozen value, built and validated in one place, and the one default cluster rule.

:class:`PlanOptions` is what :func:`primepar_fx.plan`, :func:`primepar_fx.compile`, the ``torch.compile`` backend and
the CLI hand down to the planner: the cluster resolved once into a :class:`~primepar_fx.cost.cluster.ClusterSpec`,
the sizes, the dtype, the memory budget, the objective's weight and the search's switches. :meth:`PlanOptions.make`
is the only place that turns user input (a preset name, ``"30GiB"``, ``torch.bfloat16``, ...) into it, and it
checks everything before any capture or pricing, so a bad option fails at once with a message naming it.

The default cluster (:func:`default_cluster`), where the caller names none:

1. ``$PRIMEPAR_CLUSTER``, if set (a preset name or a spec file);
2. when the plan is made to run here (``compile``, the backend, ``primepar-fx dump``, the training example), the
   preset of this machine: under CUDA the GPU's (V100 -> ``v100-paper``, A100 -> ``a100-dgx``, H100 or H200 ->
   ``h100-dgx``), otherwise ``cpu-gloo``;
3. otherwise, planning a job for other machines (``primepar_fx.plan``, ``primepar-fx plan`` and ``explain``), the
   paper's cluster ``v100-paper``.

``compile`` and the backend then replace rule 2's preset by this machine as measured on its ranks, cached
(:func:`primepar_fx.compiler.agree.with_machine_cluster`, :mod:`primepar_fx.calibrate.machine`).

:func:`parse_plan` is the one place that reads the ``plan=`` argument of ``compile``, the backend and ``dump``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, dtype_key, load_cluster
from primepar_fx.cost.pipeline import check_schedule_name
from primepar_fx.graph import check_fallback
from primepar_fx.levers.choices import check_choice, check_zero
from primepar_fx.levers.choose import LeverOptions
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.groupings import Grouped
from primepar_fx.record.plan import Plan
from primepar_fx.utils.units import memory_budget_bytes

#: The cluster for planning a job for other machines (rule 3 of :func:`default_cluster`).
PAPER_CLUSTER = "v100-paper"
#: The cluster of a machine without CUDA (rule 2).
CPU_CLUSTER = "cpu-gloo"
#: GPU name fragment -> preset (rule 2), first match wins.
GPU_CLUSTERS = (("H200", "h100-dgx"), ("H100", "h100-dgx"), ("A100", "a100-dgx"), ("V100", "v100-paper"))
#: The search methods.
METHODS = ("auto", "dp", "ilp")
#: The names ``plan=`` accepts for a forced plan (``SEED`` an integer).
FORCED_NAMES = ("megatron", "megatron-sp", "data_parallel", "prime", "random:SEED")


def default_cluster(*, running: bool) -> str:
    """The cluster to price on when none is given (module docstring); ``running``: the plan is made to run here."""
    named = os.environ.get("PRIMEPAR_CLUSTER")
    if named:
        return named
    if not running:
        return PAPER_CLUSTER
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        return next((preset for part, preset in GPU_CLUSTERS if part in gpu), CPU_CLUSTER)
    return CPU_CLUSTER


def resolve_cluster(cluster: ClusterSpec | str | os.PathLike[str] | None, *, running: bool = False) -> ClusterSpec:
    """A :class:`ClusterSpec` from a spec, a preset name, a spec file or ``None`` (:func:`default_cluster`)."""
    if cluster is None:
        cluster = default_cluster(running=running)
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return load_cluster(cluster)
    raise ValueError(f"cluster must be a preset name, a spec file path or a ClusterSpec, got {cluster!r}")


def check_sizes(batch: object, seq: object) -> None:
    """``batch`` and ``seq`` must be integers >= 1 (``None``: the example's, where the caller allows it)."""
    for label, size in (("batch", batch), ("seq", seq)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{label} must be an integer >= 1, got {size!r}")


def forced_seed(name: Any) -> int | None:
    """``None`` for a fixed name of :data:`FORCED_NAMES`, the seed of ``"random:SEED"``; raises on anything else."""
    if name in FORCED_NAMES[:-1]:
        return None
    if isinstance(name, str) and name.startswith("random:"):
        text = name.removeprefix("random:")
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"forced plan {name!r}: seed {text!r} is not an integer (e.g. 'random:3')") from None
    raise ValueError(f"unknown forced plan {name!r}; expected one of {list(FORCED_NAMES)} (SEED an integer)")


PlanKind = Literal["search", "plan", "file", "json", "forced"]


def parse_plan(plan: Any) -> tuple[PlanKind, Any]:
    """What a ``plan=`` argument asks for, checked without any work: ``("search", None)`` for ``None`` or
    ``"searched"``; ``("plan", Plan)``; ``("file", path)`` for a plan JSON file; ``("json", text)`` for the text of
    one; ``("forced", name)`` for a name of :data:`FORCED_NAMES`. Raises ``ValueError`` on anything else."""
    if plan is None or plan == "searched":
        return "search", None
    if isinstance(plan, Plan):
        return "plan", plan
    if isinstance(plan, (str, os.PathLike)) and (str(plan).endswith(".json") or os.path.exists(plan)):
        if not os.path.isfile(plan):
            raise ValueError(f"no plan file {os.fspath(plan)!r}")
        return "file", os.fspath(plan)
    if isinstance(plan, os.PathLike):
        raise ValueError(f"no plan file {os.fspath(plan)!r}")
    if isinstance(plan, str) and plan.lstrip().startswith("{"):
        return "json", plan
    if isinstance(plan, str):
        forced_seed(plan)
        return "forced", plan
    shown = repr(plan) if len(repr(plan)) <= 80 else f"{repr(plan)[:77]}..."
    raise ValueError(
        f"plan must be None, a Plan, a plan JSON (its path or its text) or one of {FORCED_NAMES}; got {shown}"
    )


#: The share of a device's memory the default budget leaves to what the cost model does not count: the CUDA
#: context and NCCL's buffers (1-2 GiB), the caching allocator's fragmentation, GEMM and attention workspaces.
DEVICE_MEMORY_RESERVE = 0.1


def device_budget(cluster: ClusterSpec) -> int:
    """The default memory budget: the device's memory less :data:`DEVICE_MEMORY_RESERVE` of it, in bytes."""
    return int(cluster.device.memory_capacity * (1 - DEVICE_MEMORY_RESERVE))


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Every option of a plan, validated (build one with :meth:`make`).

    Attributes:
        cluster: the cluster the plan is priced on.
        world_size: the number of devices; ``None`` until known (the backend learns it at the first call).
        batch, seq: the sizes the plan is priced at; ``None``: the example's.
        dtype: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``; ``None``: the model's first parameter's.
        memory_budget: a hard limit on each device's predicted peak, in bytes; ``None``: no limit (:meth:`make`
            defaults to the device's memory less :data:`DEVICE_MEMORY_RESERVE`, :func:`device_budget`).
        alpha: seconds per byte of memory added to the objective.
        grad_dtype, master_weights, state_dtype: what a device keeps per parameter element besides the parameter
            (:class:`~primepar_fx.cost.blocks.CostOptions`): gradients in ``grad_dtype`` (``None``: ``dtype``), an
            fp32 master copy (``None``: when ``dtype`` is 16 bits), optimizer moments in ``state_dtype``.
        recompute: activation recomputation (:mod:`~primepar_fx.levers.recompute`): ``"auto"`` (none unless the
            budget needs it, then the fastest mode that fits), or ``"none"``, ``"selective"`` or ``"full"`` on every
            layer of the stack.
        zero: ZeRO's stage for the plan's replicated parameters (:attr:`~primepar_fx.cost.blocks.CostOptions.zero`):
            ``"auto"`` (the search runs at stage 2, which costs no time and the least memory; the plan keeps stage 0
            when it fits without), or 0, 1 or 2.
        micro_batches: gradient accumulation (:func:`micro_batch_tries`): ``"auto"``
            (1 unless the budget binds, then the fastest of 1, 2, 4, 8 that divide the batch, stopping at the
            first that fits without recomputation), or a count that divides the batch.
        method: ``"dp"``, ``"ilp"`` or ``"auto"``.
        allow_prime: whether P(S x S) is in the space (``False``: the split-only space).
        baselines: also price Megatron-LM, data parallelism and split-only.
        digits: device digits overriding the cluster's (their product is ``world_size``).
        grouped: past three device digits, which meshes the search runs on (a
            :class:`~primepar_fx.planning.groupings.Grouped`: every grouping of the digits into three, the default;
            the leading digits merged only; or the full mesh, then every grouping; :meth:`make` also takes ``None``,
            ``True``, ``False`` and the members' values).
        group_digits: with ``grouped`` :attr:`~primepar_fx.planning.groupings.Grouped.ALL`, also the groupings into
            4, ..., this many digits
            (finer, slower; at least the mesh's digits: the full mesh); 3, the default, the groupings into three.
        canonical: search one sequence per class of equivalent ones.
        fallback: ``"replicate"`` runs ops without a dimension rule replicated; ``None`` raises.
        progress: show the pricing's progress bars on stderr.
        workers: processes that price and search the groupings of the digits side by side (forked,
            :mod:`~primepar_fx.planning.workers`; 1, the default, plans in this process alone, as
            :func:`~primepar_fx.compile` does on every rank).
        stages: pipeline stages (:mod:`~primepar_fx.planning.staged`): ``None`` (auto: searched beside the plan
            without stages where the world spans nodes and no ``digits`` are given), 1 (none), or a count that
            divides the world, each stage ``world_size / stages`` devices.
        schedule: the pipeline schedule (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``); ``None``: 1F1B and
            interleaved 1F1B with two virtual stages a rank are searched.
    """

    cluster: ClusterSpec
    world_size: int | None = None
    batch: int | None = None
    seq: int | None = None
    dtype: str | None = "fp32"
    memory_budget: float | None = None
    alpha: float = 0.0
    grad_dtype: str | None = None
    master_weights: bool | None = None
    state_dtype: str = "fp32"
    recompute: str = "auto"
    zero: str | int = "auto"
    micro_batches: str | int = "auto"
    method: str = "auto"
    allow_prime: bool = True
    baselines: bool = True
    digits: tuple[int, ...] | None = None
    grouped: Grouped = Grouped.ALL
    group_digits: int = 3
    canonical: bool = False
    fallback: str | None = None
    progress: bool = False
    workers: int = 1
    stages: int | None = None
    schedule: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterSpec):
            raise ValueError(f"cluster must be a ClusterSpec here (use PlanOptions.make), got {self.cluster!r}")
        ws = self.world_size
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 1):
            raise ValueError(f"world_size must be a positive integer, got {ws!r}")
        check_sizes(self.batch, self.seq)
        for name in ("dtype", "grad_dtype", "state_dtype"):
            value = getattr(self, name)
            if value is not None and value != dtype_key(value):
                raise ValueError(f"{name} must be a key such as 'bf16' here (use PlanOptions.make), got {value!r}")
        if self.master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be True, False or None (auto), got {self.master_weights!r}")
        if memory_budget_bytes(self.memory_budget) != self.memory_budget:
            raise ValueError(f"memory_budget must be bytes here (use PlanOptions.make), got {self.memory_budget!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"alpha must be a finite number of seconds per byte >= 0, got {self.alpha!r}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0 seconds per byte, got {self.alpha!r}")
        check_choice(self.recompute)
        if check_zero(self.zero) != self.zero:
            raise ValueError(f"zero must be 'auto' or a stage number here (use PlanOptions.make), got {self.zero!r}")
        m = self.micro_batches
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"micro_batches must be 'auto' or a whole number >= 1, got {m!r}")
        if isinstance(m, int) and self.batch is not None and self.batch % m:
            raise ValueError(f"micro_batches={m} does not divide the batch of {self.batch}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        check_fallback(self.fallback)
        w = self.workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"workers must be a whole number >= 1, got {w!r}")
        if not isinstance(self.grouped, Grouped):
            raise ValueError(f"grouped must be a Grouped here (use PlanOptions.make), got {self.grouped!r}")
        g = self.group_digits
        if isinstance(g, bool) or not isinstance(g, int) or g < 3:
            raise ValueError(f"group_digits must be a whole number >= 3, got {g!r}")
        if g != 3 and self.grouped is not Grouped.ALL:
            raise ValueError(f"group_digits={g} adds groupings to grouped='all', not to grouped={self.grouped.value!r}")
        self._check_pipeline()
        if self.digits is not None:
            if not self.digits or any(isinstance(d, bool) or not isinstance(d, int) or d < 2 for d in self.digits):
                raise ValueError(f"digits must be radices >= 2, got {self.digits!r}")
            if ws is not None and math.prod(self.digits) != ws:
                raise ValueError(
                    f"device digits {tuple(self.digits)} make {math.prod(self.digits)} devices, not world size {ws}"
                )

    def _check_pipeline(self) -> None:
        p, ws = self.stages, self.world_size
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"stages must be None (auto) or a whole number >= 1, got {p!r}")
        if self.schedule is not None:
            check_schedule_name(self.schedule)
        if p is None or p == 1:
            return
        if ws is not None and ws % p:
            raise ValueError(f"{p} pipeline stages do not divide the {ws} devices (each stage needs as many)")
        if self.digits is not None:
            raise ValueError(f"stages={p} with digits: the digits name the whole mesh; pass one or the other")
        m = self.micro_batches
        if isinstance(m, int) and m < p:
            raise ValueError(f"a pipeline of {p} stages needs at least {p} micro-batches, got micro_batches={m}")
        if self.batch is not None and self.batch < p:
            raise ValueError(f"the batch of {self.batch} does not split into {p} micro-batches for {p} stages")

    @classmethod
    def make(
        cls,
        *,
        cluster: ClusterSpec | str | os.PathLike[str] | None = None,
        running: bool = False,
        memory_budget: object = "device",
        dtype: object = "fp32",
        grad_dtype: object = None,
        state_dtype: object = "fp32",
        digits: Any = None,
        zero: object = "auto",
        micro_batches: object = "auto",
        grouped: object = None,
        **fields: Any,
    ) -> PlanOptions:
        """Options from user input: ``cluster`` a spec, preset name, spec file or ``None`` (:func:`default_cluster`,
        ``running`` as there); ``memory_budget`` bytes, a size such as ``"30GiB"``, ``"device"`` (the default:
        :func:`device_budget` of the cluster) or ``None`` / ``"none"`` (no limit); ``dtype`` a key or a torch
        dtype (``None``: the model's); ``grouped`` as :meth:`Grouped.of <primepar_fx.planning.groupings.Grouped.of>`
        reads it; the other fields as the class has them."""
        spec = resolve_cluster(cluster, running=running)
        if isinstance(memory_budget, str) and memory_budget.strip().lower() in ("device", "none"):
            memory_budget = device_budget(spec) if memory_budget.strip().lower() == "device" else None
        return cls(
            cluster=spec,
            memory_budget=memory_budget_bytes(memory_budget),
            dtype=None if dtype is None else dtype_key(dtype),
            grad_dtype=None if grad_dtype is None else dtype_key(grad_dtype),
            state_dtype=dtype_key(state_dtype),
            digits=None if digits is None else tuple(digits),
            zero=check_zero(zero),
            grouped=Grouped.of(grouped),
            micro_batches=int(micro_batches)
            if isinstance(micro_batches, str) and micro_batches.strip().isdigit()
            else micro_batches,
            **fields,
        )

    def cost_options(self) -> CostOptions:
        """What the cost model assumes about training under these options (the dtype must be known); ZeRO
        ``"auto"`` prices stage 2, the search's (the plan may keep 0: :func:`~primepar_fx.planning.planner.plan_graph`).
        """
        if self.dtype is None:
            raise ValueError("the dtype is not known yet: PlanOptions needs dtype for the cost model's options")
        return CostOptions(
            dtype=self.dtype,
            alpha=self.alpha,
            grad_dtype=self.grad_dtype,
            master_weights=self.master_weights,
            state_dtype=self.state_dtype,
            zero=2 if self.zero == "auto" else self.zero,  # type: ignore[arg-type]
        )

    def levers(self) -> LeverOptions:
        """What these options ask of the memory levers."""
        return LeverOptions(self.recompute, self.zero, self.memory_budget, self.alpha, self.method)

    def replace(self, **changes: Any) -> PlanOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def mesh(self) -> DeviceMesh:
        """The device mesh: :attr:`digits`, or the cluster's mesh of :attr:`world_size` devices."""
        if self.world_size is None and self.digits is None:
            raise ValueError("the world size is not known yet: PlanOptions needs world_size or digits for a mesh")
        mesh = DeviceMesh(self.digits) if self.digits else self.cluster.mesh(self.world_size)  # type: ignore[arg-type]
        if self.world_size is not None and mesh.size != self.world_size:
            raise ValueError(f"device digits {mesh.digits} make {mesh.size} devices, not world size {self.world_size}")
        return mesh
