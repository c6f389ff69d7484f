"""The planner's state: one object per plan, :class:`Planning`, which the steps of :mod:`~primepar_fx.planning.planner`
read and write: the options, the meshes searched, the pricings kept, the best plan found and the micro-batch counts'
progress; and the one bound type, :class:`Bound`, the plan a search must beat.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.graph import OpGraph
from primepar_fx.levers.choices import micro_batch_tries
from primepar_fx.levers.recompute import Chosen
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.groupings import search_meshes
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.workers import can_fork
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.record.search import GroupingRecord

#: bytes of priced graphs a plan keeps for later searches (past it, a mesh is priced again): the one knob for them
KEEP_PRICED = 2 * 2**30


class KeptPricings:
    """The pricings one plan makes, by (micro-batch count, mesh, cost options), read again instead of priced again
    (pricing is deterministic, so a pricing read again is the pricing made again): a count's probe and then its
    search price the same meshes, as do a count's search and the probe that found its plan. The oldest are dropped
    past :data:`KEEP_PRICED` bytes of arrays (read when one is added) or ``entries`` pricings."""

    def __init__(self, entries: int) -> None:
        self.entries, self.held = entries, 0
        self._items: dict[tuple, PricedGraph] = {}

    def get(self, key: tuple) -> PricedGraph | None:
        return self._items.get(key)

    def made(self, m: int, mesh: DeviceMesh) -> list[tuple[tuple, PricedGraph]]:
        """The pricings kept of ``mesh`` at ``m`` micro-batches, with their keys (what a worker sends back)."""
        return [(key, priced) for key, priced in self._items.items() if key[:2] == (m, mesh)]

    @staticmethod
    def fits(nbytes: int, held: int = 0) -> bool:
        """Whether ``nbytes`` more of pricings may be kept beside ``held`` (:data:`KEEP_PRICED`)."""
        return held + nbytes <= KEEP_PRICED

    def put(self, key: tuple, priced: PricedGraph) -> None:
        size = priced.array_nbytes()
        if not self.fits(size):
            return
        if key in self._items:
            self.held -= self._items.pop(key).array_nbytes()
        while self._items and (not self.fits(size, self.held) or len(self._items) >= self.entries):
            oldest = next(iter(self._items))
            self.held -= self._items.pop(oldest).array_nbytes()
        self._items[key], self.held = priced, self.held + size


@dataclass
class Found:
    """The cheapest plan of one micro-batch count over the meshes searched, and what its search weighed."""

    mesh: DeviceMesh
    chosen: Chosen
    costs: CostOptions
    micro_batches: int
    priced_s: float
    #: the whole search on this mesh: every recomputation policy, ZeRO stage and budget cap it weighed
    searched_s: float
    #: every mesh of the count's search, in the order of the meshes (filled in when the search ends)
    tried: tuple[GroupingRecord, ...] = ()

    @property
    def priced(self) -> PricedGraph:
        return self.chosen.priced

    @property
    def step_objective(self) -> float:
        """The plan's objective over the whole step (every micro-batch)."""
        return self.chosen.solution.cost * self.micro_batches

    @property
    def uses_levers(self) -> bool:
        """Whether the plan recomputes or shards its parameters (ZeRO-3): a plan that does neither fits holding
        every activation, so more micro-batches would only run smaller ones."""
        recomputes = self.chosen.recompute is not None and self.chosen.recompute.active
        return recomputes or self.costs.zero == 3


class Bound:
    """The plan a search at ``m`` micro-batches must beat, per micro-batch: the cheapest it has found itself
    (:attr:`found`) and a plan found elsewhere, ``elsewhere()`` (a per-step objective: another count's plan, or a
    probe's), looked up only the first time the search needs it (:meth:`ceiling`), since finding it may take a
    search of its own. ``known``: whether ``elsewhere()`` answers without such a search."""

    def __init__(self, m: int, elsewhere: Callable[[], float] | None = None, *, known: bool = False) -> None:
        self.m, self.elsewhere, self.known = m, elsewhere, known
        self.found = math.inf
        self.asked = False  # whether the search has needed the plan to beat (it then knows it)
        self._ceiling: float | None = None

    def ceiling(self) -> float:
        """The plan found elsewhere, per micro-batch (``inf`` where there is none)."""
        self.asked = True
        if self._ceiling is None:
            self._ceiling = math.inf if self.elsewhere is None else self.elsewhere() / self.m
        return self._ceiling

    def cutoff(self) -> float:
        """The objective per micro-batch a plan must beat: the cheaper of :attr:`found` and :meth:`ceiling`."""
        return min(self.found, self.ceiling())


@dataclass
class Planning:
    """One plan's search: what every step reads and writes (:mod:`~primepar_fx.planning.planner`)."""

    graph: OpGraph
    opts: PlanOptions
    #: the meshes every count is searched on (:func:`~primepar_fx.planning.groupings.search_meshes`)
    meshes: list[DeviceMesh]
    #: the micro-batch counts to try, in order (:func:`~primepar_fx.levers.choices.micro_batch_tries`)
    tries: list[int]
    pricings: KeptPricings
    #: the cheapest plan found so far, of any count
    best: Found | None = None
    #: the counts searched whole ahead of their turn, to bound the counts before them (``None``: nothing fits)
    ahead: dict[int, Found | None] = field(default_factory=dict)
    #: per count probed, its fastest plan's per-step objective where that plan fits as it is, else ``None``
    probes: dict[int, float | None] = field(default_factory=dict)
    #: the counts searched, in order
    searched: list[int] = field(default_factory=list)
    #: the least memory a plan needs, of each count where nothing fits
    min_memory: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    #: the pipeline stages the plan is one stage's plan of (``opts`` then name one stage's devices; 1: no pipeline):
    #: its pricing counts ``1 / stages`` of each node's parameter state (:attr:`CostOptions.stages`)
    stages: int = 1

    @classmethod
    def start(cls, graph: OpGraph, opts: PlanOptions, stages: int = 1) -> Planning:
        meshes = search_meshes(opts.mesh(), opts.grouped, opts.cluster, opts.group_digits)
        tries = micro_batch_tries(opts.micro_batches, opts.memory_budget, opts.batch)  # type: ignore[arg-type]
        # every mesh's pricing at up to four counts (a count's probe, then its search; one mesh: every count's)
        return cls(graph, opts, meshes, tries, KeptPricings(max(4 * len(meshes), len(tries))), stages=stages)

    @property
    def workers(self) -> int:
        """The processes the meshes are searched on side by side (1: this one alone)."""
        return workers_for(self.opts, len(self.meshes))

    @property
    def probing(self) -> bool:
        """Whether counts are probed: several are tried, and the levers are the search's to choose."""
        return len(self.tries) > 1 and self.opts.zero == self.opts.recompute == "auto"

    def has_plan(self) -> bool:
        """Whether a plan was found, in turn or ahead of it."""
        return self.best is not None or any(g is not None for g in self.ahead.values())


def forks(opts: PlanOptions) -> bool:
    """Whether the options ask for workers and this platform can fork them."""
    return opts.workers > 1 and can_fork()


def workers_for(opts: PlanOptions, items: int) -> int:
    """The processes that share out ``items`` pieces of work (1: this one alone)."""
    return min(opts.workers, items) if forks(opts) else 1
