"""Enumerate the legal partition sequences of an operator on a device mesh.

A sequence is legal when it uses every digit of the device ID exactly once, splits only splittable dims, puts
P(S x S) only on a matrix product whose M, N and K may be split (at most once), and cuts every concrete size into
equal parts. Symbolic sizes (``B``, ``S``) are checked against ``values`` when given and assumed divisible otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import sympy

from primepar_fx.partition.mesh import DeviceMesh
from primepar_fx.partition.seq import Element, PartitionSeq, Prime, Replicate, Split
from primepar_fx.rules.spec import OpDims


@lru_cache(maxsize=1 << 14)
def size_at(size: sympy.Expr | int, values: tuple[tuple[sympy.Symbol, int], ...]) -> int | None:
    """``size`` at ``values`` as an int, or ``None`` while a symbol is left."""
    expr = sympy.sympify(size)
    if values:
        expr = expr.xreplace({k: sympy.Integer(v) for k, v in values})
    return int(expr) if expr.is_Integer else None


#: ``values`` as a hashable memo key: ``(symbol, int)`` pairs in the order of the symbols' names
ValuesKey = tuple[tuple[sympy.Symbol, int], ...]


def _symbol_name(sym: object) -> str:
    return sym.name if isinstance(sym, sympy.Symbol) else str(sym)  # str() of a sympy object runs its printer


def values_key(values: Mapping[sympy.Symbol, int]) -> ValuesKey:
    """``values`` as a :data:`ValuesKey`."""
    return tuple(sorted(((k, int(v)) for k, v in values.items()), key=lambda kv: _symbol_name(kv[0])))


def fits(size: sympy.Expr | int, parts: int, values: Mapping[sympy.Symbol, int] | None) -> bool:
    """Whether ``size`` splits into ``parts`` equal parts at ``values`` (assumed so while a symbol is left)."""
    return fits_at(size, parts, values_key(values) if values else ())


def fits_at(size: sympy.Expr | int, parts: int, vkey: ValuesKey) -> bool:
    """:func:`fits` at values given as a :func:`values_key` (``()``: none)."""
    n = size_at(size, vkey)
    return n is None or n % parts == 0


def _rank(size: sympy.Expr) -> int:
    names = {str(sym) for sym in sympy.sympify(size).free_symbols}
    return 0 if "B" in names else 1 if "S" in names else 2


def prime_sizes_at(mesh: DeviceMesh, pos: int) -> list[tuple[int, int]]:
    """``(S, digits used)`` for every P(S x S) that can start at digit ``pos``."""
    out, rows, used = [], 1, 0
    while pos + used + 1 < len(mesh.digits) and mesh.digits[pos + used] == mesh.digits[pos + used + 1]:
        rows *= mesh.digits[pos + used]
        used += 2
        out.append((rows, used))
    return out


def enumerate_sequences(
    op: OpDims,
    mesh: DeviceMesh,
    *,
    values: dict[sympy.Symbol, int] | None = None,
    allow_prime: bool = True,
    allow_replicate: bool = True,
    levels: tuple[int, ...] | None = None,
) -> list[PartitionSeq]:
    """All legal partition sequences of ``op`` on ``mesh``, in a deterministic order.

    With ``levels`` (the network level of each digit), the *canonical* subspace is returned instead: where two
    consecutive single-digit elements sit on digits of the same level and radix, their order is fixed by rank
    (batch-like dims, then sequence-like dims, then the other dims, then ``Replicate``). Swapping two such digits
    relabels devices without changing any cost, so this drops most reorderings; it is not exact across ops
    (two ops may want different orders), which is why it is opt-in.
    """
    splittable = [d for d in op.dims if d not in op.no_split]
    prime_ok = allow_prime and op.matmul is not None and all(d not in op.no_split for d in op.matmul)
    out: list[PartitionSeq] = []
    parts = {d: 1 for d in op.dims}

    rank = {d: _rank(op.size(d)) for d in op.dims}

    def ordered(pos: int, acc: list[Element], new_rank: int) -> bool:
        if levels is None or not acc or isinstance(acc[-1], Prime) or pos == 0:
            return True
        if levels[pos - 1] != levels[pos] or mesh.digits[pos - 1] != mesh.digits[pos]:
            return True
        prev = acc[-1]
        return (3 if isinstance(prev, Replicate) else rank[prev.dim]) <= new_rank  # type: ignore[union-attr]

    def rec(pos: int, acc: list[Element], used_prime: bool) -> None:
        if pos == len(mesh.digits):
            out.append(PartitionSeq(tuple(acc)))
            return
        radix = mesh.digits[pos]
        for d in splittable:
            if ordered(pos, acc, rank[d]) and fits(op.size(d), parts[d] * radix, values):
                parts[d] *= radix
                rec(pos + 1, [*acc, Split(d)], used_prime)
                parts[d] //= radix
        if prime_ok and not used_prime:
            for s, used in prime_sizes_at(mesh, pos):
                if all(fits(op.size(d), parts[d] * s, values) for d in op.matmul):  # type: ignore[union-attr]
                    for d in op.matmul:  # type: ignore[union-attr]
                        parts[d] *= s
                    rec(pos + used, [*acc, Prime(s)], True)
                    for d in op.matmul:  # type: ignore[union-attr]
                        parts[d] //= s
        if allow_replicate and ordered(pos, acc, 3):
            rec(pos + 1, [*acc, Replicate()], used_prime)

    rec(0, [], False)
    return out


def count_sequences(op: OpDims, mesh: DeviceMesh, **kw: object) -> int:
    return len(enumerate_sequences(op, mesh, **kw))  # type: ignore[arg-type]
