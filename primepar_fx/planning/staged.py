"""Pipeline stages as a lever of our search (:func:`search_stages`): the plan without stages against plans run as
pipelines of ``p`` stages, each stage a PrimePar plan of its own devices.

For each stage count ``p`` (:func:`stage_choices`) the stages run on ``world / p`` devices each (stage ``s``: ranks
``s * q`` to ``(s + 1) * q - 1``, so the cuts cross nodes where a stage fills whole nodes), and for each micro-batch
count ``m`` of :func:`pipeline_counts` the existing search (:func:`~primepar_fx.planning.meshes.search_count`: the
groupings, recomputation, ZeRO, the budgeted peak search) finds one plan of the whole graph on a stage's mesh at a
micro-batch of ``batch / m``, which every stage runs on its own layers (identical layers are priced and searched once,
as in the plan without stages). That search prices memory as a stage holds it
(:attr:`~primepar_fx.cost.blocks.CostOptions.stages`: ``1 / p`` of the parameter state, a whole micro-batch's stash,
which is what the first stage holds under 1F1B), and is cut off where it cannot win: a pipeline's step is at least
``m / p`` micro-batches' time (no bubble, stages in perfect balance), so a plan whose time per micro-batch is at
least ``p / m`` of the best step found is not searched further.

Each plan found is then priced as a pipeline (:func:`~primepar_fx.pricing.pipelined.price_pipeline`: layers cut into
stages balanced by their priced time, the tensors crossing each cut sent point to point on the link between the
stages, the schedule replayed for the step and each stage's peak) under each schedule of :func:`schedule_choices`,
and the fastest that fits the budget is kept where it beats the plan without stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from primepar_fx.cost.pipeline import INTERLEAVED
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning.meshes import search_count
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.pipelines import MEGATRON_SCHEDULES, schedules, stage_counts
from primepar_fx.planning.state import Bound, Found, Planning
from primepar_fx.pricing.pipelined import (
    PipelinePricing,
    plan_pieces,
    price_pipeline,
    shared_parameter_bytes,
    stage_pieces,
)
from primepar_fx.pricing.summary import Summary, per_step, summarize
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.record.plan import Predicted

#: virtual stages a rank where the schedule named interleaves and no count is given
DEFAULT_VIRTUAL = 2


@dataclass
class Staged:
    """The fastest pipelined plan found: one stage's plan (``found``: its mesh, choice, training state and
    recomputation), run as ``pipeline``; ``summary``: the plan over a whole step (each node's costs on its stage's
    devices, ``m`` micro-batches; the pipeline's step, peak and bytes)."""

    found: Found
    pipeline: PipelinePricing
    summary: Summary

    def record(self) -> Pipeline:
        """What the plan records of its pipeline."""
        pp = self.pipeline
        return Pipeline(
            stages=pp.stages,
            schedule=pp.schedule,
            virtual_stages=pp.virtual,
            micro_batches=pp.micro_batches,
            layers_per_stage=pp.layers,
            bubble=round(pp.bubble, 6),
            stage_peak_bytes=pp.peak_bytes,
            p2p_bytes=pp.p2p_bytes,
        )


def stage_choices(graph: OpGraph, opts: PlanOptions) -> list[int]:
    """The stage counts searched: ``opts.stages`` where it is a count above 1 (checked against the graph's layers),
    none where it is 1; auto (``None``): every count of :func:`~primepar_fx.planning.pipelines.stage_counts` where
    the world spans more than one node, the graph has a layer stack and no ``digits`` name the mesh."""
    p, world = opts.stages, opts.world_size
    assert world is not None
    pieces = stage_pieces(graph)
    dpn = opts.cluster.devices_per_node
    none = (
        "stages=1 asks for none" if p == 1
        else None if p is not None
        else f"{graph.name} has no stack of layers" if pieces is None
        else "digits name the mesh" if opts.digits is not None
        else f"the {world} devices fit one node of {dpn}" if world <= dpn
        else None
    )  # fmt: skip
    if none is not None:
        if opts.schedule is not None:
            raise ValueError(
                f"schedule {opts.schedule!r} names how pipeline stages run, but no stages are searched ({none}): "
                "ask for a stage count (stages=P, --stages P) or leave the schedule out"
            )
        return []
    if p is None:
        return stage_counts(world, len(pieces), dpn)  # type: ignore[arg-type]
    if pieces is None:
        raise ValueError(f"{graph.name} has no stack of layers to cut into {p} pipeline stages")
    if p > len(pieces):
        raise ValueError(f"{p} pipeline stages need a layer each; {graph.name} has {len(pieces)} layers")
    return [p]


def pipeline_counts(batch: int, stages: int, requested: str | int) -> list[int]:
    """The micro-batch counts a pipeline of ``stages`` is searched at: ``requested`` where it is a count, else
    ``stages`` and its doublings that divide ``batch``, and ``batch`` itself (one sample a micro-batch); raises
    where none divides the batch."""
    if isinstance(requested, int):
        return [requested]
    counts = []
    m = stages
    while m <= batch:
        if batch % m == 0:
            counts.append(m)
        m *= 2
    if batch >= stages and batch not in counts:
        counts.append(batch)
    if not counts:
        raise ValueError(
            f"the batch of {batch} does not split into at least {stages} micro-batches for {stages} stages"
        )
    return counts


def schedule_choices(opts: PlanOptions) -> tuple[tuple[str, int], ...]:
    """``(schedule, virtual stages a rank)`` searched: ``opts.schedule`` (interleaved: :data:`DEFAULT_VIRTUAL`), or
    Megatron-LM's two (:data:`~primepar_fx.planning.pipelines.MEGATRON_SCHEDULES`)."""
    if opts.schedule is None:
        return MEGATRON_SCHEDULES
    return ((opts.schedule, DEFAULT_VIRTUAL if opts.schedule in INTERLEAVED else 1),)


def search_stages(graph: OpGraph, opts: PlanOptions, to_beat: float) -> StageWalk:
    """The search for the fastest pipelined plan (module docstring) whose step is under ``to_beat`` seconds
    (``inf``: any) and whose every stage fits the budget: its :attr:`StageWalk.best` (``None`` where none is), the
    least peak a device of any plan priced needed (for the error where none fit), the stage counts walked.

    The step is taken as unimodal in the stage count and in the micro-batch count (more stages: less per stage, a
    longer bubble; more micro-batches: a shorter bubble, smaller and slower micro-batches): the stage counts are
    walked from the one whose stage fills one node outwards, each way until a count finds nothing faster, and each
    count's micro-batch counts upwards until :data:`PATIENCE` in a row find nothing faster."""
    walk = StageWalk(graph, opts, to_beat)
    counts = stage_choices(graph, opts)
    if counts:
        dpn = opts.cluster.devices_per_node
        first = min(range(len(counts)), key=lambda i: abs(math.log2(opts.world_size // counts[i] / dpn)))  # type: ignore[operator]
        for way in (range(first, len(counts)), range(first - 1, -1, -1)):
            for i in way:
                if not walk.stages(counts[i]):
                    break
    walk.bar.close()
    walk.seconds = time.perf_counter() - walk.started
    return walk


#: micro-batch counts in a row that find nothing faster before a stage count's walk stops
PATIENCE = 2


class StageWalk:
    """:func:`search_stages`' walk: the best pipeline found, the least peak seen, the stage counts walked (in
    order) and the seconds it took."""

    def __init__(self, graph: OpGraph, opts: PlanOptions, to_beat: float) -> None:
        self.graph, self.opts, self.to_beat = graph, opts, to_beat
        self.best: Staged | None = None
        self.least = math.inf
        self.tried: list[int] = []
        self.started, self.seconds = time.perf_counter(), 0.0
        self.bar = tqdm(desc="pipeline stages", disable=not opts.progress, leave=False, unit="search")

    @property
    def ceiling(self) -> float:
        return self.to_beat if self.best is None else min(self.to_beat, self.best.pipeline.step_s)

    def stages(self, p: int) -> bool:
        """Walk ``p`` stages' micro-batch counts; whether it found the best pipeline so far."""
        opts = self.opts
        self.tried.append(p)
        sub = opts.replace(world_size=opts.world_size // p, stages=1, micro_batches="auto", baselines=False)  # type: ignore[operator]
        state = Planning.start(self.graph, sub, stages=p)
        improved, local, stale = False, math.inf, 0
        for m in pipeline_counts(opts.batch, p, opts.micro_batches):  # type: ignore[arg-type]
            got = _at_count(self.graph, opts, state, m, self.ceiling, self)
            self.bar.update()
            if got is not None and got.pipeline.step_s < self.ceiling:
                self.best, improved = got, True
            step = math.inf if got is None else got.pipeline.step_s
            if step < local:
                local, stale = step, 0
            elif self.best is not None or local < math.inf:  # nothing faster (once something fits)
                stale += 1
                if stale >= PATIENCE:
                    break
        return improved


def _at_count(
    graph: OpGraph, opts: PlanOptions, state: Planning, m: int, ceiling: float, walk: StageWalk
) -> Staged | None:
    """The fastest pipeline of ``state.stages`` stages over ``m`` micro-batches that fits, from the plan the search
    at ``m`` finds on a stage's mesh, cut off at ``ceiling`` seconds a step; ``walk.least`` lowered to the least
    peak seen where nothing fits.

    The search's memory is the first stage's under 1F1B; a schedule that holds more (interleaving) or stages cut
    unevenly may lift a rank over the budget. A schedule faster than the best that fits but over the budget is
    searched once more under the budget lowered by its overshoot (the pricings are kept, so only the search runs
    again)."""
    found = _search(state, m, ceiling, walk)
    if found is None:
        return None
    best, over = _schedules(graph, opts, state.stages, m, found, walk)
    budget = opts.memory_budget
    for pp in over:
        if budget is None or pp.step_s >= min(ceiling, best[1].step_s if best else math.inf):
            continue  # (even over the budget it could not win)
        lowered = budget - (pp.peak - budget)
        again = _search(_with_budget(state, lowered), m, ceiling, walk) if lowered > 0 else None
        if again is None:
            continue
        got, _ = _schedules(graph, opts, state.stages, m, again, walk, only=(pp.schedule, pp.virtual))
        if got is not None and (best is None or got[1].step_s < best[1].step_s):
            best = got
    return None if best is None else _staged(graph, opts, m, *best)


def _search(state: Planning, m: int, ceiling: float, walk: StageWalk) -> Found | None:
    """The plan the search at ``m`` finds on a stage's mesh, cut off at ``ceiling`` seconds a step."""
    outcome = search_count(state, m, Bound(m, functools.partial(float, ceiling * state.stages), known=True))
    if outcome.found is None:
        walk.least = min(walk.least, outcome.min_memory)
    return outcome.found


def _with_budget(state: Planning, budget: float) -> Planning:
    """``state`` searching under ``budget``, its pricings shared."""
    return dataclasses.replace(
        state, opts=state.opts.replace(memory_budget=budget), best=None, ahead={}, probes={}, searched=[], min_memory=[]
    )


def _schedules(
    graph: OpGraph,
    opts: PlanOptions,
    p: int,
    m: int,
    found: Found,
    walk: StageWalk,
    only: tuple[str, int] | None = None,
) -> tuple[tuple[Found, PipelinePricing] | None, list[PipelinePricing]]:
    """``found`` priced as a pipeline under each schedule (``only``: that one): the fastest that fits, and the
    schedules faster than it that do not."""
    costs = dataclasses.replace(found.costs, stages=1)  # each node's state counted whole, on its own stage
    found = dataclasses.replace(found, costs=costs)
    vkey = values_key({B: opts.batch // m, S: opts.seq})  # type: ignore[operator]
    pieces = plan_pieces(graph, found.priced, found.chosen.solution.choice, costs, vkey)
    priced = []
    for name, virtual in [only] if only else schedules(p, len(pieces), m, schedule_choices(opts)):
        pp = price_pipeline(pieces, opts.cluster, m, stages=p, schedule=name, virtual=virtual,
                            extra_peak=found.chosen.extra_peak)  # fmt: skip
        walk.least = min(walk.least, pp.peak)
        priced.append(pp)
    fits = [opts.memory_budget is None or pp.peak <= opts.memory_budget for pp in priced]
    kept = min((pp for pp, ok in zip(priced, fits) if ok), key=lambda pp: pp.step_s, default=None)
    over = [pp for pp, ok in zip(priced, fits) if not ok and (kept is None or pp.step_s < kept.step_s)]
    return (None if kept is None else (found, kept)), over


def _staged(graph: OpGraph, opts: PlanOptions, m: int, found: Found, pp: PipelinePricing) -> Staged:
    """``found`` run as ``pp``, with its summary over a step."""
    choice = found.chosen.solution.choice
    flat = per_step(summarize(graph, found.priced, choice, found.costs, extra_peak=found.chosen.extra_peak), m)
    vkey = values_key({B: opts.batch // m, S: opts.seq})  # type: ignore[operator]
    shared = shared_parameter_bytes(graph, found.priced, choice, pp, vkey, found.costs)
    # each node runs on one stage's devices; a parameter stages share is summed in each and between them
    comm = round(flat.predicted.comm_bytes / pp.stages) + pp.p2p_bytes + shared
    return Staged(found, pp, Summary(Predicted(pp.step_s, pp.peak, comm), flat.nodes))
