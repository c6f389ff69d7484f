"""One micro-batch count searched on every mesh: price the groupings, bound them, search the levers on each that
can still win, keep the cheapest (:func:`search_count`).

Under a budget each mesh weighs recomputation, ZeRO and ring-buffer caps: many DP runs. A mesh's fastest plan
without a budget bounds all of that from below (recomputation only adds time, ZeRO-2 none), so the meshes are
searched in the order of that bound (:func:`grouping_bounds`), and those whose bound is no faster than the best plan
found are skipped. The pricing of a bound is the search's, so it is kept for it, as long as those kept stay under
:data:`~primepar_fx.planning.state.KEEP_PRICED`. With workers the bounds are found side by side, also without a
budget, where the bound is the search: only the best mesh is searched then, on its bound's pricing (a worker sends
back its cheapest grouping's, which is likely to be searched). Once the plan to beat is known, the remaining meshes'
lever searches run side by side too (:func:`~primepar_fx.planning.workers.search_forked`), each cut off at the
cheapest plan any process found; the cheapest of all is the one a single process finds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm.auto import tqdm

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.model import clear_caches
from primepar_fx.frontend.symbols import B, S
from primepar_fx.levers.choose import choose_levers
from primepar_fx.levers.recompute import Chosen
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.state import Bound, Found, KeptPricings, Planning, workers_for
from primepar_fx.planning.workers import run_forked, search_forked
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.record.search import GroupingRecord
from primepar_fx.search import CutOff, InfeasibleBudget
from primepar_fx.utils.gcpause import collect


@dataclass
class MeshResult:
    """One mesh's search: its plan's objective per micro-batch where it found one, or why not."""

    seconds: float
    cost: float | None = None
    chosen: Chosen | None = None  # None also where a worker sent it light
    stage: int = 0
    priced_s: float = 0.0
    searched_s: float = 0.0
    min_memory: float | None = None  # nothing fits: the least any of its plans needs
    cut: bool = False  # nothing that fits beats the plan to beat

    def light(self) -> MeshResult:
        return dataclasses.replace(self, chosen=None)


@dataclass
class Outcome:
    """A count's search over its meshes: the cheapest plan, or that nothing beat the plan to beat (``cut``), or the
    least memory any mesh's plan needs (nothing fits)."""

    found: Found | None = None
    cut: bool = False
    min_memory: float = math.inf


def search_count(
    state: Planning,
    m: int,
    bound: Bound | None = None,
    *,
    free_only: bool = False,
    meshes: list[DeviceMesh] | None = None,
) -> Outcome:
    """The search at ``m`` micro-batches of ``batch / m`` on ``meshes`` (default: the plan's), the cheapest kept.

    ``bound``: the plan to beat (default: none but what this search finds); a mesh whose plans cannot beat it is not
    searched. ``free_only``: keep only meshes whose fastest plan fits as it is (no levers searched)."""
    return CountSearch(state, m, bound or Bound(m), free_only, state.meshes if meshes is None else meshes).run()


class CountSearch:
    """:func:`search_count`'s state: the meshes' bounds and pricings kept for their searches, the records of each
    mesh searched, and what was found."""

    def __init__(self, state: Planning, m: int, bound: Bound, free_only: bool, meshes: list[DeviceMesh]) -> None:
        opts = state.opts
        if opts.batch % m:  # type: ignore[operator]
            raise ValueError(f"micro_batches={m} does not divide the batch of {opts.batch}")
        self.state, self.m, self.bound, self.free_only, self.meshes = state, m, bound, free_only, meshes
        self.values = {B: opts.batch // m, S: opts.seq}  # type: ignore[operator]
        self.costs = dataclasses.replace(opts.cost_options(), micro_batches=m, stages=state.stages)
        self.workers = workers_for(opts, len(meshes))
        self.fastest: list[float | None] = [None] * len(meshes)  # each mesh's fastest plan, where bounded
        self.kept: dict[int, tuple[PricedGraph, float]] = {}  # a bound's pricing, kept for the mesh's search
        self.records: dict[int, GroupingRecord] = {}
        self.outcome = Outcome()
        self.searched = False  # a mesh was searched in this process since the last collection

    def run(self) -> Outcome:
        self.bound_groupings()
        order = sorted(range(len(self.meshes)), key=lambda i: -math.inf if self.fastest[i] is None else self.fastest[i])
        shown = self.state.opts.progress and len(self.meshes) > 1
        with tqdm(total=len(order), desc="groupings", disable=not shown, leave=False) as bar:
            for k, i in enumerate(order):
                if self.side_by_side(len(order) - k):
                    for j, got in self.search_forked(order[k:]):
                        self.take(j, got)
                        bar.update()
                    break
                if self.found is not None and self.fastest[i] is not None and self.fastest[i] >= self.bound.found:
                    self.kept.pop(i, None)
                    self.take(i, None)  # its fastest plan is no faster than the best found: not searched
                else:
                    self.take(i, self.search(i, self.bound.cutoff))
                bar.update()
        if self.found is not None:
            self.found.tried = tuple(self.records[i] for i in range(len(self.meshes)))
        return self.outcome

    @property
    def found(self) -> Found | None:
        return self.outcome.found

    def price(
        self, mesh: DeviceMesh, at: CostOptions | None = None, *, progress: bool, threads: int | None
    ) -> PricedGraph:
        """``mesh`` priced at this count (``at``: other cost options), read from the plan's kept pricings where it
        was priced before."""
        state, opts = self.state, self.state.opts
        key = (self.m, mesh, at or self.costs)
        made = state.pricings.get(key)
        if made is not None:
            return made
        clear_caches()  # each mesh numbers its own index sets, so the table of their overlaps holds this one's
        made = price_graph(
            state.graph,
            mesh,
            opts.cluster,
            self.values,
            at or self.costs,
            allow_prime=opts.allow_prime,
            canonical=opts.canonical,
            progress=progress,
            workers=threads,
        )
        state.pricings.put(key, made)
        return made

    def bound_groupings(self) -> None:
        """Each grouping's fastest plan (no budget), where several are searched and a bound can spare searches:
        under a budget, or with workers (where the bound is the search). The full mesh past three digits, searched
        with the groupings when it is asked for, is not bounded: its pricing is large and slow, so it is priced for
        its search only, and it comes first (no bound), so a tie keeps it."""
        opts = self.state.opts
        full = opts.mesh() if len(self.meshes) > 1 else None
        grouped = [i for i, mesh in enumerate(self.meshes) if mesh != full]
        wanted = opts.memory_budget is not None or self.workers > 1
        if len(grouped) <= 1 or opts.alpha != 0 or self.free_only or not wanted:
            return
        threads = 1 if self.workers > 1 else None  # side by side in processes: threads would compete for the cores
        fastest, kept = grouping_bounds(
            [self.meshes[i] for i in grouped],
            lambda mesh, shown: self.price(mesh, progress=shown, threads=threads),
            method=opts.method,
            workers=min(self.workers, len(grouped)),
            progress=opts.progress,
        )
        for j, i in enumerate(grouped):
            self.fastest[i] = fastest[j]
        self.kept = {grouped[j]: got for j, got in kept.items()}

    def search(
        self, i: int, cutoff: Callable[[], float], shown: bool | None = None, threads: int | None = None
    ) -> MeshResult:
        """Mesh ``i``'s plan with the levers it needs, or why it has none (``cutoff()``: the plan to beat)."""
        opts = self.state.opts
        shown = opts.progress if shown is None else shown
        if self.searched and (opts.memory_budget is not None or opts.alpha):
            collect()  # the last mesh's lever search left cyclic garbage (planning runs with the collector paused)
        self.searched = True
        mesh, start = self.meshes[i], time.perf_counter()
        if i in self.kept:  # priced and searched for its bound, before this search started (its fastest plan is kept)
            priced, priced_s = self.kept.pop(i)
            start -= priced_s + priced.fastest(opts.method).seconds
        else:
            priced = self.price(mesh, progress=shown, threads=threads)
            priced_s = priced.seconds  # the time it took, also where it was made before (a probe's, read again)
            start = time.perf_counter() - priced_s
        reprice = functools.partial(self.price, mesh, progress=shown, threads=threads)
        try:
            chosen, stage = choose_levers(
                self.state.graph, priced, self.values, self.costs, opts.levers(), cutoff,
                free_only=self.free_only, reprice=reprice,
            )  # fmt: skip
        except InfeasibleBudget as exc:
            return MeshResult(time.perf_counter() - start, min_memory=exc.min_memory)
        except CutOff:
            return MeshResult(time.perf_counter() - start, cut=True)
        seconds = time.perf_counter() - start
        return MeshResult(seconds, chosen.solution.cost, chosen, stage, priced_s, seconds - priced_s)

    def side_by_side(self, left: int) -> bool:
        """Whether the ``left`` meshes still to search are searched side by side: under a budget, with workers and
        more than one of them, once the plan to beat is known (asked for, or known without a search of its own)."""
        opts = self.state.opts
        levers = not self.free_only and opts.memory_budget is not None
        return self.workers > 1 and levers and left > 1 and (self.bound.asked or self.bound.known)

    def search_forked(self, items: list[int]) -> list[tuple[int, MeshResult | None]]:
        """The meshes ``items`` searched side by side (:func:`~primepar_fx.planning.workers.search_forked`), their
        results in the order one process searches them, so that the first of equal plans is kept."""
        done = dict(
            search_forked(
                items,
                lambda j, cutoff: self.search(j, cutoff, shown=False, threads=1),
                bound=self.fastest.__getitem__,
                best=self.bound.found,
                ceiling=self.bound.ceiling(),
                workers=self.workers,
            )
        )
        return [(j, done[j]) for j in items]

    def take(self, i: int, got: MeshResult | None) -> None:
        """Record mesh ``i``'s search (``None``: its bound could not win, not searched) and keep its plan where it is
        the cheapest yet."""
        bound = self.fastest[i]
        record = GroupingRecord(
            digits=self.meshes[i].digits,
            bound=None if bound is None else bound * self.m,
            seconds=0.0 if got is None else round(got.seconds, 4),
        )
        if got is None or got.cut:
            self.outcome.cut = self.outcome.cut or got is not None
        elif got.min_memory is not None:
            self.outcome.min_memory = min(self.outcome.min_memory, got.min_memory)
        else:
            record = dataclasses.replace(record, objective=got.cost * self.m)  # type: ignore[operator]
            if got.chosen is not None and got.cost < self.bound.found:  # type: ignore[operator]
                got.chosen.attach(self.state.graph)  # a worker's comes without it
                at = dataclasses.replace(self.costs, zero=got.stage)
                self.outcome.found = Found(self.meshes[i], got.chosen, at, self.m, got.priced_s, got.searched_s)
                self.bound.found = got.cost  # type: ignore[assignment]
        self.records[i] = record


@dataclass
class GroupingBound:
    """A grouping's fastest plan's cost (per micro-batch, no budget), with the pricing it took to find it and its
    seconds, to keep for the grouping's search (a worker sends only its cheapest one's pricing: :meth:`light`)."""

    cost: float
    priced: PricedGraph | None
    priced_s: float

    def light(self) -> GroupingBound:
        return dataclasses.replace(self, priced=None)


def grouping_bounds(
    meshes: list[DeviceMesh],
    price: Callable[[DeviceMesh, bool], PricedGraph],
    *,
    method: str,
    workers: int,
    progress: bool,
) -> tuple[list[float | None], dict[int, tuple[PricedGraph, float]]]:
    """Each mesh's fastest plan's cost (per micro-batch, no budget), found on ``workers`` processes (this one
    included: :func:`~primepar_fx.planning.workers.run_forked`), and the pricings kept for the searches that
    follow: ``{mesh index: (pricing, seconds it took)}``, as long as they stay under
    :data:`~primepar_fx.planning.state.KEEP_PRICED` bytes.

    ``price(mesh, progress)`` prices one mesh. A worker sends back only its cheapest mesh's pricing (that mesh is
    the likeliest to be searched), so the winner is not priced twice. A worker's error is raised here, as this
    process meets it when it prices that mesh again itself.
    """

    def bound(i: int) -> GroupingBound:
        start = time.perf_counter()
        priced = price(meshes[i], progress and workers == 1)
        priced_s = time.perf_counter() - start
        found = GroupingBound(priced.fastest(method).cost, priced, priced_s)
        return found if KeptPricings.fits(priced.array_nbytes()) else found.light()

    bounds: list[float | None] = [None] * len(meshes)
    kept: dict[int, tuple[PricedGraph, float]] = {}
    held = 0
    # the meshes of most digits first: they take the longest, and the processes then share out the quick ones
    # (longest processing time first)
    items = sorted(range(len(meshes)), key=lambda i: -len(meshes[i].digits))
    found = run_forked(bound, items, workers, cheapest_whole=True)
    for i, ok, value in tqdm(found, "groupings' bounds", len(meshes), disable=not progress, leave=False):
        got = value if ok else bound(i)
        if got.priced is not None and KeptPricings.fits(got.priced.array_nbytes(), held):
            kept[i], held = (got.priced, got.priced_s), held + got.priced.array_nbytes()
        bounds[i] = got.cost
    return bounds, kept
