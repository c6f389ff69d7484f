"""Latency models of a cluster spec: collectives on one link level, and compute of one op family.

**Collectives.** Each link level of a :class:`~primepar_fx.cost.cluster.ClusterSpec` holds one
:class:`LinearLatency` per collective kind, priced with the ring algorithm's bus factors (the nccl-tests
convention)::

    t(kind, g, n) = bytes_coeff * bus(kind, g) * n + fixed * steps(kind, g) + call

    kind            bus(kind, g)   steps(kind, g)
    all-reduce      2 (g-1) / g    2 (g-1)
    all-gather      (g-1) / g      g-1
    reduce-scatter  (g-1) / g      g-1
    all-to-all      (g-1) / g      g-1
    p2p (ring)      1              1

where ``g`` is the group size, ``n`` the bytes per device of the full buffer (all-reduce: the tensor;
all-gather: its output; reduce-scatter: its input; all-to-all: the send buffer; p2p: the message), and a group
of one costs nothing. So ``bytes_coeff`` is seconds per byte of bus traffic (1 / bus bandwidth) and ``fixed``
is seconds per ring step; both are independent of ``g`` and are what calibration fits (:func:`fit_collective`).
``call`` (seconds per call, 0 in the presets) is fitted only from groups of several sizes: the machine's own
measurement (:mod:`primepar_fx.calibrate.machine`) finds most of gloo's latency per call, not per step.

**Compute.** Each op family has a :class:`ComputeModel` ``t = flops_coeff * flops + bytes_coeff * bytes +
fixed``; a calibrated model may carry an efficiency table, which slows the FLOP term of small calls (small shards
of a P(S x S) or of a high-degree split run further from peak).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from primepar_fx.cost.specdata import SpecData, fields, integer, plain, real, set_field

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p")


def ring_factors(kind: str, group_size: int) -> tuple[float, int]:
    """``(bus(kind, g), steps(kind, g))`` of the ring algorithm (module docstring); ``(0, 0)`` for ``g = 1``."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(COLLECTIVES)}")
    g = integer("group_size", group_size, "devices")
    if g == 1:
        return 0.0, 0
    if kind == "p2p":
        return 1.0, 1
    if kind == "all-reduce":
        return 2 * (g - 1) / g, 2 * (g - 1)
    return (g - 1) / g, g - 1


@dataclass(frozen=True, slots=True)
class LinearLatency(SpecData):
    """``t = bytes_coeff * nbytes + fixed + call``; for a collective, ``nbytes`` is bus traffic, ``fixed`` is paid
    per ring step and ``call`` once per call whatever the group's size (module docstring). ``call`` is 0 unless a
    fit over several group sizes measured it, and is left out of the JSON then."""

    bytes_coeff: float
    fixed: float
    call: float = 0.0

    def __post_init__(self) -> None:
        set_field(self, "bytes_coeff", real("LinearLatency.bytes_coeff", self.bytes_coeff, "seconds per byte"))
        set_field(self, "fixed", real("LinearLatency.fixed", self.fixed, "seconds"))
        set_field(self, "call", real("LinearLatency.call", self.call, "seconds"))

    def __call__(self, nbytes: float) -> float:
        return self.bytes_coeff * real("nbytes", nbytes, "bytes") + self.fixed + self.call

    def collective(self, kind: str, group_size: int, nbytes: float, *, bucketed: bool = False) -> float:
        """Seconds for a ``kind`` collective of ``nbytes`` per device over ``group_size`` devices; ``bucketed``: it
        travels in a bucket with others (a parameter gradient), so its per-call latency is the bucket's, not its."""
        bus, steps = ring_factors(kind, group_size)
        if steps == 0:
            return 0.0
        latency = 0.0 if bucketed else self.fixed * steps + self.call
        return self.bytes_coeff * bus * real("nbytes", nbytes, "bytes") + latency

    def to_dict(self) -> dict[str, Any]:
        out = {"bytes_coeff": self.bytes_coeff, "fixed": self.fixed}
        return out | ({"call": self.call} if self.call else {})

    @classmethod
    def from_dict(cls, data: Any) -> LinearLatency:
        return cls(**fields("LinearLatency", data, ("bytes_coeff", "fixed"), ("call",)))


@dataclass(frozen=True, slots=True)
class ComputeModel(SpecData):
    """``t = flops_coeff * flops / efficiency(flops) + bytes_coeff * bytes + fixed`` for one op family (seconds).

    ``efficiency`` is a table of ``(flops per call, factor)`` points, FLOPs strictly increasing, each factor in
    ``(0, 1]``: the fraction of the ``flops_coeff`` rate a call of that size reaches. Between points the factor is
    interpolated linearly in ``log10(flops)``; below the first and above the last it is the end point's. An empty
    table (the default) is a factor of 1 everywhere. The table is keyed by a call's FLOPs (``2 M N K`` of a matrix
    product), not by its three dims: a calibration measures shapes, and the planner needs one number per shard.
    """

    flops_coeff: float
    bytes_coeff: float
    fixed: float = 0.0
    efficiency: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        set_field(self, "flops_coeff", real("ComputeModel.flops_coeff", self.flops_coeff, "seconds per FLOP"))
        set_field(self, "bytes_coeff", real("ComputeModel.bytes_coeff", self.bytes_coeff, "seconds per byte"))
        set_field(self, "fixed", real("ComputeModel.fixed", self.fixed, "seconds"))
        points = []
        for i, point in enumerate(self.efficiency):
            where = f"ComputeModel.efficiency[{i}]"
            if not isinstance(point, tuple | list) or len(point) != 2:
                raise ValueError(f"{where} must be a (flops, factor) pair, got {point!r}")
            flops = real(f"{where} flops", point[0], "FLOPs per call", positive=True)
            factor = real(f"{where} factor", point[1], "fraction of the flops_coeff rate", positive=True)
            if factor > 1:
                raise ValueError(f"{where} factor must be <= 1 (a fraction of the flops_coeff rate), got {factor}")
            if points and flops <= points[-1][0]:
                raise ValueError(f"{where}: FLOPs must increase strictly, got {flops:g} after {points[-1][0]:g}")
            points.append((flops, factor))
        set_field(self, "efficiency", tuple(points))

    def factor(self, flops: float) -> float:
        """The efficiency factor of a call of ``flops`` FLOPs (class docstring)."""
        table = self.efficiency
        if not table or flops <= table[0][0]:
            return table[0][1] if table else 1.0
        if flops >= table[-1][0]:
            return table[-1][1]
        hi = next(i for i, (f, _) in enumerate(table) if f >= flops)
        (f0, e0), (f1, e1) = table[hi - 1], table[hi]
        w = (math.log10(flops) - math.log10(f0)) / (math.log10(f1) - math.log10(f0))
        return e0 + w * (e1 - e0)

    def __call__(self, flops: float, nbytes: float) -> float:
        flops, nbytes = real("flops", flops, "FLOPs"), real("nbytes", nbytes, "bytes")
        compute = self.flops_coeff * flops / self.factor(flops) if flops else 0.0
        return compute + self.bytes_coeff * nbytes + self.fixed

    def to_dict(self) -> dict[str, Any]:
        d = plain(self)
        if not d["efficiency"]:
            del d["efficiency"]  # the default: specs without a table stay as they were
        return d

    @classmethod
    def from_dict(cls, data: Any) -> ComputeModel:
        d = fields("ComputeModel", data, ("flops_coeff", "bytes_coeff"), ("fixed", "efficiency"))
        table = d.get("efficiency", [])
        if not isinstance(table, list | tuple):
            raise ValueError(f"ComputeModel.efficiency must be a list of [flops, factor] pairs, got {table!r}")
        return cls(**{**d, "efficiency": tuple(tuple(p) if isinstance(p, list) else p for p in table)})


def fit_collective(
    kind: str,
    group_size: int | Mapping[int, Iterable[tuple[float, float]]],
    samples: Iterable[tuple[float, float]] = (),
) -> LinearLatency:
    """Least-squares fit of measured ``(nbytes_per_device, seconds)`` to the ring model (module docstring).

    ``fit_collective(kind, g, samples)``: samples at one group size ``g``; the latency is all per ring step
    (``call = 0``). ``fit_collective(kind, {g: samples, ...})``: samples at two or more group sizes, which also
    separates the latency paid once per call from the latency per ring step (a group of 2 does not cost a third
    of a group of 4's 6 steps where the per-call part dominates, as on gloo). Coefficients are non-negative (a
    negative one is dropped and the rest refitted). Needs at least two distinct message sizes.
    """
    by_size = dict(group_size) if isinstance(group_size, Mapping) else {group_size: samples}
    rows: list[tuple[float, float, float]] = []  # (bus bytes, ring steps, seconds)
    for g, pts in by_size.items():
        bus, steps = ring_factors(kind, g)
        if steps == 0:
            raise ValueError("group_size must be >= 2 to fit a collective (a group of one moves nothing)")
        rows += [
            (bus * real("samples nbytes", n, "bytes"), steps, real("samples seconds", t, "seconds")) for n, t in pts
        ]
    if len({x for x, _, _ in rows}) < 2:
        raise ValueError(f"samples need at least two distinct message sizes to fit {kind}, got {len(rows)} sample(s)")
    terms = ["bytes_coeff", "fixed"] + (["call"] if len({s for _, s, _ in rows}) > 1 else [])
    column = {"bytes_coeff": lambda r: r[0], "fixed": lambda r: r[1], "call": lambda r: 1.0}
    while True:
        x = np.array([[column[t](r) for t in terms] for r in rows])
        coef = np.linalg.lstsq(x, np.array([r[2] for r in rows]), rcond=None)[0]
        if terms and coef.min() < 0:
            terms.pop(int(coef.argmin()))  # a negative coefficient: leave it out (0) and refit the rest
            continue
        fit = dict(zip(terms, (float(c) for c in coef)))
        return LinearLatency(fit.get("bytes_coeff", 0.0), fit.get("fixed", 0.0), fit.get("call", 0.0))
