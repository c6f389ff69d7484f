"""Hand-built operator descriptions shared by the partition, redistribution and cost-model tests."""

from __future__ import annotations

import sympy

from primepar_fx.rules.spec import OpDims

Size = int | sympy.Expr


def linear_dims(b: Size, m: Size, n: Size, k: Size) -> OpDims:
    """``O[B,M,K] = I[B,M,N] . W[N,K]`` with W a parameter and ``2 B M N K`` forward FLOPs."""
    sizes = tuple(sympy.sympify(v) for v in (b, m, n, k))
    return OpDims(
        "matmul",
        ("B", "M", "N", "K"),
        sizes,
        inputs=((("B",), ("M",), ("N",)), (("N",), ("K",))),
        outputs=((("B",), ("M",), ("K",)),),
        matmul=("M", "N", "K"),
        matmul_operands=(0, 1),
        flops=2 * sizes[0] * sizes[1] * sizes[2] * sizes[3],
        weights=frozenset({1}),
    )


def biased_linear_dims(b: Size, m: Size, n: Size, k: Size) -> OpDims:
    """The linear with a bias input ``[K]`` (input 2), both weights parameters."""
    op = linear_dims(b, m, n, k)
    return OpDims(
        "matmul",
        op.dims,
        op.sizes,
        inputs=(*op.inputs, (("K",),)),
        outputs=op.outputs,
        matmul=op.matmul,
        matmul_operands=op.matmul_operands,
        flops=op.flops,
        weights=frozenset({1, 2}),
    )
