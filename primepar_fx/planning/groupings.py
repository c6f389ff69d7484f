"""The meshes the free search runs on past three digits: *groupings* of the device digits.

With many digits the full space grows past what the DP tables hold (``docs/benchmarks/search_time.md``), so the
planner searches :func:`search_meshes`: the mesh with runs of consecutive digits merged, :data:`GROUPED_DIGITS`
digits left, and keeps the cheapest plan of them. :class:`Grouped` is the option that picks which.
"""

from __future__ import annotations

import enum
import itertools
import math

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.partition import DeviceMesh

#: the digits of a grouping; with more the full space passes ~700 sequences per node (16 devices: search_time.md)
GROUPED_DIGITS = 3


class Grouped(enum.Enum):
    """Past :data:`GROUPED_DIGITS` device digits, which meshes the free search runs on (:func:`search_meshes`)."""

    #: every grouping of the digits into three (and, with ``group_digits``, into more), the cheapest plan kept
    ALL = "all"
    #: only the grouping that merges the leading (inter-node) digits
    LEADING = "leading"
    #: the full mesh, then every grouping, the cheapest plan kept
    FULL = "full"

    @classmethod
    def of(cls, value: object) -> Grouped:
        """The option from user input: a member or its value; ``None`` is :attr:`ALL`, ``True`` :attr:`LEADING`
        (what ``--grouped`` alone asks for), ``False`` :attr:`FULL` (``--no-grouped``)."""
        if isinstance(value, Grouped):
            return value
        named = {None: cls.ALL, True: cls.LEADING, False: cls.FULL}
        if value is None or isinstance(value, bool):
            return named[value]
        try:
            return cls(value)
        except ValueError:
            choices = [g.value for g in cls]
            raise ValueError(f"grouped must be one of {choices}, None, True or False, got {value!r}") from None


def leading_grouping(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with its leading (inter-node) digits merged into one, :data:`GROUPED_DIGITS` digits left (``mesh``
    itself where it has no more): the first mesh :func:`search_meshes` gives by default."""
    return mesh.grouped(GROUPED_DIGITS) if len(mesh.digits) > GROUPED_DIGITS else mesh


def search_meshes(
    mesh: DeviceMesh, grouped: Grouped, cluster: ClusterSpec, digits: int = GROUPED_DIGITS
) -> list[DeviceMesh]:
    """The meshes the free search runs on, the plan kept being the cheapest of theirs.

    With at most :data:`GROUPED_DIGITS` digits: ``mesh`` itself (the full space). Past that the full space grows
    past what the DP tables hold, so the search runs on *groupings*: ``mesh`` with runs of consecutive digits merged
    into one each, :data:`GROUPED_DIGITS` digits left. A plan on a grouping is a plan on ``mesh`` whose merged digits
    split one dim together. :attr:`Grouped.LEADING` is the one grouping that merges the leading (inter-node) digits
    (:meth:`~primepar_fx.partition.DeviceMesh.grouped`): every split across nodes is of one dim.
    :attr:`Grouped.ALL` (the default) is every grouping, which also has mixed splits across nodes
    (K across two groups of nodes, B across four) and P(S x S) across nodes; two groupings whose digits have the
    same radices made of the same network levels relabel each other's plans of splits, so one of them is searched:
    the one with a pair of consecutive equal digits for P(S x S) where only one has it (:func:`_relabels`). The
    leading grouping comes first, so a tie keeps it (unless another one relabels its plans and has such a pair).

    :attr:`Grouped.FULL`: ``mesh`` first, then every grouping. A grouping's plans of splits are plans on ``mesh``,
    but its P(S x S) on merged digits (a ring over their devices) is not in ``mesh``'s space, and where the full
    mesh's DP tables are too large the search narrows them (:mod:`primepar_fx.search.solve`): either way the full
    mesh's plan can lose to a grouping's (``docs/benchmarks/measured_in_code.md``). The cheapest is kept, a tie
    keeping ``mesh``'s, so the plan is never worse than a grouping's.

    ``digits`` above :data:`GROUPED_DIGITS` (with :attr:`Grouped.ALL`) adds the groupings into 4, ..., ``digits``
    digits after those into three: finer plans, in a space each of whose groupings is many times larger
    (``docs/benchmarks/search_time.md``). A tie keeps the coarser grouping's plan. ``digits`` at least ``mesh``'s is
    the full mesh, as :attr:`Grouped.FULL`.
    """
    if len(mesh.digits) <= GROUPED_DIGITS:
        return [mesh]
    if digits < GROUPED_DIGITS:
        raise ValueError(f"the groupings have at least {GROUPED_DIGITS} digits, got {digits}")
    if grouped is Grouped.FULL or (digits >= len(mesh.digits) and grouped is Grouped.ALL):
        return [mesh, *search_meshes(mesh, Grouped.ALL, cluster)]
    if grouped is Grouped.LEADING:
        return [mesh.grouped(GROUPED_DIGITS)]
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


def _level_parts(mesh: DeviceMesh, levels: list[int], a: int, b: int) -> tuple[tuple[int, int], ...]:
    """``(level, product of the radices of that level)`` of the run of digits ``a:b``."""
    parts: dict[int, int] = {}
    for p in range(a, b):
        parts[levels[p]] = parts.get(levels[p], 1) * mesh.digits[p]
    return tuple(sorted(parts.items()))
