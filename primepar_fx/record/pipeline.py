"""What a plan records of its pipeline (:class:`Pipeline`, JSON ``plan["pipeline"]``): how many stages a replica runs,
under which schedule, over how many micro-batches, and how many layers each (virtual) stage holds. Plain data,
validated on load; searched by :mod:`primepar_fx.planning.staged` and priced by
:func:`~primepar_fx.pricing.pipelined.price_pipeline`.

A plan with a pipeline splits its ``world_size`` devices into ``stages`` groups of ``world_size / stages`` (stage
``s``: ranks ``s * q`` to ``(s + 1) * q - 1``); its ``digits`` and node partitions are one stage's mesh and plan,
which every stage runs on its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primepar_fx.cost.pipeline import check_schedule
from primepar_fx.record import fields as fieldcheck

_REQUIRED = ("stages", "schedule", "virtual_stages", "micro_batches", "layers_per_stage")
_OPTIONAL = ("bubble", "stage_peak_bytes", "p2p_bytes")


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A plan's pipeline (module docstring). ``layers_per_stage``: the layers of each of the ``stages *
    virtual_stages`` stages in order (stage ``s`` runs on rank group ``s % stages``; the first holds the nodes before
    the layer stack, the last those after it); ``bubble``: the share of the step the ranks wait;
    ``stage_peak_bytes``: each rank group's predicted peak a device; ``p2p_bytes``: the bytes one device sends
    point to point a step (the mean)."""

    stages: int
    schedule: str
    virtual_stages: int
    micro_batches: int
    layers_per_stage: tuple[int, ...]
    bubble: float = 0.0
    stage_peak_bytes: tuple[int, ...] = ()
    p2p_bytes: int = 0

    def __post_init__(self) -> None:
        where = "plan.pipeline"
        fieldcheck.count(f"{where}.stages", self.stages, "stages")
        if self.stages < 2:
            fieldcheck.fail(f"{where}.stages", f"a pipeline has at least 2 stages, got {self.stages}")
        fieldcheck.count(f"{where}.virtual_stages", self.virtual_stages, "stages a rank")
        fieldcheck.count(f"{where}.micro_batches", self.micro_batches, "micro-batches")
        fieldcheck.text(f"{where}.schedule", self.schedule)
        try:
            check_schedule(self.schedule, self.stages, self.micro_batches, self.virtual_stages)
        except ValueError as e:
            fieldcheck.fail(f"{where}.schedule", str(e))
        layers = self.layers_per_stage
        if not isinstance(layers, (tuple, list)) or len(layers) != self.stages * self.virtual_stages:
            fieldcheck.fail(
                f"{where}.layers_per_stage",
                f"must list the layers of each of {self.stages} x {self.virtual_stages} stages, got {layers!r}",
            )
        for i, n in enumerate(layers):
            fieldcheck.count(f"{where}.layers_per_stage[{i}]", n, "layers")
        fieldcheck.set_attr(self, "layers_per_stage", tuple(layers))
        bubble = fieldcheck.seconds(f"{where}.bubble", self.bubble)
        if bubble >= 1:
            fieldcheck.fail(f"{where}.bubble", f"must be a share of the step in [0, 1), got {bubble!r}")
        fieldcheck.set_attr(self, "bubble", bubble)
        peaks = self.stage_peak_bytes
        if not isinstance(peaks, (tuple, list)) or len(peaks) not in (0, self.stages):
            fieldcheck.fail(f"{where}.stage_peak_bytes", f"must list {self.stages} peaks (or none), got {peaks!r}")
        for i, b in enumerate(peaks):
            fieldcheck.nbytes(f"{where}.stage_peak_bytes[{i}]", b)
        fieldcheck.set_attr(self, "stage_peak_bytes", tuple(peaks))
        fieldcheck.nbytes(f"{where}.p2p_bytes", self.p2p_bytes)

    @property
    def layers(self) -> int:
        """The layers of the stack, over every stage."""
        return sum(self.layers_per_stage)

    def describe(self) -> str:
        """``"4 stages, 1F1B over 64 micro-batches, layers 20/20/20/20, bubble 4.5%"`` and the like."""
        v = f" x {self.virtual_stages} virtual" if self.virtual_stages > 1 else ""
        layers = "/".join(map(str, self.layers_per_stage))
        return (
            f"{self.stages} stages{v}, {self.schedule} over {self.micro_batches} micro-batches, layers {layers}, "
            f"bubble {self.bubble:.1%}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "micro_batches": self.micro_batches,
            "layers_per_stage": list(self.layers_per_stage),
            "bubble": self.bubble,
            "stage_peak_bytes": list(self.stage_peak_bytes),
            "p2p_bytes": self.p2p_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Pipeline:
        d = fieldcheck.fields("plan.pipeline", data, _REQUIRED, _OPTIONAL)
        for key in ("layers_per_stage", "stage_peak_bytes"):
            if key in d and not isinstance(d[key], list):
                fieldcheck.fail(f"plan.pipeline.{key}", f"must be a list, got {type(d[key]).__name__}")
        return cls(**d)
