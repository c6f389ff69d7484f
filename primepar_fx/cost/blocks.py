"""What the cost model assumes about training (:class:`CostOptions`) and the size of one device's block of a tensor.

The bottom of the cost stage: :mod:`~primepar_fx.cost.model` (Eq. 7) and :mod:`~primepar_fx.cost.scatter` (the
reduce-scatter saving) both price blocks through :func:`block_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from math import prod

from primepar_fx.cost.cluster import dtype_key
from primepar_fx.partition import OpPartition
from primepar_fx.partition.enumerate import ValuesKey
from primepar_fx.partition.layouts import concrete_sizes
from primepar_fx.rules.spec import OpDims, TensorMap

#: Bytes per element of each training dtype.
ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class CostOptions:
    """What the cost model assumes about training: dtype, optimizer state and the memory weight ``alpha``."""

    dtype: str = "fp32"
    optimizer_states: int = 2  # Adam keeps two moments per parameter
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if dtype_key(self.dtype) not in ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")
        if self.optimizer_states < 0 or self.alpha < 0:
            raise ValueError("optimizer_states and alpha must be non-negative")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[dtype_key(self.dtype)]


@lru_cache(maxsize=1 << 16)
def block_elems(op: OpDims, parts: tuple[int, ...], tmap: TensorMap, vkey: ValuesKey) -> int:
    """Elements of one device's block of ``tmap`` when iteration dim ``op.dims[i]`` is cut into ``parts[i]``."""
    part_of, sizes = dict(zip(op.dims, parts)), concrete_sizes(op, vkey)
    return int(round(float(prod((Fraction(sizes[d], part_of[d]) for group in tmap for d in group), start=1))))


def block_bytes(part: OpPartition, tmap: TensorMap, vkey: ValuesKey, itemsize: int) -> int:
    """Bytes of one device's block of ``tmap`` under ``part``, ``itemsize`` bytes an element."""
    return block_elems(part.op, tuple(part.parts.values()), tmap, vkey) * itemsize


def tensor_map(op: OpDims, name: str) -> TensorMap:
    """The TensorMap of a tensor named like ``in0``, ``out1``, ``d_in2``, ``d_out0``."""
    base = name.removeprefix("d_")
    maps = op.inputs if base.startswith("in") else op.outputs
    tmap = maps[int(base.lstrip("inout"))]
    assert tmap is not None, name
    return tmap
