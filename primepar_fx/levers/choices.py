"""What a plan's options may ask of the memory levers, checked: a recomputation mode, a ZeRO stage, a micro-batch
count, or ``"auto"`` for each (the search weighs it); and the micro-batch counts an ``"auto"`` search tries."""

from __future__ import annotations

from primepar_fx.record.levers import MODES

#: what a plan's options may ask for: a mode for every layer, or ``"auto"`` (chosen by the search)
CHOICES = ("auto", *MODES)

#: the micro-batch counts a search under a budget tries, in order, where they divide the batch (ours and
#: Megatron-LM's gradient accumulation alike)
MICRO_BATCH_TRIES = (1, 2, 4, 8)

#: what a plan's options may ask of ZeRO: a stage, or ``"auto"`` (0 when the plan fits without, else 2, else 3)
ZERO_CHOICES = ("auto", 0, 1, 2, 3)


def check_zero(value: object) -> str | int:
    """``value`` as a ZeRO choice: ``"auto"`` or a stage (``"2"`` as 2)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or value not in ZERO_CHOICES:
        raise ValueError(f"zero must be one of {list(ZERO_CHOICES)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_choice(value: object) -> str:
    """``value`` as a recomputation choice: ``"auto"`` or a mode of :data:`~primepar_fx.record.levers.MODES`."""
    if value not in CHOICES:
        raise ValueError(f"recompute must be one of {list(CHOICES)}, got {value!r}")
    return value  # type: ignore[return-value]


def micro_batch_tries(micro_batches: str | int, memory_budget: float | None, batch: int) -> list[int]:
    """The micro-batch counts the search tries: the one asked for, or for ``"auto"`` 1 and, under a budget, the
    counts of :data:`MICRO_BATCH_TRIES` that divide ``batch``. The planner searches them in order and stops at the
    first whose plan fits without recomputation (a slower count does not stop it: the step is not unimodal in the
    count); the last count may be searched ahead of its turn, to bound the first ones
    (:mod:`primepar_fx.planning.counts`)."""
    if micro_batches != "auto":
        return [int(micro_batches)]
    if memory_budget is None:
        return [1]
    return [m for m in MICRO_BATCH_TRIES if batch % m == 0]
