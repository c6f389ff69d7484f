"""How a plan was found: :class:`SearchRecord`, the ``"search"`` object of the plan JSON.

A searched plan records the search's method and proof, the options it searched under, the micro-batch counts it
tried, each grouping of the device digits it priced (:class:`GroupingRecord`) and where the time went; a forced
plan (``primepar_fx.planning.forced``) records the strategy it follows instead. Every field is optional in JSON
but ``memory_budget`` (``null``: no budget), which every plan writes; unknown fields are refused, naming the field.
Times are seconds of planning on the machine that planned, not predictions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from primepar_fx.record import fields as fieldcheck

#: the fields written in this order (the plan JSON's order since its format 2), each where it is not ``None``
_ORDER = (
    "forced",
    "config",
    "seed",
    "method",
    "proven_optimal",
    "objective",
    "pricing_s",
    "search_s",
    "planning_s",
    "micro_batches_tried",
    "stages_tried",
    "stages_s",
    "baselines_s",
    "alpha",
    "memory_budget",
    "allow_prime",
    "canonical",
    "grouped",
    "group_digits",
    "split_only_kept",
    "groupings",
    "groupings_s",
    "seconds",
    "training_state",
)
_TIMES = ("pricing_s", "search_s", "planning_s", "baselines_s", "groupings_s", "seconds", "stages_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupingRecord:
    """One mesh the search priced: its ``digits``, the ``objective`` (seconds a step) of its plan (``None`` where
    it found none: nothing fit, or nothing beat the plan found), the ``bound`` its fastest plan set on it (where it
    was bounded) and the ``seconds`` its pricing and search took (0 where its bound could not win)."""

    digits: tuple[int, ...]
    objective: float | None = None
    bound: float | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        where = "search.groupings[]"
        if not isinstance(self.digits, (list, tuple)):  # (empty: one device)
            fieldcheck.fail(f"{where}.digits", f"must be a list of device-ID radices, got {self.digits!r}")
        for d in self.digits:
            fieldcheck.count(f"{where}.digits", d, "a device-ID radix")
        fieldcheck.set_attr(self, "digits", tuple(self.digits))
        for name in ("objective", "bound"):
            value = getattr(self, name)
            if value is not None:
                fieldcheck.set_attr(self, name, fieldcheck.seconds(f"{where}.{name}", value))
        fieldcheck.set_attr(self, "seconds", fieldcheck.seconds(f"{where}.seconds", self.seconds))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"digits": list(self.digits), "objective": self.objective}
        if self.bound is not None:
            out["bound"] = self.bound
        return {**out, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> GroupingRecord:
        d = fieldcheck.fields(where, data, ("digits",), ("objective", "bound", "seconds"))
        with fieldcheck.rebase(where, "search.groupings[]"):
            return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchRecord:
    """How a plan was found (module docstring).

    Attributes:
        forced: the named strategy a forced plan follows (``"megatron"``, ``"random:3"``, ...); ``None`` for a
            searched plan. ``config``: the Megatron configuration it picked; ``seed``: a random plan's seed.
        method: the search method that found the plan (``"dp"``, ``"ilp"``, ...); ``proven_optimal``: whether the
            plan is proven optimal in its space (within the grouping it was found on); ``objective``: its objective,
            seconds a step (plus ``alpha`` times its memory).
        alpha, memory_budget, allow_prime, canonical: the options it was searched under (``memory_budget`` in bytes,
            ``None``: no budget). ``grouped``: whether the plan's mesh is a grouping of the digits rather than the
            full mesh; ``group_digits``: the finest groupings searched, where more than three digits.
        split_only_kept: the split-only search's plan beat the one the search found, and is the plan.
        micro_batches_tried: the micro-batch counts priced, in order. ``stages_tried``: the pipeline stage counts
            searched, in order (:mod:`~primepar_fx.planning.staged`), ``stages_s`` their seconds. ``groupings``:
            every mesh priced, in the order of the mesh list, where there were several.
        training_state: what a device keeps per parameter, its ZeRO stage and micro-batch count
            (:meth:`~primepar_fx.cost.blocks.CostOptions.training_state`).
        pricing_s, search_s: the kept mesh's pricing and search; planning_s: every count and mesh, priced and
            searched; baselines_s: the baselines; groupings_s: every grouping; seconds: a forced plan's whole time.
    """

    forced: str | None = None
    config: dict[str, Any] | None = None
    seed: int | None = None
    method: str | None = None
    proven_optimal: bool | None = None
    objective: float | None = None
    alpha: float | None = None
    memory_budget: float | None = None
    allow_prime: bool | None = None
    canonical: bool | None = None
    grouped: bool | None = None
    group_digits: int | None = None
    split_only_kept: bool = False
    micro_batches_tried: tuple[int, ...] | None = None
    stages_tried: tuple[int, ...] | None = None
    stages_s: float | None = None
    groupings: tuple[GroupingRecord, ...] | None = None
    training_state: dict[str, Any] | None = None
    pricing_s: float | None = None
    search_s: float | None = None
    planning_s: float | None = None
    baselines_s: float | None = None
    groupings_s: float | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        self._check_scalars()
        self._check_numbers()
        if self.micro_batches_tried is not None:
            tried = self._list("micro_batches_tried", self.micro_batches_tried)
            for i, m in enumerate(tried):
                fieldcheck.count(f"search.micro_batches_tried[{i}]", m, "micro-batches")
            fieldcheck.set_attr(self, "micro_batches_tried", tuple(tried))
        if self.stages_tried is not None:
            tried = self._list("stages_tried", self.stages_tried)
            for i, p in enumerate(tried):
                fieldcheck.count(f"search.stages_tried[{i}]", p, "pipeline stages")
            fieldcheck.set_attr(self, "stages_tried", tuple(tried))
        if self.groupings is not None:
            listed = self._list("groupings", self.groupings)
            for i, g in enumerate(listed):
                if not isinstance(g, GroupingRecord):
                    fieldcheck.fail(f"search.groupings[{i}]", f"must be a GroupingRecord, got {type(g).__name__}")
            fieldcheck.set_attr(self, "groupings", tuple(listed))
        for name in ("config", "training_state"):
            value = getattr(self, name)
            if value is not None:
                fieldcheck.mapping(f"search.{name}", value, "settings")
                fieldcheck.set_attr(self, name, fieldcheck.json_plain(f"search.{name}", value))

    def _check_scalars(self) -> None:
        for name in ("forced", "method"):
            if getattr(self, name) is not None:
                fieldcheck.text(f"search.{name}", getattr(self, name))
        for name in ("proven_optimal", "allow_prime", "canonical", "grouped", "split_only_kept"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                fieldcheck.fail(f"search.{name}", f"must be true or false, got {value!r}")
        for name in ("seed", "group_digits"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                fieldcheck.fail(f"search.{name}", f"must be an integer, got {value!r}")

    def _check_numbers(self) -> None:
        for name in ("objective", "alpha", "memory_budget", *_TIMES):
            value = getattr(self, name)
            if value is not None:
                fieldcheck.set_attr(self, name, _number(f"search.{name}", value))

    @staticmethod
    def _list(name: str, value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            fieldcheck.fail(f"search.{name}", f"must be a list, got {type(value).__name__}")
        return list(value)

    __hash__ = fieldcheck.json_hash

    def replace(self, **changes: Any) -> SearchRecord:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _ORDER:
            value = getattr(self, name)
            if name == "memory_budget" or (value is not None and (name != "split_only_kept" or value)):
                out[name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.search") -> SearchRecord:
        d = fieldcheck.fields(where, data, (), _ORDER)
        if isinstance(d.get("groupings"), list):
            d["groupings"] = tuple(
                GroupingRecord.from_dict(g, f"{where}.groupings[{i}]") for i, g in enumerate(d["groupings"])
            )
        with fieldcheck.rebase(where, "search"):
            return cls(**d)

    def describe_times(self, digits: tuple[int, ...]) -> str:
        """Where the search's time went, in one line: each grouping priced and searched (with the full mesh first
        where it was searched too) and the kept mesh's ``digits``, or the one pricing and search; then the
        micro-batch counts tried."""
        if self.groupings:
            full = len(self.groupings[0].digits) > len(self.groupings[-1].digits)  # the full mesh, then groupings
            meshes = f"the full mesh and {len(self.groupings) - 1}" if full else f"{len(self.groupings)}"
            kept = "x".join(map(str, digits))
            out = (
                f"{meshes} groupings of the digits priced and searched {self.groupings_s or 0.0:.2f} s "
                f"({kept} kept: pricing {self.pricing_s or 0.0:.2f} s, search {self.search_s or 0.0:.2f} s)"
            )
        else:
            out = f"pricing {self.pricing_s or 0.0:.2f} s, search {self.search_s or 0.0:.2f} s"
        counts = self.micro_batches_tried or ()
        if len(counts) > 1:
            out += f" (micro-batch counts {', '.join(map(str, counts))} tried: {self.planning_s or 0.0:.2f} s)"
        if self.stages_tried:
            out += f", pipelines of {', '.join(map(str, self.stages_tried))} stages {self.stages_s or 0.0:.2f} s"
        return out


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        fieldcheck.fail(where, f"must be a finite number, got {value!r}")
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, tuple) and value and isinstance(value[0], GroupingRecord):
        return [g.to_dict() for g in value]
    if isinstance(value, tuple):
        return list(value)
    return value
