"""Where every tensor of the graph lives on every rank: the layouts the passes exchange between.

A layout (:data:`~primepar_fx.partition.layouts.Layout`) lists, per rank and tensor dim, the flat index intervals
the rank holds. The passes read them from the plan's partitions with the same functions the cost model prices
(:mod:`primepar_fx.cost.redistribute`): a producer holds ``out_j`` at its last Forward step and needs ``d_out_j`` at
its first Backward step; a consumer needs ``in_k`` at its first Forward step and holds ``d_in_k`` at the last step
of Backward (Gradient for a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from primepar_fx.cost.redistribute import backward_held, backward_needed, forward_held, forward_needed
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Replicate
from primepar_fx.partition.enumerate import ValuesKey, values_key
from primepar_fx.partition.layouts import Layout


@dataclass(frozen=True)
class NodeLayouts:
    """The layouts one partitioned node exchanges with its neighbours."""

    part: OpPartition
    vkey: ValuesKey
    requires_grad: bool

    def out_held(self, j: int) -> Layout:
        return forward_held(self.part, j).layout(self.vkey)

    def out_grad_needed(self, j: int) -> Layout | None:
        return backward_needed(self.part, j).layout(self.vkey) if self.requires_grad else None

    def in_needed(self, k: int) -> Layout:
        return forward_needed(self.part, k).layout(self.vkey)

    def in_grad_held(self, k: int) -> Layout | None:
        use = backward_held(self.part, k)
        return None if use is None or not self.requires_grad else use.layout(self.vkey)


def replicated(mesh: DeviceMesh) -> PartitionSeq:
    """The all-``Replicate`` sequence: every rank computes the whole op."""
    return PartitionSeq(tuple(Replicate() for _ in mesh.digits))


def vkey_of(values: dict[sympy.Symbol, int]) -> ValuesKey:
    return values_key(values)


def local_shape(layout: Layout, rank: int) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in s) for s in layout[rank])
