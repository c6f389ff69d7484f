"""Plans: the search's answer as data (one partition sequence per node, its modelled cost, the baselines).

A :class:`Plan` is what the search hands to the graph passes and what a user saves, diffs and reloads. It is a
frozen dataclass that validates itself and round-trips through JSON (never pickle)::

    {"format": "primepar-plan/2", "model": ..., "model_fingerprint": ..., "world_size": 8, "digits": [2, 2, 2],
     "cluster": "h100-dgx", "batch": 8, "seq": 1024, "dtype": "bf16",
     "nodes": [{"name": "fc1", "op": "aten.mm.default", "partition": "B,P2x2", "cost": {...}}, ...],
     "predicted": {"step_time_s": ..., "peak_memory_bytes": ..., "comm_bytes": ...},
     "baselines": {"megatron": {"config": {...}, "predicted": {...}, "partitions": {...}}},
     "search": {"method": "dp", "proven_optimal": true, "objective": ..., "memory_budget": null, ...}}

Loading rejects unknown fields and names the offending field path in every error (``plan.nodes[3].partition:
...``). Only cheap, graph-independent checks live here (a ``P(S x S)`` needs ``S*S`` to divide ``world_size``);
full legality of each partition is checked against the graph elsewhere. :meth:`Plan.check_model` detects a plan
used on another model through :attr:`Plan.model_fingerprint` and the node names and ops.

Times are per training step (forward + backward) in seconds. :attr:`CostBreakdown.step_s` is the node's modelled
time as the cost model computed it (Eq. 7 overlaps each temporal step's ring shift with its compute)::

    step_s = sum_t max(compute_t, ring_t) + collective_s + redistribution_s

so ``max(compute_s, ring_s) + rest <= step_s <= compute_s + ring_s + rest``; it is stored, not recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, NoReturn

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.partition.seq import PartitionSeq
from primepar_fx.record import fields as fieldcheck
from primepar_fx.record.fields import PlanError
from primepar_fx.record.levers import Recompute
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.record.search import SearchRecord

PLAN_FORMAT = "primepar-plan/2"
#: formats this version reads no more, and why
_OLD_FORMATS = {
    "primepar-plan/1": "it was written before plans recorded their memory levers (plan.recompute); make it again"
}
COMM_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p", "redistribution", "recomputation")
PHASES = ("forward", "backward", "gradient")
PLAN_DTYPES = ("fp32", "tf32", "bf16", "fp16")
KNOWN_BASELINES = (
    "megatron",
    "megatron_pipelined",
    "data_parallel",
    "fsdp",
    "fsdp_pipelined",
    "split_only",
)  # others are allowed
MiB = 1 << 20
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{16}")
_REL_TOL = 1e-9


# ---------------------------------------------------------------------------------------------------- costs
@dataclass(frozen=True, slots=True, kw_only=True)
class CostBreakdown:
    """One node's modelled cost per training step (seconds, bytes per device); see the module docstring.

    ``comm_bytes`` maps kinds of :data:`COMM_KINDS` to bytes sent per device (absent kinds are 0). ``phase_s``
    is empty or maps every phase of :data:`PHASES` to its time (the cost model's ``sum_t max(compute_t, ring_t)``
    within the phase); the phases sum to at most ``step_s``.
    """

    compute_s: float
    ring_s: float
    collective_s: float
    redistribution_s: float
    memory_bytes: int
    comm_bytes: dict[str, int]
    step_s: float
    phase_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("compute_s", "ring_s", "collective_s", "redistribution_s", "step_s"):
            fieldcheck.set_attr(self, name, fieldcheck.seconds(f"cost.{name}", getattr(self, name)))
        fieldcheck.set_attr(self, "memory_bytes", fieldcheck.nbytes("cost.memory_bytes", self.memory_bytes))
        comm = fieldcheck.mapping("cost.comm_bytes", self.comm_bytes, f"kind -> bytes, kinds {list(COMM_KINDS)}")
        for k in comm:
            if k not in COMM_KINDS:
                fieldcheck.fail(
                    f"cost.comm_bytes[{k!r}]", f"unknown communication kind; expected one of {list(COMM_KINDS)}"
                )
        fieldcheck.set_attr(
            self,
            "comm_bytes",
            {k: fieldcheck.nbytes(f"cost.comm_bytes[{k!r}]", comm[k]) for k in COMM_KINDS if k in comm},
        )
        phases = fieldcheck.mapping("cost.phase_s", self.phase_s, f"phase -> seconds, phases {list(PHASES)}")
        for k in phases:
            if k not in PHASES:
                fieldcheck.fail(f"cost.phase_s[{k!r}]", f"unknown phase; expected one of {list(PHASES)}")
        missing = [k for k in PHASES if k not in phases]
        if phases and missing:
            fieldcheck.fail("cost.phase_s", f"missing phase(s) {missing}; give all of {list(PHASES)} or none")
        fieldcheck.set_attr(
            self, "phase_s", {k: fieldcheck.seconds(f"cost.phase_s[{k!r}]", phases[k]) for k in PHASES if k in phases}
        )
        rest = self.collective_s + self.redistribution_s
        low, high = max(self.compute_s, self.ring_s) + rest, self.compute_s + self.ring_s + rest
        if not low * (1 - _REL_TOL) <= self.step_s <= high * (1 + _REL_TOL):
            fieldcheck.fail(
                "cost.step_s",
                f"{self.step_s!r} s is outside [{low!r}, {high!r}], the range that sum_t max(compute_t, ring_t) + "
                "collective_s + redistribution_s can take for these compute_s, ring_s, collective_s, redistribution_s",
            )
        if sum(self.phase_s.values()) > self.step_s * (1 + _REL_TOL):
            fieldcheck.fail(
                "cost.phase_s", f"sums to {sum(self.phase_s.values())!r} s, more than step_s {self.step_s!r} s"
            )

    __hash__ = fieldcheck.json_hash

    @property
    def time_s(self) -> float:
        """The node's modelled time per step: :attr:`step_s` (ring overlapped with compute, Eq. 7)."""
        return self.step_s

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        names = ("compute_s", "ring_s", "collective_s", "redistribution_s", "step_s", "phase_s", "memory_bytes")
        return {k: getattr(self, k) for k in names} | {"comm_bytes": dict(self.comm_bytes)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "cost") -> CostBreakdown:
        required = ("compute_s", "ring_s", "collective_s", "redistribution_s", "step_s", "memory_bytes")
        d = fieldcheck.fields(where, data, required, ("comm_bytes", "phase_s"))
        with fieldcheck.rebase(where, "cost"):
            return cls(**{"comm_bytes": {}, **d})


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One graph node's partition sequence (canonical text, e.g. ``"B,P2x2,N"``) and, optionally, its cost."""

    name: str
    op: str
    partition: str
    cost: CostBreakdown | None = None

    def __post_init__(self) -> None:
        fieldcheck.text("node.name", self.name)
        fieldcheck.text("node.op", self.op)
        fieldcheck.set_attr(self, "partition", fieldcheck.partition("node.partition", self.partition))
        if self.cost is not None and not isinstance(self.cost, CostBreakdown):
            fieldcheck.fail("node.cost", f"must be a CostBreakdown or null, got {type(self.cost).__name__}")

    @property
    def seq(self) -> PartitionSeq:
        return PartitionSeq.parse(self.partition)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "op": self.op, "partition": self.partition}
        if self.cost is not None:
            d["cost"] = self.cost.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str = "node") -> NodePlan:
        d = fieldcheck.fields(where, data, ("name", "op", "partition"), ("cost",))
        if d.get("cost") is not None:
            d["cost"] = CostBreakdown.from_dict(d["cost"], f"{where}.cost")
        with fieldcheck.rebase(where, "node"):
            return cls(**d)


@dataclass(frozen=True, slots=True)
class Predicted:
    """Whole-model prediction per training step: time (s), peak memory and communication (bytes per device)."""

    step_time_s: float
    peak_memory_bytes: int
    comm_bytes: int

    def __post_init__(self) -> None:
        fieldcheck.set_attr(self, "step_time_s", fieldcheck.seconds("predicted.step_time_s", self.step_time_s))
        fieldcheck.nbytes("predicted.peak_memory_bytes", self.peak_memory_bytes)
        fieldcheck.nbytes("predicted.comm_bytes", self.comm_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "comm_bytes": self.comm_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "predicted") -> Predicted:
        d = fieldcheck.fields(where, data, ("step_time_s", "peak_memory_bytes", "comm_bytes"))
        with fieldcheck.rebase(where, "predicted"):
            return cls(**d)


@dataclass(frozen=True, slots=True)
class Baseline:
    """A reference strategy priced by the same cost model, e.g. ``"megatron"`` (see :data:`KNOWN_BASELINES`).

    ``config`` holds its knobs as plain JSON data (e.g. ``{"tp": 4, "dp": 2}``); ``partitions`` optionally maps
    node names to the partition text the baseline uses.
    """

    name: str
    config: dict[str, Any]
    predicted: Predicted
    partitions: dict[str, str] | None = None

    def __post_init__(self) -> None:
        fieldcheck.text("baseline.name", self.name)
        fieldcheck.set_attr(
            self,
            "config",
            fieldcheck.json_plain("baseline.config", fieldcheck.mapping("baseline.config", self.config, "settings")),
        )
        if not isinstance(self.predicted, Predicted):
            fieldcheck.fail("baseline.predicted", f"must be a Predicted, got {type(self.predicted).__name__}")
        if self.partitions is not None:
            parts = fieldcheck.mapping("baseline.partitions", self.partitions, "node name -> partition")
            for k in parts:
                fieldcheck.text(f"baseline.partitions[{k!r}]", k)
            fieldcheck.set_attr(
                self,
                "partitions",
                {k: fieldcheck.partition(f"baseline.partitions[{k!r}]", v) for k, v in parts.items()},
            )

    __hash__ = fieldcheck.json_hash

    def to_dict(self) -> dict[str, Any]:
        """The JSON value under ``baselines[name]`` (the name is the key, not repeated)."""
        d: dict[str, Any] = {
            "config": fieldcheck.json_plain("config", self.config),
            "predicted": self.predicted.to_dict(),
        }
        if self.partitions is not None:
            d["partitions"] = dict(self.partitions)
        return d

    @classmethod
    def from_dict(cls, name: str, data: Any, where: str = "baseline") -> Baseline:
        d = fieldcheck.fields(where, data, ("config", "predicted"), ("partitions",))
        d["predicted"] = Predicted.from_dict(d["predicted"], f"{where}.predicted")
        with fieldcheck.rebase(where, "baseline"):
            return cls(name=name, **d)


# ---------------------------------------------------------------------------------------------------- plans
_PLAN_KEYS = ("format", "model", "model_fingerprint", "world_size", "digits", "cluster", "batch", "seq", "dtype")
_PLAN_REQUIRED = ("format", "model", "world_size", "digits", "cluster", "batch", "seq", "dtype", "nodes", "predicted")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A partition plan for ``model`` on ``world_size`` devices of ``cluster`` (keyword arguments only).

    ``digits`` are the device-ID radices (most significant first; their product is ``world_size``), ``nodes``
    the per-node partitions in graph order, ``predicted`` the modelled totals, ``baselines`` reference
    strategies by name and ``search`` how the plan was found (a :class:`~primepar_fx.record.search.SearchRecord`:
    ``method``, ``proven_optimal``, ``alpha``, ``memory_budget``, ...). ``model_fingerprint`` is :meth:`fingerprint`
    of the graph's node names and ops ("" if unknown).

    A plan with a :class:`~primepar_fx.record.pipeline.Pipeline` runs as ``pipeline.stages`` stages of
    ``world_size / stages`` devices each: ``digits`` are then one stage's mesh (their product is
    :attr:`stage_devices`), ``nodes`` its plan, and ``pipeline.micro_batches`` the training state's micro-batches.
    """

    format: str = PLAN_FORMAT
    model: str
    model_fingerprint: str = ""
    world_size: int
    digits: tuple[int, ...]
    cluster: str
    batch: int
    seq: int
    dtype: str
    nodes: tuple[NodePlan, ...]
    predicted: Predicted
    baselines: dict[str, Baseline] = field(default_factory=dict)
    search: SearchRecord = field(default_factory=SearchRecord)
    recompute: Recompute | None = None
    pipeline: Pipeline | None = None

    def __post_init__(self) -> None:
        _check_format(self.format)
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            fieldcheck.fail("plan.pipeline", f"must be a Pipeline or None, got {type(self.pipeline).__name__}")
        if self.recompute is not None and not isinstance(self.recompute, Recompute):
            fieldcheck.fail("plan.recompute", f"must be a Recompute or None, got {type(self.recompute).__name__}")
        fieldcheck.text("plan.model", self.model)
        if not isinstance(self.model_fingerprint, str) or not (
            self.model_fingerprint == "" or _FINGERPRINT_RE.fullmatch(self.model_fingerprint)
        ):
            fieldcheck.fail(
                "plan.model_fingerprint", f"must be '' or 16 lowercase hex digits, got {self.model_fingerprint!r}"
            )
        fieldcheck.count("plan.world_size", self.world_size, "devices")
        self._check_digits()
        fieldcheck.text("plan.cluster", self.cluster)
        fieldcheck.count("plan.batch", self.batch, "samples")
        fieldcheck.count("plan.seq", self.seq, "tokens")
        if self.dtype not in PLAN_DTYPES:
            fieldcheck.fail("plan.dtype", f"must be one of {list(PLAN_DTYPES)}, got {self.dtype!r}")
        self._check_nodes()
        if not isinstance(self.predicted, Predicted):
            fieldcheck.fail("plan.predicted", f"must be a Predicted, got {type(self.predicted).__name__}")
        self._check_baselines()
        if not isinstance(self.search, SearchRecord):
            fieldcheck.fail("plan.search", f"must be a SearchRecord, got {type(self.search).__name__}")
        try:
            self.cost_options()
        except ValueError as e:
            fieldcheck.fail("plan.search", str(e).removeprefix("plan.search."))
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        pipe = self.pipeline
        if pipe is None:
            return
        if pipe.micro_batches != self.micro_batches:
            fieldcheck.fail(
                "plan.pipeline.micro_batches",
                f"is {pipe.micro_batches} but the training state runs {self.micro_batches} micro-batches",
            )
        if self.batch % pipe.micro_batches:
            fieldcheck.fail(
                "plan.pipeline.micro_batches",
                f"{pipe.micro_batches} micro-batches do not split the batch of {self.batch}",
            )

    @property
    def stage_devices(self) -> int:
        """The devices of one pipeline stage: ``world_size / pipeline.stages`` (``world_size`` without a pipeline)."""
        return self.world_size // (self.pipeline.stages if self.pipeline is not None else 1)

    def cost_options(self) -> CostOptions:
        """What the plan was priced with: its dtype, ``search.alpha`` and ``search.training_state`` (what a
        device keeps per parameter; a plan without it: the defaults)."""
        return CostOptions.from_training_state(self.dtype, float(self.search.alpha or 0.0), self.search.training_state)

    @property
    def micro_batches(self) -> int:
        """How many micro-batches of ``batch / micro_batches`` a step runs (``search.training_state``; 1: none)."""
        return self.cost_options().micro_batches

    @property
    def zero(self) -> int:
        """The plan's ZeRO stage for every parameter it replicates (``search.training_state.zero``; 0: none)."""
        return self.cost_options().zero

    def _check_digits(self) -> None:
        if self.pipeline is not None and self.world_size % self.pipeline.stages:
            fieldcheck.fail(
                "plan.pipeline.stages",
                f"{self.pipeline.stages} stages do not divide the plan's {self.world_size} devices",
            )
        if not isinstance(self.digits, (tuple, list)):
            fieldcheck.fail("plan.digits", f"must be a list of device-ID radices, got {type(self.digits).__name__}")
        for i, d in enumerate(self.digits):
            if isinstance(d, bool) or not isinstance(d, int) or d < 2:
                fieldcheck.fail(f"plan.digits[{i}]", f"must be an integer radix >= 2, got {d!r}")
        fieldcheck.set_attr(self, "digits", tuple(self.digits))
        if prod(self.digits) * (self.pipeline.stages if self.pipeline is not None else 1) != self.world_size:
            of = "" if self.pipeline is None else f" x {self.pipeline.stages} stages"
            fieldcheck.fail(
                "plan.digits",
                f"{list(self.digits)}{of} multiply to {prod(self.digits) * (self.world_size // self.stage_devices)}, "
                f"not world_size {self.world_size}",
            )

    def _check_nodes(self) -> None:
        if not isinstance(self.nodes, (tuple, list)):
            fieldcheck.fail("plan.nodes", f"must be a list of NodePlan, got {type(self.nodes).__name__}")
        fieldcheck.set_attr(self, "nodes", tuple(self.nodes))
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if not isinstance(node, NodePlan):
                fieldcheck.fail(f"plan.nodes[{i}]", f"must be a NodePlan, got {type(node).__name__}")
            if node.name in seen:
                fieldcheck.fail(
                    f"plan.nodes[{i}].name", f"duplicate node name {node.name!r} (also plan.nodes[{seen[node.name]}])"
                )
            seen[node.name] = i
            fieldcheck.check_prime(f"plan.nodes[{i}].partition", node.partition, self.stage_devices)

    def _check_baselines(self) -> None:
        fieldcheck.mapping("plan.baselines", self.baselines, "name -> baseline")
        fieldcheck.set_attr(self, "baselines", dict(self.baselines))
        for key, b in self.baselines.items():
            where = f"plan.baselines[{key!r}]"
            if not isinstance(b, Baseline):
                fieldcheck.fail(where, f"must be a Baseline, got {type(b).__name__}")
            if b.name != key:
                fieldcheck.fail(f"{where}.name", f"is {b.name!r} but the baseline is stored under {key!r}")
            for node, text in (b.partitions or {}).items():
                fieldcheck.check_prime(f"{where}.partitions[{node!r}]", text, self.world_size)

    __hash__ = fieldcheck.json_hash

    # ------------------------------------------------------------------------------------------------ queries
    def partitions(self) -> dict[str, PartitionSeq]:
        """Node name -> parsed partition sequence, in graph order."""
        return {n.name: n.seq for n in self.nodes}

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan for {self.model!r} has no node {name!r}")

    @staticmethod
    def fingerprint(names_and_ops: Iterable[tuple[str, str]]) -> str:
        """The first 16 hex digits of the sha256 of ``name<TAB>op`` lines, in graph order."""
        text = "\n".join(f"{name}\t{op}" for name, op in names_and_ops)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def check_model(self, names_and_ops: Iterable[tuple[str, str]]) -> None:
        """Raise a ValueError naming the first mismatching node if this plan was made for another graph.

        Every plan node must be a graph node with the same op, and every graph node must have a partition; with a
        :attr:`model_fingerprint`, the graph must also fingerprint to it (the same order).
        """
        graph = [(str(name), str(op)) for name, op in names_and_ops]
        ops = dict(graph)
        for i, node in enumerate(self.nodes):
            if node.name not in ops:
                there = f"; the model's node at that position is {graph[i][0]!r}" if i < len(graph) else ""
                fieldcheck.fail(
                    f"plan.nodes[{i}].name", f"node {node.name!r} is not in the model{there}: plan is for another model"
                )
            if ops[node.name] != node.op:
                reason = f"node {node.name!r} is {node.op!r} in the plan but {ops[node.name]!r} in the model"
                fieldcheck.fail(f"plan.nodes[{i}].op", f"{reason}: plan is for another model")
        planned = {n.name for n in self.nodes}
        missing = [name for name, _ in graph if name not in planned]
        if missing:
            fieldcheck.fail(
                "plan.nodes",
                f"model node {missing[0]!r} has no partition in the plan ({len(missing)} of {len(graph)} nodes have "
                "none): plan is for another model, or was edited",
            )
        actual = self.fingerprint(graph)
        if self.model_fingerprint and actual != self.model_fingerprint:
            planned = {n.name for n in self.nodes}
            extra = next((name for name, _ in graph if name not in planned), None)
            what = f"model node {extra!r} has no partition in the plan" if extra else "the model's node order differs"
            fieldcheck.fail(
                "plan.model_fingerprint", f"{self.model_fingerprint} but the model fingerprints to {actual}: {what}"
            )

    def summary_table(self, tablefmt: str = "simple", fold: bool = False) -> str:
        """Per-node partitions and costs, then predicted totals with one comparison row per baseline.

        ``fold`` prints the copies of the longest repeated block of rows (a model's identical layers) as one marker
        row, with a note under the table (:func:`~primepar_fx.utils.tables.fold_repeats`)."""
        from tabulate import tabulate

        from primepar_fx.utils.tables import fold_repeats

        costed = [n.cost for n in self.nodes if n.cost is not None]
        kinds = [k for k in COMM_KINDS if any(c.comm_bytes.get(k) for c in costed)]
        header = ["node", "op", "partition"]
        if costed:
            header += [f"{p} ms" for p in PHASES] + ["collective ms", "redistr. ms", "step ms"]
            header += [f"{k} B" for k in kinds] + ["memory MiB"]
        rows = []
        for n in self.nodes:
            row: list[Any] = [n.name, n.op, n.partition]
            if costed and n.cost is None:
                row += [""] * (len(header) - 3)
            elif n.cost is not None:
                c = n.cost
                row += [c.phase_s[p] * 1e3 if c.phase_s else "" for p in PHASES]
                row += [c.collective_s * 1e3, c.redistribution_s * 1e3, c.step_s * 1e3]
                row += [c.comm_bytes.get(k, 0) for k in kinds] + [c.memory_bytes / MiB]
            rows.append(row)
        note = None
        if fold:  # rows that print alike (floats to 3 decimals) but for the name
            rows, note = fold_repeats(rows, lambda r: tuple(f"{v:.3f}" if isinstance(v, float) else v for v in r[1:]))
        nodes = tabulate(rows, header, tablefmt=tablefmt, floatfmt=".3f", intfmt=",")
        if note is not None:
            nodes += f"\n\n{note}"
        ours = self.predicted
        totals = []
        rows = [("primepar (this plan)", ours)] + [
            (k + (" (over budget)" if b.config.get("fits_budget") is False else ""), b.predicted)
            for k, b in self.baselines.items()
        ]
        for name, p in rows:
            time_ratio = fieldcheck.ratio(p.step_time_s, ours.step_time_s)
            memory_ratio = fieldcheck.ratio(p.peak_memory_bytes, ours.peak_memory_bytes)
            totals.append(
                [name, p.step_time_s * 1e3, time_ratio, p.peak_memory_bytes / MiB, memory_ratio, p.comm_bytes]
            )
        head = ["predicted", "step ms", "time vs ours", "peak memory MiB", "memory vs ours", "comm B"]
        table = tabulate(totals, head, tablefmt=tablefmt, floatfmt=".3f", intfmt=",")
        recompute = f"; recompute {self.recompute.describe()}" if self.recompute and self.recompute.active else ""
        m, pipe = self.micro_batches, self.pipeline
        if m > 1 and pipe is None:
            recompute += f"; {m} micro-batches of {self.batch // m}"
        mesh = f"{list(self.digits)}"
        if pipe is not None:
            mesh = f"as a pipeline of {pipe.describe()}, each stage {mesh}"
        title = (
            f"{self.model} on {self.world_size} devices {mesh} of {self.cluster} "
            f"(B={self.batch}, S={self.seq}, {self.dtype}; {self.cost_options().describe_state()}{recompute}); "
            "per node: "
            "step = forward + backward + gradient + collectives + redistribution"
        )
        return f"{title}\n{nodes}\n\n{table}"

    # ------------------------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: getattr(self, k) for k in _PLAN_KEYS}
        d["digits"] = list(self.digits)
        d["nodes"] = [n.to_dict() for n in self.nodes]
        d["predicted"] = self.predicted.to_dict()
        d["baselines"] = {k: b.to_dict() for k, b in self.baselines.items()}
        d["search"] = self.search.to_dict()
        if self.recompute is not None:
            d["recompute"] = self.recompute.to_dict()
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if isinstance(data, Mapping):  # before any other field
            _check_format(data.get("format", PLAN_FORMAT))
        d = fieldcheck.fields(
            "plan", data, _PLAN_REQUIRED, ("model_fingerprint", "baselines", "search", "recompute", "pipeline")
        )
        if d.get("pipeline") is not None:
            d["pipeline"] = Pipeline.from_dict(d["pipeline"])
        if d.get("recompute") is not None:
            try:
                d["recompute"] = Recompute.from_dict(d["recompute"])
            except ValueError as e:
                fieldcheck.fail("plan.recompute", str(e).removeprefix("plan.recompute").lstrip(". "))
        if "search" in d:
            d["search"] = SearchRecord.from_dict(d["search"], "plan.search")
        if not isinstance(d["nodes"], list):
            fieldcheck.fail("plan.nodes", f"must be a list of nodes, got {type(d['nodes']).__name__}")
        d["nodes"] = tuple(NodePlan.from_dict(n, f"plan.nodes[{i}]") for i, n in enumerate(d["nodes"]))
        d["predicted"] = Predicted.from_dict(d["predicted"], "plan.predicted")
        baselines = fieldcheck.mapping("plan.baselines", d.get("baselines", {}), "name -> baseline")
        d["baselines"] = {k: Baseline.from_dict(k, v, f"plan.baselines[{k!r}]") for k, v in baselines.items()}
        if not isinstance(d["digits"], list):
            fieldcheck.fail("plan.digits", f"must be a list of device-ID radices, got {type(d['digits']).__name__}")
        return cls(**d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            fieldcheck.fail("plan", f"not valid JSON: {e}")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON (atomically: a temporary file, then a rename), creating missing parent folders;
        return the path. A ``path`` that is a folder is a ``ValueError``; a failed write leaves nothing behind."""
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"cannot write the plan to {os.fspath(path)!r}: it is a folder; give a file name")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        try:
            tmp.write_text(self.to_json(), encoding="utf-8")
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan written by :meth:`save`; errors name the field path and the file."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            reason = f"not a JSON text file: byte {e.start} is not UTF-8 (in {os.fspath(path)})"
            raise PlanError("plan", reason) from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(e.path, f"{e.reason} (in {os.fspath(path)})") from None


def _check_format(fmt: object) -> None:
    if fmt in _OLD_FORMATS:
        fieldcheck.fail("plan.format", f"{fmt!r} is no longer read ({PLAN_FORMAT!r} is): {_OLD_FORMATS[fmt]}")  # type: ignore[index]
    if fmt != PLAN_FORMAT:
        fieldcheck.fail("plan.format", f"unsupported plan format {fmt!r}; expected {PLAN_FORMAT!r}")


def _reject_constant(name: str) -> NoReturn:
    fieldcheck.fail("plan", f"not valid JSON: {name} is not a number a plan may hold")
