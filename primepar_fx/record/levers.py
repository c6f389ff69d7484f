"""What a plan records of its memory levers: the recomputation mode of each layer (:class:`Recompute`). Plain data,
validated; recomputation is priced and chosen by :mod:`primepar_fx.levers.recompute` and honoured at run time by
:mod:`primepar_fx.passes.recompute`. The ZeRO stage and micro-batch count are in the plan's training state
(:attr:`~primepar_fx.cost.blocks.CostOptions.zero`, ``micro_batches``), honoured by :mod:`primepar_fx.runtime.zero`
and :mod:`primepar_fx.compiler.microbatch`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the modes of one layer, least memory last
MODES = ("none", "selective", "full")
#: the kind under which a recomputed Forward's bytes are reported
RECOMPUTE_KIND = "recomputation"


@dataclass(frozen=True)
class Recompute:
    """What a plan recomputes: the mode of each layer of the stack ``stack`` (JSON: ``plan["recompute"]``)."""

    stack: str
    layers: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.stack, str) or not self.stack:
            raise ValueError(f"plan.recompute.stack must be a module path, got {self.stack!r}")
        if not isinstance(self.layers, (tuple, list)) or not self.layers:
            raise ValueError(f"plan.recompute.layers must be a non-empty list of modes, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, m in enumerate(self.layers):
            if m not in MODES:
                raise ValueError(f"plan.recompute.layers[{i}] must be one of {list(MODES)}, got {m!r}")

    @classmethod
    def uniform(cls, stack: str, count: int, mode: str, first: int | None = None) -> Recompute:
        """``mode`` on the first ``first`` layers (default: all), none on the rest."""
        first = count if first is None else first
        return cls(stack, tuple(mode if i < first else "none" for i in range(count)))

    @property
    def active(self) -> bool:
        return any(m != "none" for m in self.layers)

    def describe(self) -> str:
        """``"full on 60 of 80 layers of model.layers"``, ``"none"``, ..."""
        if not self.active:
            return "none"
        parts = []
        for mode in ("full", "selective"):
            n = self.layers.count(mode)
            if n:
                parts.append(f"{mode} on {n} of {len(self.layers)} layers")
        return f"{', '.join(parts)} of {self.stack}"

    def to_dict(self) -> dict[str, Any]:
        return {"stack": self.stack, "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, data: object) -> Recompute:
        if not isinstance(data, Mapping) or set(data) != {"stack", "layers"}:
            raise ValueError(f"plan.recompute must be an object with keys 'stack' and 'layers', got {data!r}")
        return cls(data["stack"], data["layers"])
