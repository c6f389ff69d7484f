"""The meshes the free search runs on past three digits (*groupings* of the digits), and their bounds.

With many digits the full space grows past what the DP tables hold (16 devices: ~700 sequences per node, see
``docs/benchmarks/search_time.md``), so the planner searches :func:`search_meshes`: the mesh with runs of
consecutive digits merged, :data:`GROUPED_DIGITS` digits left, and keeps the cheapest plan of them.
:func:`grouping_bounds` finds each grouping's fastest plan, side by side in worker processes where there are
several cores, so that the planner searches them in that order and skips those that cannot win.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.workers import run_forked
from primepar_fx.pricing.priced import PricedGraph

GROUPED_DIGITS = 3  # with more digits the full space passes ~700 sequences per node (16 devices: see search_time.md)
GROUPINGS = ("leading", "all")

#: bytes of priced graphs that the groupings' bounds keep for their searches (past it, a grouping is priced again)
KEEP_PRICED = 2 * 2**30


def search_mesh(mesh: DeviceMesh, grouped: bool | str | None) -> DeviceMesh:
    """The first mesh :func:`search_meshes` gives: ``mesh`` itself, or with its leading (inter-node) digits merged."""
    if grouped is None or grouped is True or grouped in GROUPINGS:
        grouped = len(mesh.digits) > GROUPED_DIGITS
    return mesh.grouped(GROUPED_DIGITS) if grouped else mesh


def search_meshes(
    mesh: DeviceMesh, grouped: bool | str | None, cluster: ClusterSpec, digits: int = GROUPED_DIGITS
) -> list[DeviceMesh]:
    """The meshes the free search runs on, the plan kept being the cheapest of theirs.

    With at most :data:`GROUPED_DIGITS` digits, or ``grouped=False``: ``mesh`` itself (the full space). Past that
    the full space grows past what the DP tables hold, so the search runs on *groupings*: ``mesh`` with runs of
    consecutive digits merged into one each, :data:`GROUPED_DIGITS` digits left. A plan on a grouping is a plan on
    ``mesh`` whose merged digits split one dim together. ``"leading"`` (or ``True``) is the one grouping that merges
    the leading (inter-node) digits (:meth:`~primepar_fx.partition.DeviceMesh.grouped`): every split across nodes
    is of one dim. ``"all"`` (the default, ``None``) is every grouping, which also has mixed splits across nodes
    (K across two groups of nodes, B across four) and P(S x S) across nodes; two groupings whose digits have the
    same radices made of the same network levels relabel each other's plans of splits, so one of them is searched:
    the one with a pair of consecutive equal digits for P(S x S) where only one has it (:func:`_relabels`). The
    leading grouping comes first, so a tie keeps it (unless another one relabels its plans and has such a pair).

    ``False`` past :data:`GROUPED_DIGITS` digits: ``mesh`` first, then every grouping. A grouping's plans of splits
    are plans on ``mesh``, but its P(S x S) on merged digits (a ring over their devices) is not in ``mesh``'s space,
    and where the full mesh's DP tables are too large the search narrows them (:mod:`primepar_fx.search.solve`):
    either way the full mesh's plan can lose to a grouping's. BLOOM-176B on 32 V100s (``v100-paper``, B = 16,
    S = 2048): 19,562.8 ms a step narrowed, against 19,406.8 ms on ``2x4x4`` with P(S x S) on its ``4x4``. The
    cheapest is kept, a tie keeping ``mesh``'s, so the plan is never worse than a grouping's.

    ``digits`` above :data:`GROUPED_DIGITS` (with ``"all"``) adds the groupings into 4, ..., ``digits`` digits after
    those into three, finer and slower: each 4-digit grouping of 32 devices has ~1,300 sequences per node (the full
    16-device space's) and takes ~20 s to price and search for llama2-70b, against ~1.5 s for a 3-digit one, and
    finds a plan 3.7% faster (``docs/benchmarks/search_time.md``). A tie keeps the coarser grouping's plan.
    ``digits`` at least ``mesh``'s is the full mesh, as ``False``.
    """
    if len(mesh.digits) <= GROUPED_DIGITS:
        return [mesh]
    if digits < GROUPED_DIGITS:
        raise ValueError(f"the groupings have at least {GROUPED_DIGITS} digits, got {digits}")
    if grouped is False or (digits >= len(mesh.digits) and grouped in (None, "all")):
        return [mesh, *search_meshes(mesh, "all", cluster)]
    if grouped is True or grouped == "leading":
        return [mesh.grouped(GROUPED_DIGITS)]
    if grouped is not None and grouped != "all":
        raise ValueError(f"grouped must be None, True, False or one of {list(GROUPINGS)}, got {grouped!r}")
    levels = [cluster.group_level(mesh, (p,)) for p in range(len(mesh.digits))]
    n = len(mesh.digits)
    out: list[DeviceMesh | None] = []  # None: left out after all, for a later one that has its plans and more
    pairs: list[tuple] = []  # per grouping kept, its P(S x S) pairs
    alike: dict[tuple, list[int]] = {}  # the groupings kept per multiset of digits (radix, network levels)
    for k in range(GROUPED_DIGITS, digits + 1):
        leading = tuple(range(n - k + 1, n))  # the cuts between runs of mesh.grouped(k)
        for cut in [leading, *(c for c in itertools.combinations(range(1, n), k - 1) if c != leading)]:
            spans = zip((0, *cut), (*cut, n))
            runs = [(math.prod(mesh.digits[a:b]), _level_parts(mesh, levels, a, b)) for a, b in spans]
            grouping, own = DeviceMesh(tuple(r for r, _ in runs)), _prime_pairs(runs)
            same = [j for j in alike.setdefault(tuple(sorted(runs)), []) if out[j] is not None]
            if any(_relabels(pairs[j], own) for j in same):
                continue  # its plans are relabelings of a kept one's
            weaker = [j for j in same if _relabels(own, pairs[j])]
            for j in weaker[1:]:
                out[j] = None
            if weaker:  # in the place of the first it has every plan of, so the order stays
                out[weaker[0]], pairs[weaker[0]] = grouping, own
            else:
                alike[tuple(sorted(runs))].append(len(out))
                out.append(grouping)
                pairs.append(own)
    return [m for m in out if m is not None]


def search_times(search: dict[str, Any], digits: tuple[int, ...]) -> str:
    """Where a plan's search went, for the ``plan`` command's last line, from its ``search`` record: each grouping
    priced and searched (past three digits; with ``--no-grouped`` the full mesh first) or the one pricing and
    search, and the micro-batch counts tried."""
    if "groupings" in search:
        listed = search["groupings"]
        full = len(listed[0]["digits"]) > GROUPED_DIGITS  # --no-grouped: the full mesh first, then the groupings
        meshes = f"the full mesh and {len(listed) - 1}" if full else f"{len(listed)}"
        kept = "x".join(map(str, digits))
        out = (
            f"{meshes} groupings of the digits priced and searched {search['groupings_s']:.2f} s "
            f"({kept} kept: pricing {search['pricing_s']:.2f} s, search {search['search_s']:.2f} s)"
        )
    else:
        out = f"pricing {search['pricing_s']:.2f} s, search {search['search_s']:.2f} s"
    counts = search.get("micro_batches_tried", [])
    if len(counts) > 1:
        out += f" (micro-batch counts {', '.join(map(str, counts))} tried: {search['planning_s']:.2f} s)"
    return out


def _prime_pairs(runs: list[tuple[int, tuple]]) -> tuple:
    """The pairs of consecutive digits of equal radix, by (radix, network levels), that a P(S x S) can take."""
    return tuple(sorted((runs[i], runs[i + 1]) for i in range(len(runs) - 1) if runs[i][0] == runs[i + 1][0]))


def _relabels(kept: tuple, other: tuple) -> bool:
    """Whether every plan of a grouping with P(S x S) pairs ``other`` is a relabeling of a plan of one with the
    same digits (radices and network levels) in another order and pairs ``kept``.

    Devices relabeled by a permutation of digits of equal radix and levels give plans of splits alone the same
    costs, so groupings with the same digits have the same split-only plans. A P(S x S) takes two consecutive
    digits of one radix, which another order may lack (``2x4x4`` has the pair ``4x4`` across and inside nodes,
    ``4x2x4`` none): a grouping with at most one pair, which the kept one has too, is then a relabeling (its pair
    onto that one, the other digits onto the others); with more pairs it is searched, to be safe."""
    return len(other) <= 1 and set(other) <= set(kept)


class KeptPricings:
    """The pricings one plan makes, by (micro-batch count, mesh, cost options), read again instead of priced again
    (pricing is deterministic, so a pricing read again is the pricing made again): a count's probe and then its
    search price the same meshes, as do a count's search and the probe that found its plan. The oldest are dropped
    past :data:`KEEP_PRICED` bytes of arrays (read when one is added: the one knob
    for the pricings a plan keeps) or ``entries`` pricings."""

    def __init__(self, entries: int) -> None:
        self.entries, self.held = entries, 0
        self._items: dict[tuple, PricedGraph] = {}

    def get(self, key: tuple) -> PricedGraph | None:
        return self._items.get(key)

    def made(self, m: int, mesh: DeviceMesh) -> list[tuple[tuple, PricedGraph]]:
        """The pricings kept of ``mesh`` at ``m`` micro-batches, with their keys (what a worker sends back)."""
        return [(key, priced) for key, priced in self._items.items() if key[:2] == (m, mesh)]

    def run_forked(self, job: Callable[[int], Any], m: int, meshes: list[DeviceMesh], workers: int) -> list[Any]:
        """``job(i)`` for each mesh at ``m`` micro-batches (:func:`~primepar_fx.planning.workers.run_forked`), in
        order; what a worker's jobs priced and kept here (in its copy) comes back with its results and is kept here
        too, so that a later search of that count reads it instead of pricing it again (pickled through the pipe:
        13.6 MB for a llama2-70b grouping at 64 GPUs, against 1-2 s to price it)."""

        def job_here(i: int) -> tuple[Any, list[tuple[tuple, PricedGraph]]]:
            return job(i), []  # what this process prices is kept here already

        def send(done: list[tuple[int, bool, Any]]) -> list[tuple[int, bool, Any]]:
            return [(i, ok, (value[0], self.made(m, meshes[i])) if ok else value) for i, ok, value in done]

        out: list[Any] = [None] * len(meshes)
        for i, ok, value in run_forked(job_here, range(len(meshes)), workers, finish=send):
            out[i], made = value if ok else job_here(i)  # a worker's error: here again, to raise here or to get it
            for key, priced in made:
                self.put(key, priced)
        return out

    def put(self, key: tuple, priced: PricedGraph) -> None:
        size, limit = priced.array_nbytes(), KEEP_PRICED
        if size > limit:
            return
        if key in self._items:
            self.held -= self._items.pop(key).array_nbytes()
        while self._items and (self.held + size > limit or len(self._items) >= self.entries):
            oldest = next(iter(self._items))
            self.held -= self._items.pop(oldest).array_nbytes()
        self._items[key], self.held = priced, self.held + size


def _level_parts(mesh: DeviceMesh, levels: list[int], a: int, b: int) -> tuple[tuple[int, int], ...]:
    """``(level, product of the radices of that level)`` of the run of digits ``a:b``."""
    parts: dict[int, int] = {}
    for p in range(a, b):
        parts[levels[p]] = parts.get(levels[p], 1) * mesh.digits[p]
    return tuple(sorted(parts.items()))


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
    follow: ``{mesh index: (pricing, seconds it took)}``, as long as they stay under :data:`KEEP_PRICED` bytes.

    ``price(mesh, progress)`` prices one mesh. A worker keeps only its cheapest mesh's pricing and sends it back
    with its bounds (that mesh is the likeliest to be searched), so the winner is not priced twice. A worker's
    error is raised here, as this process meets it when it prices that mesh again itself.
    """
    kept: dict[int, tuple[PricedGraph, float]] = {}
    held, planner = 0, os.getpid()
    own: list[tuple[float, int, PricedGraph, float]] = []  # in a worker: its cheapest mesh so far

    def bound(i: int) -> float:
        nonlocal held
        start = time.perf_counter()
        priced = price(meshes[i], progress and workers == 1)
        priced_s = time.perf_counter() - start
        cost = priced.fastest(method).cost
        size = priced.array_nbytes()
        if os.getpid() != planner:  # a worker keeps only its cheapest, for send_own
            if size <= KEEP_PRICED and (not own or cost < own[0][0]):
                own[:] = [(cost, i, priced, priced_s)]
        elif held + size <= KEEP_PRICED:
            kept[i], held = (priced, priced_s), held + size
        return cost

    def send_own(done: list[tuple[int, bool, Any]]) -> list[tuple[int, bool, Any]]:
        if not own:
            return done
        cost, j, priced, priced_s = own[0]
        return [(i, ok, (cost, priced, priced_s) if ok and i == j else value) for i, ok, value in done]

    bounds: list[float | None] = [None] * len(meshes)
    # the meshes of most digits first: they take the longest (a 4-digit grouping ~10x a 3-digit one), and the
    # processes then share out the quick ones (longest processing time first)
    items = sorted(range(len(meshes)), key=lambda i: -len(meshes[i].digits))
    found = run_forked(bound, items, workers, finish=send_own)
    for i, ok, value in tqdm(found, "groupings' bounds", len(meshes), disable=not progress, leave=False):
        if ok and isinstance(value, tuple):  # a worker's cheapest, with its pricing
            value, priced, priced_s = value
            if held + priced.array_nbytes() <= KEEP_PRICED:
                kept[i], held = (priced, priced_s), held + priced.array_nbytes()
        bounds[i] = value if ok else bound(i)
    return bounds, kept
