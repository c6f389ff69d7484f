"""Index sets and layouts: which flat indices of a tensor each device holds (paper Eq. 8), as tuples and as int arrays.

A tensor dim is made of iteration dims (major first); a device's DSIs pick one slice of each, and the flat indices
it holds along the dim form an :data:`IndexSet`, a sorted tuple of disjoint half-open intervals
(:func:`index_set`; the arithmetic is in :mod:`primepar_fx.cost.redistribute`'s docstring). A :data:`Layout` lists,
per device and tensor dim, the set held or needed at one ``(phase, t)`` of a partition.

Every distinct set is numbered once in :data:`SETS`, so that a layout is also a ``(world, tensor dims)`` int array
(:func:`layout_ids`) and layouts compare, intern (:func:`intern_rows`) and intersect (:func:`block_overlaps`) as
arrays; :class:`IndexSets` remembers the size of each pair of sets' intersection.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from functools import lru_cache
from math import prod
from types import MappingProxyType

import numpy as np
import sympy

from primepar_fx.partition.dsi import OpPartition, PartitionError, Phase
from primepar_fx.partition.enumerate import ValuesKey
from primepar_fx.partition.mesh import DeviceMesh
from primepar_fx.partition.seq import PartitionSeq, Prime
from primepar_fx.rules.spec import OpDims, TensorMap

#: Sorted, disjoint, half-open ``(start, stop)`` intervals of flat indices along one tensor dim.
IndexSet = tuple[tuple[int, int], ...]
#: Per device (rank order), per tensor dim, the :data:`IndexSet` the device holds or needs.
Layout = tuple[tuple[IndexSet, ...], ...]
PartKey = tuple[OpDims, PartitionSeq, DeviceMesh]


# ---------------------------------------------------------------------------------------------- index sets
@lru_cache(maxsize=1 << 16)
def index_set(sizes: tuple[int, ...], dim_slice: tuple[tuple[int, int], ...]) -> IndexSet:
    """The flat indices ``{sum_j x_j * s_j : i_j * b_j <= x_j < (i_j + 1) * b_j}`` of one tensor dim.

    ``sizes`` are the group's iteration-dim sizes ``n_j`` (major first) and ``dim_slice`` its ``(i_j, p_j)``
    pairs, with ``b_j = n_j / p_j`` and ``s_j`` the product of the more minor sizes. The set is built major to
    minor: the prefix set ``P`` becomes ``{x * n_j + y : x in P, y in block_j}``. A whole block keeps each interval
    contiguous. A proper block turns each prefix value into its own interval, so the result has
    ``prod_{j < j*} b_j`` intervals, where ``j*`` is the most minor split dim.
    """
    out: list[tuple[int, int]] = [(0, 1)]
    for n, (i, p) in zip(sizes, dim_slice):
        if n % p:
            raise PartitionError(f"a dim of size {n} does not split into {p} parts")
        lo, hi = i * n // p, (i + 1) * n // p
        if lo == 0 and hi == n:
            out = [(a * n, b * n) for a, b in out]
        else:
            out = [(x * n + lo, x * n + hi) for a, b in out for x in range(a, b)]
    return tuple(out)


def set_size(s: IndexSet) -> int:
    return sum(b - a for a, b in s)


@lru_cache(maxsize=1 << 16)
def overlap(a: IndexSet, b: IndexSet) -> int:
    """``|a ∩ b|`` of two sorted disjoint interval lists, by a linear two-pointer merge."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            total += hi - lo
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


@lru_cache(maxsize=4096)
def concrete_sizes(op: OpDims, vkey: ValuesKey) -> Mapping[str, int]:
    """Every iteration dim's size at ``values`` as an exact int (raises if a symbol is left or it is fractional)."""
    subs = {k: sympy.Integer(v) for k, v in vkey}
    out = {}
    for d, size in zip(op.dims, op.sizes):
        expr = sympy.sympify(size).xreplace(subs)
        if not expr.is_Integer:
            raise ValueError(f"size {size} of dim {d!r} is not an integer at {dict(vkey)}: {expr}")
        out[d] = int(expr)
    return MappingProxyType(out)


def dim_sizes(op: OpDims, tmap: TensorMap, vkey: ValuesKey) -> tuple[int, ...]:
    """The concrete size of each tensor dim: the product of its group's iteration-dim sizes (1 for ``()``)."""
    sizes = concrete_sizes(op, vkey)
    return tuple(prod(sizes[d] for d in group) for group in tmap)


def covered(bounds: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``F(x) = |B ∩ [0, x)|`` at every ``x`` for a set ``B`` given as its ``(n, 2)`` array of intervals."""
    lo, length = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
    before = np.concatenate(([0], np.cumsum(length)))  # elements of B in the intervals before each one
    n = np.searchsorted(lo, x, side="right")  # intervals of B that start at or before x
    last = np.maximum(n - 1, 0)
    return np.where(n > 0, before[last] + np.minimum(x - lo[last], length[last]), 0)


class IndexSets:
    """Every distinct :data:`IndexSet` met so far, numbered, so that layouts compare and intern as int arrays."""

    #: the sets whose pairwise overlaps are remembered: a table of at most this many squared int64 (128 MiB)
    MEMO_SETS = 4096

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.number: dict[IndexSet, int] = {}
        self.sets: list[IndexSet] = []
        self.bounds: list[np.ndarray] = []  # per set, its intervals as an (n, 2) int64 array
        self.sizes: list[int] = []
        # per set, the Cartesian block it was first numbered as: (iteration-dim sizes, their (lo, hi) bounds), or None
        self.blocks: list[tuple[tuple[int, ...], tuple[tuple[int, int], ...]] | None] = []
        # memo[i, j]: |sets[i] ∩ sets[j]|, -1 until computed; int32 (half the memory to fill and read) until a set
        # has 2**31 elements or more
        self.memo = np.zeros((0, 0), dtype=np.int32)

    def add(self, s: IndexSet, block: tuple[tuple[int, ...], tuple[tuple[int, int], ...]] | None = None) -> int:
        """The number of ``s``, numbering it if it is new. ``block``: ``s`` as the Cartesian block of
        :func:`index_set` (the iteration-dim sizes and each one's ``(lo, hi)``), which intersects with a block over
        the same sizes as a product of interval overlaps (:meth:`_intersect`)."""
        k = self.number.setdefault(s, len(self.sets))
        if k == len(self.sets):
            self.sets.append(s)
            self.bounds.append(np.array(s, dtype=np.int64).reshape(len(s), 2))
            self.sizes.append(set_size(s))
            self.blocks.append(block)
            if self.sizes[-1] > np.iinfo(self.memo.dtype).max:
                with self.lock:
                    self.memo = self.memo.astype(np.int64)
        return k

    def overlaps(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``O[i, j] = |sets[a[i]] ∩ sets[b[j]]|``, each pair of sets intersected once and remembered (up to
        :attr:`MEMO_SETS` sets; past that, pairs among the later sets are intersected on every call)."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        n = min(len(self.sets), self.MEMO_SETS)
        with self.lock:  # the pricing threads share the table (price_directions): one grows it at a time
            if len(self.memo) < n:
                old = self.memo
                grown = np.full((max(n, min(2 * len(old), self.MEMO_SETS)),) * 2, -1, dtype=old.dtype)
                grown[: len(old), : len(old)] = old
                self.memo = grown
            memo = self.memo
        limit = min(len(memo), self.MEMO_SETS)
        if not len(a) or not len(b) or a.max() >= limit or b.max() >= limit:
            return self._intersect(a, b)
        out = memo[np.ix_(a, b)]
        missing = out < 0
        if missing.any():
            rows, cols = np.flatnonzero(missing.any(axis=1)), np.flatnonzero(missing.any(axis=0))
            fresh = self._intersect(a[rows], b[cols])
            memo[np.ix_(a[rows], b[cols])] = fresh  # into a table since swapped for a bigger one: recomputed later
            out[np.ix_(rows, cols)] = fresh
        return out

    def pairwise(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``|sets[a] ∩ sets[b]|`` elementwise, ``a`` and ``b`` broadcast against each other."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        if not a.size or not b.size:
            return np.zeros(np.broadcast_shapes(a.shape, b.shape), dtype=np.int64)
        shape = np.broadcast_shapes(a.shape, b.shape)
        if max(a.max(), b.max()) >= min(len(self.sets), self.MEMO_SETS) or prod(shape) > 4 * (a.size + b.size):
            # an outer product: gather from the small table of the distinct sets, which stays in cache
            (ua, ia), (ub, ib) = self.distinct(a), self.distinct(b)
            return _gather(self.overlaps(ua, ub), ia, ib)
        self.overlaps(a[:0], b[:0])  # grow the table to the sets numbered so far
        out = _gather(self.memo, a, b)
        missing = out < 0
        if missing.any():  # filled from what overlaps returns, not re-read: another thread may swap the table
            wanted = (np.broadcast_to(x, out.shape)[missing] for x in (a, b))
            (ua, ia), (ub, ib) = (np.unique(x, return_inverse=True) for x in wanted)
            out[missing] = self.overlaps(ua, ub)[ia.reshape(-1), ib.reshape(-1)]
        return out

    def distinct(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``np.unique(x, return_inverse=True)`` for an array of set numbers, the inverse shaped like ``x``: marked
        in a table of every set number instead of sorted (the numbers are few and small)."""
        x = np.asarray(x, dtype=np.int64)
        bound = len(self.sets)
        if x.size * 64 < bound:  # a small array among very many sets: sorting is cheaper than the table
            out, inverse = np.unique(x, return_inverse=True)
            return out, inverse.reshape(x.shape)
        seen = np.zeros(bound, dtype=bool)
        seen[x.ravel()] = True
        rank = np.cumsum(seen, dtype=np.int64) - 1
        return np.flatnonzero(seen), rank[x]

    def _intersect(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """:meth:`overlaps` computed. Sets numbered as Cartesian blocks (:func:`set_number`) whose iteration-dim sizes
        have a common refinement (``(8192,)`` and ``(64, 128)``: ``(64, 128)``), each block a block of it too,
        intersect as the product of their per-dim interval overlaps, a few array operations for every such pair at
        once; the other pairs by their intervals (:meth:`_intersect_intervals`). Sets are numbered by content, so a
        set met in a larger domain (``[0, 1024)`` of a dim of 2048) may carry the block of a smaller one: it is the
        same block behind a leading dim of the ratio, at index 0."""
        out = np.empty((len(a), len(b)), dtype=np.int64)
        sizes_a = [None if (f := self.blocks[i]) is None else f[0] for i in a.tolist()]
        sizes_b = [None if (f := self.blocks[j]) is None else f[0] for j in b.tolist()]
        rows: dict[object, list[int]] = {}
        cols: dict[object, list[int]] = {}
        for r, key in enumerate(sizes_a):
            rows.setdefault(key, []).append(r)
        for c, key in enumerate(sizes_b):
            cols.setdefault(key, []).append(c)
        for ka, ra in rows.items():
            for kb, cb in cols.items():
                ri, ci = np.array(ra), np.array(cb)
                ba = bb = None
                if ka is not None and kb is not None and prod(ka) and prod(kb):  # type: ignore[arg-type]
                    # a set is also a block of a larger domain it starts: a leading dim of the ratio, at its index 0
                    na, nb = prod(ka), prod(kb)  # type: ignore[arg-type]
                    lead_a, lead_b = (nb // na, 1) if nb % na == 0 else (1, na // nb) if na % nb == 0 else (0, 0)
                    common = _refinement((lead_a, *ka), (lead_b, *kb)) if lead_a else None  # type: ignore[misc]
                    ba = None if common is None else self._refined(a[ri], common, lead_a)
                    bb = None if common is None else self._refined(b[ci], common, lead_b)
                if ba is None or bb is None:
                    out[np.ix_(ri, ci)] = self._intersect_intervals(a[ri], b[ci])
                    continue
                lo = np.maximum(ba[:, None, :, 0], bb[None, :, :, 0])
                hi = np.minimum(ba[:, None, :, 1], bb[None, :, :, 1])
                out[np.ix_(ri, ci)] = np.maximum(hi - lo, 0).prod(axis=-1)
        return out

    def _refined(self, ids: np.ndarray, common: tuple[int, ...], lead: int) -> np.ndarray | None:
        """The blocks of sets ``ids``, each behind a leading dim of size ``lead`` at index 0, over the refined sizes
        ``common``, ``(len(ids), len(common), 2)``; ``None`` where one is not a block there (a split across the
        refined dims' boundaries)."""
        out = []
        for i in ids.tolist():
            sizes, bounds = self.blocks[i]  # type: ignore[misc]
            refined = _refine_block((lead, *sizes), ((0, 1), *bounds), common)
            if refined is None:
                return None
            out.append(refined)
        return np.array(out, dtype=np.int64).reshape(len(ids), len(common), 2)

    def _intersect_intervals(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """:meth:`overlaps` computed by intervals, one set of the shorter list at a time, vectorised over the
        intervals of all the sets of the longer.

        An interval ``[lo, hi)`` meets a set ``B`` in ``F_B(hi) - F_B(lo)`` elements (:func:`covered`), and
        ``|A ∩ B|`` is the sum of that over the intervals of ``A``; the count is symmetric.
        """
        if len(a) < len(b):
            return self._intersect_intervals(b, a).T.copy()
        out = np.zeros((len(a), len(b)), dtype=np.int64)
        if not len(a):
            return out
        bounds = np.concatenate([self.bounds[i] for i in a])
        starts = np.cumsum([0] + [len(self.bounds[i]) for i in a[:-1]])
        for j, k in enumerate(b):
            within = covered(self.bounds[k], bounds[:, 1]) - covered(self.bounds[k], bounds[:, 0])
            out[:, j] = np.add.reduceat(within, starts)
        return out


@lru_cache(maxsize=4096)
def _refinement(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The coarsest sizes (major first) that refine both decompositions ``a`` and ``b`` of one tensor dim: their
    strides (products of the more minor sizes) together, where each divides the next larger; ``None`` where they
    do not (``(4, 6)`` and ``(2, 3, 4)``) or the dims differ in size."""
    if prod(a) != prod(b):
        return None
    strides = sorted({prod(a[k:]) for k in range(len(a) + 1)} | {prod(b[k:]) for k in range(len(b) + 1)})
    if any(big % small for small, big in zip(strides, strides[1:])):
        return None
    return tuple(big // small for small, big in zip(strides[-2::-1], strides[:0:-1]))


@lru_cache(maxsize=1 << 16)
def _refine_block(
    sizes: tuple[int, ...], bounds: tuple[tuple[int, int], ...], common: tuple[int, ...]
) -> tuple[tuple[int, int], ...] | None:
    """The block ``bounds`` (a ``[lo, hi)`` per dim of ``sizes``) as a block over ``common``, a refinement of
    ``sizes``; ``None`` where an interval is not one there (it spans part of a more minor refined dim)."""
    out: list[tuple[int, int]] = []
    k = 0
    for n, (lo, hi) in zip(sizes, bounds):
        parts = []  # the refined sizes that make up n, major first
        while prod(parts) < n:
            parts.append(common[k])
            k += 1
        for j in range(len(parts)):
            minor = prod(parts[j + 1 :])
            first, last = lo // minor, (hi - 1) // minor
            if first == last:  # one digit here: the rest of the interval is inside it
                out.append((first, first + 1))
                lo, hi = lo - first * minor, hi - first * minor
                continue
            if lo % minor or hi % minor:
                return None
            out.append((first, last + 1))
            out.extend((0, m) for m in parts[j + 1 :])
            break
    return tuple(out)


def _gather(table: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``table[rows, cols]`` with ``rows`` and ``cols`` broadcast, as one ``take`` on flat indices, which numpy
    runs faster than two-array fancy indexing on these shapes (measured: ``docs/benchmarks/measured_in_code.md``)."""
    return table.ravel().take(rows * table.shape[1] + cols)


#: The numbering of every index set in a layout (:func:`layout_ids`); :func:`clear_layout_caches` resets it.
SETS = IndexSets()


@lru_cache(maxsize=1 << 16)
def set_number(sizes: tuple[int, ...], dim_slice: tuple[tuple[int, int], ...]) -> int:
    """The number in :data:`SETS` of :func:`index_set` ``(sizes, dim_slice)``."""
    bounds = tuple((i * n // p, (i + 1) * n // p) for n, (i, p) in zip(sizes, dim_slice))
    return SETS.add(index_set(sizes, dim_slice), (sizes, bounds))


@lru_cache(maxsize=1 << 14)
def layout_ids(key: PartKey, tmap: TensorMap, phase: Phase, t: int, vkey: ValuesKey) -> np.ndarray:
    """:func:`layout` as a ``(world, tensor dims)`` int64 array of :data:`SETS` numbers (read-only).

    Devices that hold the same slice of a tensor dim share its set, which is built once: the DSIs of every device
    come from :meth:`OpPartition.dsi_table`, and the slices of a dim are told apart by their mixed-radix code. The
    array depends only on each tensor dim's iteration dims (size, parts, every device's DSI), so different ops
    and partitions that slice a tensor alike share one (:func:`_layout_of_slices`).
    """
    part = bound_partition(key)
    sizes = concrete_sizes(part.op, vkey)
    idx = _split_dsis(key, phase, t)
    zero = _zero_dsis(part.mesh.size)
    return _layout_of_slices(
        part.mesh.size, tuple(tuple((sizes[d], part.parts[d], idx.get(d, zero)) for d in group) for group in tmap)
    )


#: :func:`_split_dsis` per ``(seq, mesh, phase, t, matmul roles when the sequence has a P(S x S))``
_SPLIT_DSIS: dict[tuple, dict[str, bytes]] = {}


def _split_dsis(key: PartKey, phase: Phase, t: int) -> dict[str, bytes]:
    """Every device's DSI (int64 bytes, rank order) of each dim the partition cuts; an uncut dim's is 0 everywhere.

    Algorithm 1 reads only the sequence, the mesh and, for a P(S x S), which dims are M, N and K, so ops that share
    a sequence share the table."""
    op, seq, mesh = key
    prime = any(isinstance(e, Prime) for e in seq.elements)
    memo = (seq, mesh, phase, t, op.matmul if prime else None)
    if memo not in _SPLIT_DSIS:
        part = bound_partition(key)
        table = part.dsi_table(phase, t)
        _SPLIT_DSIS[memo] = {d: table[d].tobytes() for d in op.dims if part.parts[d] > 1}
    return _SPLIT_DSIS[memo]


@lru_cache(maxsize=64)
def _zero_dsis(world: int) -> bytes:
    return np.zeros(world, dtype=np.int64).tobytes()


@lru_cache(maxsize=1 << 15)
def bound_partition(key: PartKey) -> OpPartition:
    """One shared :class:`OpPartition` per ``(op, seq, mesh)`` (binding a sequence is checked work; read it only)."""
    return OpPartition(*key)


@lru_cache(maxsize=1 << 14)
def _layout_of_slices(world: int, groups: tuple[tuple[tuple[int, int, bytes], ...], ...]) -> np.ndarray:
    """:func:`layout_ids` from each tensor dim's ``(size, parts, DSI of every device as int64 bytes)`` per
    iteration dim.

    A device's slice of a tensor dim is its mixed-radix code over the parts of the dim's iteration dims, so the set
    numbers of one ``(sizes, parts)`` are a table indexed by code (:func:`_code_sets`), filled as codes are met."""
    out = np.empty((world, len(groups)), dtype=np.int64)
    for k, group in enumerate(groups):
        code = np.zeros(world, dtype=np.int64)
        for _, parts, dsi in group:
            code = code * parts + np.frombuffer(dsi, dtype=np.int64)
        sizes, parts = tuple(g[0] for g in group), tuple(g[1] for g in group)
        table = _code_sets(sizes, parts)
        numbers = table[code]
        if (numbers < 0).any():
            for c in np.unique(code[numbers < 0]).tolist():
                table[c] = set_number(sizes, tuple(zip(_digits(c, parts), parts)))
            numbers = table[code]
        out[:, k] = numbers
    out.flags.writeable = False
    return out


#: :func:`_code_sets` per ``(sizes, parts)``: the set number of every slice code met so far, -1 for the others
_CODE_SETS: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}


def _code_sets(sizes: tuple[int, ...], parts: tuple[int, ...]) -> np.ndarray:
    """The (mutable) table of :data:`SETS` numbers by mixed-radix slice code of a tensor dim whose iteration dims
    have ``sizes`` and split into ``parts``."""
    key = (sizes, parts)
    if key not in _CODE_SETS:
        _CODE_SETS[key] = np.full(prod(parts), -1, dtype=np.int64)
    return _CODE_SETS[key]


def _digits(code: int, parts: tuple[int, ...]) -> list[int]:
    """The mixed-radix digits of ``code`` over ``parts``, the first (major) first."""
    out = []
    for p in reversed(parts):
        code, i = divmod(code, p)
        out.append(i)
    return out[::-1]


@lru_cache(maxsize=1 << 14)
def layout(key: PartKey, tmap: TensorMap, phase: Phase, t: int, vkey: ValuesKey) -> Layout:
    """Per device (rank order) and tensor dim, the :data:`IndexSet` of ``tmap`` at ``(phase, t)`` (Eq. 8)."""
    return tuple(tuple(SETS.sets[k] for k in row) for row in layout_ids(key, tmap, phase, t, vkey).tolist())


def part_key(part: OpPartition) -> PartKey:
    """A hashable key for an :class:`OpPartition`, which holds a dict and so cannot be hashed itself."""
    return part.op, part.seq, part.mesh


# ------------------------------------------------------------------------------------------ as arrays
def array_digest(*arrays: np.ndarray) -> bytes:
    """A 16-byte digest of int arrays (shapes and values): a cheap memo key for arrays of layouts."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(repr(a.shape).encode())
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.digest()


def intern_rows(items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``items`` (non-negative ints, sorted) and, for each row, the index of its distinct copy.

    Short rows are read as one mixed-radix number each, which keeps their order, and numbered with a 1-d unique."""
    rows = items.reshape(len(items), -1)
    base = int(rows.max()) + 1 if rows.size else 1
    if rows.shape[1] * max(1, base - 1).bit_length() <= 62:
        code = np.zeros(len(rows), dtype=np.int64)
        for col in rows.T:
            code = code * base + col
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        distinct = rows[first]
    else:  # long rows (whole layouts): unique as raw bytes (memcmp order), then the few distinct rows sorted
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        raw = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)
        _, first, at = np.unique(raw, return_index=True, return_inverse=True)
        at = at.reshape(-1)
        distinct = rows[first]
        order = np.lexsort(distinct.T[::-1])  # lexicographic, first column most significant
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        distinct, inverse = distinct[order], rank[at]
    return distinct.reshape(len(distinct), *items.shape[1:]), inverse.reshape(-1)


def block_overlaps(held: np.ndarray, needed: np.ndarray) -> np.ndarray:
    """``prod_d |held[..., d] ∩ needed[..., d]|``: the overlap of Cartesian blocks given as :data:`SETS` numbers
    along the last axis, the leading axes broadcast. Each pair of sets is intersected once
    (:meth:`IndexSets.pairwise`)."""
    out = np.ones(np.broadcast_shapes(held.shape[:-1], needed.shape[:-1]), dtype=np.int64)
    for d in range(held.shape[-1]):
        out *= SETS.pairwise(held[..., d], needed[..., d])
    return out


def clear_layout_caches() -> None:
    """Drop the memoised sizes, sets, layouts and overlaps."""
    concrete_sizes.cache_clear()
    layout.cache_clear()
    layout_ids.cache_clear()
    _SPLIT_DSIS.clear()
    bound_partition.cache_clear()
    _layout_of_slices.cache_clear()
    _CODE_SETS.clear()
    set_number.cache_clear()
    index_set.cache_clear()
    overlap.cache_clear()
    SETS.clear()
