"""``primepar_fx.cost.scatter``: when an all-reduce and the slice after it are one reduce-scatter."""

from __future__ import annotations

import itertools

import numpy as np
import sympy
from opdims import biased_linear_dims as biased_linear

from primepar_fx.cost.redistribute import backward_held, backward_needed, forward_held, forward_needed
from primepar_fx.cost.scatter import bias_broadcasts, broadcasts_many, scatters, scatters_many
from primepar_fx.partition import DeviceMesh, OpPartition, enumerate_sequences
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import SETS
from primepar_fx.rules.spec import OpDims

WHOLE = ((0, 4),), ((0, 6),)  # a 4 x 6 tensor, held whole


def test_a_group_that_splits_its_block_evenly_scatters():
    held = (WHOLE, WHOLE)
    assert scatters(held, ((((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),))), [[0, 1]])
    assert scatters(held, ((((0, 4),), ((3, 6),)), (((0, 4),), ((0, 3),))), [[0, 1]])  # any order, any dim
    assert scatters(held, ((((0, 1), (3, 4)), ((0, 6),)), (((1, 3),), ((0, 6),))), [[0, 1]])  # pieces of intervals


def test_overlapping_unequal_uncovered_or_unchanged_pieces_do_not():
    held = (WHOLE, WHOLE)
    assert not scatters(held, ((((0, 2),), ((0, 6),)), (((0, 2),), ((0, 6),))), [[0, 1]])  # the same piece twice
    assert not scatters(held, ((((0, 1),), ((0, 6),)), (((1, 4),), ((0, 6),))), [[0, 1]])  # unequal
    assert not scatters(held, ((((0, 1),), ((0, 6),)), (((1, 2),), ((0, 6),))), [[0, 1]])  # rows 2-4 kept by none
    assert not scatters(held, held, [[0, 1]])  # nothing sliced: a plain all-reduce
    assert not scatters(held, ((((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),))), [[0], [1]])  # groups of one


def test_every_group_holds_one_block_and_splits_it():
    top, bottom = (((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),))
    held = (top, top, bottom, bottom)
    left = [(((0, 2),), ((0, 3),)), (((0, 2),), ((3, 6),)), (((2, 4),), ((0, 3),)), (((2, 4),), ((3, 6),))]
    assert scatters(held, tuple(left), [[0, 1], [2, 3]])
    assert not scatters(held, tuple(left), [[0, 2], [1, 3]])  # these groups do not hold one block each
    outside = [*left[:3], (((0, 2),), ((3, 6),))]  # rank 3 asks for rows it does not hold
    assert not scatters(held, tuple(outside), [[0, 1], [2, 3]])


def test_a_bias_broadcasts_over_pieces_cut_along_other_dims_only():
    # linear(x[M, K], w[N, K], b[N]) -> [M, N]
    op = OpDims(
        kind="matmul",
        dims=("M", "N", "K"),
        sizes=(sympy.Integer(4), sympy.Integer(6), sympy.Integer(8)),
        inputs=((("M",), ("K",)), (("N",), ("K",)), (("N",),)),
        outputs=((("M",), ("N",)),),
    )
    held = (WHOLE, WHOLE)
    by_rows = ((((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),)))
    by_cols = ((((0, 4),), ((0, 3),)), (((0, 4),), ((3, 6),)))
    assert bias_broadcasts(op, 2, held, by_rows)
    assert not bias_broadcasts(op, 2, held, by_cols)


def ids(layout) -> np.ndarray:
    return np.array([[SETS.add(s) for s in row] for row in layout], dtype=np.int64)


def assert_many_matches(held, neededs, groups) -> None:
    got = scatters_many(ids(held), np.stack([ids(n) for n in neededs]), groups)
    assert got.tolist() == [scatters(held, n, groups) for n in neededs]


def test_the_vectorised_test_agrees_on_the_hand_cases():
    held = (WHOLE, WHOLE)
    pieces = [
        ((((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),))),
        ((((0, 4),), ((3, 6),)), (((0, 4),), ((0, 3),))),
        ((((0, 1), (3, 4)), ((0, 6),)), (((1, 3),), ((0, 6),))),
        ((((0, 2),), ((0, 6),)), (((0, 2),), ((0, 6),))),
        ((((0, 1),), ((0, 6),)), (((1, 4),), ((0, 6),))),
        ((((0, 1),), ((0, 6),)), (((1, 2),), ((0, 6),))),
        held,
    ]
    assert_many_matches(held, pieces, [[0, 1]])
    assert_many_matches(held, pieces, [[0], [1]])
    top, bottom = (((0, 2),), ((0, 6),)), (((2, 4),), ((0, 6),))
    left = [(((0, 2),), ((0, 3),)), (((0, 2),), ((3, 6),)), (((2, 4),), ((0, 3),)), (((2, 4),), ((3, 6),))]
    outside = [*left[:3], (((0, 2),), ((3, 6),))]
    for groups in ([[0, 1], [2, 3]], [[0, 2], [1, 3]]):
        assert_many_matches((top, top, bottom, bottom), [tuple(left), tuple(outside)], groups)


def test_the_vectorised_tests_agree_on_every_linear_pair_of_a_2x2x2_mesh():
    """Every Forward (output held, next input needed) and Backward (input gradient held, gradient needed) pair of
    two linears, over every group pattern: the array tests give the tuple tests' answers, and some pairs scatter."""
    mesh, vals = DeviceMesh((2, 2, 2)), {}
    op = biased_linear(2, 4, 8, 8)
    parts = [OpPartition(op, s, mesh) for s in enumerate_sequences(op, mesh, values=vals)]
    vkey = values_key(vals)
    forward = [(forward_held(p, 0), forward_needed(p, 0)) for p in parts]
    backward = [(backward_held(p, 0), backward_needed(p, 0)) for p in parts]
    found = 0
    for side in (forward, backward):
        needed = [n.layout(vkey) for _, n in side]
        needed_ids = np.stack([n.layout_ids(vkey) for _, n in side])
        for (h, _), digits in itertools.product(side[::3], [(0,), (1, 2), (0, 1, 2)]):
            groups = mesh.groups(digits)
            held = h.layout(vkey)
            got = scatters_many(h.layout_ids(vkey), needed_ids, groups)
            assert got.tolist() == [scatters(held, n, groups) for n in needed]
            bias = broadcasts_many(op, 2, h.layout_ids(vkey), needed_ids) if side is forward else None
            if bias is not None:
                assert bias.tolist() == [bias_broadcasts(op, 2, held, n) for n in needed]
            found += int(got.sum())
        for digits in [(0,), (1, 2), (0, 1, 2)]:  # a stack of held layouts: one row per held layout
            groups = mesh.groups(digits)
            helds = np.stack([h.layout_ids(vkey) for h, _ in side])
            rows = [[scatters(h.layout(vkey), n, groups) for n in needed] for h, _ in side]
            assert scatters_many(helds, needed_ids, groups).tolist() == rows
            if side is forward:
                broadcast = [[bias_broadcasts(op, 2, h.layout(vkey), n) for n in needed] for h, _ in side]
                assert broadcasts_many(op, 2, helds, needed_ids).tolist() == broadcast
    assert found > 0
