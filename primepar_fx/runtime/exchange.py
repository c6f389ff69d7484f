"""Point-to-point redistribution of a tensor from one layout to another (paper Eq. 8-9, executed).

A *layout* gives, for every rank and tensor dim, the sorted disjoint intervals of flat indices the rank holds
(:data:`primepar_fx.partition.layouts.Layout`). :class:`Exchange` turns a held and a needed layout into what this
rank copies locally, sends and receives: every tensor dim is cut at every interval end of every rank into *atoms*;
a block of atoms that a rank needs and does not hold comes from the holder that differs from it in the fewest
device-ID digits (the lowest rank on a tie), the rule :func:`primepar_fx.partition.comm.transfers` uses. Each rank
therefore receives exactly ``|needed - held|`` elements, the Eq. 9 count the cost model prices, and every pair of
ranks exchanges at most one message (``batch_isend_irecv``). A Cannon skew between two P(S x S) operators is such
an exchange whose pieces form a permutation.

:class:`Redistribute` is the autograd-aware graph node: forward runs the activation's exchange, backward the
gradient's (consumer ``d_in`` layout to producer ``d_out`` layout). By the convention of
:mod:`primepar_fx.runtime.collectives` a replicated gradient is already complete on each holder, so backward is
again a plain exchange.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.layouts import IndexSet, Layout
from primepar_fx.partition.mesh import nearest_holder
from primepar_fx.runtime.groups import global_rank, wait_p2p
from primepar_fx.runtime.stats import CommStats

Slices = tuple[slice, ...]


def full_layout(shape: tuple[int, ...], world: int) -> Layout:
    """Every rank holds the whole tensor."""
    return tuple(tuple(((0, int(n)),) for n in shape) for _ in range(world))


def _size(s: IndexSet) -> int:
    return sum(b - a for a, b in s)


def _position(s: IndexSet, lo: int, hi: int) -> int | None:
    """Local offset of the atom ``[lo, hi)`` inside the set ``s``, or ``None`` when ``s`` does not contain it."""
    i = bisect.bisect_right([a for a, _ in s], lo) - 1
    if i < 0 or not (s[i][0] <= lo and hi <= s[i][1]):
        return None
    return sum(b - a for a, b in s[:i]) + lo - s[i][0]


#: ``(needed by, sent by, shape, source slices, destination slices)``: one block of an exchange
Block = tuple[int, int, tuple[int, ...], Slices, Slices]


@functools.lru_cache(maxsize=1024)
def _matching(held: Layout, needed: Layout, mesh: DeviceMesh) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    """Every block of the exchange from ``held`` to ``needed``, for every rank, and the elements each rank receives
    (the Eq. 9 terms, in rank order).

    Every tensor dim is cut at every interval end of every rank into *atoms*; for each rank ``k`` and each block of
    atoms it needs, the sender is the nearest holder (the rank itself where it holds it). The work is the same on
    every rank, so it is done once per pair of layouts in a process and read per rank by :meth:`Exchange.plan`:
    the layers repeat their layouts, and where ranks are simulated as threads of one process
    (:mod:`primepar_fx.runtime.simulated`) every rank reads the same matching.
    """
    world, ndim = mesh.size, len(held[0])
    atoms: list[list[tuple[int, int]]] = []
    for d in range(ndim):
        points = sorted({p for lay in (held, needed) for r in lay for iv in r[d] for p in iv})
        atoms.append(list(zip(points, points[1:])))
    blocks: list[Block] = []
    received = [0] * world
    for k in range(world):
        # per dim: the atoms k needs, with their offset in k's block and in every rank's held block
        per_dim = []
        for d in range(ndim):
            rows = []
            for lo, hi in atoms[d]:
                dst = _position(needed[k][d], lo, hi)
                if dst is None:
                    continue
                rows.append((hi - lo, dst, [_position(held[r][d], lo, hi) for r in range(world)]))
            per_dim.append(rows)
        for combo in _product(per_dim):
            shape = tuple(n for n, _, _ in combo)
            dst = tuple(slice(o, o + n) for n, o, _ in combo)
            holders = [r for r in range(world) if all(src[r] is not None for _, _, src in combo)]
            if not holders:
                raise ValueError(f"no rank holds a block that rank {k} needs (layouts do not cover the tensor)")
            sender = nearest_holder(holders, k, mesh)  # the cost model's rule, so it counts these messages
            src = tuple(slice(s[sender], s[sender] + n) for n, _, s in combo)  # type: ignore[operator]
            blocks.append((k, sender, shape, src, dst))
            if sender != k:
                received[k] += prod(shape)
    return tuple(blocks), tuple(received)


@dataclass(frozen=True)
class Exchange:
    """What rank ``me`` copies, sends and receives to go from ``held`` to ``needed``."""

    me: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    local: tuple[tuple[Slices, Slices], ...]
    sends: tuple[tuple[int, tuple[Slices, ...]], ...]
    recvs: tuple[tuple[int, tuple[tuple[Slices, tuple[int, ...]], ...]], ...]
    identity: bool
    comm: bool  # some rank sends something
    #: elements every rank receives, in rank order (the Eq. 9 terms)
    received: tuple[int, ...]

    @classmethod
    def plan(cls, held: Layout, needed: Layout, mesh: DeviceMesh, me: int) -> Exchange:
        world = mesh.size
        if len(held) != world or len(needed) != world:
            raise ValueError(f"layouts cover {len(held)} and {len(needed)} ranks, the mesh has {world}")
        ndim = len(held[0])
        if any(len(h) != ndim for h in held) or any(len(n) != ndim for n in needed):
            raise ValueError("held and needed layouts describe tensors of different ranks")
        in_shape = tuple(_size(s) for s in held[me])
        out_shape = tuple(_size(s) for s in needed[me])
        if held == needed:
            return cls(me, in_shape, out_shape, (), (), (), True, False, (0,) * world)
        blocks, received = _matching(held, needed, mesh)
        local: list[tuple[Slices, Slices]] = []
        sends: dict[int, list[Slices]] = {}
        recvs: dict[int, list[tuple[Slices, tuple[int, ...]]]] = {}
        for k, sender, shape, src, dst in blocks:
            if sender == me and k == me:
                local.append((src, dst))
            elif sender == me:
                sends.setdefault(k, []).append(src)
            elif k == me:
                recvs.setdefault(sender, []).append((dst, shape))
        return cls(
            me,
            in_shape,
            out_shape,
            tuple(local),
            tuple((p, tuple(v)) for p, v in sorted(sends.items())),
            tuple((p, tuple(v)) for p, v in sorted(recvs.items())),
            False,
            any(received),
            received,
        )

    def post(
        self, x: torch.Tensor, stats: CommStats | None = None, kind: str = "redistribution", node: str = ""
    ) -> Posted:
        """Post this rank's sends of ``x`` and its receives, all at once, and return them without waiting: one message
        per peer, its pieces flattened and concatenated in order (the wire format :meth:`unpack` reads)."""
        ops, sent, boxes = [], [], []
        for peer, pieces in self.sends:
            if len(pieces) == 1 and x[pieces[0]].is_contiguous():
                buf = x[pieces[0]].reshape(-1)  # a view: sent before this exchange returns, so x may not change
            else:
                buf = torch.cat([x[s].reshape(-1) for s in pieces]) if pieces else x.new_empty(0)
            ops.append(dist.P2POp(dist.isend, buf, global_rank(peer)))
            sent.append(buf)
            if stats is not None:
                stats.add(kind, buf.numel() * buf.element_size(), node)
        for peer, pieces in self.recvs:
            buf = x.new_empty(sum(prod(shape) for _, shape in pieces))
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(peer)))
            boxes.append((peer, buf, pieces))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        n = len(self.sends)
        return Posted(list(zip(reqs[:n], sent)), [(req, *box) for req, box in zip(reqs[n:], boxes)])

    @staticmethod
    def unpack(out: torch.Tensor, buf: torch.Tensor, pieces: tuple[tuple[Slices, tuple[int, ...]], ...]) -> None:
        """Cut one received message into its pieces and write each into ``out``."""
        off = 0
        for dst, shape in pieces:
            n = prod(shape)
            out[dst] = buf[off : off + n].view(shape)
            off += n

    def run(
        self, x: torch.Tensor, stats: CommStats | None = None, kind: str = "redistribution", node: str = ""
    ) -> torch.Tensor:
        if tuple(x.shape) != self.in_shape:
            raise RuntimeError(f"redistribution expected a local block of shape {self.in_shape}, got {tuple(x.shape)}")
        if self.identity:
            return x
        out = x.new_empty(self.out_shape)
        posted = self.post(x, stats, kind, node)
        for src, dst in self.local:
            out[dst] = x[src]
        posted.wait_sent()
        for req, _, buf, pieces in posted.arrivals:
            wait_p2p(req)
            self.unpack(out, buf, pieces)
        return out


@dataclass
class Posted:
    """The messages of one :meth:`Exchange.post`: ``sent`` (work, buffer) pairs, the buffers kept alive until their
    sends complete, and ``arrivals`` (work, peer, buffer, pieces), one per peer, in the exchange's receive order."""

    sent: list[tuple[Any, torch.Tensor]]
    arrivals: list[tuple[Any, int, torch.Tensor, tuple[tuple[Slices, tuple[int, ...]], ...]]]

    def wait_sent(self) -> None:
        for req, _ in self.sent:
            wait_p2p(req)
        self.sent = []


def _product(per_dim: list[list]) -> list[tuple]:
    out: list[tuple] = [()]
    for rows in per_dim:
        out = [c + (r,) for c in out for r in rows]
    return out


class _RedistributeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):  # type: ignore[override]
        ctx.module = module
        return module.fwd.run(x, module.stats, module.kind, module.node)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        bwd = ctx.module.bwd
        if bwd is None:
            return None, None
        return bwd.run(g.contiguous(), ctx.module.stats, ctx.module.kind, ctx.module.node), None


class Redistribute(nn.Module):
    """A graph node that changes a tensor's layout (forward) and its gradient's (backward).

    Either direction may instead be a :class:`~primepar_fx.runtime.collectives.ReduceScatter` (an all-reduce fused
    with this node's slice), which has the same ``run``.
    """

    def __init__(
        self,
        fwd: Exchange,
        bwd: Exchange | None,
        stats: CommStats,
        what: str = "",
        node: str = "",
        kind: str = "redistribution",
        layouts: tuple[Layout, Layout, Layout | None, Layout | None] | None = None,
    ) -> None:
        super().__init__()
        self.fwd, self.bwd, self.stats, self.what, self.node, self.kind = fwd, bwd, stats, what, node, kind
        #: ``(held, needed, gradient held, gradient needed)``, the layouts the exchanges were planned from
        self.layouts = layouts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.fwd.run(x, self.stats, self.kind, self.node)
        return _RedistributeFn.apply(x, self)

    def extra_repr(self) -> str:
        def describe(e: Any) -> str:
            if e is None:
                return "none"
            if e.identity:
                return "identity"
            if not isinstance(e, Exchange):
                return f"{e.in_shape}->{e.out_shape}, reduce-scatter over {list(e.ranks)}"
            return (
                f"{e.in_shape}->{e.out_shape}, sends to {[p for p, _ in e.sends]}, recvs from {[p for p, _ in e.recvs]}"
            )

        return f"{self.what}: forward {describe(self.fwd)}; backward {describe(self.bwd)}"
