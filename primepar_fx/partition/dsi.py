"""Dimension Slice Indices (paper Algorithm 1, Eq. 4-6) for any partition sequence on any device mesh.

For an operator bound to a partition sequence, :class:`OpPartition` evaluates ``I_X^phase(D, t)``: which slice of
iteration dim ``X`` device ``D`` handles at step ``t`` of a phase. Every element is applied as
``I <- radix * I + term``, nested inside the elements before it:

* ``Split(X)`` on digit ``d``: ``I_X <- r*I_X + d`` in all three phases.
* ``Prime(S)`` with row ``r`` and column ``c`` (every index mod ``S``; ``delta = 1`` only at ``t = S-1``)::

      Forward   I_M = r       I_N = r + c + t          I_K = c
      Backward  I_M = r       I_N = r + c - 1          I_K = c + t
      Gradient  I_M = r + t   I_N = r + c - 1 + delta  I_K = c - 1 + delta

  The formulas hold for any ``S >= 2``, so the digits need not be binary.
* ``Replicate`` changes no index.

Everything else (which tensor slice a device holds, the ring senders, the collectives) is derived from these
indices in :mod:`primepar_fx.partition.comm`; nothing there is tabulated by hand.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np
import sympy

from primepar_fx.partition.mesh import DeviceMesh, device_grid
from primepar_fx.partition.seq import PartitionSeq, Prime, Replicate, Split
from primepar_fx.rules.spec import OpDims, TensorMap


class Phase(enum.Enum):
    """A phase of an operator's training step: Forward, Backward (data gradient) or Gradient (weight gradient)."""

    FORWARD = "F"
    BACKWARD = "B"
    GRADIENT = "G"


PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.GRADIENT)
#: The slice of one tensor dim: for each iteration dim it is made of, ``(index, parts)``.
DimSlice = tuple[tuple[int, int], ...]
TensorSlice = tuple[DimSlice, ...]


class PartitionError(ValueError):
    """A partition sequence that is not legal for an operator (names the dim and the reason)."""


def _mixed(digits: list[int], radices: list[int]) -> int:
    v = 0
    for d, r in zip(digits, radices):
        v = v * r + d
    return v


@dataclass(frozen=True)
class OpPartition:
    """A partition sequence bound to one operator's iteration space and a device mesh."""

    op: OpDims
    seq: PartitionSeq
    mesh: DeviceMesh
    positions: tuple[tuple[int, ...], ...] = field(init=False)
    parts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        try:
            positions = self.seq.bind(self.mesh)
        except ValueError as e:
            raise PartitionError(str(e)) from None
        parts = {d: 1 for d in self.op.dims}
        for e, pos in zip(self.seq.elements, positions):
            if isinstance(e, Split):
                if e.dim not in parts:
                    raise PartitionError(f"{self.seq}: the op has no dim {e.dim!r} (its dims are {self.op.dims})")
                if e.dim in self.op.no_split:
                    raise PartitionError(f"{self.seq}: dim {e.dim!r} may not be split")
                parts[e.dim] *= self.mesh.digits[pos[0]]
            elif isinstance(e, Prime):
                if self.op.matmul is None:
                    raise PartitionError(f"{self.seq}: P(S x S) needs a matrix product, this op is {self.op.kind}")
                bad = [d for d in self.op.matmul if d in self.op.no_split]
                if bad:
                    raise PartitionError(f"{self.seq}: P(S x S) would split dim {bad[0]!r}, which may not be split")
                for d in self.op.matmul:
                    parts[d] *= e.size
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "parts", parts)

    # ----------------------------------------------------------------------------------- basics
    @property
    def steps(self) -> int:
        return self.seq.steps

    def digits_of(self, dim: str) -> tuple[int, ...]:
        """Digit positions whose value changes the slice of ``dim`` (its group indicator)."""
        out: list[int] = []
        for e, pos in zip(self.seq.elements, self.positions):
            if (isinstance(e, Split) and e.dim == dim) or (isinstance(e, Prime) and dim in (self.op.matmul or ())):
                out += pos
        return tuple(out)

    @property
    def replicate_digits(self) -> tuple[int, ...]:
        return tuple(p[0] for e, p in zip(self.seq.elements, self.positions) if isinstance(e, Replicate))

    @property
    def prime_digits(self) -> tuple[int, ...]:
        return next((p for e, p in zip(self.seq.elements, self.positions) if isinstance(e, Prime)), ())

    def row_col(self, coords: Sequence[int]) -> tuple[int, int]:
        """The device's (row, column) in the P(S x S) square."""
        pos = self.prime_digits
        if not pos:
            raise PartitionError(f"{self.seq} has no P(S x S)")
        radices = [self.mesh.digits[p] for p in pos]
        return _mixed([coords[p] for p in pos[0::2]], radices[0::2]), _mixed(
            [coords[p] for p in pos[1::2]], radices[1::2]
        )

    # ------------------------------------------------------------------------------------- DSIs
    def dsis(self, phase: Phase, coords: tuple[int, ...], t: int = 0) -> dict[str, int]:
        """``I_X^phase(D, t)`` for every iteration dim ``X``."""
        return self._indices(phase, coords, t)

    def dsi_table(self, phase: Phase, t: int = 0) -> dict[str, np.ndarray]:
        """:meth:`dsis` of every device at once: ``I_X`` of each device in rank order, as a read-only int64 array;
        computed once per ``(phase, t)`` (the layouts, ring senders and replica counts of one partition read each
        table several times), so the dict is shared: read it only."""
        tables = self.__dict__.setdefault("_dsi_tables", {})
        if (phase, t) not in tables:
            world, grid = self.mesh.size, device_grid(self.mesh)
            idx = self._indices(phase, tuple(grid.T), t)
            table = {d: np.broadcast_to(np.asarray(i, dtype=np.int64), (world,)) for d, i in idx.items()}
            tables[phase, t] = table
        return tables[phase, t]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the memo of :meth:`dsi_table`."""
        return {k: v for k, v in self.__dict__.items() if k != "_dsi_tables"}

    def _indices(self, phase: Phase, coords: Sequence[Any], t: int) -> dict[str, Any]:
        """Algorithm 1 on ``coords``, one entry per digit: an int (one device) or an int array (many devices)."""
        if not 0 <= t < self.steps:
            raise ValueError(f"step {t} is outside 0..{self.steps - 1}")
        idx: dict[str, Any] = {d: 0 for d in self.op.dims}
        for e, pos in zip(self.seq.elements, self.positions):
            if isinstance(e, Split):
                idx[e.dim] = idx[e.dim] * self.mesh.digits[pos[0]] + coords[pos[0]]
            elif isinstance(e, Prime):
                s = e.size
                r, c = self.row_col(coords)
                m, n, k = self.op.matmul  # type: ignore[misc]
                delta = 1 if t == s - 1 else 0
                if phase is Phase.FORWARD:
                    terms = (r, r + c + t, c)
                elif phase is Phase.BACKWARD:
                    terms = (r, r + c - 1, c + t)
                else:
                    terms = (r + t, r + c - 1 + delta, c - 1 + delta)
                for d, term in zip((m, n, k), terms):
                    idx[d] = idx[d] * s + term % s
        return idx

    def tensor_slice(self, phase: Phase, tmap: TensorMap, coords: tuple[int, ...], t: int = 0) -> TensorSlice:
        idx = self.dsis(phase, coords, t)
        return tuple(tuple((idx[d], self.parts[d]) for d in group) for group in tmap)

    def local_shape(self, tmap: TensorMap) -> tuple[sympy.Expr, ...]:
        """The shape of the block of a tensor that one device holds at one step."""
        return tuple(
            sympy.Integer(1)
            if not group
            else prod((self.op.size(d) / self.parts[d] for d in group), start=sympy.Integer(1))
            for group in tmap
        )

    def check_divisible(self, values: dict[sympy.Symbol, int] | None = None) -> None:
        """Raise :class:`PartitionError` naming the dim when a concrete size does not divide evenly."""
        for d, size in zip(self.op.dims, self.op.sizes):
            p = self.parts[d]
            if p == 1:
                continue
            expr = sympy.sympify(size).subs(values or {})
            if expr.is_Integer and int(expr) % p:
                raise PartitionError(f"{self.seq}: dim {d!r} of size {int(expr)} does not split into {p} parts")
            if not expr.is_Integer and not (expr / p).is_integer and not expr.free_symbols:
                raise PartitionError(f"{self.seq}: dim {d!r} of size {expr} does not split into {p} parts")
