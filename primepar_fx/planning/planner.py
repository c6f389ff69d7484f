"""From a priced graph to a :class:`~primepar_fx.record.plan.Plan`: search, read back, and price the baselines.

:func:`plan_graph` runs the search (:func:`primepar_fx.search.solve`) over the graph priced by
:func:`~primepar_fx.pricing.price.price_graph`, then prices three baselines with the same cost model so the
comparison is like for like:

* ``megatron``: every data-parallel x model-parallel split of the device digits, with and without sequence
  parallelism (:func:`~primepar_fx.planning.baselines.megatron_configs`); the fastest is kept.
* ``data_parallel``: the batch split over every digit.
* ``split_only``: our own search with P(S x S) left out (the space Alpa and GSPMD-style planners search).

:func:`forced_plan` builds a full :class:`~primepar_fx.record.plan.Plan` without the free search, to run or compare a
named strategy: ``"megatron"`` (the configuration :func:`price_baselines` picks; ``"megatron-sp"`` the best one
with sequence parallelism), ``"data_parallel"``,
``"prime"`` (P(S x S) on every node where it is legal, the rest searched) or ``"random:SEED"`` (a seeded,
uniformly random legal sequence per node).

Whole-plan figures (:func:`summarize`): the step time is the sum of node times (Eq. 7) and edge times (Eq. 8-9);
the peak memory per device is every node's parameter state and stashed activations (all live at the end of
Forward) plus the largest ring double buffer (only one ring runs at a time); the communication is the bytes one
device sends per step (collectives and ring shifts, plus the mean per-device redistribution traffic).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from tqdm.auto import tqdm

from primepar_fx.cost.model import CostOptions, clear_caches
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.levers.choices import micro_batch_tries
from primepar_fx.levers.choose import choose_levers
from primepar_fx.levers.floor import check_state_floor
from primepar_fx.levers.recompute import Chosen, choose_recompute, layer_pricing
from primepar_fx.partition import DeviceMesh, PartitionSeq, enumerate_sequences
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.planning.compare import best_megatron, fixed_baselines, plan_baselines, split_only_search
from primepar_fx.planning.groupings import GROUPED_DIGITS, KeptPricings, grouping_bounds, search_meshes
from primepar_fx.planning.options import PlanOptions, forced_seed
from primepar_fx.planning.workers import Forked, can_fork, search_forked
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.pricing.summary import Summary, per_step, summarize
from primepar_fx.record.levers import Recompute
from primepar_fx.record.plan import Baseline, Plan
from primepar_fx.search import CutOff, InfeasibleBudget
from primepar_fx.utils.gcpause import collect, gc_paused

log = logging.getLogger(__name__)

#: torch dtype -> the dtype key a plan of a model with such parameters is priced at by default
_MODEL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_plan(
    graph: OpGraph,
    opts: PlanOptions,
    mesh: DeviceMesh,
    summary: Summary,
    *,
    baselines: dict[str, Baseline],
    search: dict[str, Any],
    recompute: Recompute | None = None,
    costs: CostOptions | None = None,
) -> Plan:
    """The :class:`Plan` of ``graph`` priced as ``summary`` on ``mesh``, with ``opts``' cluster, sizes and dtype
    and ``costs``' training state (default: ``opts``')."""
    return Plan(
        model=graph.name,
        model_fingerprint=Plan.fingerprint((n.name, n.op) for n in graph.nodes.values()),
        world_size=mesh.size,
        digits=mesh.digits,
        cluster=opts.cluster.name,
        batch=opts.batch,
        seq=opts.seq,
        dtype=opts.dtype,
        nodes=summary.nodes,
        predicted=summary.predicted,
        baselines=baselines,
        search={**search, "training_state": (costs or opts.cost_options()).training_state()},
        recompute=recompute,
    )


@gc_paused
def plan_graph(graph: OpGraph, options: PlanOptions | None = None, /, **kwargs: Any) -> Plan:
    """Search the cheapest plan for ``graph`` and compare it with the baselines (module docstring).

    ``options`` (a :class:`PlanOptions`), or its fields as keywords for :meth:`PlanOptions.make` (``cluster``,
    ``world_size``, ``batch``, ``seq``, ``dtype``, ``memory_budget``, ``alpha``, ``method``, ``allow_prime``,
    ``baselines``, ``digits``, ``grouped``, ``canonical``, ``progress``); ``batch`` and ``seq`` default to the
    example's. The search runs on each mesh of :func:`search_meshes` (past :data:`GROUPED_DIGITS` digits, every
    grouping of them into three unless ``grouped`` says otherwise) and the cheapest plan is kept; the baselines are
    priced on the ungrouped mesh either way, so Megatron keeps all of its data x model splits. A budget no grouping
    can meet raises :class:`~primepar_fx.search.InfeasibleBudget` with the smallest budget any of them needs.
    """
    opts = _options(graph, options, kwargs)
    full = opts.mesh()
    if opts.memory_budget is not None:
        check_state_floor(graph, opts.cost_options(), opts.world_size, opts.memory_budget)
    # with workers, Megatron's, data parallelism's and FSDP's plans are priced in a fork while the search runs, at a
    # lower priority: it runs on the cores the search's own workers leave idle (the last grouping's, the levers')
    early = (
        Forked(functools.partial(fixed_baselines, graph, full, opts), nice=BASELINES_NICE)
        if opts.baselines and _forks(opts)
        else None
    )
    try:
        return _plan_graph(graph, opts, full, early)
    finally:
        if early is not None:
            early.stop()


#: niceness added to the process that prices the baselines beside the search
BASELINES_NICE = 10


def _forks(opts: PlanOptions) -> bool:
    return opts.workers > 1 and can_fork()


def _plan_graph(graph: OpGraph, opts: PlanOptions, full: DeviceMesh, early: Forked | None) -> Plan:
    meshes = search_meshes(full, opts.grouped, opts.cluster, opts.group_digits)
    t0 = time.perf_counter()
    found, infeasible = None, []
    tries = micro_batch_tries(opts.micro_batches, opts.memory_budget, opts.batch)
    probing = len(tries) > 1 and opts.zero == opts.recompute == "auto"
    # a count's fastest plan's per-step objective where it fits as it is, else None; only the number is kept, and
    # the plan is found again if that count is reached (from the pricings kept meanwhile, where they still are)
    probes: dict[int, float | None] = {}
    # every mesh's pricing at up to four counts (a count's probe, then its search; one mesh: every count's)
    pricings = KeptPricings(max(4 * len(meshes), len(tries)))

    def fits(m: int, i: int) -> float | None:  # mesh i's fastest plan's per-step objective where it fits as it is
        try:
            return _search_at(graph, opts, [meshes[i]], m, free_only=True, pricings=pricings).step_objective
        except (CutOff, InfeasibleBudget):
            return None

    def probe(m: int) -> float | None:
        if m not in probes:  # the meshes side by side where there are workers (their pricings sent back)
            workers = min(opts.workers, len(meshes)) if _forks(opts) else 1
            done = pricings.run_forked(functools.partial(fits, m), m, meshes, workers)
            probes[m] = min((v for v in done if v is not None), default=None)
        return probes[m]

    def search_count(
        m: int, upper: Callable[[], float] | None = None, ready: Callable[[], bool] | None = None
    ) -> _Found | None:  # None: nothing (better) fits
        try:
            return _search_at(graph, opts, meshes, m, upper, pricings=pricings, ready=ready)
        except InfeasibleBudget as exc:
            infeasible.append(exc)
        except CutOff:
            pass  # nothing at this count beats the plan found or probed; more micro-batches still may
        return None

    # the most micro-batches, searched whole ahead of their turn where no later count's fastest plan fits as it is:
    # they hold the least, so their plan is the likeliest to fit with few levers, and it bounds the counts before
    ahead: dict[int, _Found | None] = {}
    searched: list[int] = []  # the counts searched, in order
    for i, m in enumerate(tries):
        searched.append(m)

        def upper(i: int = i, found: _Found | None = found) -> float:  # noqa: B023 -- ahead: read when called
            """The per-step objective the search at ``tries[i]`` must beat: the best plan found so far (with fewer
            micro-batches, or with the most, ahead), or, before there is one, the fastest plan of the first later
            count but the last that fits as it is (probes), or else the plan of the last count, the most
            micro-batches (searched whole, ahead of its turn); run only when ``tries[i]`` needs the levers."""
            known = [g.step_objective for g in (found, *ahead.values()) if g is not None]
            if known:
                return min(known)
            for later in tries[i + 1 : -1] if probing else ():  # the last count is searched whole (below)
                objective = probe(later)
                if objective is not None:
                    return objective
            if probing and i + 1 < len(tries):
                if tries[-1] not in ahead:
                    ahead[tries[-1]] = search_count(tries[-1])
                if ahead[tries[-1]] is not None:
                    return ahead[tries[-1]].step_objective  # type: ignore[union-attr]
            return math.inf

        def ready(found: _Found | None = found) -> bool:  # noqa: B023 -- ahead: read when called
            """Whether upper() answers from a plan found, without a search of its own."""
            return found is not None or any(g is not None for g in ahead.values())

        if m in ahead:
            got = ahead[m]
        elif probes.get(m) is not None:
            if found is not None and probes[m] >= found.step_objective:
                break  # its fastest plan fits as it is and is no faster than the plan found: nor are more counts'
            # its fastest plan fits: the best at this count
            got = _search_at(graph, opts, meshes, m, free_only=True, pricings=pricings)
        else:
            got = search_count(m, upper, ready)
        if got is None:
            continue
        if found is not None and got.step_objective >= found.step_objective:
            continue  # slower; more micro-batches still may not be (the step is not unimodal in the count)
        found = got
        if (got.chosen.recompute is None or not got.chosen.recompute.active) and got.costs.zero != 3:
            break  # it fits without recomputation or ZeRO-3: more micro-batches would only run smaller ones
    for got in ahead.values():  # a count searched ahead that the loop did not reach
        if got is not None and (found is None or got.step_objective < found.step_objective):
            found = got
    if found is None:
        raise InfeasibleBudget(opts.memory_budget, min(e.min_memory for e in infeasible))  # type: ignore[arg-type]
    mesh, priced, chosen, m = found.mesh, found.priced, found.chosen, found.micro_batches
    costs = found.costs
    split, kept_split = split_only_search(graph, opts, chosen, costs)
    if kept_split:
        chosen = split[0]  # type: ignore[index]
        priced = chosen.priced
    sol = chosen.solution
    ours = per_step(summarize(graph, priced, sol.choice, costs, extra_peak=chosen.extra_peak), m)
    t2 = time.perf_counter()
    # ours where it is proven optimal: where it uses no P(S x S), it is the split-only baseline too
    fastest = (sol.choice, ours) if sol.proven_optimal and not kept_split else None
    base = (
        plan_baselines(graph, priced, full, opts, costs, early, fastest, split, chosen.recompute)
        if opts.baselines
        else {}
    )
    search = {
        "method": sol.method,
        "proven_optimal": sol.proven_optimal,
        "objective": sol.cost * m,
        "pricing_s": round(found.priced_s, 4),
        "search_s": round(found.searched_s, 4),
        "planning_s": round(t2 - t0, 4),  # every micro-batch count and grouping, priced and searched
        "micro_batches_tried": sorted({*searched, *probes, *ahead}),
        "baselines_s": round(time.perf_counter() - t2, 4),
        "alpha": opts.alpha,
        "memory_budget": opts.memory_budget,
        "allow_prime": opts.allow_prime,
        "canonical": opts.canonical,
        "grouped": mesh != full,
    }
    if opts.group_digits != GROUPED_DIGITS:
        search["group_digits"] = opts.group_digits
    if kept_split:
        search["split_only_kept"] = True  # the split-only search's plan beat the one the search found
    if len(meshes) > 1:  # the proof of optimality is within the grouping; the others are listed with their optima
        search["groupings"] = found.tried
        search["groupings_s"] = round(t2 - t0, 4)
    return make_plan(graph, opts, mesh, ours, baselines=base, search=search, recompute=chosen.recompute, costs=costs)


@dataclass
class _Found:
    """The cheapest plan of one micro-batch count over the meshes searched."""

    mesh: DeviceMesh
    priced: PricedGraph
    chosen: Chosen
    priced_s: float
    #: the whole search on this mesh: every recomputation policy, ZeRO stage and budget cap it weighed
    searched_s: float
    costs: CostOptions
    micro_batches: int
    tried: list[dict[str, Any]]

    @property
    def step_objective(self) -> float:
        return self.chosen.solution.cost * self.micro_batches


@dataclass
class _Searched:
    """One mesh's search in :func:`_search_at`: the plan's per-micro-batch cost where it found one, or why not."""

    seconds: float
    cost: float | None = None
    chosen: Chosen | None = None  # None also where a worker sent only the cost (planning.workers.Found.lite)
    stage: int = 0
    priced_s: float = 0.0
    searched_s: float = 0.0
    min_memory: float | None = None  # nothing fits: the least any of its plans needs
    cut: bool = False  # nothing that fits beats the plan to beat

    def portable(self) -> _Searched:
        return self if self.chosen is None else dataclasses.replace(self, chosen=self.chosen.detached())

    def lite(self) -> _Searched:
        return dataclasses.replace(self, chosen=None)


def _search_at(
    graph: OpGraph,
    opts: PlanOptions,
    meshes: list[DeviceMesh],
    m: int,
    upper: Callable[[], float] | None = None,
    *,
    free_only: bool = False,
    pricings: KeptPricings | None = None,
    ready: Callable[[], bool] | None = None,
) -> _Found:
    """The search on every mesh of ``meshes`` with ``m`` micro-batches of ``opts.batch / m`` (priced at that
    batch), the cheapest kept; raises :class:`InfeasibleBudget` with the least any mesh needs.

    ``upper()``: the per-step objective of a plan the caller has (called only when a mesh needs the memory
    levers); a mesh whose plans cannot beat it is not searched, and :class:`~primepar_fx.search.CutOff` is raised
    when none can. ``free_only``: keep only meshes whose fastest plan fits as it is (no levers searched).
    ``pricings``: the pricings made so far, read where this search would make one again, and added to.
    ``ready()``: whether ``upper()`` would answer without a search of its own (with workers, the meshes that need the
    levers are then searched side by side from the first)."""
    if opts.batch % m:  # type: ignore[operator]
        raise ValueError(f"micro_batches={m} does not divide the batch of {opts.batch}")
    values = {B: opts.batch // m, S: opts.seq}  # type: ignore[operator]
    costs = dataclasses.replace(opts.cost_options(), micro_batches=m)

    def price(
        mesh: DeviceMesh, at: CostOptions = costs, progress: bool = opts.progress, threads: int | None = None
    ) -> PricedGraph:
        key = (m, mesh, at)
        made = None if pricings is None else pricings.get(key)
        if made is not None:
            return made
        clear_caches()  # each mesh numbers its own index sets, so the table of their overlaps holds this one's
        made = price_graph(
            graph,
            mesh,
            opts.cluster,
            values,
            at,
            allow_prime=opts.allow_prime,
            canonical=opts.canonical,
            progress=progress,
            workers=threads,
        )
        if pricings is not None:
            pricings.put(key, made)
        return made

    # Under a budget each mesh weighs recomputation, ZeRO and budget caps: many DP runs. A mesh's fastest plan
    # without a budget bounds all of that from below (recomputation only adds time, ZeRO-2 none), so the meshes are
    # searched in the order of that bound, and those whose bound is no faster than the best plan found are skipped.
    # The pricing of a bound is the search's, so it is kept for it, as long as those kept stay under KEEP_PRICED.
    # With workers the bounds are found side by side (planning.workers), also without a budget, where the bound is
    # the search: only the best mesh is searched then, on its bound's pricing: this process's, or the one a worker
    # sends back with its bounds (each worker sends its cheapest grouping's, which is likely to be searched).
    bounds: list[float | None] = [None] * len(meshes)
    kept: dict[int, tuple[PricedGraph, float]] = {}
    workers = min(opts.workers, len(meshes)) if _forks(opts) else 1
    # The full mesh past GROUPED_DIGITS digits (searched with the groupings when it is asked for) is priced for its
    # search only: its pricing is large and slow, and it comes first (no bound) so a tie keeps it.
    full = opts.mesh() if len(meshes) > 1 else None
    grouped = [i for i, mesh in enumerate(meshes) if mesh != full]
    if len(grouped) > 1 and opts.alpha == 0 and not free_only and (opts.memory_budget is not None or workers > 1):
        found_bounds, found_kept = grouping_bounds(
            [meshes[i] for i in grouped],
            # side by side in processes, each on one thread: threads beside them would compete for the cores
            lambda mesh, shown: price(mesh, progress=shown, threads=1 if workers > 1 else None),
            method=opts.method,
            workers=min(workers, len(grouped)),
            progress=opts.progress,
        )
        for j, i in enumerate(grouped):
            bounds[i] = found_bounds[j]
        kept = {grouped[j]: got for j, got in found_kept.items()}
    order = sorted(range(len(meshes)), key=lambda i: -math.inf if bounds[i] is None else bounds[i])
    best: _Found | None = None
    infeasible: list[InfeasibleBudget] = []
    cut, asked, searched = False, False, False  # searched: in this process, since the last collection
    entries: dict[int, dict[str, Any]] = {}
    for i in order:
        entries[i] = {"digits": list(meshes[i].digits), "objective": None}
        if bounds[i] is not None:
            entries[i]["bound"] = bounds[i] * m  # type: ignore[operator]

    def limit() -> float:  # per micro-batch
        nonlocal asked
        asked = True  # upper() is known from now on
        own = math.inf if best is None else best.chosen.solution.cost
        return min(own, math.inf if upper is None else upper() / m)

    def search(
        i: int, cutoff: Callable[[], float], shown: bool = opts.progress, threads: int | None = None
    ) -> _Searched:
        """Mesh ``i``'s plan with the levers it needs, or why it has none."""
        nonlocal searched
        if searched and (opts.memory_budget is not None or opts.alpha):
            collect()  # the last mesh's lever search left cyclic garbage (planning runs with the collector paused)
        searched = True
        mesh, start = meshes[i], time.perf_counter()
        if i in kept:  # priced and searched for its bound, before this search started (its fastest plan is kept)
            priced, priced_s = kept.pop(i)
            start -= priced_s + priced.fastest(opts.method).seconds
        else:
            priced = price(mesh, progress=shown, threads=threads)
            priced_s = priced.seconds  # the time it took, also where it was made before (a probe's, read again)
            start = time.perf_counter() - priced_s
        reprice = functools.partial(price, mesh, progress=shown, threads=threads)
        try:
            chosen, stage = choose_levers(
                graph, priced, values, costs, opts.levers(), cutoff, free_only=free_only, reprice=reprice
            )
        except InfeasibleBudget as exc:
            if len(meshes) == 1:
                raise
            return _Searched(time.perf_counter() - start, min_memory=exc.min_memory)
        except CutOff:
            return _Searched(time.perf_counter() - start, cut=True)
        seconds = time.perf_counter() - start
        return _Searched(seconds, chosen.solution.cost, chosen, stage, priced_s, seconds - priced_s)

    def take(i: int, got: _Searched | None) -> None:
        nonlocal best, cut
        entry = entries[i]
        entry["seconds"] = 0.0 if got is None else round(got.seconds, 4)  # None: its bound could not win
        if got is None or got.cut:
            cut = cut or got is not None
        elif got.min_memory is not None:
            infeasible.append(InfeasibleBudget(opts.memory_budget, got.min_memory))  # type: ignore[arg-type]
        else:
            entry["objective"] = got.cost * m  # type: ignore[operator]
            if got.chosen is not None and (best is None or got.cost < best.chosen.solution.cost):  # type: ignore[operator]
                got.chosen.attach(graph)  # a worker's comes without it
                at = dataclasses.replace(costs, zero=got.stage)
                best = _Found(meshes[i], got.chosen.priced, got.chosen, got.priced_s, got.searched_s, at, m, [])

    # Under a budget the levers weigh many DP runs per mesh: with workers the meshes are searched side by side once
    # the plan to beat is known (upper() read, or ready to answer at once), each process cutting off at the cheapest
    # plan found by any (planning.workers.search_forked); the cheapest of all is the one a single process finds.
    side = workers > 1 and not free_only and opts.memory_budget is not None
    with tqdm(total=len(order), desc="groupings", disable=not opts.progress or len(meshes) == 1, leave=False) as bar:
        for k, i in enumerate(order):
            if side and len(order) - k > 1 and (asked or (ready is not None and ready())):
                found = search_forked(
                    order[k:],
                    lambda j, cutoff: search(j, cutoff, shown=False, threads=1),
                    bound=lambda j: bounds[j],
                    best=math.inf if best is None else best.chosen.solution.cost,
                    ceiling=math.inf if upper is None else upper() / m,
                    workers=workers,
                )
                done = dict(found)
                for j in order[k:]:  # in the order one process searches them: the first of equal plans kept
                    take(j, done[j])
                    bar.update()
                break
            if best is not None and bounds[i] is not None and bounds[i] >= best.chosen.solution.cost:  # type: ignore[operator]
                kept.pop(i, None)
                take(i, None)  # its fastest plan is no faster than the best found: not searched
            else:
                take(i, search(i, limit))
            bar.update()
    if best is not None:
        best.tried.extend(entries[i] for i in range(len(meshes)))
    elif cut:
        raise CutOff(limit() * m)
    if best is None:
        raise InfeasibleBudget(opts.memory_budget, min(e.min_memory for e in infeasible))  # type: ignore[arg-type]
    return best


def _options(graph: OpGraph, options: PlanOptions | None, kwargs: dict[str, Any]) -> PlanOptions:
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


def _prime_only(seqs: list[PartitionSeq]) -> list[PartitionSeq]:
    """The sequences that use P(S x S), or all of them where none does."""
    return [s for s in seqs if s.prime is not None] or seqs


def _random_assignment(
    graph: OpGraph, mesh: DeviceMesh, values: dict[sympy.Symbol, int], seed: int
) -> dict[str, PartitionSeq]:
    """A uniformly random legal sequence per node (constants included), drawn in graph order from ``seed``."""
    rng = random.Random(seed)
    return {
        name: rng.choice(enumerate_sequences(node.dims, mesh, values=values, allow_prime=True))
        for name, node in graph.nodes.items()
    }


def forced_plan(graph: OpGraph, name: str, options: PlanOptions | None = None, /, **kwargs: Any) -> Plan:
    """A full :class:`Plan` that follows the named strategy instead of the free search (module docstring).

    ``name`` is one of :data:`FORCED_NAMES`; ``options`` or keywords as for :func:`plan_graph` (only the cluster,
    world size or digits, sizes, dtype and memory budget matter). ``memory_budget`` picks the Megatron
    configuration (:func:`price_baselines`' rule) and bounds the ``"prime"`` search; the fixed strategies ignore
    it. The plan has no baselines; ``search["forced"]`` names the strategy.
    """
    seed = forced_seed(name)
    opts = _options(graph, options, kwargs)
    spec, mesh, budget = opts.cluster, opts.mesh(), opts.memory_budget
    m = 1 if opts.micro_batches == "auto" else int(opts.micro_batches)  # as told, like the ZeRO stage
    values = {B: opts.batch // m, S: opts.seq}  # type: ignore[operator]
    zero = 0 if opts.zero == "auto" else opts.zero  # a forced plan shards only what it is told to
    costs = dataclasses.replace(opts.cost_options(), alpha=0.0, zero=zero, micro_batches=m)
    search: dict[str, Any] = {"forced": name, "memory_budget": budget}
    t0 = time.perf_counter()
    mode = opts.recompute if opts.recompute != "auto" else "none"
    assignment = None
    if name in ("megatron", "megatron-sp"):
        sp = True if name == "megatron-sp" else None
        (search["config"], summary, assignment), _ = best_megatron(
            graph, mesh, spec, values, costs, budget, sp, distributed_optimizer=False
        )
        summary = per_step(summary, m)
    elif name == "data_parallel":
        assignment = data_parallel_assignment(graph, mesh, values=values)
    elif name == "prime":
        priced = price_graph(graph, mesh, spec, values, costs, restrict=lambda _, seqs: _prime_only(seqs))
        chosen = choose_recompute(
            graph, priced, values, costs, choice=mode, memory_budget=budget, alpha=0.0, method="dp"
        )
        sol = chosen.solution
        summary = per_step(summarize(graph, chosen.priced, sol.choice, costs, extra_peak=chosen.extra_peak), m)
        search.update(method=sol.method, proven_optimal=sol.proven_optimal, objective=sol.cost)
        search["seconds"] = round(time.perf_counter() - t0, 4)
        return make_plan(
            graph, opts, mesh, summary, baselines={}, search=search, recompute=chosen.recompute, costs=costs
        )
    else:
        assert seed is not None
        assignment = _random_assignment(graph, mesh, values, seed)
        search["seed"] = seed
    recompute = None
    if mode != "none" or name not in ("megatron", "megatron-sp"):
        priced, (choice,) = price_assignments(graph, [assignment], mesh, spec, values, costs)
        layers = layer_pricing(graph, priced, values, costs) if mode != "none" else None
        if mode != "none" and layers is None:
            raise ValueError(f"recompute={mode!r}: {graph.name} has no layer stack to recompute")
        extra = 0
        if layers is not None:
            recompute = Recompute.uniform(layers.units.stack, len(layers.units), mode)
            applied = layers.apply(recompute)
            extra = layers.extra_peak(recompute, applied, choice)
            priced = applied
        summary = per_step(summarize(graph, priced, choice, costs, extra_peak=extra), m)
    search["seconds"] = round(time.perf_counter() - t0, 4)
    return make_plan(graph, opts, mesh, summary, baselines={}, search=search, recompute=recompute, costs=costs)
