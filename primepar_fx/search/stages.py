"""Pipeline stages: a run of priced pieces (the embedding, each layer, the head with the loss) cut into contiguous
stages whose slowest is as fast as it can be.

A pipeline's steady state moves at its slowest stage, so :func:`balance_stages` minimises the largest stage sum (the
linear partition problem, a dynamic program over cut points: ``O(n^2 p)`` for ``n`` pieces, which is nothing next to
pricing them). Among equal optima it keeps the earliest cuts, so the result is one answer for one input. Contiguity
keeps the embedding in the first stage and the head in the last. The stage times themselves, and the schedule's
bubble, are priced by :mod:`primepar_fx.cost.pipeline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def balance_stages(costs: Sequence[float], stages: int) -> list[int]:
    """The first piece of each of ``stages`` contiguous stages of ``costs`` (``[0, ...]``) whose largest sum is least;
    every stage gets at least one piece."""
    n = len(costs)
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if stages > n:
        raise ValueError(f"more stages ({stages}) than pieces to put in them ({n}: the layers, embedding and head)")
    if any(c < 0 for c in costs):
        raise ValueError(f"stage costs must not be negative, got {min(costs)}")
    prefix = [0.0, *accumulate(costs)]
    # best[k][j]: the least largest sum of the first j pieces in k stages; cut[k][j]: where its last stage starts
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def stage_sums(costs: Sequence[float], starts: Sequence[int]) -> list[float]:
    """Each stage's sum of ``costs`` for the stages starting at ``starts``."""
    ends = [*starts[1:], len(costs)]
    return [sum(costs[a:b]) for a, b in zip(starts, ends)]
