"""Inter-operator redistribution traffic (Eq. 8-9): exact element counts, checked by hand and by brute force.

The brute force enumerates every element a device holds or needs as a tuple of tensor coordinates: the iteration
coordinates of each group's block are composed into a flat index by mixed radix, and the Cartesian product over
the tensor dims is taken. It counts ``|needed(D) - held(D)|`` with Python sets and never uses intervals.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opdims import linear_dims as linear

from primepar_fx.cost.redistribute import (
    LayoutPairs,
    Redistribution,
    backward_held,
    backward_needed,
    forward_held,
    forward_needed,
    per_device_traffic,
    redistribution,
    redistribution_matrix,
)
from primepar_fx.frontend.symbols import B, S
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Phase, enumerate_sequences
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import SETS, index_set, intern_rows, overlap
from primepar_fx.partition.mesh import class_senders, nearest_holder
from primepar_fx.rules.spec import OpDims, TensorMap
from primepar_fx.runtime.exchange import Exchange

F, Bk, G = Phase.FORWARD, Phase.BACKWARD, Phase.GRADIENT
Size = int | sympy.Expr


def pointwise(dims: dict[str, Size], tmap: TensorMap, kind: str = "pointwise", out: TensorMap | None = None) -> OpDims:
    sizes = tuple(sympy.sympify(v) for v in dims.values())
    return OpDims(kind, tuple(dims), sizes, inputs=(tmap,), outputs=(tmap if out is None else out,))


def bind(op: OpDims, seq: str, digits: tuple[int, ...]) -> OpPartition:
    return OpPartition(op, PartitionSeq.parse(seq), DeviceMesh(digits))


# ------------------------------------------------------------------------------------------- brute force
def elements(part: OpPartition, tmap: TensorMap, phase: Phase, t: int, coords: tuple[int, ...], vals) -> set:
    sizes = {d: int(sympy.sympify(s).subs(vals)) for d, s in zip(part.op.dims, part.op.sizes)}
    per_dim = []
    for group, dim_slice in zip(tmap, part.tensor_slice(phase, tmap, coords, t)):
        ns = [sizes[d] for d in group]
        ranges = [range(i * n // p, (i + 1) * n // p) for n, (i, p) in zip(ns, dim_slice)]
        flat = set()
        for xs in itertools.product(*ranges):
            v = 0
            for x, n in zip(xs, ns):
                v = v * n + x
            flat.add(v)
        per_dim.append(flat)
    return set(itertools.product(*per_dim))


def brute(producer: OpPartition, j: int, consumer: OpPartition, k: int, vals: Mapping) -> tuple[list, list]:
    """Per-device ``|needed - held|`` for Forward and Backward, from explicit element sets."""
    out_map, in_map = producer.op.outputs[j], consumer.op.inputs[k]
    g_phase = G if k in consumer.op.weights else Bk
    fwd, bwd = [], []
    for coords in producer.mesh.devices():
        held = elements(producer, out_map, F, producer.steps - 1, coords, vals)
        fwd.append(len(elements(consumer, in_map, F, 0, coords, vals) - held))
        if k in consumer.op.no_grad:
            bwd.append(0)
            continue
        g_held = elements(consumer, in_map, g_phase, consumer.steps - 1, coords, vals)
        bwd.append(len(elements(producer, out_map, Bk, 0, coords, vals) - g_held))
    return fwd, bwd


def assert_matches_brute(producer: OpPartition, j: int, consumer: OpPartition, k: int, vals: Mapping) -> Redistribution:
    r = redistribution(producer, j, consumer, k, vals)
    fwd, bwd = brute(producer, j, consumer, k, vals)
    assert list(r.per_device_forward) == fwd, (producer.seq, consumer.seq)
    assert list(r.per_device_backward) == bwd, (producer.seq, consumer.seq)
    assert r.forward_elems == sum(fwd) and r.backward_elems == sum(bwd)
    return r


def runtime_messages(held, needed, mesh: DeviceMesh, per_node: int) -> tuple[list[int], list[bool]]:
    """Per rank: how many ranks :meth:`Exchange.plan` receives from, and whether one is on another node."""
    counts, crosses = [], []
    for k in range(mesh.size):
        senders = [peer for peer, _ in Exchange.plan(held, needed, mesh, k).recvs]
        counts.append(len(senders))
        crosses.append(any(s // per_node != k // per_node for s in senders))
    return counts, crosses


def assert_messages_match_runtime(producer: OpPartition, consumer: OpPartition, vals: Mapping, per_node: int) -> None:
    """Forward and Backward, :meth:`LayoutPairs.messages` equals the exchange the runtime plans, rank by rank."""
    vkey, mesh = values_key(vals), producer.mesh
    uses = [(forward_held(producer, 0), forward_needed(consumer, 0))]
    grad = backward_held(consumer, 0)
    if grad is not None:
        uses.append((grad, backward_needed(producer, 0)))
    for held, needed in uses:
        pairs = LayoutPairs.build([held.layout_ids(vkey)], [needed.layout_ids(vkey)])
        count, cross = pairs.messages(mesh, per_node)
        expected = runtime_messages(held.layout(vkey), needed.layout(vkey), mesh, per_node)
        assert (count[0, 0].tolist(), cross[0, 0].tolist()) == expected, (producer.seq, consumer.seq)


# ------------------------------------------------------------------------------------------ index sets
def test_index_set_contiguous_strided_and_broadcast() -> None:
    assert index_set((8,), ((1, 4),)) == ((2, 4),)
    assert index_set((4, 6), ((0, 1), (0, 2))) == ((0, 3), (6, 9), (12, 15), (18, 21))  # minor S split
    assert index_set((4, 6), ((1, 2), (0, 1))) == ((12, 24),)  # major B split: one interval
    assert index_set((4, 6), ((1, 2), (1, 3))) == ((14, 16), (20, 22))
    assert index_set((), ()) == ((0, 1),)


def test_overlap_is_linear_merge_of_intervals() -> None:
    assert overlap(((0, 3), (6, 9), (12, 15)), ((2, 7), (14, 20))) == 1 + 1 + 1
    assert overlap(((0, 10),), ((0, 10),)) == 10
    assert overlap(((0, 5),), ((5, 10),)) == 0


@st.composite
def index_sets(draw: st.DrawFn) -> tuple[tuple[int, int], ...]:
    """A random non-empty set of disjoint, sorted, non-adjacent intervals inside [0, 40)."""
    cuts = sorted(draw(st.sets(st.integers(0, 40), min_size=2, max_size=8)))
    spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
    return tuple(spans) if spans else ((0, 1),)


@settings(max_examples=60, deadline=None)
@given(sets=st.lists(index_sets(), min_size=2, max_size=12, unique=True), seed=st.integers(0, 2**16))
def test_overlap_table_matches_the_merge_in_every_access_pattern(sets, seed) -> None:
    """The remembered table, the outer-product path and the fallback past ``MEMO_SETS`` all give ``overlap``."""
    import numpy as np

    ids = np.array([SETS.add(s) for s in sets])
    want = np.array([[overlap(a, b) for b in sets] for a in sets])
    rng = np.random.default_rng(seed)
    a, b = rng.permutation(len(ids)), rng.permutation(len(ids))
    assert (SETS.pairwise(ids[a], ids[b]) == want[a, b]).all()  # elementwise, through the table
    assert (SETS.pairwise(ids[a][:, None], ids[b][None]) == want[a][:, b]).all()  # outer product
    assert (SETS.overlaps(ids[a], ids[b]) == want[a][:, b]).all()
    limit = SETS.MEMO_SETS
    try:
        SETS.MEMO_SETS = int(ids.min())  # every set past the table: intersected afresh
        assert (SETS.pairwise(ids[a], ids[b]) == want[a, b]).all()
        assert (SETS.overlaps(ids[a], ids[b]) == want[a][:, b]).all()
    finally:
        SETS.MEMO_SETS = limit


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 30),
    width=st.integers(1, 40),
    high=st.sampled_from([1, 3, 1000, 2**40]),
    seed=st.integers(0, 99),
)
def test_interning_rows_matches_numpy_unique(rows, width, high, seed) -> None:
    """Short rows of small numbers (one mixed-radix code each) and long or large ones (numpy's row unique) alike."""
    import numpy as np

    items = np.random.default_rng(seed).integers(0, high, size=(rows, width, 1))
    items[rows // 2] = items[0]  # a repeat
    distinct, inverse = intern_rows(items)
    want, want_inverse = np.unique(items.reshape(rows, -1), axis=0, return_inverse=True)
    assert (distinct.reshape(len(distinct), -1) == want).all() and distinct.shape[1:] == items.shape[1:]
    assert (inverse == want_inverse.reshape(-1)).all()


# ------------------------------------------------------------------------------------------ hand cases
def test_identical_partitions_move_nothing() -> None:
    ew = pointwise({"B": B, "S": S, "D": 8}, (("B",), ("S",), ("D",)))
    for seq in enumerate_sequences(ew, DeviceMesh((2, 2)), values={B: 4, S: 4}):
        p = OpPartition(ew, seq, DeviceMesh((2, 2)))
        r = redistribution(p, 0, p, 0, {B: 4, S: 4})
        assert r.forward_elems == r.backward_elems == 0 and not r.is_permutation, seq


def test_linear_b_split_to_next_linear_n_split() -> None:
    # O[B,M,K] split on B (4 ways) feeds I[B,M,N] split on N, with K of the producer = N of the consumer.
    # Device d holds O[B_d, :, :] and needs I[:, :, N_d]: V = 4*2*8/4 = 16, overlap = 1*2*2 = 4 -> 12 each.
    producer, consumer = bind(linear(B, S, 8, 8), "B", (4,)), bind(linear(B, S, 8, 4), "N", (4,))
    r = assert_matches_brute(producer, 0, consumer, 0, {B: 4, S: 2})
    assert r.per_device_forward == (12, 12, 12, 12) and r.forward_elems == 48 == 3 * 4 * 2 * 8 // 4
    assert r.per_device_backward == (12, 12, 12, 12) and r.backward_elems == 48
    assert r.bytes(2) == (96, 96) and not r.is_permutation


def test_cannon_skew_between_two_prime_linears_is_a_permutation() -> None:
    # Producer O[M=r, K=c] at its last Forward step; consumer I[M=r, N=r+c] at t=0 (K of producer = N of consumer).
    # In place iff r + c = c (mod 2), i.e. row 0 (ranks 0, 1); rows 1 swap. Block = 2*2*2 = 8 elements.
    producer, consumer = bind(linear(2, 4, 4, 4), "P2x2", (2, 2)), bind(linear(2, 4, 4, 6), "P2x2", (2, 2))
    r = assert_matches_brute(producer, 0, consumer, 0, {})
    block = 2 * 2 * 2
    assert r.per_device_forward == (0, 0, block, block)
    assert r.forward_elems == 4 * block - 2 * block == 16
    assert r.is_permutation
    # dI lands as [M=r, N=r+c-1]; the producer needs dO[M=r, K=c]: in place iff r = 1, rows 0 swap.
    assert r.per_device_backward == (block, block, 0, 0) and r.backward_is_permutation


def test_cannon_skew_p3x3() -> None:
    producer, consumer = bind(linear(1, 6, 3, 9), "P3x3", (3, 3)), bind(linear(1, 6, 9, 3), "P3x3", (3, 3))
    r = assert_matches_brute(producer, 0, consumer, 0, {})
    block = 1 * 2 * 3
    assert r.forward_elems == 6 * block and r.is_permutation  # rows 1 and 2 rotate, row 0 stays
    assert r.backward_is_permutation


@st.composite
def blocks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """A tensor dim's iteration-dim sizes (decompositions of 24, of 12 and 48 that its sets may also be met in, and
    of 36, which shares no refinement with them) and a block of each."""
    sizes = draw(st.sampled_from([(24,), (4, 6), (2, 12), (2, 3, 4), (), (12,), (3, 4), (4, 12), (6, 6)]))
    parts = tuple(draw(st.sampled_from([p for p in (1, 2, 3, 4) if n % p == 0])) for n in sizes)
    return sizes, tuple((draw(st.integers(0, p - 1)), p) for p in parts)


@settings(max_examples=60, deadline=None)
@given(picked=st.lists(blocks(), min_size=2, max_size=12), plain=st.lists(index_sets(), max_size=3))
def test_blocks_over_the_same_sizes_intersect_as_a_product_and_match_the_intervals(picked, plain) -> None:
    """Sets numbered as Cartesian blocks (``set_number``) intersect with blocks over the same sizes as the product of
    their per-dim overlaps, also where one domain is a multiple of the other (a set of the smaller behind a leading
    dim); with blocks over other sizes and with sets numbered as intervals alone, by intervals. Every path gives
    ``overlap``, including a set numbered first as intervals and met again as a block."""
    import numpy as np

    from primepar_fx.partition.layouts import IndexSets, index_set

    sets = IndexSets()
    plain_ids = [sets.add(s) for s in plain]  # equal sets share a number
    ids = [
        sets.add(index_set(sz, sl), (sz, tuple((i * n // p, (i + 1) * n // p) for n, (i, p) in zip(sz, sl))))
        for sz, sl in picked
    ]
    ids = np.array(ids + plain_ids)
    want = np.array([[overlap(sets.sets[a], sets.sets[b]) for b in ids] for a in ids])
    assert (sets.overlaps(ids, ids) == want).all()
    assert (sets._intersect(ids, ids[::-1]) == want[:, ::-1]).all()  # noqa: SLF001 -- the path past the table


def test_merged_dims_strided_intersection() -> None:
    # A view's output [(B*S), D] described as ("B", "S") with S split feeds a pointwise op over ("BS",) split.
    # B=4, S=6: device 0 holds rows {b*6 + s : s < 3} and needs rows [0, 12): 6 of 12 rows, so it lacks
    # 6 rows * D=8 = 48 elements; likewise device 1.
    view = OpDims(
        "view",
        ("B", "S", "D"),
        (B, S, sympy.Integer(8)),
        inputs=((("B",), ("S",), ("D",)),),
        outputs=((("B", "S"), ("D",)),),
    )
    flat = pointwise({"BS": B * S, "D": 8}, (("BS",), ("D",)))
    vals = {B: 4, S: 6}
    r = assert_matches_brute(bind(view, "S", (2,)), 0, bind(flat, "BS", (2,)), 0, vals)
    assert r.per_device_forward == (48, 48) and r.forward_elems == 96
    assert r.per_device_backward == (48, 48) and r.backward_elems == 96
    # A B split of the merged group is contiguous and lines up with the BS split exactly.
    aligned = redistribution(bind(view, "B", (2,)), 0, bind(flat, "BS", (2,)), 0, vals)
    assert aligned.forward_elems == aligned.backward_elems == 0
    # The reverse direction: the consumer's input group is merged.
    unflat = pointwise({"B": B, "S": S, "D": 8}, (("B", "S"), ("D",)))
    back = assert_matches_brute(bind(flat, "BS", (2,)), 0, bind(unflat, "S", (2,)), 0, vals)
    assert back.forward_elems == 96


def test_replicated_producer_to_split_consumer() -> None:
    # Every device holds the whole O: Forward moves nothing. Backward: each device holds a quarter of dI and
    # needs all of dO, so it lacks 3/4 of the tensor (2*4*8 = 64 elements).
    producer, consumer = bind(linear(2, 4, 8, 8), "R,R", (2, 2)), bind(linear(2, 4, 8, 4), "M,N", (2, 2))
    r = assert_matches_brute(producer, 0, consumer, 0, {})
    assert r.forward_elems == 0 and r.per_device_backward == (48,) * 4 and r.backward_elems == 3 * 64


def test_split_producer_to_replicated_consumer() -> None:
    numel, world = 2 * 4 * 8, 4
    producer, consumer = bind(linear(2, 4, 8, 8), "B,M", (2, 2)), bind(linear(2, 4, 8, 4), "R,R", (2, 2))
    r = assert_matches_brute(producer, 0, consumer, 0, {})
    assert r.per_device_forward == ((world - 1) * numel // world,) * world
    assert r.forward_elems == (world - 1) * numel and r.backward_elems == 0 and not r.is_permutation


def test_partial_sum_producer_counts_the_slice_after_its_all_reduce() -> None:
    # A row-parallel linear (N split) leaves partial sums of the whole O; after the all-reduce every device
    # holds all of O, so a B-split consumer needs nothing more.
    producer, consumer = bind(linear(4, 2, 8, 8), "N", (2,)), bind(linear(4, 2, 8, 2), "B", (2,))
    assert assert_matches_brute(producer, 0, consumer, 0, {}).forward_elems == 0


def test_weight_input_gradient_comes_from_the_gradient_phase() -> None:
    # W[N,K] from a pointwise producer into a P2x2 linear: dW ends at Gradient's last step where W starts.
    producer = pointwise({"N": 4, "K": 4}, (("N",), ("K",)))
    consumer = bind(linear(2, 4, 4, 4), "P2x2", (2, 2))
    for seq in enumerate_sequences(producer, DeviceMesh((2, 2))):
        assert_matches_brute(OpPartition(producer, seq, DeviceMesh((2, 2))), 0, consumer, 1, {})


def test_no_grad_input_has_no_backward_traffic() -> None:
    op = pointwise({"B": 4, "D": 4}, (("B",), ("D",)))
    consumer = OpDims("pointwise", op.dims, op.sizes, op.inputs, op.outputs, no_grad=frozenset({0}))
    r = redistribution(bind(op, "B", (2,)), 0, bind(consumer, "D", (2,)), 0, {})
    assert r.forward_elems == 8 and r.per_device_backward == (0, 0)
    fwd, bwd = redistribution_matrix([bind(op, "B", (2,))], 0, [bind(consumer, "D", (2,))], 0, {})
    assert fwd.tolist() == [[8]] and bwd.tolist() == [[0]]


def test_errors() -> None:
    a, b = bind(linear(B, 4, 8, 8), "B", (2,)), bind(linear(B, 4, 6, 8), "B", (2,))
    with pytest.raises(ValueError, match="shape"):
        redistribution(a, 0, b, 0, {B: 2})
    with pytest.raises(ValueError, match="mesh"):
        redistribution(a, 0, bind(linear(B, 4, 8, 8), "B,R", (2, 2)), 0, {B: 2})
    with pytest.raises(ValueError, match="not an integer"):
        redistribution(a, 0, a, 0, {})
    with pytest.raises(ValueError, match="split"):
        redistribution(a, 0, a, 0, {B: 3})


# --------------------------------------------------------------------------------- all pairs, brute force
def test_all_linear_pairs_on_2x2_match_brute_force_and_matrix() -> None:
    mesh = DeviceMesh((2, 2))
    p_op, c_op = linear(2, 4, 4, 4), linear(2, 4, 4, 2)
    producers = [OpPartition(p_op, s, mesh) for s in enumerate_sequences(p_op, mesh)]
    consumers = [OpPartition(c_op, s, mesh) for s in enumerate_sequences(c_op, mesh)]
    fwd, bwd = redistribution_matrix(producers, 0, consumers, 0, {})
    assert fwd.shape == bwd.shape == (len(producers), len(consumers))
    for (i, p), (j, c) in itertools.product(enumerate(producers), enumerate(consumers)):
        r = assert_matches_brute(p, 0, c, 0, {})
        assert (fwd[i, j], bwd[i, j]) == (r.forward_elems, r.backward_elems)
        assert 0 <= r.forward_elems <= 4 * 2 * 4 * 4 and 0 <= r.backward_elems <= 4 * 2 * 4 * 4


def every_forward_pair(p_op: OpDims, c_op: OpDims, mesh: DeviceMesh) -> tuple[list, list, LayoutPairs]:
    """Every partition of two ops on ``mesh`` and the Forward :class:`LayoutPairs` between them."""
    producers = [OpPartition(p_op, s, mesh) for s in enumerate_sequences(p_op, mesh)]
    consumers = [OpPartition(c_op, s, mesh) for s in enumerate_sequences(c_op, mesh)]
    vkey = values_key({})
    pairs = LayoutPairs.build(
        [forward_held(p, 0).layout_ids(vkey) for p in producers],
        [forward_needed(c, 0).layout_ids(vkey) for c in consumers],
    )
    return producers, consumers, pairs


def test_messages_of_every_linear_pair_are_the_senders_the_runtime_plans() -> None:
    # on 2 x 2 (one node of two: digit 0 crosses) and on 2 x 2 x 2 (two nodes of four)
    for digits, per_node in (((2, 2), 2), ((2, 2, 2), 4)):
        mesh = DeviceMesh(digits)
        producers, consumers, pairs = every_forward_pair(linear(2, 4, 4, 4), linear(2, 4, 4, 2), mesh)
        vkey = values_key({})
        count, cross = pairs.messages(mesh, per_node)
        received = pairs.received()
        # every pair on 2 x 2; on 2 x 2 x 2 (119 producers, 105 consumers) one pair in 11 of the row-major order,
        # which meets every producer and every consumer (11 is prime to 105) at a tenth of the time
        stride = 1 if len(digits) == 2 else 11
        met: set[tuple[str, int]] = set()
        for (i, p), (j, c) in itertools.product(enumerate(producers), enumerate(consumers)):
            if (i * len(consumers) + j) % stride:
                continue
            met |= {("producer", i), ("consumer", j)}
            held, needed = forward_held(p, 0).layout(vkey), forward_needed(c, 0).layout(vkey)
            a, b = pairs.held_of[i], pairs.needed_of[j]
            expected = runtime_messages(held, needed, mesh, per_node)
            assert (count[a, b].tolist(), cross[a, b].tolist()) == expected
            assert reference_messages(held, needed, mesh, per_node) == expected
            assert tuple(received[a, b].tolist()) == Exchange.plan(held, needed, mesh, 0).received
        assert len(met) == len(producers) + len(consumers)
        for p, c in itertools.product(producers[::3], consumers[::3]):
            assert_messages_match_runtime(p, c, {}, per_node)


def reference_messages(held, needed, mesh: DeviceMesh, per_node: int) -> tuple[list[int], list[bool]]:
    """Per rank, from the tuples: the other classes of ``held`` whose block meets its needed block, and whether
    the sender :func:`class_senders` picks for one of them is on another node (the runtime's rule, which
    ``test_messages_of_every_linear_pair_are_the_senders_the_runtime_plans`` checks on small meshes)."""
    first = tuple(held.index(block) for block in held)
    senders = class_senders(first, mesh)
    counts, crosses = [], []
    for k in range(mesh.size):
        meets = [
            r
            for r in sorted(set(first))
            if held[r] != held[k] and all(overlap(h, n) for h, n in zip(held[r], needed[k]))
        ]
        counts.append(len(meets))
        crosses.append(any(senders[r, k] // per_node != k // per_node for r in meets))
    return counts, crosses


def test_messages_past_64_ranks_match_the_sender_rule() -> None:
    """128 ranks (32 nodes of 4): the packed words of ranks 0-63 and 64-127 are counted together."""
    mesh = DeviceMesh((32, 2, 2))
    producers, consumers, pairs = every_forward_pair(linear(2, 64, 8, 8), linear(2, 64, 8, 4), mesh)
    vkey = values_key({})
    count, cross = pairs.messages(mesh, 4)
    crossing = 0
    for (i, p), (j, c) in itertools.product(enumerate(producers[::4]), enumerate(consumers[::4])):
        held, needed = forward_held(p, 0).layout(vkey), forward_needed(c, 0).layout(vkey)
        a, b = pairs.held_of[4 * i], pairs.needed_of[4 * j]
        assert (count[a, b].tolist(), cross[a, b].tolist()) == reference_messages(held, needed, mesh, 4)
        crossing += int(cross[a, b].sum())
    assert crossing > 0


def block_elements(block) -> set:
    return set(itertools.product(*[[x for lo, hi in dim for x in range(lo, hi)] for dim in block]))


@pytest.mark.parametrize(("digits", "per_node"), [((2, 2, 2), 2), ((2, 2, 2), 4), ((3, 2), 4)])
def test_node_local_is_every_needed_element_held_on_the_node(digits, per_node) -> None:
    """Element by element: every device's needed block lies in the union of the blocks its node's ranks hold (on
    ``(3, 2)`` with 4 per node the nodes have 4 and 2 ranks)."""
    mesh = DeviceMesh(digits)
    size = 12 if 3 in digits else 8
    producers, consumers, pairs = every_forward_pair(linear(2, size, 4, 4), linear(2, size, 4, 2), mesh)
    node = [k // per_node for k in range(mesh.size)]
    local = pairs.node_local(node)
    vkey, seen = values_key({}), set()
    for (i, p), (j, c) in itertools.product(enumerate(producers), enumerate(consumers)):
        held, needed = forward_held(p, 0).layout(vkey), forward_needed(c, 0).layout(vkey)
        on_node = [set().union(*(block_elements(held[r]) for r in range(mesh.size) if node[r] == n)) for n in set(node)]
        expected = all(block_elements(needed[k]) <= on_node[node[k]] for k in range(mesh.size))
        assert bool(local[i, j]) == expected, (p.seq, c.seq)
        seen.add(expected)
    assert seen == {True, False}


@pytest.mark.parametrize(("digits", "per_node"), [((2, 2, 2), 2), ((2, 2, 2), 4), ((3, 2), 4), ((2, 4, 4), 4)])
def test_exchange_finds_the_node_local_pairs_the_overlaps_find(digits, per_node) -> None:
    """:meth:`LayoutPairs.exchange`'s locality, read off the packed senders, equals :meth:`node_local_distinct`'s
    (checked element by element above), on meshes of one to eight nodes."""
    mesh = DeviceMesh(digits)
    size = {8: 8, 6: 12, 32: 32}[mesh.size]
    _, _, pairs = every_forward_pair(linear(2, size, 4, 4), linear(2, size, 4, 2), mesh)
    count, cross, local = pairs.exchange(mesh, per_node)
    expected = pairs.node_local_distinct([k // per_node for k in range(mesh.size)])
    assert np.array_equal(local, expected)
    messages = pairs.messages(mesh, per_node)
    assert np.array_equal(count, messages[0]) and np.array_equal(cross, messages[1])
    assert local.any() and not local.all()


def test_cannon_skew_is_one_message_per_receiving_device() -> None:
    producer, consumer = bind(linear(2, 4, 4, 4), "P2x2", (2, 2)), bind(linear(2, 4, 4, 6), "P2x2", (2, 2))
    vkey = values_key({})
    pairs = LayoutPairs.build(
        [forward_held(producer, 0).layout_ids(vkey)], [forward_needed(consumer, 0).layout_ids(vkey)]
    )
    count, cross = pairs.messages(producer.mesh, 4)
    assert count[0, 0].tolist() == [0, 0, 1, 1] and not cross.any()  # ranks 2 and 3 swap (see the skew above)
    count, cross = pairs.messages(producer.mesh, 2)  # one node per row: the swap stays inside node 1
    assert count[0, 0].tolist() == [0, 0, 1, 1] and not cross.any()
    count, cross = pairs.messages(producer.mesh, 1)
    assert cross[0, 0].tolist() == [False, False, True, True]


def test_nearest_holder_is_the_fewest_differing_digits_then_the_lowest_rank() -> None:
    mesh = DeviceMesh((2, 2, 2))  # rank = 4 d0 + 2 d1 + d2
    assert nearest_holder([1, 2, 7], 7, mesh) == 7  # a holder keeps its own block
    assert nearest_holder([1, 2], 0, mesh) == 1  # both one digit away: the lower rank
    assert nearest_holder([3, 5, 6], 0, mesh) == 3  # all two digits away
    assert nearest_holder([3, 4], 0, mesh) == 4  # one digit beats two
    senders = class_senders((0, 0, 1, 1, 0, 0, 1, 1), mesh)  # digit 1 picks the block
    assert senders[2].tolist() == [2, 3, 2, 3, 6, 7, 6, 7]  # each rank takes rank 2's block from its d1 = 1 twin
    assert senders[0].tolist() == [0, 1, 0, 1, 4, 5, 4, 5]


# ----------------------------------------------------------------------------------- property: random maps
@st.composite
def edges(draw: st.DrawFn) -> tuple[OpPartition, OpPartition, dict]:
    """A producer and a consumer that factor the same random tensor into iteration dims differently."""
    mesh = DeviceMesh(draw(st.sampled_from([(2,), (3,), (2, 2), (2, 3), (2, 2, 2)])))
    b = draw(st.sampled_from([1, 2, 4]))
    rank = draw(st.integers(1, 3))
    factors = [[draw(st.sampled_from([1, 2, 3, 4])) for _ in range(draw(st.integers(1, 3)))] for _ in range(rank)]
    if draw(st.booleans()):
        factors[0][0] = B  # a symbolic factor
    sides = []
    for tag in "pc":
        dims: dict[str, Size] = {}
        tmap = []
        for t, fs in enumerate(factors):
            cuts = [i for i in range(1, len(fs)) if draw(st.booleans())]
            runs = [fs[a:z] for a, z in zip([0, *cuts], [*cuts, len(fs)])]
            if all(f == 1 for f in fs) and draw(st.booleans()):
                tmap.append(())
                continue
            group = []
            for r, run in enumerate(runs):
                dims[f"{tag}{t}_{r}"] = sympy.Mul(*run)
                group.append(f"{tag}{t}_{r}")
            tmap.append(tuple(group))
        dims[f"{tag}z"] = 2  # producer: summed away (partial sums); consumer: broadcast into its output
        tm = tuple(tmap)
        if tag == "p":
            sides.append(pointwise(dims, (*tm, (f"{tag}z",)), kind="reduce", out=tm))
        else:
            sides.append(pointwise(dims, tm, out=(*tm, (f"{tag}z",))))
    vals = {B: b}
    parts = []
    for op in sides:
        seqs = enumerate_sequences(op, mesh, values=vals)
        parts.append(OpPartition(op, draw(st.sampled_from(seqs)), mesh))
    return parts[0], parts[1], vals


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edge=edges())
def test_random_factorings_match_brute_force(edge: tuple[OpPartition, OpPartition, dict]) -> None:
    producer, consumer, vals = edge
    r = assert_matches_brute(producer, 0, consumer, 0, vals)
    numel = int(sympy.Mul(*(producer.op.size(d) for g in producer.op.outputs[0] for d in g)).subs(vals))
    world = producer.mesh.size
    assert 0 <= r.forward_elems <= world * numel and 0 <= r.backward_elems <= world * numel
    fwd, bwd = redistribution_matrix([producer], 0, [consumer], 0, vals)
    assert (int(fwd[0, 0]), int(bwd[0, 0])) == (r.forward_elems, r.backward_elems)
    if r.is_permutation:
        assert sum(1 for v in r.per_device_forward if v) >= 2
    assert_messages_match_runtime(producer, consumer, vals, max(1, world // 2))


def test_scalar_edge_moves_nothing() -> None:
    loss = OpDims("loss", ("B",), (sympy.Integer(4),), inputs=((("B",),),), outputs=((),))
    scale = pointwise({"X": 1}, ())
    r = redistribution(bind(loss, "B", (2,)), 0, bind(scale, "R", (2,)), 0, {})
    assert (r.forward_elems, r.backward_elems, r.total_elems) == (0, 0, 0)
    fwd, bwd = redistribution_matrix([bind(loss, "B", (2,))], 0, [bind(scale, "R", (2,))], 0, {})
    assert fwd.tolist() == bwd.tolist() == [[0]]


def test_received_counts_blocks_past_two_to_the_31_exactly() -> None:
    """Blocks of 2^32 elements: an overlap is a product of per-dim counts (2^16 each) that int32 cannot hold."""
    op = pointwise({"a": 2**17, "b": 2**17}, (("a",), ("b",)))
    mesh = DeviceMesh((2, 2))
    parts = [OpPartition(op, s, mesh) for s in enumerate_sequences(op, mesh)]
    vkey = values_key({})
    pairs = LayoutPairs.build(
        [forward_held(p, 0).layout_ids(vkey) for p in parts], [forward_needed(p, 0).layout_ids(vkey) for p in parts]
    )
    received = pairs.received()
    for (i, p), (j, c) in itertools.product(enumerate(parts), enumerate(parts)):
        held, needed = forward_held(p, 0).layout(vkey), forward_needed(c, 0).layout(vkey)
        expected = per_device_traffic(held, needed)
        assert tuple(received[pairs.held_of[i], pairs.needed_of[j]].tolist()) == expected
    assert received.max() == 3 * 2**32  # a replicated block needed where a quarter of it is held


@pytest.mark.parametrize("shape", [(3, 64, 5), (2, 7, 4, 3), (1, 64), (4, 13), (2, 1, 2)])
def test_pack_puts_flag_r_in_bit_r(shape):
    from primepar_fx.cost.redistribute import _pack

    flags = np.random.default_rng(sum(shape)).random(shape) < 0.5
    words = _pack(flags)
    assert words.dtype == np.uint64 and words.shape == flags.shape[:1] + flags.shape[2:]
    for r in range(flags.shape[1]):
        assert np.array_equal((words >> np.uint64(r)) & np.uint64(1), flags[:, r].astype(np.uint64))
    assert not (words >> np.uint64(flags.shape[1])).any()  # no bit past the last flag


def test_pairwise_fills_what_it_missed_from_its_own_answer_not_the_shared_table():
    """Pricing threads share the overlap table, and one may swap it for a bigger copy that lacks the values another
    just wrote. ``pairwise`` must fill its gaps from what ``overlaps`` returned, never by re-reading the table."""
    from primepar_fx.partition.layouts import IndexSets

    sets = IndexSets()
    numbers = [sets.add(index_set((8,), ((i, 4),))) for i in range(4)] + [sets.add(index_set((8,), ((1, 2),)))]
    computed = sets.overlaps

    def swapped_after(a, b):  # another thread grows the table right after this one wrote into the old one
        out = computed(a, b)
        sets.memo = np.full_like(sets.memo, -1)
        return out

    sets.overlaps = swapped_after
    a, b = np.array(numbers)[:, None], np.array(numbers[::-1])[None, :]
    got = sets.pairwise(a, b)
    want = [[overlap(sets.sets[i], sets.sets[j]) for j in numbers[::-1]] for i in numbers]
    assert got.tolist() == want and (got >= 0).all()
