"""Autograd-aware all-reduces: forward and backward are defined together.

Convention (the one Megatron's ``f``/``g`` operators follow): a tensor that several ranks hold the same slice of
carries the *complete* gradient of that slice on each of them. Then

* a ``"forward"`` all-reduce sums partial results (a split contraction dim) and its backward is the identity;
* a ``"backward"`` all-reduce is the identity in forward and sums the partial gradients that ranks computing
  different outputs from one replicated input leave behind (a collective on ``d_in``);
* ``"both"`` does both (statistics of a norm whose normalised dim is split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from primepar_fx.cost.cluster import ring_factors
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
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"all-reduce mode must be one of {MODES}, got {mode!r}")
        self.group, self.ranks, self.digits, self.mode, self.stats, self.why = group, ranks, digits, mode, stats, why
        self.node = node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_autograd(x, self.group, len(self.ranks), self.mode, self.stats, self.node)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, digits={self.digits}, ranks={self.ranks}" + (f", for={self.why}" if self.why else "")
