"""The fewest of something that fits: a search over integers for a value that falls as the count grows, such as the
least peak with the first ``k`` layers recomputed (:mod:`primepar_fx.levers.recompute`), where each value costs a
memory-only DP."""

from __future__ import annotations

import math
from collections.abc import Callable


def fewest(value: Callable[[int], float], limit: float, lo: int, hi: int) -> int | None:
    """The least ``k`` in ``[lo, hi]`` with ``value(k) <= limit``, for a ``value`` that does not grow with ``k``, or
    ``None`` when not even ``value(hi)`` fits. ``value`` is called at most once per ``k``, ``hi`` first.

    Bisection, with probes placed where a line through two values meets ``limit`` (the values this is used for fall
    by about the same step per ``k``): the line's crossing ``g`` and then ``g - 1`` (``g`` fits) or ``g + 1`` (it does
    not) usually decide it in two probes. Whenever such a round leaves more than half of the range, a plain
    halving comes next, so there are never many more probes than bisection's. For a value that does not grow, every
    probe keeps the least ``k`` that fits in the range, so the answer is bisection's."""
    if lo > hi:
        raise ValueError(f"an empty range [{lo}, {hi}]")
    seen: dict[int, float] = {}

    def fits(k: int) -> bool:
        if k not in seen:
            seen[k] = value(k)
        return seen[k] <= limit

    if not fits(hi):
        return None
    interpolate = False  # one value known: the first probe halves
    while lo < hi:
        width = hi - lo
        if not interpolate:
            k = (lo + hi) // 2
            lo, hi = (lo, k) if fits(k) else (k + 1, hi)
        else:
            k = _crossing(seen, limit, lo, hi)
            if fits(k):  # the answer is k unless k - 1 fits too
                hi = k
                if lo < k:
                    lo, hi = (lo, k - 1) if fits(k - 1) else (k, k)
            else:  # the answer is above k: k + 1 unless it does not fit either
                lo = k + 1
                if lo < hi:
                    lo, hi = (lo, lo) if fits(lo) else (lo + 1, hi)
        interpolate = not interpolate or 2 * (hi - lo) <= width
    return hi


def _crossing(seen: dict[int, float], limit: float, lo: int, hi: int) -> int:
    """A probe in ``[lo, hi - 1]`` where a line meets ``limit``: the line through the largest ``k`` seen that does not
    fit and ``hi`` (the least that does), else through ``hi`` and the next that fits above it; the middle where
    neither exists or the line is flat (or so nearly flat that its crossing is past any float: a fall of 5e-324)."""
    below = [k for k, v in seen.items() if k < hi and v > limit]
    above = [k for k in seen if k > hi]
    if below:
        a, b = max(below), hi
    elif above:
        a, b = hi, min(above)
    else:
        return (lo + hi) // 2
    if not seen[a] > seen[b]:
        return (lo + hi) // 2
    crossing = a + (seen[a] - limit) * (b - a) / (seen[a] - seen[b])
    if not math.isfinite(crossing):
        return (lo + hi) // 2
    return min(max(math.ceil(crossing), lo), hi - 1)  # the first k on or past the crossing
