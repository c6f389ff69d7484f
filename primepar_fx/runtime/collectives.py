"""Autograd-aware all-reduces: forward and backward are defined together.

Convention (the one Megatron's ``f``/``g`` operators follow): a tensor that several ranks hold the same slice of
carries the *complete* gradient of that slice on each of them. Then

* a ``"forward"`` all-reduce sums partial results (a split contraction dim) and its backward is the identity;
* a ``"backward"`` all-reduce is the identity in forward and sums the partial gradients that ranks computing
  different outputs from one replicated input leave behind (a collective on ``d_in``);
* ``"both"`` does both (statistics of a norm whose normalised dim is split).

:class:`ReduceScatter` is an all-reduce fused with the slice a re-layout takes after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.scatter import scatters
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.layouts import Layout
from primepar_fx.runtime.exchange import Exchange, Slices
from primepar_fx.runtime.stats import CommStats

MODES = ("forward", "backward", "both")


def all_reduce(
    x: torch.Tensor, group: object, size: int, stats: CommStats | None, op=dist.ReduceOp.SUM, node: str = ""
) -> torch.Tensor:
    """An out-of-place all-reduce over ``group`` (``size`` ranks), counted in ``stats``."""
    y = x.detach().clone(memory_format=torch.contiguous_format)
    if group is None or size < 2:
        return y
    dist.all_reduce(y, op=op, group=group)
    if stats is not None:
        stats.add("collective", ring_factors("all-reduce", size)[0] * y.numel() * y.element_size(), node)
    return y


class _AllReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, mode, stats, node):  # type: ignore[override]
        ctx.args = (group, size, mode, stats, node)
        if mode == "backward":
            return x.view_as(x)
        return all_reduce(x, group, size, stats, node=node)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        group, size, mode, stats, node = ctx.args
        if mode == "forward":
            return g, None, None, None, None, None
        return all_reduce(g, group, size, stats, node=node), None, None, None, None, None


def all_reduce_autograd(
    x: torch.Tensor, group: object, size: int, mode: str, stats: CommStats | None, node: str = ""
) -> torch.Tensor:
    if mode not in MODES:
        raise ValueError(f"all-reduce mode must be one of {MODES}, got {mode!r}")
    if group is None or size < 2:
        return x
    return _AllReduceFn.apply(x, group, size, mode, stats, node)


class AllReduce(nn.Module):
    """A graph node: an all-reduce over the ranks that differ only in ``digits`` (see the module docstring)."""

    def __init__(
        self,
        group: object,
        ranks: tuple[int, ...],
        digits: tuple[int, ...],
        mode: str,
        stats: CommStats,
        why: str = "",
        node: str = "",
        input_index: int | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"all-reduce mode must be one of {MODES}, got {mode!r}")
        self.group, self.ranks, self.digits, self.mode, self.stats, self.why = group, ranks, digits, mode, stats, why
        #: the plan node it belongs to, and for a ``"backward"`` one the input of that node whose gradient it sums
        self.node, self.input_index = node, input_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_autograd(x, self.group, len(self.ranks), self.mode, self.stats, self.node)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, digits={self.digits}, ranks={self.ranks}" + (f", for={self.why}" if self.why else "")


@dataclass(frozen=True)
class ReduceScatter:
    """An all-reduce over ``ranks`` fused with the local slice after it (:func:`primepar_fx.cost.scatter.scatters`).

    Every rank of the group holds a partial block of ``in_shape``; rank ``ranks[i]`` keeps the sum of the piece
    that ``pieces[i]`` copies out of it (``(source, destination)`` slices, the local part of that rank's
    :class:`~primepar_fx.runtime.exchange.Exchange`). It runs as one ``reduce_scatter`` over pieces laid out in
    group order, with the same :meth:`run` signature as an :class:`Exchange`, so a
    :class:`~primepar_fx.runtime.exchange.Redistribute` can carry it in either direction.
    """

    group: object
    ranks: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[Slices, Slices], ...], ...]
    identity: bool = False

    @classmethod
    def plan(
        cls, held: Layout, needed: Layout, mesh: DeviceMesh, me: int, group: object, ranks: tuple[int, ...]
    ) -> ReduceScatter:
        if not scatters(held, needed, [list(ranks)]):
            raise ValueError(f"going from the held to the needed layout is not a reduce-scatter over ranks {ranks}")
        plans = [Exchange.plan(held, needed, mesh, r) for r in ranks]
        if any(p.comm for p in plans):
            raise ValueError(f"a reduce-scatter over ranks {ranks} must be a local slice on each of them")
        mine = plans[ranks.index(me)]
        return cls(group, tuple(ranks), mine.in_shape, mine.out_shape, tuple(p.local for p in plans))

    def run(self, x: torch.Tensor, stats: CommStats | None = None, kind: str = "", node: str = "") -> torch.Tensor:
        """The sum over the group of this rank's piece of ``x`` (``kind`` is ignored: this is a collective)."""
        if tuple(x.shape) != self.in_shape:
            raise RuntimeError(f"reduce-scatter expected a local block of shape {self.in_shape}, got {tuple(x.shape)}")
        inputs = []
        for local in self.pieces:
            piece = x.new_empty(self.out_shape)
            for src, dst in local:
                piece[dst] = x[src]
            inputs.append(piece)
        out = x.new_empty(self.out_shape)
        dist.reduce_scatter(out, inputs, group=self.group)
        if stats is not None:
            stats.add(
                "collective", ring_factors("reduce-scatter", len(self.ranks))[0] * x.numel() * x.element_size(), node
            )
        return out
