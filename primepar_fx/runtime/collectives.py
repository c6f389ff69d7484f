"""Autograd-aware all-reduces: forward and backward are defined together.

Convention (the one Megatron's ``f``/``g`` operators follow): a tensor that several ranks hold the same slice of
carries the *complete* gradient of that slice on each of them. Then

* a ``"forward"`` all-reduce sums partial results (a split contraction dim) and its backward is the identity;
* a ``"backward"`` all-reduce is the identity in forward and sums the partial gradients that ranks computing
  different outputs from one replicated input leave behind (a collective on ``d_in``);
* ``"both"`` does both (statistics of a norm whose normalised dim is split).

:class:`ReduceScatter` is an all-reduce fused with the slice a re-layout takes after it; :func:`reduce_scatter_flat`
is the asynchronous reduce-scatter of a flat tensor that ZeRO's gradient buckets run.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist
from torch import nn

from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.scatter import scatters
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.layouts import Layout
from primepar_fx.runtime.exchange import Exchange, Slices
from primepar_fx.runtime.groups import global_rank, mesh_rank, wait_p2p
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
    :class:`~primepar_fx.runtime.exchange.Exchange`). It runs point to point, as the re-layouts do: this rank
    (``me``) sends each peer that peer's piece of its block, one message each, all posted at once, and sums the
    pieces it receives with its own, in group order. That is the ring's volume exactly ((g-1)/g of the block) in
    g-1 messages; gloo's own ``reduce_scatter`` sends twice that and takes several times as long
    (docs/runtime.md, "Reduce-scatters"). It has the same :meth:`run` signature as an :class:`Exchange`, so a
    :class:`~primepar_fx.runtime.exchange.Redistribute` can carry it in either direction; :meth:`piece` and
    :meth:`total` let a caller send pieces as it computes them (:mod:`primepar_fx.runtime.collective_matmul`).
    """

    group: object
    ranks: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[Slices, Slices], ...], ...]
    identity: bool = False
    me: int = -1
    #: the planned node whose all-reduce this is, which ``comm_stats`` counts it under (the plan reports a Forward
    #: one on its producer, :mod:`primepar_fx.cost.scatter`); ``""``: the node the caller names
    owner: str = ""

    @classmethod
    def plan(
        cls,
        held: Layout,
        needed: Layout,
        mesh: DeviceMesh,
        me: int,
        group: object,
        ranks: tuple[int, ...],
        owner: str = "",
    ) -> ReduceScatter:
        if not scatters(held, needed, [list(ranks)]):
            raise ValueError(f"going from the held to the needed layout is not a reduce-scatter over ranks {ranks}")
        plans = [Exchange.plan(held, needed, mesh, r) for r in ranks]
        if any(p.comm for p in plans):
            raise ValueError(f"a reduce-scatter over ranks {ranks} must be a local slice on each of them")
        mine = plans[ranks.index(me)]
        return cls(
            group, tuple(ranks), mine.in_shape, mine.out_shape, tuple(p.local for p in plans), me=me, owner=owner
        )

    @property
    def peers(self) -> tuple[int, ...]:
        """The other ranks of the group, in group order."""
        return tuple(r for r in self.ranks if r != self.me)

    def piece(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of this rank's block ``x`` (a new contiguous tensor)."""
        out = x.new_empty(self.out_shape)
        for src, dst in self.pieces[self.ranks.index(rank)]:
            out[dst] = x[src]
        return out

    def nbytes(self, itemsize: int) -> int:
        """The bus bytes ``comm_stats`` counts for one reduce-scatter of elements of ``itemsize`` bytes (the cost
        model's ring volume: (g-1)/g of the block)."""
        return int(round(ring_factors("reduce-scatter", len(self.ranks))[0] * prod(self.in_shape) * itemsize))

    def total(self, own: torch.Tensor, received: dict[int, torch.Tensor]) -> torch.Tensor:
        """This rank's piece summed over the group, in group order (the same order whoever sent first)."""
        parts = [own if r == self.me else received[r] for r in self.ranks]
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def run(self, x: torch.Tensor, stats: CommStats | None = None, kind: str = "", node: str = "") -> torch.Tensor:
        """The sum over the group of this rank's piece of ``x`` (``kind`` is ignored: this is a collective)."""
        if tuple(x.shape) != self.in_shape:
            raise RuntimeError(f"reduce-scatter expected a local block of shape {self.in_shape}, got {tuple(x.shape)}")
        ops, inbox = [], {}
        for r in self.peers:
            ops.append(dist.P2POp(dist.isend, self.piece(x, r), global_rank(r)))
            inbox[r] = x.new_empty(self.out_shape)
            ops.append(dist.P2POp(dist.irecv, inbox[r], global_rank(r)))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        own = self.piece(x, self.me)
        for req in reqs:
            wait_p2p(req)
        if stats is not None:
            stats.add("collective", self.nbytes(x.element_size()), self.owner or node)
        return self.total(own, inbox)


class _PointToPointScatter:
    """A reduce-scatter of ``flat`` (``g`` equal pieces, one per rank of ``ranks`` in group order) into ``out``, point
    to point: every piece sent to its rank at once, one message each, and this rank's own piece summed with what it
    receives, in group order, when :meth:`wait` is called. ``(g-1)/g`` of ``flat`` in ``g-1`` messages, as
    :class:`ReduceScatter` runs; ``flat`` and the receive buffers are held until then."""

    def __init__(self, out: torch.Tensor, flat: torch.Tensor, group: object, ranks: tuple[int, ...], me: int) -> None:
        self.out, self.pieces, self.me, self.ranks = out, flat.view(len(ranks), -1), me, ranks
        ops, self.inbox = [], {}
        for k, r in enumerate(ranks):
            if r != me:
                self.inbox[r] = out.new_empty(out.shape)
                ops.append(dist.P2POp(dist.isend, self.pieces[k], global_rank(r), group))
                ops.append(dist.P2POp(dist.irecv, self.inbox[r], global_rank(r), group))
        self.reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> bool:
        for req in self.reqs:
            wait_p2p(req)
        parts = [self.pieces[k] if r == self.me else self.inbox[r] for k, r in enumerate(self.ranks)]
        self.out.copy_(parts[0])
        for part in parts[1:]:
            self.out.add_(part)
        self.reqs, self.inbox, self.pieces = [], {}, self.pieces[:0]
        return True


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: object, ranks: tuple[int, ...]) -> object:
    """Start the reduce-scatter of ``flat`` (``len(ranks) * out.numel()`` elements) over ``group`` into ``out``; returns
    the work to ``wait()`` for. Under gloo it runs point to point (:class:`_PointToPointScatter`): gloo's own
    ``reduce_scatter`` writes an all-reduce's bytes to its sockets, twice the ring volume, and took 2.4x as long for
    4 MiB on 4 ranks of a 2-core machine (docs/runtime.md, "Reduce-scatters"); other backends (NCCL) run their own,
    asynchronously."""
    if flat.numel() != len(ranks) * out.numel():
        raise ValueError(f"reduce-scatter of {flat.numel()} elements into {len(ranks)} x {out.numel()}")
    if dist.get_backend(group) == "gloo":
        return _PointToPointScatter(out, flat, group, ranks, mesh_rank(dist.get_rank()))
    return dist.reduce_scatter_single(out, flat, group=group, async_op=True)
