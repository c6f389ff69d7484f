"""Inter-operator redistribution traffic of one graph edge (paper §4, Eq. 8-9).

An edge carries one tensor from output ``j`` of a producer node to input ``k`` of a consumer node. Each side
describes the tensor with its own :data:`~primepar_fx.rules.spec.TensorMap` over its own iteration dims, and
the two may factor a tensor dim differently (producer ``("B", "S")`` vs consumer ``("BS",)``). Both describe
the same shape, so a tensor dim is compared through its *flat index* ``0 .. n-1``.

**Index set of a tensor dim (Eq. 8, generalised to merged dims).** Let a tensor dim be made of the iteration
dims ``X_1 .. X_m`` (major first) of sizes ``n_1 .. n_m``, cut into ``p_1 .. p_m`` parts, and let device ``D``
hold slice ``i_j = I_{X_j}(D, t)`` of each. With block ``b_j = n_j / p_j`` and stride
``s_j = n_{j+1} * ... * n_m``, ``D`` holds the flat indices::

    S(D) = { sum_j x_j * s_j  :  i_j * b_j <= x_j < (i_j + 1) * b_j }

For one iteration dim this is the paper's ``S_X(D) = [b * I_X : b * I_X + b]``. When a minor dim of a merged
group is split, ``S(D)`` is a union of intervals (strided). It is stored as a sorted tuple of disjoint
half-open ``(start, stop)`` intervals. A broadcast dim ``()`` has size 1 and the set ``{0}``. The block a device
holds is the Cartesian product of its per-dim sets.

**Traffic (Eq. 9).** ``held(D)`` is the producer's ``out_j`` at its last Forward step (``t = steps - 1``), and
``needed(D)`` is the consumer's ``in_k`` at its first Forward step (``t = 0``)::

    V_D     = prod_d |needed_d(D)|
    fwd(D)  = V_D - prod_d |held_d(D) ∩ needed_d(D)|
    forward = sum_D fwd(D)

Backward is the same formula with the roles swapped. The consumer holds ``d_in_k`` at the last step of the phase
that produces it: Backward, or Gradient when input ``k`` is a parameter. The producer needs ``d_out_j`` at its
first Backward step (``t = 0``). An input in ``op.no_grad`` has no backward traffic. Only the elements that device
``D`` itself lacks count, so a block that several devices hold is never counted twice (Eq. 9 as written).

**Partial sums.** If a summed dim of the result is split, the producer's ``out_j`` or the consumer's ``d_in_k`` is
a partial sum until its all-reduce runs (:func:`primepar_fx.partition.collectives`). The cost model prices that
all-reduce separately (Eq. 7). Here every held set is the one after the all-reduce, which is what
``OpPartition.tensor_slice`` describes: it does not depend on the summed dims.

**Messages.** The runtime (:class:`~primepar_fx.runtime.exchange.Exchange`) sends device ``D`` each block it lacks
from the holder nearest in device-ID digits, the lowest rank on a tie
(:func:`~primepar_fx.partition.mesh.nearest_holder`), one message per sender. The blocks of one layout are equal or
disjoint, so its devices form classes that hold one block each, and ``D`` receives one message from every other
class whose block meets ``needed(D)`` (:meth:`LayoutPairs.messages`, with
:func:`~primepar_fx.partition.mesh.class_senders` the rule for all pairs of ranks at once). The cost model prices
these messages (:func:`primepar_fx.cost.model.p2p_seconds`).

Sizes are sympy expressions in ``B`` and ``S``. They are evaluated at the caller's ``values`` (required), so every
count is an exact integer. Index sets and layouts live in :mod:`primepar_fx.partition.layouts`: every distinct set is
numbered once, and a layout is memoised per ``(op, seq, mesh, tmap, phase, t, values)`` as an int array of set
numbers. :func:`redistribution_matrix` prices every (producer strategy, consumer strategy) pair of an edge at once with
numpy (:class:`LayoutPairs`), intersecting each distinct pair of sets once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import NamedTuple

import numpy as np
import sympy

from primepar_fx.partition.comm import gradient_phase_inputs
from primepar_fx.partition.dsi import OpPartition, Phase
from primepar_fx.partition.enumerate import ValuesKey, values_key
from primepar_fx.partition.layouts import (
    SETS,
    IndexSet,
    Layout,
    PartKey,
    array_digest,
    block_overlaps,
    clear_layout_caches,
    dim_sizes,
    intern_rows,
    layout,
    layout_ids,
    overlap,
    part_key,
    set_size,
)
from primepar_fx.partition.mesh import DeviceMesh, class_senders
from primepar_fx.rules.spec import TensorMap


@dataclass(frozen=True, slots=True)
class Redistribution:
    """Eq. 9 traffic of one edge under one (producer, consumer) strategy pair, in elements.

    Attributes:
        forward_elems: ``sum_D (V_D - |held(D) ∩ needed(D)|)`` for the activation.
        backward_elems: the same for the gradient, consumer ``d_in`` to producer ``d_out``.
        per_device_forward: the forward term of each device, in rank order (what device ``D`` receives).
        per_device_backward: the backward term of each device, in rank order.
        is_permutation: the forward redistribution is a P2P permutation. Every device that lacks part of its
            needed block finds the whole block on exactly one other device, those senders are pairwise
            distinct and are not devices that keep their own block, and at least one device receives
            (the Cannon skew between two P(S x S) linears).
        backward_is_permutation: the same test for the backward redistribution.
    """

    forward_elems: int
    backward_elems: int
    per_device_forward: tuple[int, ...]
    per_device_backward: tuple[int, ...]
    is_permutation: bool
    backward_is_permutation: bool = False

    def bytes(self, itemsize: int) -> tuple[int, int]:
        """``(forward, backward)`` traffic in bytes for elements of ``itemsize`` bytes."""
        return self.forward_elems * itemsize, self.backward_elems * itemsize

    @property
    def total_elems(self) -> int:
        return self.forward_elems + self.backward_elems


# ------------------------------------------------------------------------------------------------ the edge
class EdgeUse(NamedTuple):
    """Where one side of an edge holds or needs the tensor: the partition, its map and ``(phase, t)`` (a named tuple:
    pricing makes one per strategy and use, tens of thousands a grouping)."""

    key: PartKey
    tmap: TensorMap
    phase: Phase
    t: int

    def layout(self, vkey: ValuesKey) -> Layout:
        return layout(self.key, self.tmap, self.phase, self.t, vkey)

    def layout_ids(self, vkey: ValuesKey) -> np.ndarray:
        return layout_ids(self.key, self.tmap, self.phase, self.t, vkey)


def _out_map(part: OpPartition, out_index: int) -> TensorMap:
    if not 0 <= out_index < len(part.op.outputs):
        raise ValueError(f"the producer has {len(part.op.outputs)} outputs, not an output {out_index}")
    return part.op.outputs[out_index]


def _in_map(part: OpPartition, in_index: int) -> TensorMap:
    if not 0 <= in_index < len(part.op.inputs) or part.op.inputs[in_index] is None:
        raise ValueError(f"the consumer has no tensor input {in_index}")
    return part.op.inputs[in_index]  # type: ignore[return-value]


def forward_held(producer: OpPartition, out_index: int) -> EdgeUse:
    """The producer holds ``out_j`` at its last Forward step (``t = steps - 1``)."""
    return EdgeUse(part_key(producer), _out_map(producer, out_index), Phase.FORWARD, producer.steps - 1)


def forward_needed(consumer: OpPartition, in_index: int) -> EdgeUse:
    """The consumer needs ``in_k`` at its first Forward step (``t = 0``)."""
    return EdgeUse(part_key(consumer), _in_map(consumer, in_index), Phase.FORWARD, 0)


def backward_held(consumer: OpPartition, in_index: int) -> EdgeUse | None:
    """The consumer holds ``d_in_k`` at the last step of Backward (Gradient for a parameter); ``None`` if no_grad."""
    if in_index in consumer.op.no_grad:
        return None
    phase = Phase.GRADIENT if in_index in gradient_phase_inputs(consumer.op) else Phase.BACKWARD
    return EdgeUse(part_key(consumer), _in_map(consumer, in_index), phase, consumer.steps - 1)


def backward_needed(producer: OpPartition, out_index: int) -> EdgeUse:
    """The producer needs ``d_out_j`` at its first Backward step (``t = 0``)."""
    return EdgeUse(part_key(producer), _out_map(producer, out_index), Phase.BACKWARD, 0)


def _source_held(producer: OpPartition, index: int, shared: bool) -> EdgeUse:
    """What the source side holds: its output, or (``shared``) its Forward-start block of a parameter input."""
    return forward_needed(producer, index) if shared else forward_held(producer, index)


def source_grad_needed(producer: OpPartition, index: int, shared: bool) -> EdgeUse:
    """Where the source side needs the gradient: its ``d_out``, or a shared parameter's storage layout."""
    return forward_needed(producer, index) if shared else backward_needed(producer, index)


def check_edge(
    producer: OpPartition, out_index: int, consumer: OpPartition, in_index: int, vkey: ValuesKey, shared: bool = False
) -> None:
    """Raise ``ValueError`` unless both sides use one mesh and describe the same tensor shape at ``values``."""
    if producer.mesh != consumer.mesh:
        raise ValueError(f"producer mesh {producer.mesh.digits} differs from consumer mesh {consumer.mesh.digits}")
    a = dim_sizes(producer.op, _in_map(producer, out_index) if shared else _out_map(producer, out_index), vkey)
    b = dim_sizes(consumer.op, _in_map(consumer, in_index), vkey)
    if a != b:
        raise ValueError(f"producer output {out_index} has shape {a} but consumer input {in_index} has shape {b}")


# --------------------------------------------------------------------------------------------- one pair
def per_device_traffic(held: Layout, needed: Layout) -> tuple[int, ...]:
    """``V_D - prod_d |held_d(D) ∩ needed_d(D)|`` for every device ``D`` (Eq. 9, one term per device)."""
    return tuple(
        prod(set_size(n) for n in need) - prod(overlap(h, n) for h, n in zip(have, need))
        for have, need in zip(held, needed)
    )


def _contains(have: tuple[IndexSet, ...], need: tuple[IndexSet, ...]) -> bool:
    """``need ⊆ have`` for Cartesian products: every per-dim set is contained (the need is never empty)."""
    return all(overlap(h, n) == set_size(n) for h, n in zip(have, need))


def is_permutation(held: Layout, needed: Layout, traffic: Sequence[int]) -> bool:
    """Whether the devices that receive (``traffic[D] > 0``) form a P2P permutation.

    Each receiver ``D`` needs a sender ``σ(D) ≠ D`` that holds all of ``needed(D)``, and that sender must be
    unique. The senders must be pairwise distinct and must not be devices that keep their own block
    (``traffic = 0``). At least one device receives.
    """
    movers = [d for d, v in enumerate(traffic) if v]
    if not movers:
        return False
    senders: set[int] = set()
    for d in movers:
        size = prod(set_size(n) for n in needed[d])
        found = [
            e
            for e, have in enumerate(held)
            if e != d and prod(set_size(h) for h in have) >= size and _contains(have, needed[d])
        ]
        if len(found) != 1 or found[0] in senders:
            return False
        senders.add(found[0])
    return not senders - set(movers)


def redistribution(
    producer: OpPartition,
    out_index: int,
    consumer: OpPartition,
    in_index: int,
    values: Mapping[sympy.Symbol, int],
) -> Redistribution:
    """Eq. 9 traffic of the edge ``producer.out[out_index] -> consumer.in[in_index]``, Forward and Backward.

    ``values`` gives the concrete ``B`` and ``S`` (e.g. ``{B: 8, S: 2048}``). Partial sums are assumed
    all-reduced (that collective is priced by the intra-operator cost). Raises ``ValueError`` when the meshes or
    the two shapes differ, or a dim does not split evenly at ``values``.
    """
    vkey = values_key(values)
    check_edge(producer, out_index, consumer, in_index, vkey)
    held, needed = forward_held(producer, out_index).layout(vkey), forward_needed(consumer, in_index).layout(vkey)
    fwd = per_device_traffic(held, needed)
    grad = backward_held(consumer, in_index)
    if grad is None:
        bwd: tuple[int, ...] = (0,) * producer.mesh.size
        bwd_perm = False
    else:
        g_held, g_needed = grad.layout(vkey), backward_needed(producer, out_index).layout(vkey)
        bwd = per_device_traffic(g_held, g_needed)
        bwd_perm = is_permutation(g_held, g_needed, bwd)
    return Redistribution(sum(fwd), sum(bwd), fwd, bwd, is_permutation(held, needed, fwd), bwd_perm)


# ------------------------------------------------------------------------------------------- who sends
@lru_cache(maxsize=1 << 12)
def _class_words(
    first: tuple[int, ...], mesh: DeviceMesh, devices_per_node: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(leads, far, absent)`` for a held layout whose rank ``r`` holds the block of rank ``first[r]`` (the first
    rank holding it), the ranks ``r`` packed 64 to a word (:func:`_pack_ranks`): ``leads[w]``, the ranks that are
    the first of their class (one per class, standing for it); ``far[w, k]``, those whose class's sender to ``k``
    (:func:`class_senders`) is on another node than ``k`` (never ``k``'s own class: ``k`` holds its block);
    ``absent[w, n]``, those whose class has no rank on node ``n``."""
    cls = np.asarray(first)
    ranks = np.arange(mesh.size)
    leads = cls == ranks
    node = ranks // devices_per_node
    far = leads[:, None] & (node[class_senders(first, mesh)] != node[None, :])
    on = np.zeros((mesh.size, int(node.max()) + 1), dtype=bool)  # on[r, n]: a rank of r's class is on node n
    on[cls, node] = True
    return _pack_ranks(leads), _pack_ranks(far), _pack_ranks(leads[:, None] & ~on)


def _pack_ranks(flags: np.ndarray) -> np.ndarray:
    """``flags`` (ranks on axis 0) packed 64 ranks to a uint64 word: ``(words, ...)``, rank ``r`` bit ``r % 64`` of
    word ``r // 64`` (:func:`_pack`)."""
    return np.stack([_pack(flags[None, r : r + 64])[0] for r in range(0, len(flags), 64)])


def _pack(flags: np.ndarray) -> np.ndarray:
    """``out[i, ...] = sum_r flags[i, r, ...] << r`` for at most 64 flags along axis 1, as uint64: the flags packed
    8 to a byte (least significant bit first), the 8 bytes read as one little-endian word."""
    packed = np.moveaxis(np.packbits(flags, axis=1, bitorder="little"), 1, -1)
    if packed.shape[-1] < 8:
        packed = np.concatenate([packed, np.zeros((*packed.shape[:-1], 8 - packed.shape[-1]), np.uint8)], axis=-1)
    return np.ascontiguousarray(packed).view(np.dtype("<u8")).astype(np.uint64, copy=False)[..., 0]


def _popcount(words: np.ndarray) -> np.ndarray:
    """The set bits of each uint64."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(words)
    return np.unpackbits(words[..., None].view(np.uint8), axis=-1).sum(axis=-1, dtype=np.uint8)


# ------------------------------------------------------------------------------------------- all pairs
@dataclass(frozen=True, slots=True)
class LayoutPairs:
    """Every (held layout, needed layout) pair of one edge, from :func:`layout_ids` arrays, one per strategy.

    Equal layouts are priced once: ``held_of[i]`` and ``needed_of[j]`` index the distinct layouts ``held`` and
    ``needed``, ``(distinct layouts, world, tensor dims)`` arrays of :data:`SETS` numbers.
    """

    held_of: np.ndarray
    needed_of: np.ndarray
    held: np.ndarray
    needed: np.ndarray

    @classmethod
    def build(cls, helds: Sequence[np.ndarray], neededs: Sequence[np.ndarray]) -> LayoutPairs:
        """From one :func:`layout_ids` array per strategy of each side."""
        (held, held_of), (needed, needed_of) = intern_rows(np.stack(helds)), intern_rows(np.stack(neededs))
        return cls(held_of, needed_of, held, needed)

    def digest(self) -> bytes:
        """A digest of the distinct layouts: pairs with equal digests price alike whatever their strategies."""
        return array_digest(self.held, self.needed)

    def _volume(self) -> np.ndarray:
        """``V[j, D]``: the elements of device ``D``'s needed block under distinct needed layout ``j``."""
        return np.prod(np.array(SETS.sizes, dtype=np.int64)[self.needed], axis=-1)

    def received(self, budget: int = 1 << 22) -> np.ndarray:
        """``R[i, j, D] = V_jD - prod_d |held_i,d(D) ∩ needed_j,d(D)|``: what device ``D`` receives (one Eq. 9 term)
        under distinct held layout ``i`` and distinct needed layout ``j``, in chunks of at most ``budget`` device
        pairs.

        Layouts that differ in one dim repeat the others, so each dim's factor is a table over the distinct rows
        (every device's set) of that dim on either side, read for every pair of layouts a row of devices at a time.
        """
        volume = self._volume()
        held, world, dims = self.held.shape
        factors = []
        for d in range(dims):
            held_rows, held_of = intern_rows(np.ascontiguousarray(self.held[:, :, d]))
            needed_rows, needed_of = intern_rows(np.ascontiguousarray(self.needed[:, :, d]))
            # int64: the product of a few int32 overlaps can pass 2^31
            table = SETS.pairwise(held_rows[:, None], needed_rows[None]).astype(np.int64).reshape(-1, world)
            factors.append((table, held_of * len(needed_rows), needed_of))
        out = np.empty((held, *volume.shape), dtype=np.int64)
        chunk = max(1, budget // max(1, volume.size))
        for lo in range(0, held, chunk):
            i = slice(lo, lo + chunk)
            overlap = None
            for table, row, col in factors:
                factor = np.take(table, row[i, None] + col[None], axis=0)  # [held layout, needed layout, device]
                overlap = factor if overlap is None else np.multiply(overlap, factor, out=overlap)
            out[i] = volume[None] - (1 if overlap is None else overlap)
        return out

    def traffic(self, received: np.ndarray | None = None) -> np.ndarray:
        """``M[i, j] = sum_D (V_jD - prod_d |held_i,d(D) ∩ needed_j,d(D)|)`` (Eq. 9, vectorised) for every strategy
        pair, from :meth:`received` (computed when not given)."""
        total = (self.received() if received is None else received).sum(axis=-1)
        return total[self.held_of][:, self.needed_of]

    def messages(self, mesh: DeviceMesh, devices_per_node: int, budget: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
        """``(M, X)``, ``(distinct held, distinct needed, world)`` arrays: ``M[i, j, k]`` is the number of ranks that
        send device ``k`` part of its needed block by the runtime's rule (:func:`class_senders`), one message each,
        and ``X[i, j, k]`` whether one of them sits on another node than ``k``. :meth:`exchange` says how."""
        count, cross, _ = self.exchange(mesh, devices_per_node, budget)
        return count, cross

    def exchange(
        self, mesh: DeviceMesh, devices_per_node: int, budget: int = 1 << 22, received: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(M, X, L)``: :meth:`messages` and, per pair of distinct layouts, ``L[i, j]``: every device finds its
        needed block on its own node (:meth:`node_local_distinct` on nodes of ``devices_per_node`` ranks).
        ``received``: :meth:`received`, where the caller has it.

        The blocks of one layout are equal or disjoint, so its devices fall into classes that hold one block each.
        Device ``k`` receives one message from every other class whose block meets its needed block, sent by that
        class's :func:`nearest_holder`. Two blocks meet when they meet in every dim. For each held layout and each
        distinct needed block (far fewer than layouts times devices), the ranks whose blocks meet it are packed 64
        to a word (:meth:`_meets`), and from these words:

        * ``M``: the classes whose blocks meet the needed block (a popcount over the first rank of each class), less
          ``k``'s own class where it meets it, which is where ``k`` receives less than all of its block;
        * ``X``: a class whose block meets it has its sender to ``k`` on another node;
        * ``L``: no device's needed block meets a class that has no rank on its node (the classes' blocks are
          disjoint, so the part of a needed block in such a class's block is held only off the node).
        """
        world, dims = self.held.shape[1:]
        received = self.received(budget) if received is None else received
        _, hid = intern_rows(self.held.reshape(-1, dims))
        hid = hid.reshape(len(self.held), world)
        first = (hid[:, :, None] == hid[:, None, :]).argmax(axis=-1)  # first[i, r]: the first rank of r's class
        blocks, block_of = intern_rows(self.needed.reshape(-1, dims))
        block_of = block_of.reshape(len(self.needed), world)
        node = np.arange(world) // devices_per_node
        own = received < self._volume()[None]  # [i, j, k]: k's own class's block meets k's needed block
        count = np.empty(received.shape, dtype=np.int32)
        cross = np.zeros(received.shape, dtype=bool)
        elsewhere = np.zeros(received.shape[:2], dtype=bool)  # some device's needed block is not on its node
        chunk = max(1, budget // max(1, len(self.needed) * world))
        for lo in range(0, len(self.held), chunk):
            i = slice(lo, lo + chunk)
            rows = first[i].tolist()
            leads, far, absent = (
                np.stack(a) for a in zip(*(_class_words(tuple(r), mesh, devices_per_node) for r in rows))
            )
            classes = np.zeros((len(rows), len(blocks)), dtype=np.int32)  # [i, needed block]: classes that meet it
            for w, meet in enumerate(self._meets(i, blocks)):
                classes += _popcount(meet & leads[:, w, None])
                bits = np.take(meet, block_of, axis=1)  # [held layout, needed layout, device]
                elsewhere[i] |= np.bitwise_and(bits, absent[:, w, node][:, None], out=np.empty_like(bits)).any(axis=-1)
                cross[i] |= np.bitwise_and(bits, far[:, w][:, None], out=bits) != 0
            np.subtract(np.take(classes, block_of, axis=1), own[i], out=count[i])
        return count, cross, ~elsewhere

    def _meets(self, i: slice, blocks: np.ndarray) -> Iterator[np.ndarray]:
        """Per word of 64 ranks, ``[held layout of i, needed block]``: the word's ranks whose held blocks meet each of
        ``blocks`` (distinct needed blocks, as rows of set numbers). Each dim contributes a word from a small table:
        whether each distinct held set meets each distinct needed set of the dim, packed over the ranks of each
        distinct row of held sets (far fewer than the layouts: layouts that differ in one dim repeat the others);
        the AND of the dims' words is the packed AND."""
        world, dims = self.held.shape[1:]
        needed_sets = [SETS.distinct(blocks[:, d]) for d in range(dims)]
        for r in range(0, world, 64):
            meet = None
            for d, (ns, ni) in enumerate(needed_sets):
                held_rows, row_of = intern_rows(np.ascontiguousarray(self.held[i, r : r + 64, d]))
                hs, hi = SETS.distinct(held_rows)
                packed = _pack(SETS.overlaps(hs, ns)[hi] > 0)  # [distinct row, needed set of dim d]
                word = np.take(packed.ravel(), (row_of * packed.shape[1])[:, None] + ni[None])
                meet = word if meet is None else np.bitwise_and(meet, word, out=meet)
            if meet is None:  # a scalar: every block meets every other
                meet = np.full((len(self.held[i]), len(blocks)), ~np.uint64(0))
            yield meet

    def node_local(self, node_of: Sequence[int]) -> np.ndarray:
        """:meth:`node_local_distinct` per strategy pair."""
        return self.node_local_distinct(node_of)[self.held_of][:, self.needed_of]

    def node_local_distinct(self, node_of: Sequence[int]) -> np.ndarray:
        """``L[i, j]``: under distinct held layout ``i``, every device finds its needed block of distinct layout ``j``
        on its own node.

        Devices of one layout hold blocks that are equal or disjoint, so a node's coverage of a needed block is the
        sum of its overlaps with the node's distinct held blocks (a rank counts unless an earlier rank of its node
        holds its block); the block stays node-local when that covers it. Node by node, the distinct held blocks of
        every layout are intersected once with the distinct needed blocks.
        """
        nodes, volume = np.asarray(node_of), self._volume()
        (n_held, _, dims), n_needed = self.held.shape, len(self.needed)
        out = np.ones((n_held, n_needed), dtype=bool)
        for node in np.unique(nodes):
            on = np.flatnonzero(nodes == node)
            held_rows, held_at = intern_rows(self.held[:, on].reshape(n_held * len(on), dims))
            needed_rows, needed_at = intern_rows(self.needed[:, on].reshape(n_needed * len(on), dims))
            held_at, needed_at = held_at.reshape(n_held, len(on)), needed_at.reshape(n_needed, len(on))
            table = block_overlaps(held_rows[:, None], needed_rows[None])  # [held block, needed block]
            repeat = np.tril(held_at[:, :, None] == held_at[:, None, :], -1).any(axis=-1)  # an earlier rank holds it
            cover = (table[held_at] * ~repeat[..., None]).sum(axis=1)  # [i, needed block]
            out &= (np.take(cover, needed_at, axis=1) >= volume[None][..., on]).all(axis=-1)
        return out


#: one side of an edge: its distinct layouts and, per strategy, the index of its layout (:func:`intern_rows`)
Side = tuple[np.ndarray, np.ndarray]


def _side(uses: Sequence[EdgeUse], vkey: ValuesKey) -> Side:
    return intern_rows(np.stack([u.layout_ids(vkey) for u in uses]))


def producer_sides(producers: Sequence[OpPartition], out_index: int, vkey: ValuesKey, shared: bool = False) -> tuple:
    """``(held, grad_needed)``: the :data:`Side` of the producer's Forward output and of its gradient's need."""
    return (
        _side([_source_held(p, out_index, shared) for p in producers], vkey),
        _side([source_grad_needed(p, out_index, shared) for p in producers], vkey),
    )


def consumer_sides(consumers: Sequence[OpPartition], in_index: int, vkey: ValuesKey) -> tuple:
    """``(needed, grad_held)``: the :data:`Side` the consumer needs, and of the gradient it holds (``None`` when the
    input takes no gradient)."""
    grads = [backward_held(c, in_index) for c in consumers]
    held = None if any(g is None for g in grads) else _side(grads, vkey)  # type: ignore[arg-type]
    return _side([forward_needed(c, in_index) for c in consumers], vkey), held


def pairs_of(producer: tuple, consumer: tuple) -> tuple[LayoutPairs, LayoutPairs | None]:
    """The Forward and Backward :class:`LayoutPairs` of an edge from :func:`producer_sides` and
    :func:`consumer_sides` (which a caller may compute once per node and reuse across its edges)."""
    (held, held_of), (grad_needed, grad_needed_of) = producer
    (needed, needed_of), grad_held = consumer
    fwd = LayoutPairs(held_of, needed_of, held, needed)
    if grad_held is None:
        return fwd, None
    return fwd, LayoutPairs(grad_held[1], grad_needed_of, grad_held[0], grad_needed)


def edge_pairs(
    producers: Sequence[OpPartition],
    out_index: int,
    consumers: Sequence[OpPartition],
    in_index: int,
    values: Mapping[sympy.Symbol, int],
    shared: bool = False,
) -> tuple[LayoutPairs, LayoutPairs | None]:
    """The Forward pairs (producer held, consumer needed) and the Backward pairs (consumer gradient held, producer
    gradient needed; ``None`` when the input takes no gradient) of an edge. Backward is indexed ``[consumer,
    producer]``. All strategies of one side must share one op and one mesh; ``shared`` as in
    :func:`redistribution_matrix`."""
    vkey = values_key(values)
    check_edge(producers[0], out_index, consumers[0], in_index, vkey, shared)
    for side in (producers, consumers):
        if len({(p.op, p.mesh) for p in side}) > 1:
            raise ValueError("all strategies of one side of an edge must share one op and one mesh")
    return pairs_of(producer_sides(producers, out_index, vkey, shared), consumer_sides(consumers, in_index, vkey))


def redistribution_matrix(
    producers: Sequence[OpPartition],
    out_index: int,
    consumers: Sequence[OpPartition],
    in_index: int,
    values: Mapping[sympy.Symbol, int],
    shared: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(fwd, bwd)``: int64 arrays of shape ``(len(producers), len(consumers))`` of Eq. 9 traffic in elements.

    ``fwd[i, j]`` and ``bwd[i, j]`` equal ``redistribution(producers[i], ..., consumers[j], ...)``'s
    ``forward_elems`` and ``backward_elems``. All strategies of one side must share one op and one mesh.

    ``shared``: the "edge" is a parameter read by two nodes (tied embeddings). The first reader stores it in its
    Forward-start layout (its input ``out_index``); the other reader fetches its own block from there, and its
    gradient goes back to that storage layout.
    """
    if not producers or not consumers:
        empty = np.zeros((len(producers), len(consumers)), np.int64)
        return empty, empty.copy()
    fwd, bwd = edge_pairs(producers, out_index, consumers, in_index, values, shared)
    forward = fwd.traffic()
    if bwd is None:
        return forward, np.zeros_like(forward)
    return forward, np.ascontiguousarray(bwd.traffic().T)


#: :func:`~primepar_fx.cost.model.edge_cost_matrix`'s price of one direction of a re-layout, per pair of distinct
#: layouts, keyed by :meth:`LayoutPairs.digest` and what prices it. Edges whose strategies differ but whose distinct
#: layouts agree share it (in Llama-2-70B at 32 GPUs, 134 directions have 45 distinct layout pairs).
DIRECTIONS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def clear_redistribution_caches() -> None:
    """Drop this module's memoised layouts, overlaps, senders and re-layout prices."""
    DIRECTIONS.clear()
    clear_layout_caches()
    class_senders.cache_clear()
    _class_words.cache_clear()
