"""Cluster specs: the hardware a plan is priced against (paper §4, the latency and compute terms of Eq. 7).

A :class:`ClusterSpec` is data: devices, how many share a node, and one :class:`LinkLevel` per level of the
network (level 0 inside a node, level 1 between nodes). Specs round-trip through JSON and TOML and ship as
presets in ``primepar_fx/cost/presets/*.json`` (:func:`load_cluster`, :func:`list_clusters`).

**Collectives** and **compute** are priced by the latency models of :mod:`primepar_fx.cost.latency`
(:class:`LinearLatency` per collective kind and level, with the ring algorithm's bus factors; :class:`ComputeModel`
per op family). A group of devices that differ only in some digits (a *group indicator*) runs on the slowest level
it touches (:meth:`ClusterSpec.group_level`). Every group of the indicator runs at once, so a level's numbers are
per device under full load (a node's NICs shared by its devices); a group that spans nodes pays the inter-node
coefficients for all of its steps. Uncalibrated op families default to the device's peak FLOP/s at
:data:`DEFAULT_FLOPS_EFFICIENCY` (tensor-core peak of the dtype for matmul/attention, the fp32 vector peak for the
rest), memory bandwidth at :data:`DEFAULT_BYTES_EFFICIENCY` and ``op_overhead`` per op; views and meta ops cost
nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from math import prod
from pathlib import Path
from typing import Any

from primepar_fx.cost.latency import COLLECTIVES, ComputeModel, LinearLatency
from primepar_fx.cost.specdata import (
    SpecData,
    check_keys,
    data_hash,
    fields,
    integer,
    plain,
    real,
    set_field,
    text,
    toml_table,
    within,
)
from primepar_fx.partition.mesh import DeviceMesh

OP_FAMILIES = ("matmul", "attention", "pointwise", "norm", "reduce", "view", "embedding", "loss", "factory", "meta")
DTYPES = ("fp32", "tf32", "bf16", "fp16")
REQUIRED_DTYPES = ("fp32", "bf16", "fp16")
TENSOR_CORE_FAMILIES = frozenset({"matmul", "attention"})
FREE_FAMILIES = frozenset({"view", "meta"})
DEFAULT_FLOPS_EFFICIENCY = {"matmul": 0.6, "attention": 0.5}
DEFAULT_VECTOR_EFFICIENCY = 0.5
DEFAULT_BYTES_EFFICIENCY = 0.8
DEFAULT_LINK_EFFICIENCY = {"all-reduce": 0.8, "all-gather": 0.8, "reduce-scatter": 0.8, "all-to-all": 0.6, "p2p": 0.9}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def dtype_key(dtype: object) -> str:
    """``"bf16"`` for ``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"`` (and likewise fp32, fp16, tf32)."""
    try:
        return _dtype_key(dtype)
    except TypeError:  # unhashable: not a dtype
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)} or a torch floating dtype") from None


@functools.lru_cache(maxsize=256)
def _dtype_key(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)} or a torch floating dtype")
    return name


# ---------------------------------------------------------------------------------------------------- link levels
@dataclass(frozen=True, slots=True)
class LinkLevel(SpecData):
    """One level of the network. ``bandwidth`` (bytes/s per device, one direction) is informational.

    ``peer_bandwidth`` (bytes/s, one direction) is what one device can send to *one* peer of this level, where that
    is less than its whole ``bandwidth``: in a point-to-point NVLink mesh (a 4-GPU V100 board gives each pair of
    GPUs 2 of a GPU's 6 links) a collective's rings use every link, but a message to one peer uses only the links to
    it. ``None`` (the default): one peer can use all of it (a switch: NVSwitch, a NIC). Point-to-point transfers are
    priced with it (:meth:`p2p_time`); collectives are not.
    """

    name: str
    bandwidth: float
    collectives: dict[str, LinearLatency]
    peer_bandwidth: float | None = None

    def __post_init__(self) -> None:
        text("LinkLevel.name", self.name)
        set_field(self, "bandwidth", real("LinkLevel.bandwidth", self.bandwidth, "bytes/s per device", positive=True))
        if self.peer_bandwidth is not None:
            peer = real("LinkLevel.peer_bandwidth", self.peer_bandwidth, "bytes/s to one peer", positive=True)
            if peer > self.bandwidth:
                raise ValueError(
                    f"LinkLevel.peer_bandwidth ({peer:g} bytes/s to one peer) cannot exceed the level's bandwidth "
                    f"({self.bandwidth:g} bytes/s per device); leave it out when one peer can use all of it"
                )
            set_field(self, "peer_bandwidth", peer)
        check_keys("LinkLevel.collectives", self.collectives, COLLECTIVES, COLLECTIVES, "collective kind(s)")
        for k, v in self.collectives.items():
            if not isinstance(v, LinearLatency):
                raise ValueError(f"LinkLevel.collectives[{k!r}] must be a LinearLatency, got {type(v).__name__}")
        set_field(self, "collectives", {k: self.collectives[k] for k in COLLECTIVES})

    _hash: int | None = field(init=False, repr=False, compare=False, default=None)  # data_hash's, once computed
    __hash__ = data_hash  # dict fields: hash the canonical JSON (consistent with ==)

    @classmethod
    def from_bandwidth(
        cls, name: str, bandwidth: float, fixed: float, efficiency: Mapping[str, float] | None = None
    ) -> LinkLevel:
        """A level from its per-direction bandwidth: ``bytes_coeff = 1 / (efficiency[kind] * bandwidth)``.

        ``fixed`` is the per-ring-step latency in seconds; coefficients are rounded to 6 significant digits.
        """
        eff = {**DEFAULT_LINK_EFFICIENCY, **(efficiency or {})}
        bw = real("bandwidth", bandwidth, "bytes/s", positive=True)
        lat = {}
        for kind in COLLECTIVES:
            bus_bw = real(f"efficiency[{kind!r}]", eff[kind], "fraction of bandwidth", positive=True) * bw
            lat[kind] = LinearLatency(float(f"{1 / bus_bw:.6g}"), fixed)
        return cls(name, bw, lat)

    def collective_time(self, kind: str, group_size: int, nbytes: float, *, bucketed: bool = False) -> float:
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(COLLECTIVES)}")
        return self.collectives[kind].collective(kind, group_size, nbytes, bucketed=bucketed)

    @property
    def peer_factor(self) -> float:
        """How much slower one peer's link is than the device's whole bandwidth (1 without ``peer_bandwidth``)."""
        return 1.0 if self.peer_bandwidth is None else self.bandwidth / self.peer_bandwidth

    def p2p_coefficients(self, messages: float = 1) -> tuple[float, float]:
        """``(fixed, seconds per byte)`` of receiving ``messages`` point-to-point messages from as many peers at once.

        Each message pays the ``"p2p"`` intercept. The bytes arrive at the ``"p2p"`` rate of the whole bandwidth,
        or at the rate of one peer's links if the busiest peer's share is the bottleneck: with ``m`` equal messages
        the busiest peer carries ``1/m`` of the bytes, so the rate is ``bytes_coeff * max(1, peer_factor / m)``.
        """
        lat = self.collectives["p2p"]
        return (lat.fixed + lat.call) * messages, lat.bytes_coeff * max(1.0, self.peer_factor / max(messages, 1))

    def p2p_time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to receive ``nbytes`` in ``messages`` equal point-to-point messages from distinct peers at once."""
        fixed, coeff = self.p2p_coefficients(messages)
        return fixed + coeff * real("nbytes", nbytes, "bytes")

    def to_dict(self) -> dict[str, Any]:
        d = plain(self)
        if d["peer_bandwidth"] is None:
            del d["peer_bandwidth"]  # the default: spec files that predate the field stay canonical
        return d

    @classmethod
    def from_dict(cls, data: Any) -> LinkLevel:
        d = fields("LinkLevel", data, ("name", "bandwidth", "collectives"), ("peer_bandwidth",))
        check_keys("LinkLevel.collectives", d["collectives"], COLLECTIVES, (), "collective kind(s)")
        lat = {k: within(f"collectives[{k!r}]", LinearLatency.from_dict, v) for k, v in d["collectives"].items()}
        return cls(**{**d, "collectives": lat})


# ---------------------------------------------------------------------------------------------------- devices
@dataclass(frozen=True, slots=True)
class DeviceSpec(SpecData):
    """One accelerator: peak FLOP/s per dtype, memory bandwidth (bytes/s) and capacity (bytes), compute models.

    ``compute`` keys are an op family (``"matmul"``) or a family and dtype (``"matmul:bf16"``); the latter wins.
    ``op_overhead`` (seconds) is the fixed cost per op of the default models (kernel launch / dispatch).
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_capacity: int
    op_overhead: float = 0.0
    compute: dict[str, ComputeModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        text("DeviceSpec.name", self.name)
        check_keys("DeviceSpec.peak_flops", self.peak_flops, DTYPES, REQUIRED_DTYPES, "dtype(s)")
        pf = {k: real(f"DeviceSpec.peak_flops[{k!r}]", v, "FLOP/s", positive=True) for k, v in self.peak_flops.items()}
        set_field(self, "peak_flops", {k: pf[k] for k in DTYPES if k in pf})
        mem_bw = real("DeviceSpec.memory_bandwidth", self.memory_bandwidth, "bytes/s", positive=True)
        set_field(self, "memory_bandwidth", mem_bw)
        set_field(self, "memory_capacity", integer("DeviceSpec.memory_capacity", self.memory_capacity, "bytes"))
        set_field(self, "op_overhead", real("DeviceSpec.op_overhead", self.op_overhead, "seconds"))
        if not isinstance(self.compute, Mapping):
            raise ValueError("DeviceSpec.compute must map op families to ComputeModel")
        for key, model in self.compute.items():
            family, _, dtype = str(key).partition(":")
            if not isinstance(key, str) or family not in OP_FAMILIES or (dtype and dtype not in DTYPES):
                msg = f"an op family {list(OP_FAMILIES)}, optionally with ':' and a dtype {list(DTYPES)}"
                raise ValueError(f"DeviceSpec.compute key {key!r} must be {msg}")
            if not isinstance(model, ComputeModel):
                raise ValueError(f"DeviceSpec.compute[{key!r}] must be a ComputeModel, got {type(model).__name__}")
        set_field(self, "compute", dict(sorted(self.compute.items())))

    _hash: int | None = field(init=False, repr=False, compare=False, default=None)  # data_hash's, once computed
    __hash__ = data_hash  # dict fields: hash the canonical JSON (consistent with ==)

    def peak(self, dtype: object) -> float:
        """Peak FLOP/s for ``dtype``; tf32 falls back to fp32 when not given."""
        key = dtype_key(dtype)
        return self.peak_flops.get(key, self.peak_flops["fp32"])

    def default_compute(self, family: str, dtype: object = "fp32") -> ComputeModel:
        """The uncalibrated model of ``family`` derived from peak FLOP/s and memory bandwidth."""
        if family not in OP_FAMILIES:
            raise ValueError(f"unknown op family {family!r}; expected one of {list(OP_FAMILIES)}")
        if family in FREE_FAMILIES:
            return ComputeModel(0.0, 0.0, 0.0)
        if family in TENSOR_CORE_FAMILIES:
            flops_per_s = self.peak(dtype) * DEFAULT_FLOPS_EFFICIENCY[family]
        else:
            flops_per_s = self.peak_flops["fp32"] * DEFAULT_VECTOR_EFFICIENCY
        bytes_per_s = self.memory_bandwidth * DEFAULT_BYTES_EFFICIENCY
        return ComputeModel(1.0 / flops_per_s, 1.0 / bytes_per_s, self.op_overhead)

    def compute_model(self, family: str, dtype: object = "fp32") -> ComputeModel:
        """The calibrated model (``family:dtype``, then ``family``) or else :meth:`default_compute`."""
        return _compute_model(self, family, dtype_key(dtype))

    def compute_time(self, family: str, flops: float, nbytes: float, dtype: object = "fp32") -> float:
        """Seconds for one op of ``family`` doing ``flops`` and moving ``nbytes`` of memory traffic."""
        return self.compute_model(family, dtype)(flops, nbytes)

    @classmethod
    def from_dict(cls, data: Any) -> DeviceSpec:
        required = ("name", "peak_flops", "memory_bandwidth", "memory_capacity")
        d = fields("DeviceSpec", data, required, ("op_overhead", "compute"))
        compute = d.get("compute", {})
        if not isinstance(compute, Mapping):
            raise ValueError(f"DeviceSpec.compute must be an object/table, got {type(compute).__name__}")
        models = {k: within(f"compute[{k!r}]", ComputeModel.from_dict, v) for k, v in compute.items()}
        return cls(**{**d, "compute": models})


@functools.lru_cache(maxsize=1024)
def _compute_model(device: DeviceSpec, family: str, key: str) -> ComputeModel:
    """:meth:`DeviceSpec.compute_model`, once per device, family and dtype (pricing asks once per strategy)."""
    for k in (f"{family}:{key}", family):
        if k in device.compute:
            return device.compute[k]
    return device.default_compute(family, key)


# ---------------------------------------------------------------------------------------------------- clusters
@functools.lru_cache(maxsize=4096)
def _crosses_nodes(digits: tuple[int, ...], positions: tuple[int, ...], devices_per_node: int) -> bool:
    """Whether some group of devices differing only in ``positions`` spans two nodes (checked rank by rank)."""
    groups = DeviceMesh(digits).groups(positions)
    return any(len({rank // devices_per_node for rank in group}) > 1 for group in groups)


@dataclass(frozen=True, slots=True)
class ClusterSpec(SpecData):
    """A homogeneous cluster: ``num_devices`` devices, ``devices_per_node`` per node, innermost level first.

    ``calibrated`` says whether the numbers were measured on the machine; ``source`` says where they came from.

    ``gradient_overlap`` (0 to 1): the fraction of a bucketed parameter-gradient all-reduce's time hidden behind
    the rest of backward. primepar's runtime launches its buckets asynchronously during backward, as DDP and FSDP2
    do; how much of them that hides depends on the machine, so the default is 0, every byte on the critical path
    (Megatron-LM's default too: its ``--overlap-grad-reduce`` is off unless asked for). The same value prices the
    baselines, which are planned by this model too.

    ``matmul_overlap`` (0 to 1): the fraction of the compute beside a re-layout that hides it where the runtime cuts a
    linear by rows around the re-layout (collective matmul, :mod:`primepar_fx.cost.matmul_overlap`). The default, 1,
    is Eq. 7's ``max(compute, communication)``, as the P(S x S) ring's shifts are priced; 0 prices the transfers as
    if nothing ran beside them (a machine where a rank that waits hands its core to another, and a transfer does not
    run while the rank computes).
    """

    name: str
    num_devices: int
    devices_per_node: int
    device: DeviceSpec
    levels: tuple[LinkLevel, ...]
    description: str = ""
    calibrated: bool = False
    source: str = ""
    gradient_overlap: float = 0.0
    matmul_overlap: float = 1.0

    def __post_init__(self) -> None:
        text("ClusterSpec.name", self.name)
        set_field(self, "num_devices", integer("ClusterSpec.num_devices", self.num_devices, "devices"))
        set_field(self, "devices_per_node", integer("ClusterSpec.devices_per_node", self.devices_per_node, "devices"))
        if self.num_devices % self.devices_per_node:
            raise ValueError(
                f"ClusterSpec.num_devices ({self.num_devices}) must be a multiple of devices_per_node "
                f"({self.devices_per_node}); nodes are assumed identical"
            )
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"ClusterSpec.device must be a DeviceSpec, got {type(self.device).__name__}")
        if not isinstance(self.levels, (tuple, list)) or not all(isinstance(lv, LinkLevel) for lv in self.levels):
            raise ValueError("ClusterSpec.levels must be a sequence of LinkLevel, innermost (intra-node) first")
        set_field(self, "levels", tuple(self.levels))
        if not (1 if self.num_nodes == 1 else 2) <= len(self.levels) <= 2:
            want = "[intra-node, inter-node]" if self.num_nodes > 1 else "[intra-node] or [intra-node, inter-node]"
            raise ValueError(f"ClusterSpec.levels must be {want} for {self.num_nodes} node(s), got {len(self.levels)}")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"ClusterSpec.levels names must be unique, got {names}")
        text("ClusterSpec.description", self.description, nonempty=False)
        text("ClusterSpec.source", self.source, nonempty=False)
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"ClusterSpec.calibrated must be true or false, got {self.calibrated!r}")
        overlap = real("ClusterSpec.gradient_overlap", self.gradient_overlap, "a fraction")
        if overlap > 1:
            raise ValueError(f"ClusterSpec.gradient_overlap must be a fraction from 0 to 1, got {overlap!r}")
        set_field(self, "gradient_overlap", overlap)
        beside = real("ClusterSpec.matmul_overlap", self.matmul_overlap, "a fraction")
        if beside > 1:
            raise ValueError(f"ClusterSpec.matmul_overlap must be a fraction from 0 to 1, got {beside!r}")
        set_field(self, "matmul_overlap", beside)

    _hash: int | None = field(init=False, repr=False, compare=False, default=None)  # data_hash's, once computed
    __hash__ = data_hash  # dict fields: hash the canonical JSON (consistent with ==)

    @property
    def num_nodes(self) -> int:
        return self.num_devices // self.devices_per_node

    def check_world(self, world_size: int) -> None:
        """Whether ``world_size`` devices fit: up to ``num_devices``, or any whole number of nodes when the spec has
        an inter-node level (a spec describes its nodes and their network; ``num_devices`` is only the size of the
        cluster it names, so ``-n 64`` of an 8-GPU-node preset is 8 such nodes)."""
        world = integer("world_size", world_size, "devices")
        if world <= self.num_devices:
            return
        if len(self.levels) < 2:
            raise ValueError(
                f"world_size {world} exceeds cluster {self.name!r}: one node of {self.num_devices} devices, and the "
                "spec has no inter-node level to add nodes with"
            )
        if world % self.devices_per_node:
            raise ValueError(
                f"world_size {world} exceeds cluster {self.name!r} of {self.num_devices} devices and is not a whole "
                f"number of its {self.devices_per_node}-device nodes"
            )

    def mesh(self, world_size: int | None = None) -> DeviceMesh:
        """The device digits of ``world_size`` devices (default: ``num_devices``), node digits first; more devices
        than ``num_devices`` are more nodes of the same kind (:meth:`check_world`)."""
        world = self.num_devices if world_size is None else integer("world_size", world_size, "devices")
        self.check_world(world)
        return DeviceMesh.for_world_size(world, self.devices_per_node)

    def _check_mesh(self, mesh: DeviceMesh, digits: Iterable[int]) -> tuple[int, ...]:
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        try:
            self.check_world(mesh.size)
        except ValueError as e:
            raise ValueError(f"a mesh of {mesh.size} devices does not fit: {e}") from None
        positions = tuple(sorted(set(digits)))
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(mesh) for i in positions):
            raise ValueError(f"digits {positions} must be positions 0..{len(mesh) - 1} of mesh digits {mesh.digits}")
        return positions

    def group_size(self, mesh: DeviceMesh, digits: Iterable[int]) -> int:
        """Devices per group of devices that differ only in ``digits``."""
        return prod(mesh.digits[i] for i in self._check_mesh(mesh, digits))

    def group_level(self, mesh: DeviceMesh, digits: Iterable[int]) -> int:
        """The slowest level a group differing only in ``digits`` uses: 1 if any group spans nodes, else 0."""
        positions = self._check_mesh(mesh, digits)
        level = int(_crosses_nodes(mesh.digits, positions, self.devices_per_node))
        if level >= len(self.levels):
            raise ValueError(f"groups over digits {positions} span nodes but {self.name!r} has no inter-node level")
        return level

    def collective_time(
        self, kind: str, nbytes_per_device: float, mesh: DeviceMesh, digits: Iterable[int], *, bucketed: bool = False
    ) -> float:
        """Seconds for a ``kind`` collective over the groups that differ only in ``digits`` (the ring model of
        :mod:`primepar_fx.cost.latency`); ``bucketed``: without the per-step latency, which the gradient bucket it
        travels in pays once, and less the :attr:`gradient_overlap` backward hides."""
        digits = tuple(digits)
        level = self.levels[self.group_level(mesh, digits)]
        seconds = level.collective_time(kind, self.group_size(mesh, digits), nbytes_per_device, bucketed=bucketed)
        return seconds * (1.0 - self.gradient_overlap) if bucketed else seconds

    def shift_time(self, nbytes: float, senders: Iterable[int]) -> float:
        """Seconds for a ring shift where rank ``k`` receives ``nbytes`` from ``senders[k]`` (all at once)."""
        senders = list(senders)
        moves = [(k, s) for k, s in enumerate(senders) if s != k]
        if not moves:
            return 0.0
        world = len(senders)
        self.check_world(world)
        if any(not 0 <= s < world for _, s in moves):
            raise ValueError(f"senders must be ranks 0..{world - 1}")
        level = int(any(k // self.devices_per_node != s // self.devices_per_node for k, s in moves))
        if level >= len(self.levels):
            raise ValueError(f"the shift crosses nodes but {self.name!r} has no inter-node level")
        return self.levels[level].p2p_time(nbytes)

    def with_calibration(
        self,
        *,
        source: str,
        collectives: Mapping[int | str, Mapping[str, LinearLatency]] | None = None,
        compute: Mapping[str, ComputeModel] | None = None,
        op_overhead: float | None = None,
    ) -> ClusterSpec:
        """A copy with measured coefficients merged in and ``calibrated=True``.

        ``collectives`` is keyed by level index or name, then kind; ``compute`` by ``family`` or ``family:dtype``.
        A measured ``"p2p"`` is a ring shift's, one peer's rate, so it replaces the level's ``peer_bandwidth`` too
        (dropped: the measured rate then prices every point-to-point transfer of that level).
        """
        levels = list(self.levels)
        for key, kinds in (collectives or {}).items():
            idx = key if isinstance(key, int) else next((i for i, lv in enumerate(levels) if lv.name == key), None)
            if idx is None or not 0 <= idx < len(levels):
                raise ValueError(f"collectives: no level {key!r}; levels are {[lv.name for lv in levels]}")
            peer = None if "p2p" in kinds else levels[idx].peer_bandwidth
            levels[idx] = dataclasses.replace(
                levels[idx], collectives={**levels[idx].collectives, **kinds}, peer_bandwidth=peer
            )
        dev = self.device
        if compute or op_overhead is not None:
            over = dev.op_overhead if op_overhead is None else op_overhead
            dev = dataclasses.replace(dev, compute={**dev.compute, **(compute or {})}, op_overhead=over)
        return dataclasses.replace(self, levels=tuple(levels), device=dev, calibrated=True, source=source)

    # ------------------------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = plain(self)  # the prose first, then the numbers
        if not d["gradient_overlap"]:
            del d["gradient_overlap"]  # the default: spec files that predate the field stay canonical
        if d["matmul_overlap"] == 1.0:
            del d["matmul_overlap"]
        return {k: d[k] for k in ("name", "description", "calibrated", "source")} | d

    @classmethod
    def from_dict(cls, data: Any) -> ClusterSpec:
        required = ("name", "num_devices", "devices_per_node", "device", "levels")
        d = fields(
            "ClusterSpec", data, required, ("description", "calibrated", "source", "gradient_overlap", "matmul_overlap")
        )
        device = within("ClusterSpec.device", DeviceSpec.from_dict, d["device"])
        if not isinstance(d["levels"], list):
            raise ValueError(f"ClusterSpec.levels must be a list of levels, got {type(d['levels']).__name__}")
        levels = tuple(within(f"ClusterSpec.levels[{i}]", LinkLevel.from_dict, lv) for i, lv in enumerate(d["levels"]))
        return cls(**{**d, "device": device, "levels": levels})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_toml(self) -> str:
        return "\n".join(toml_table([], [], self.to_dict())) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> ClusterSpec:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the tomli backport has the same API
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"not valid TOML: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Load a ``.json`` or ``.toml`` spec."""
        p = Path(path)
        if p.suffix not in (".json", ".toml"):
            raise ValueError(f"cluster spec {str(p)!r} must end in .json or .toml")
        text = p.read_text(encoding="utf-8")
        return cls.from_json(text) if p.suffix == ".json" else cls.from_toml(text)


# ---------------------------------------------------------------------------------------------------- presets
def _presets() -> Any:
    return resources.files("primepar_fx.cost").joinpath("presets")


def list_clusters() -> list[str]:
    """Names of the shipped presets (``primepar_fx/cost/presets/*.json``)."""
    return sorted(p.name.removesuffix(".json") for p in _presets().iterdir() if p.name.endswith(".json"))


def load_cluster(name_or_path: str | os.PathLike[str]) -> ClusterSpec:
    """A preset by name (see :func:`list_clusters`) or a ``.json`` / ``.toml`` spec file."""
    name = os.fspath(name_or_path)
    if name in list_clusters():
        text = _presets().joinpath(f"{name}.json").read_text("utf-8")
        return within(f"preset {name!r}", ClusterSpec.from_json, text)
    if Path(name).is_file():
        return within(f"cluster spec {name!r}", ClusterSpec.from_file, name)
    raise ValueError(f"no cluster preset or spec file {name!r}; presets are {list_clusters()}")
