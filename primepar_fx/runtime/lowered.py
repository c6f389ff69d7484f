"""Local computations that need more than the ATen op on local blocks: a split vocabulary or normalised dim.

* :class:`VocabEmbedding`: ``V`` split. Each rank looks up the ids in its own vocabulary range and writes zeros
  for the others; the forward all-reduce of the plan (``V`` is summed) completes the rows.
* :class:`ShardedLayerNorm`: the normalised dim split. The mean and the variance are all-reduced (two-pass, one
  statistic each) in both directions, since every rank normalises its own slice with them.
* :class:`ShardedCrossEntropy`: rows ``N`` and/or classes ``V`` split. With ``V`` split the row max, then the sum
  of exponentials and the target logit (one message) are all-reduced; with ``N`` split the count of non-ignored
  targets and the loss sum are, so a ``mean`` divides by the global count exactly as one device does. Both sums
  run asynchronously (:mod:`primepar_fx.runtime.pending`): the count from the start of the graph
  (:class:`~primepar_fx.runtime.pending.TargetCount`), the loss sum until its value is read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.collectives import all_reduce, all_reduce_autograd
from primepar_fx.runtime.pending import Pending, launch_all_reduce, lazy_all_reduce
from primepar_fx.runtime.stats import CommStats

Group = tuple[object | None, tuple[int, ...]]


class VocabEmbedding(nn.Module):
    """Embedding lookup on one rank's vocabulary rows ``[lo, lo + rows)``; ids outside them give zero rows."""

    def __init__(self, lo: int, rows: int) -> None:
        super().__init__()
        self.lo, self.rows = lo, rows

    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), weight)
        return out * inside.unsqueeze(-1).to(out.dtype)

    def extra_repr(self) -> str:
        return f"rows [{self.lo}, {self.lo + self.rows})"


class ShardedLayerNorm(nn.Module):
    """Layer norm over a normalised dim split across ``group``: mean and variance are all-reduced."""

    def __init__(self, size: int, eps: float, group: Group, stats: CommStats) -> None:
        super().__init__()
        self.size, self.eps, self.group, self.stats = size, eps, group, stats
        self.node = ""

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        g, ranks = self.group
        return all_reduce_autograd(x.sum(-1, keepdim=True), g, len(ranks), "both", self.stats, self.node)

    def forward(self, x, weight=None, bias=None):
        mean = self._sum(x) / self.size
        centred = x - mean
        var = self._sum(centred * centred) / self.size
        y = centred * torch.rsqrt(var + self.eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return f"normalised size {self.size}, eps={self.eps}, ranks={self.group[1]}"


def loss_message_bytes(ranks: int, itemsize: int, count_local: bool = False) -> tuple[int, int]:
    """``comm_stats`` bytes of a ``mean``'s count and loss sum: the plan prices them as one all-reduce of both, or,
    when every rank counts the targets itself (``count_local``), the loss sum alone."""
    both = int(round(ring_factors("all-reduce", ranks)[0] * (1 if count_local else 2) * itemsize))
    return (0, both) if count_local else (both // 2, both - both // 2)


class ShardedCrossEntropy(nn.Module):
    """Cross-entropy with the classes split across ``v_group`` and/or the rows across ``n_group``."""

    def __init__(
        self,
        reduction: str,
        ignore_index: int,
        v_lo: int,
        v_group: Group,
        n_group: Group,
        stats: CommStats,
        count_local: bool = False,
    ) -> None:
        super().__init__()
        self.reduction, self.ignore_index, self.v_lo = reduction, ignore_index, v_lo
        self.v_group, self.n_group, self.stats = v_group, n_group, stats
        self.count_local = count_local  # the ``count`` passed in is the global one, counted without a message
        self.node = ""

    def forward(self, logits: torch.Tensor, target: torch.Tensor, count: Pending | None = None) -> torch.Tensor:
        """``count``: the pending global count of targets (a ``mean``'s; started here when not given)."""
        vg, vranks = self.v_group
        valid = target != self.ignore_index
        if len(vranks) > 1:
            rows = logits.shape[-1]
            peak = all_reduce(
                logits.detach().amax(-1), vg, len(vranks), self.stats, op=dist.ReduceOp.MAX, node=self.node
            )
            sumexp = torch.exp(logits - peak.unsqueeze(-1)).sum(-1)
            local = target - self.v_lo
            inside = (local >= 0) & (local < rows)
            picked = logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
            # the two sums in one message (the max cannot join them: another reduction)
            both = all_reduce_autograd(torch.stack([sumexp, picked]), vg, len(vranks), "forward", self.stats, self.node)
            sumexp, picked = both.unbind()
            loss = torch.log(sumexp) + peak - picked
        else:
            loss = F.cross_entropy(logits, target, reduction="none", ignore_index=self.ignore_index)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        if self.reduction == "none":
            return loss
        if len(self.n_group[1]) < 2:
            return loss.sum() if self.reduction == "sum" else loss.sum() / valid.sum().to(loss.dtype)
        if self.reduction == "sum":
            return lazy_all_reduce(loss.sum(), self.n_group, self.stats, self.node)
        nbytes = loss_message_bytes(len(self.n_group[1]), loss.element_size(), self.count_local)
        if count is None:
            count = launch_all_reduce(valid.sum().to(loss.dtype), self.n_group, self.stats, self.node, nbytes=nbytes[0])
        return lazy_all_reduce(loss.sum(), self.n_group, self.stats, self.node, count.wait(), nbytes[1])

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction}, classes from {self.v_lo} over ranks {self.v_group[1]}, "
            f"rows over ranks {self.n_group[1]}"
        )
