"""``balance_stages``: the least largest stage of every contiguous cut, checked against all cuts."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from primepar_fx.search.stages import balance_stages, stage_sums


def _every_cut(costs: list[float], stages: int) -> float:
    n = len(costs)
    return min(max(stage_sums(costs, [0, *inner])) for inner in combinations(range(1, n), stages - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.integers(1, 9))
def test_the_largest_stage_is_the_least_any_cut_gives(costs, stages):
    costs = [float(c) for c in costs]
    if stages > len(costs):
        with pytest.raises(ValueError, match="more stages"):
            balance_stages(costs, stages)
        return
    starts = balance_stages(costs, stages)
    assert starts[0] == 0 and len(starts) == stages and all(a < b for a, b in zip(starts, starts[1:]))
    assert max(stage_sums(costs, starts)) == _every_cut(costs, stages)


def test_a_heavy_head_gets_a_stage_to_itself_and_equal_layers_split_evenly():
    assert balance_stages([1.0, 4.0, 4.0, 4.0, 4.0, 1.0], 2) == [0, 3]
    assert balance_stages([1.0, 4.0, 4.0, 4.0, 4.0, 20.0], 2) == [0, 5]  # the head alone: 20 against 17
    assert balance_stages([2.0] * 8, 4) == [0, 2, 4, 6]


def test_bad_stage_counts_are_refused():
    with pytest.raises(ValueError, match="at least one stage"):
        balance_stages([1.0], 0)
    with pytest.raises(ValueError, match=r"more stages \(3\) than pieces to put in them \(2"):
        balance_stages([1.0, 2.0], 3)
