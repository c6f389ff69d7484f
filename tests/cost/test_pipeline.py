"""Pipeline schedules (``cost/pipeline.py``): the orders are torch's, and the replay gives the closed forms.

The interleaved order is compared action for action with the one ``torch.distributed.pipelining`` computes (its
``ScheduleInterleaved1F1B``, given the four sizes it reads, without stages or a process group); for equal stages and
free transfers the replayed step is ``(m + (p - 1) / v) (f + b)`` (with at least ``p`` micro-batches) and the
activations held are 1F1B's ``p - s``, GPipe's ``m`` and the interleaved warm-up's Forwards plus one.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from primepar_fx.cost.pipeline import Action, StageTimes, orders, replay, step_time

CASES = [(2, 2, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3), (4, 10, 2), (4, 12, 3), (4, 3, 2)]


def _torch_interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    sched = object.__new__(ScheduleInterleaved1F1B)  # the order needs only these sizes (its __init__ needs stages)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.microbatches_per_round = m // max(1, m // p)
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [
        [Action(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in rank if a is not None]
        for rank in (sched._calculate_single_rank_operations(r) for r in range(p))
    ]


@pytest.mark.parametrize("p,m,v", CASES)
def test_the_interleaved_order_is_torchs(p, m, v):
    assert orders("Interleaved1F1B", p, m, v) == _torch_interleaved(p, m, v)


@pytest.mark.parametrize("p,m,v", CASES)
def test_equal_stages_take_the_closed_form_and_hold_the_warm_up(p, m, v):
    f, b = 0.5, 1.25
    t = step_time("Interleaved1F1B", StageTimes.uniform(p * v, f / v, b / v), m, v)
    if m >= p:
        assert t.seconds == pytest.approx((m + (p - 1) / v) * (f + b))
    else:  # a round of fewer micro-batches than ranks: each stage waits for its round to come back
        assert t.seconds > (m + (p - 1) / v) * (f + b) + 1e-9
    per_round = m // max(1, m // p)
    assert t.peak == tuple(min((v - 1) * per_round + 2 * (p - 1 - r) + 1, m * v) for r in range(p))
    assert t.busy == pytest.approx((m * (f + b),) * p)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 4), (4, 9), (3, 7)])
def test_gpipe_and_1f1b_take_the_same_time_and_1f1b_holds_less(p, m):
    f, b = 1.0, 2.0
    gpipe = step_time("GPipe", StageTimes.uniform(p, f, b), m)
    one = step_time("1F1B", StageTimes.uniform(p, f, b), m)
    assert gpipe.seconds == one.seconds == pytest.approx((m + p - 1) * (f + b))
    assert gpipe.peak == (m,) * p
    assert one.peak == tuple(min(p - s, m) for s in range(p))
    assert one.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_transfers_and_a_slow_stage_delay_the_step_as_they_should():
    """Two stages, two micro-batches, GPipe: the slow second stage sets the pace, each transfer adds its time."""
    times = StageTimes((1.0, 3.0), (2.0, 6.0), (0.5,), (1.0, 1.0))
    t = step_time("GPipe", times, 2)
    # F0(0) 0-1, F0(1) 1-2; F1(0) 1.5-4.5, F1(1) 4.5-7.5; B1(0) 7.5-13.5, B1(1) 13.5-19.5;
    # B0(0) 14-16, B0(1) 20-22
    assert t.seconds == pytest.approx(22.0)
    assert t.busy == pytest.approx((6.0, 18.0))


def test_an_order_that_cannot_finish_and_bad_schedules_are_refused():
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        replay(bad, StageTimes.uniform(2, 1.0, 1.0))
    with pytest.raises(ValueError, match="unknown pipeline schedule 'ZB1P'"):
        orders("ZB1P", 2, 4)
    with pytest.raises(ValueError, match="1F1B needs at least as many micro-batches as stages: 2 < 4"):
        orders("1F1B", 4, 2)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        orders("Interleaved1F1B", 4, 9, 2)
    with pytest.raises(ValueError, match="GPipe runs one stage a rank"):
        orders("GPipe", 2, 4, 2)
    with pytest.raises(ValueError, match="need 2 backward"):
        StageTimes((1.0, 1.0), (1.0,), (0.0,), (1.0, 1.0))
