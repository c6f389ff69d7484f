"""``utils.fewest``: the least count whose value fits, as bisection finds it, in fewer probes where the values fall
evenly."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from primepar_fx.utils.fewest import fewest


def brute(values: list[float], limit: float, lo: int, hi: int) -> int | None:
    return next((k for k in range(lo, hi + 1) if values[k] <= limit), None)


def probed(values: list[float], limit: float, lo: int, hi: int) -> tuple[int | None, list[int]]:
    calls: list[int] = []

    def value(k: int) -> float:
        calls.append(k)
        return values[k]

    return fewest(value, limit, lo, hi), calls


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.floats(0, 100), min_size=1, max_size=90),
    start=st.floats(0, 10_000),
    limit=st.floats(0, 10_000),
    data=st.data(),
)
def test_it_is_the_least_count_that_fits_whatever_the_steps(steps, start, limit, data):
    values = [start - sum(steps[:k]) for k in range(len(steps) + 1)]  # does not grow
    hi = len(values) - 1
    lo = data.draw(st.integers(0, hi))
    got, calls = probed(values, limit, lo, hi)
    assert got == brute(values, limit, lo, hi)
    assert calls[0] == hi and len(calls) == len(set(calls))  # hi first, each count once
    assert len(calls) <= 2 * math.ceil(math.log2(hi - lo + 1)) + 2


@pytest.mark.parametrize("count", [32, 80, 126])
@pytest.mark.parametrize("share", [0.1, 0.37, 0.5, 0.93])
def test_even_steps_take_at_most_four_probes(count, share):
    """Layers that each save about as much (the least peak with k layers recomputed): the first halving, then the
    line's crossing and the count below it decide it."""
    values = [1000.0 - 7.0 * k + (0.3 if k % 2 else 0.0) for k in range(count + 1)]
    limit = values[0] - share * (values[0] - values[count])
    got, calls = probed(values, limit, 1, count)
    assert got == brute(values, limit, 1, count)
    assert len(calls) <= 4 < math.ceil(math.log2(count)) + 1  # bisection: hi and log2(count) more


def test_a_fall_too_small_for_a_line_halves_instead():
    """Two values 5e-324 apart (hypothesis found it): the line's crossing is past any float, so the probe is the
    middle, not an overflow."""
    assert probed([0.0, -5e-324, -5e-324], 1.0, 0, 2)[0] == 0
    assert probed([2.0, 0.0, -5e-324], 1.0, 0, 2)[0] == 1


def test_nothing_fits_and_an_empty_range():
    assert probed([5.0, 4.0, 3.0], 2.0, 0, 2) == (None, [2])
    with pytest.raises(ValueError, match="empty range"):
        fewest(float, 0.0, 3, 2)
