"""Pipeline schedules priced by replaying them: a step's seconds and the activations each rank holds.

A pipeline of ``p`` ranks runs ``p * v`` stages (``v`` virtual stages a rank: stage ``s`` on rank ``s % p``, the
looped placement of Megatron-LM and ``torch.distributed.pipelining``) over ``m`` micro-batches. A schedule is, for
every rank, the order of its actions (:class:`Action`): the Forward of a micro-batch on a stage, its Backward.
:func:`orders` builds them as ``torch.distributed.pipelining`` runs them (its class names: ``GPipe``, ``1F1B``,
``Interleaved1F1B``); :func:`replay` then runs them on a clock: each rank takes its actions in order, an action
starts when its rank is free and what it reads has arrived (a Forward the previous stage's output of that
micro-batch, after the transfer; a Backward the next stage's input gradient, after the transfer, or on the last
stage its own Forward), and lasts its stage's seconds. That gives the step's seconds (the last action's end, the
bubble, warm-up and cool-down included, for stages of any length and transfers of any time), each rank's busy
seconds, and the most activation bytes each rank holds at once (a micro-batch's activations on a stage live from the
start of its Forward to the end of its Backward). For equal stages and free transfers the replay gives the closed
forms (``tests/cost/test_pipeline.py``): ``(m + p - 1) (f + b)`` for GPipe and 1F1B, ``(m + (p - 1) / v) (f + b)``
interleaved; 1F1B's stage ``s`` holds ``min(p - s, m)`` micro-batches, GPipe's all ``m``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: the schedules priced, by ``torch.distributed.pipelining``'s names (``get_schedule_class``)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
#: the schedules that run several (virtual) stages a rank
INTERLEAVED = ("Interleaved1F1B",)


@dataclass(frozen=True, slots=True)
class Action:
    """One rank's work on micro-batch ``mb`` of stage ``stage``: ``kind`` ``"F"`` (Forward) or ``"B"`` (Backward:
    the input's and the weights' gradients)."""

    kind: str
    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds of one micro-batch on each stage (``forward[s]``, ``backward[s]``), of moving its activation from
    stage ``s`` to ``s + 1`` and its gradient back (``send[s]``, ``len = stages - 1``), and the bytes of its
    activations a stage holds from its Forward to its Backward (``held[s]``; counts of micro-batches if all 1)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    send: tuple[float, ...]
    held: tuple[float, ...]

    @classmethod
    def uniform(cls, stages: int, forward: float, backward: float, send: float = 0.0, held: float = 1.0) -> StageTimes:
        return cls((forward,) * stages, (backward,) * stages, (send,) * (stages - 1), (held,) * stages)

    def __post_init__(self) -> None:
        n = len(self.forward)
        if len(self.backward) != n or len(self.held) != n or len(self.send) != max(0, n - 1):
            raise ValueError(
                f"stage times for {n} stages need {n} backward and held values and {n - 1} sends, got "
                f"{len(self.backward)}, {len(self.held)} and {len(self.send)}"
            )


@dataclass(frozen=True, slots=True)
class Timeline:
    """What :func:`replay` found: the step's ``seconds``, each rank's ``busy`` seconds and ``peak`` held bytes."""

    seconds: float
    busy: tuple[float, ...]
    peak: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """The share of the ranks' time spent waiting (1 - mean busy / step)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.seconds) if self.seconds else 0.0


def check_schedule_name(schedule: object) -> None:
    """One clear error for a schedule name that is not one of :data:`SCHEDULES`: one ``torch.distributed.pipelining``
    does not have, or one it has that is not priced yet."""
    if schedule in SCHEDULES:
        return
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        get_schedule_class(schedule)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}: torch.distributed.pipelining has no such schedule; the schedules "
            f"priced are {', '.join(SCHEDULES)}"
        ) from None
    raise ValueError(
        f"pipeline schedule {schedule!r} is torch.distributed.pipelining's but is not priced yet; the schedules priced "
        f"are {', '.join(SCHEDULES)}"
    )


def check_schedule(schedule: str, ranks: int, micro_batches: int, virtual: int = 1) -> None:
    """One clear error for a pipeline ``torch.distributed.pipelining`` cannot run (module docstring)."""
    check_schedule_name(schedule)
    if ranks < 1 or micro_batches < 1 or virtual < 1:
        raise ValueError(f"a pipeline needs ranks, micro-batches and virtual stages >= 1, got {ranks}, "
                         f"{micro_batches} and {virtual}")  # fmt: skip
    if virtual > 1 and schedule not in INTERLEAVED:
        raise ValueError(f"{schedule} runs one stage a rank, got {virtual} virtual stages (use Interleaved1F1B)")
    if schedule == "1F1B" and micro_batches < ranks:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: {micro_batches} < {ranks}")
    rounds = max(1, micro_batches // ranks)
    if schedule in INTERLEAVED and micro_batches % rounds:
        raise ValueError(
            f"{schedule} runs the micro-batches in rounds of {micro_batches // rounds} ({rounds} rounds for "
            f"{micro_batches} micro-batches on {ranks} ranks): {micro_batches} is not a multiple of {rounds}"
        )


def orders(schedule: str, ranks: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order ``schedule`` runs them (module docstring)."""
    check_schedule(schedule, ranks, micro_batches, virtual)
    if schedule == "GPipe":
        return [_gpipe(r, micro_batches) for r in range(ranks)]
    if schedule == "1F1B":
        return [_one_f_one_b(r, ranks, micro_batches) for r in range(ranks)]
    return [_interleaved(r, ranks, micro_batches, virtual) for r in range(ranks)]


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    """Stage ``rank`` runs ``p - rank`` Forwards, then a Backward and a Forward in turn, then the Backwards left."""
    warmup = min(m, p - rank)
    out = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m):
        out.append(Action("B", rank, i))
        if warmup + i < m:
            out.append(Action("F", rank, warmup + i))
    return out


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Depth first, in rounds of ``m // rounds`` micro-batches: the warm-up Forwards run the rank's stages in turn a
    round at a time; then each Forward is followed by a Backward, the Backwards taking the stages in reverse; the
    cool-down runs the Backwards left (``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B``)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    total = v * m
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    done_f: dict[int, int] = {}
    done_b: dict[int, int] = {}

    def next_of(kind: str, stage: int) -> Action:
        done = done_f if kind == "F" else done_b
        done[stage] = done.get(stage, 0) + 1
        return Action(kind, stage, done[stage] - 1)

    out = []
    for op in range(total):
        forward_stage = ((op // per_round) % v) * p + rank
        backward_stage = (v - 1 - ((op - warmup) // per_round) % v) * p + rank
        if op < warmup:
            out.append(next_of("F", forward_stage))
        else:
            out.append(next_of("F", forward_stage))
            out.append(next_of("B", backward_stage))
    for op in range(total, total + warmup):
        out.append(next_of("B", (v - 1 - ((op - warmup) // per_round) % v) * p + rank))
    return out


def replay(order: Sequence[Sequence[Action]], times: StageTimes) -> Timeline:
    """Run each rank's actions on a clock (module docstring); raises if the order can never finish."""
    ranks, stages = len(order), len(times.forward)
    m = 1 + max(a.mb for o in order for a in o)
    # end times by action: Forwards at [stage * m + mb], Backwards after them (NaN: not run yet)
    done = [math.nan] * (2 * stages * m)
    free, busy = [0.0] * ranks, [0.0] * ranks
    nxt = [0] * ranks
    events: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]  # (time, +/- bytes) a rank holds
    left = sum(len(o) for o in order)
    while left:
        progressed = False
        for r in range(ranks):
            mine = order[r]
            while nxt[r] < len(mine):
                a = mine[nxt[r]]
                ready = _ready(a, done, times, stages, m)
                if ready != ready:  # NaN: what it reads is not computed yet
                    break
                start = max(free[r], ready)
                backward = a.kind == "B"
                seconds = (times.backward if backward else times.forward)[a.stage]
                done[(stages * m if backward else 0) + a.stage * m + a.mb] = free[r] = start + seconds
                busy[r] += seconds
                events[r].append((free[r], -times.held[a.stage]) if backward else (start, times.held[a.stage]))
                nxt[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][nxt[r]] for r in range(ranks) if nxt[r] < len(order[r])}
            raise ValueError(f"the pipeline order deadlocks: each rank waits for an action no rank can run: {stuck}")
    return Timeline(max(free), tuple(busy), tuple(_peak(e) for e in events))


def _ready(a: Action, done: list[float], times: StageTimes, stages: int, m: int) -> float:
    """When what ``a`` reads has arrived (NaN if it has not been computed yet)."""
    if a.kind == "F":
        if a.stage == 0:
            return 0.0
        return done[(a.stage - 1) * m + a.mb] + times.send[a.stage - 1]  # (NaN stays NaN)
    own = done[a.stage * m + a.mb]
    if a.stage == stages - 1:
        return own
    after = done[stages * m + (a.stage + 1) * m + a.mb] + times.send[a.stage]
    return math.nan if own != own or after != after else max(own, after)


def _peak(events: list[tuple[float, float]]) -> float:
    """The most bytes held at once; at equal times a release comes before a new hold."""
    held = peak = 0.0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        held += change
        peak = max(peak, held)
    return peak


def step_time(schedule: str, times: StageTimes, micro_batches: int, virtual: int = 1) -> Timeline:
    """The :class:`Timeline` of ``schedule`` over ``micro_batches`` with ``times`` of ``len(times.forward)`` stages,
    ``virtual`` a rank."""
    stages = len(times.forward)
    if stages % virtual:
        raise ValueError(f"{stages} stages do not split into {virtual} virtual stages a rank")
    return replay(orders(schedule, stages // virtual, micro_batches, virtual), times)
