"""``primepar_fx.cost.scatter``: when an all-reduce and the slice after it are one reduce-scatter."""

from __future__ import annotations

import sympy

from primepar_fx.cost.scatter import bias_broadcasts, scatters
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
