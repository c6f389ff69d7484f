"""The planner's policy: from a captured graph and its options to a :class:`~primepar_fx.record.plan.Plan`.

:func:`plan_graph` runs these steps, each on the one state object of
:class:`~primepar_fx.planning.state.Planning` (the options, the meshes, the pricings kept, the best plan found):

1. **resolve the options** (:func:`resolve_options`: the example's sizes and the model's dtype where unset) and
   refuse a budget under the training state's floor before any search
   (:func:`~primepar_fx.levers.floor.check_state_floor`);
2. **price the fixed baselines beside the search**: Megatron-LM's, data parallelism's and FSDP's plans, in a forked
   process at a lower priority (:func:`~primepar_fx.planning.compare.fixed_baselines`);
3. **search the micro-batch counts** (:func:`~primepar_fx.planning.counts.search_counts`); at each count, **price
   the groupings** of the device digits (:mod:`~primepar_fx.planning.groupings`), **bound them** by their fastest
   plans and **search the levers** (recomputation, ZeRO, the budgeted peak search: :mod:`primepar_fx.levers`) on
   each grouping that can still win (:func:`~primepar_fx.planning.meshes.search_count`);
4. **check the plan against the split-only search** where that could beat it
   (:func:`~primepar_fx.planning.compare.split_only_search`);
4b. **search pipeline stages** (:func:`~primepar_fx.planning.staged.search_stages`): step 3's search on each stage
   count's stage mesh, each plan priced as a pipeline, kept where it beats the plan without stages (or where
   ``stages`` asks for them; where nothing fits without stages, they are searched before the budget error);
5. **price the baselines** against the plan (:func:`~primepar_fx.planning.compare.plan_baselines`);
6. **record the plan** (:func:`make_plan`, with its :class:`~primepar_fx.record.search.SearchRecord`).

A new lever plugs in as a dimension of step 3: a loop over its settings beside the micro-batch counts, or a choice
inside a mesh's lever search (:func:`~primepar_fx.levers.choose.choose_levers`), priced by the cost model and
recorded in the plan's training state. ``docs/architecture.md`` walks through it.

Whole-plan figures (:func:`~primepar_fx.pricing.summary.summarize`): the step time is the sum of node times (Eq. 7)
and edge times (Eq. 8-9); the peak memory per device is every node's parameter state and stashed activations (all
live at the end of Forward) plus the largest ring double buffer (only one ring runs at a time); the communication is
the bytes one device sends per step (collectives and ring shifts, plus the mean per-device redistribution traffic).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.graph import OpGraph
from primepar_fx.levers.floor import check_state_floor
from primepar_fx.levers.recompute import Chosen
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.compare import fixed_baselines, plan_baselines, split_only_search
from primepar_fx.planning.counts import search_counts
from primepar_fx.planning.groupings import GROUPED_DIGITS
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.staged import search_stages, stage_choices
from primepar_fx.planning.state import Found, Planning, forks
from primepar_fx.planning.workers import Forked
from primepar_fx.pricing.summary import Summary, per_step, summarize
from primepar_fx.record.levers import Recompute
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.record.plan import Baseline, Plan
from primepar_fx.record.search import SearchRecord
from primepar_fx.search import InfeasibleBudget
from primepar_fx.utils.gcpause import gc_paused

#: torch dtype -> the dtype key a plan of a model with such parameters is priced at by default
_MODEL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: niceness added to the process that prices the baselines beside the search
BASELINES_NICE = 10


@gc_paused
def plan_graph(graph: OpGraph, options: PlanOptions | None = None, /, **kwargs: Any) -> Plan:
    """Search the cheapest plan for ``graph`` and compare it with the baselines (module docstring: the steps).

    ``options`` (a :class:`PlanOptions`), or its fields as keywords for :meth:`PlanOptions.make`; ``batch`` and
    ``seq`` default to the example's. The search runs on each mesh of
    :func:`~primepar_fx.planning.groupings.search_meshes` and the cheapest plan is kept; the baselines are priced
    on the ungrouped mesh either way, so Megatron keeps all of its data x model splits. A budget no grouping can
    meet raises :class:`~primepar_fx.search.InfeasibleBudget` with the smallest budget any of them needs.
    """
    opts = resolve_options(graph, options, kwargs)
    stage_choices(graph, opts)  # a bad stage count or a schedule no stage uses fails before any search
    if opts.memory_budget is not None:
        check_state_floor(graph, opts.cost_options(), opts.world_size, opts.memory_budget)  # type: ignore[arg-type]
    with _fixed_baselines_beside(graph, opts) as early:
        state = Planning.start(graph, opts)
        flat, infeasible = _flat_plan(state)
        forced = (opts.stages or 1) > 1  # a stage count asked for: the plan runs as that pipeline
        to_beat = math.inf if forced or flat is None else flat.ours.predicted.step_time_s
        walk = search_stages(graph, opts, to_beat)
        staged = walk.best
        if staged is None and (forced or flat is None):
            if infeasible is not None and not forced:
                raise infeasible
            raise InfeasibleBudget(opts.memory_budget, walk.least)  # type: ignore[arg-type]
        searched = time.perf_counter()
        base = _baselines(state, flat, early) if opts.baselines else {}
    if staged is not None:  # a pipeline beats the plan without stages, or was asked for
        found, chosen, ours, kept_split = staged.found, staged.found.chosen, staged.summary, False
    else:
        assert flat is not None
        found, chosen, ours, kept_split = flat.found, flat.chosen, flat.ours, flat.kept_split
    record = _search_record(state, found, chosen, kept_split, searched)
    if walk.tried:
        record = record.replace(stages_tried=tuple(walk.tried), stages_s=round(walk.seconds, 4))
    return make_plan(graph, opts, found.mesh, ours, baselines=base, search=record, recompute=chosen.recompute,
                     costs=found.costs, pipeline=None if staged is None else staged.record())  # fmt: skip


@dataclass
class _Flat:
    """The plan without pipeline stages: the count's plan found, the plan kept (the split-only search's where it
    won), the split-only search's plan and whether it fits, whether it was kept, and the plan over a step."""

    found: Found
    chosen: Chosen
    split: tuple[Chosen, bool] | None
    kept_split: bool
    ours: Summary


def _flat_plan(state: Planning) -> tuple[_Flat | None, InfeasibleBudget | None]:
    """Steps 3 and 4: the plan without stages; where nothing fits and stages may be searched, ``None`` and why."""
    graph = state.graph
    try:
        found = search_counts(state)
    except InfeasibleBudget as e:
        if not stage_choices(graph, state.opts):
            raise
        return None, e
    chosen, split, kept_split = _split_only_checked(state, found)
    ours = per_step(
        summarize(graph, chosen.priced, chosen.solution.choice, found.costs, extra_peak=chosen.extra_peak),
        found.micro_batches,
    )
    return _Flat(found, chosen, split, kept_split, ours), None


def _baselines(state: Planning, flat: _Flat | None, early: Forked | None) -> dict[str, Baseline]:
    """Step 5: the baselines, split-only's from the plan without stages where there is one."""
    graph, opts = state.graph, state.opts
    if flat is None:
        return plan_baselines(graph, None, opts.mesh(), opts, opts.cost_options(), early)
    chosen, found = flat.chosen, flat.found
    proven = (chosen.solution.choice, flat.ours) if chosen.solution.proven_optimal and not flat.kept_split else None
    return plan_baselines(
        graph, chosen.priced, opts.mesh(), opts, found.costs, early, proven, flat.split, chosen.recompute
    )


@contextlib.contextmanager
def _fixed_baselines_beside(graph: OpGraph, opts: PlanOptions) -> Iterator[Forked | None]:
    """With workers, Megatron's, data parallelism's and FSDP's plans priced in a fork while the search runs, at a
    lower priority: on the cores the search's own workers leave idle (the last grouping's, the levers')."""
    early = None
    if opts.baselines and forks(opts):
        early = Forked(functools.partial(fixed_baselines, graph, opts.mesh(), opts), nice=BASELINES_NICE)
    try:
        yield early
    finally:
        if early is not None:
            early.stop()


def _split_only_checked(state: Planning, found: Found) -> tuple[Chosen, tuple[Chosen, bool] | None, bool]:
    """The plan found, or the split-only search's where it is cheaper
    (:func:`~primepar_fx.planning.compare.split_only_search`); the split-only search's plan and whether it fits,
    where it ran; and whether its plan was kept."""
    split, kept_split = split_only_search(state.graph, state.opts, found.chosen, found.costs)
    chosen = split[0] if kept_split else found.chosen  # type: ignore[index]
    return chosen, split, kept_split


def _search_record(state: Planning, found: Found, chosen: Chosen, kept_split: bool, searched: float) -> SearchRecord:
    """How the plan was found (:class:`~primepar_fx.record.search.SearchRecord`); ``searched``: when the search
    ended and the baselines began."""
    opts, sol, planned = state.opts, chosen.solution, round(searched - state.started, 4)
    several = len(state.meshes) > 1  # the proof of optimality is within the grouping; the others are listed
    return SearchRecord(
        method=sol.method,
        proven_optimal=sol.proven_optimal,
        objective=sol.cost * found.micro_batches,
        pricing_s=round(found.priced_s, 4),
        search_s=round(found.searched_s, 4),
        planning_s=planned,  # every micro-batch count and grouping, priced and searched
        micro_batches_tried=tuple(sorted({*state.searched, *state.probes, *state.ahead})),
        baselines_s=round(time.perf_counter() - searched, 4),
        alpha=opts.alpha,
        memory_budget=opts.memory_budget,
        allow_prime=opts.allow_prime,
        canonical=opts.canonical,
        grouped=found.mesh
        != (opts.mesh() if found.mesh.size == opts.world_size else opts.cluster.mesh(found.mesh.size)),
        group_digits=None if opts.group_digits == GROUPED_DIGITS else opts.group_digits,
        split_only_kept=kept_split,
        groupings=found.tried if several else None,
        groupings_s=planned if several else None,
    )


def make_plan(
    graph: OpGraph,
    opts: PlanOptions,
    mesh: DeviceMesh,
    summary: Summary,
    *,
    baselines: dict[str, Baseline],
    search: SearchRecord,
    recompute: Recompute | None = None,
    costs: CostOptions | None = None,
    pipeline: Pipeline | None = None,
) -> Plan:
    """The :class:`Plan` of ``graph`` priced as ``summary`` on ``mesh``, with ``opts``' cluster, sizes and dtype
    and ``costs``' training state (default: ``opts``'); with a ``pipeline``, ``mesh`` is one stage's."""
    return Plan(
        model=graph.name,
        model_fingerprint=Plan.fingerprint((n.name, n.op) for n in graph.nodes.values()),
        world_size=mesh.size * (1 if pipeline is None else pipeline.stages),
        digits=mesh.digits,
        cluster=opts.cluster.name,
        batch=opts.batch,  # type: ignore[arg-type]
        seq=opts.seq,  # type: ignore[arg-type]
        dtype=opts.dtype,  # type: ignore[arg-type]
        nodes=summary.nodes,
        predicted=summary.predicted,
        baselines=baselines,
        search=search.replace(training_state=(costs or opts.cost_options()).training_state()),
        recompute=recompute,
        pipeline=pipeline,
    )


def resolve_options(graph: OpGraph, options: PlanOptions | None, kwargs: dict[str, Any]) -> PlanOptions:
    """``options`` or the keywords made into them; the example's sizes and the model's dtype where unset."""
    if options is None:
        options = PlanOptions.make(**kwargs)
    elif kwargs:
        raise TypeError(f"pass PlanOptions or keyword options, not both (got {sorted(kwargs)})")
    if options.world_size is None and options.digits is None:
        raise ValueError("a plan needs world_size (or digits)")
    captured = graph.captured
    if captured.static_seq and options.seq not in (None, captured.example_seq):
        raise ValueError(
            f"{graph.name} was captured at S={captured.example_seq} (its sequence length could not stay symbolic), "
            f"so it cannot be planned at S={options.seq}: capture it with example inputs of sequence length "
            f"{options.seq}"
        )
    return options.replace(
        batch=graph.captured.example_batch if options.batch is None else options.batch,
        seq=graph.captured.example_seq if options.seq is None else options.seq,
        dtype=options.dtype or model_dtype(graph),
        world_size=options.mesh().size,
    )


def model_dtype(graph: OpGraph) -> str:
    """The dtype key of the model's first parameter (``"fp32"`` for a model without any)."""
    first = next(iter(graph.param_dtypes.values()), torch.float32)
    return _MODEL_DTYPES.get(first, "fp32")
