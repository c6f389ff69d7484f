"""Tensor-parallel collectives overlapped with the matrix products beside them (collective matmul).

Under Megatron's sequence parallelism a column-parallel linear reads an all-gathered activation and a row-parallel
linear's partial sums are reduce-scattered: each collective is read at once by its neighbour, so moving its start or
its wait in the graph hides nothing. What does hide it is cutting the product by rows, as PyTorch's async tensor
parallelism and XLA's collective matmul do. A linear maps every row (every index of the dims before its last) on its
own, so a re-layout that moves whole rows (every piece it moves spans the last dim) commutes with it:

* :class:`GatherLinears`: an all-gather feeding one or more linears (q, k and v reading one gathered input).
  Forward posts the exchange, computes the rows this rank holds, then each peer's rows as their message arrives.
  Backward computes each peer's rows of the input gradient first and sends them at once (the reduce-scatter of
  the gradient, one message a peer), then its own rows and the weight gradients while those travel, and sums what it
  receives last.
* :class:`LinearScatter`: a linear whose partial sums are reduce-scattered. Forward computes each peer's rows and
  sends them at once, then its own rows while those travel, and sums what it receives last. Backward posts the
  all-gather of the output gradient and computes the input and weight gradients of its own rows, then each peer's
  rows as their message arrives.

The messages are the re-layout's: the same peers, bytes and wire format as :meth:`Exchange.post
<primepar_fx.runtime.exchange.Exchange.post>` and :class:`~primepar_fx.runtime.collectives.ReduceScatter` (a peer
that runs the plain re-layout meets them), counted in ``comm_stats`` the same way. Results are the plain ones up to
the order of floating-point sums (a weight gradient summed over row blocks). Every send is posted before this rank
waits for anything, so no rank waits on a peer that waits on it. The pass that puts these nodes in the graph is
:func:`primepar_fx.passes.overlap.overlap_collective_matmuls`; the cost model prices the overlap in
:mod:`primepar_fx.cost.matmul_overlap`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from primepar_fx.runtime.collectives import ReduceScatter
from primepar_fx.runtime.exchange import Exchange, Slices
from primepar_fx.runtime.groups import global_rank, wait_p2p
from primepar_fx.runtime.stats import CommStats


def rows(slices: Slices) -> Slices:
    """``slices`` of a linear's input or output with the last dim whole: the same rows of the other."""
    return (*slices[:-1], slice(None))


def _whole_last(slices: Slices, size: int) -> bool:
    s = slices[-1]
    return (s.start or 0) == 0 and (s.stop is None or s.stop == size) and s.step in (None, 1)


def moves_rows(move: object) -> bool:
    """Whether every piece ``move`` (an :class:`Exchange` or a :class:`ReduceScatter`) copies, sends or receives spans
    the last dim, so that it commutes with a linear (a map of each row)."""
    if not isinstance(move, Exchange | ReduceScatter) or not move.in_shape or move.in_shape[-1] != move.out_shape[-1]:
        return False
    last = move.in_shape[-1]
    if isinstance(move, Exchange):
        pieces = [s for pair in move.local for s in pair] + [s for _, ps in move.sends for s in ps]
        pieces += [dst for _, ps in move.recvs for dst, _ in ps]
    else:
        pieces = [s for local in move.pieces for pair in local for s in pair]
    return all(_whole_last(s, last) for s in pieces)


def _send(t: torch.Tensor, peer: int) -> Any:
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, t, global_rank(peer))])[0]


def _recv(t: torch.Tensor, peer: int) -> Any:
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, global_rank(peer))])[0]


def _rotated(peers: Sequence[int], me: int) -> list[int]:
    """``peers`` starting after ``me``: at each moment the ranks send to different peers."""
    after = [p for p in peers if p > me]
    return after + [p for p in peers if p < me]


def _whole(t: torch.Tensor) -> Slices:
    return tuple(slice(None) for _ in t.shape)


def scatter_rows(
    rs: ReduceScatter,
    compute: Callable[[Slices], torch.Tensor],
    like: torch.Tensor,
    stats: CommStats | None,
    node: str,
    then: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The reduce-scatter ``rs`` of a block whose rows ``compute(row slices)`` makes on demand (``like``: a tensor of
    its dtype and device): each peer's piece is computed and sent at once, then this rank's own piece, then
    ``then()`` (more work to overlap), then the sum in group order. The messages are :meth:`ReduceScatter.run`'s."""
    boxes: dict[int, torch.Tensor] = {}
    works, keep = [], []
    for peer in _rotated(rs.peers, rs.me):
        piece = _piece(rs, peer, compute, like)
        works.append(_send(piece, peer))
        keep.append(piece)  # alive until sent
    for peer in rs.peers:
        boxes[peer] = like.new_empty(rs.out_shape)
        works.append(_recv(boxes[peer], peer))
    own = _piece(rs, rs.me, compute, like)
    if then is not None:
        then()
    for w in works:
        wait_p2p(w)
    if stats is not None:
        stats.add("collective", rs.nbytes(like.element_size()), rs.owner or node)
    return rs.total(own, boxes)


def _piece(rs: ReduceScatter, rank: int, compute: Callable[[Slices], torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s piece of the block ``compute`` makes, computed from its rows only."""
    pieces = rs.pieces[rs.ranks.index(rank)]
    if len(pieces) == 1:  # one block of rows: the whole piece
        return compute(rows(pieces[0][0])).contiguous()
    out = like.new_empty(rs.out_shape)
    for src, dst in pieces:
        out[rows(dst)] = compute(rows(src))
    return out


def gather_rows(
    ex: Exchange,
    x: torch.Tensor,
    each: Callable[[torch.Tensor, Slices], None],
    stats: CommStats | None,
    kind: str,
    node: str,
) -> torch.Tensor:
    """The exchange ``ex`` of ``x``, calling ``each(result, row slices)`` on each block of rows as soon as it is in:
    this rank's own first, then each peer's message as it arrives. Returns the gathered tensor."""
    if ex.identity:
        each(x, _whole(x))
        return x
    out = x.new_empty(ex.out_shape)
    posted = ex.post(x, stats, kind, node)
    for src, dst in ex.local:
        out[dst] = x[src]
        each(out, rows(dst))
    for req, _, buf, pieces in posted.arrivals:
        wait_p2p(req)
        ex.unpack(out, buf, pieces)
        for dst, _ in pieces:
            each(out, rows(dst))
    posted.wait_sent()
    return out


class _GatherLinearsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, x, *params):  # type: ignore[override]
        weights, biases = mod.split(params)
        rows_out = mod.fwd.out_shape[:-1]
        outs = [x.new_empty((*rows_out, w.shape[0])) for w in weights]

        def each(full: torch.Tensor, r: Slices) -> None:
            for out, w, b in zip(outs, weights, biases):
                out[r] = F.linear(full[r], w, b)

        full = gather_rows(mod.fwd, x, each, mod.stats, mod.kind, mod.node)
        ctx.mod = mod
        ctx.save_for_backward(full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        mod = ctx.mod
        full, *weights = ctx.saved_tensors
        live = [(g, w) for g, w in zip(grads, weights) if g is not None]

        def dinput(r: Slices) -> torch.Tensor:
            out = full[r].new_zeros(full[r].shape) if not live else None
            for g, w in live:
                part = g[r] @ w
                out = part if out is None else out.add_(part)
            return out  # type: ignore[return-value]

        dparams: list[torch.Tensor | None] = []

        def dweights() -> None:
            x2 = full.reshape(-1, full.shape[-1])
            for g, b in zip(grads, mod.has_bias):
                g2 = None if g is None else g.reshape(-1, g.shape[-1])
                dparams.append(None if g2 is None else g2.t() @ x2)
                if b:
                    dparams.append(None if g2 is None else g2.sum(0))

        bwd = mod.bwd
        if bwd is None:
            dx = None
            dweights()
        elif isinstance(bwd, ReduceScatter):
            dx = scatter_rows(bwd, dinput, full, mod.stats, mod.node, then=dweights)
        else:  # a plain exchange: the whole input gradient, then the weights'
            dx = bwd.run(dinput(_whole(full)), mod.stats, mod.kind, mod.node)
            dweights()
        return (None, dx, *dparams)


class GatherLinears(nn.Module):
    """A graph node: the re-layout ``fwd`` (``bwd`` for the gradient: a reduce-scatter, an exchange or ``None``) of
    its input, which moves whole rows, fused with the linears that read its result (module docstring). Called with
    the input and, per linear, its weight and (``has_bias``) its bias; returns one output per linear."""

    def __init__(
        self,
        fwd: Exchange,
        bwd: ReduceScatter | Exchange | None,
        has_bias: tuple[bool, ...],
        stats: CommStats,
        what: str = "",
        node: str = "",
        kind: str = "redistribution",
    ) -> None:
        super().__init__()
        if not moves_rows(fwd) or (isinstance(bwd, ReduceScatter) and not moves_rows(bwd)):
            raise ValueError("GatherLinears needs an exchange (and a reduce-scatter back) that moves whole rows")
        self.fwd, self.bwd, self.has_bias, self.stats = fwd, bwd, tuple(has_bias), stats
        self.what, self.node, self.kind = what, node, kind

    def split(self, params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The weights and biases (``None`` where a linear has none) of the flat ``params``."""
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        i = 0
        for b in self.has_bias:
            weights.append(params[i])
            biases.append(params[i + 1] if b else None)
            i += 2 if b else 1
        return weights, biases

    def forward(self, x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _GatherLinearsFn.apply(self, x, *params)
        full = self.fwd.run(x, self.stats, self.kind, self.node)
        weights, biases = self.split(params)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    def extra_repr(self) -> str:
        back = "none" if self.bwd is None else type(self.bwd).__name__
        return (
            f"{self.what}: gather {self.fwd.in_shape}->{self.fwd.out_shape} into {len(self.has_bias)} linear(s) "
            f"by rows; backward {back}"
        )


class _KeepFn(torch.autograd.Function):
    """Keeps the linear's input and weight for :class:`_LinearScatterFn`'s backward, and returns a token that
    carries them there. A node of its own, so that they are packed before the reduce-scatter is sent: a checkpoint's
    recomputation stops at the last tensor it packs (the cost model prices no collective after the last node that
    keeps a tensor running again, :mod:`primepar_fx.levers.recompute`), and a custom function packs what it keeps
    only when its forward returns."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        return None, None


class _LinearScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, token, x, w):  # type: ignore[override]
        out = scatter_rows(mod.fwd, lambda r: x[r] @ w.t(), x, mod.stats, mod.node)
        ctx.mod, ctx.keep = mod, token.grad_fn  # _KeepFn's node: its saved x and w
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        mod = ctx.mod
        x, w = ctx.keep.saved_tensors
        if mod.bwd is None:
            return None, None, None, None
        dx = x.new_empty(x.shape) if ctx.needs_input_grad[2] else None
        dw = w.new_zeros(w.shape) if ctx.needs_input_grad[3] else None

        def each(gfull: torch.Tensor, r: Slices) -> None:
            gr = gfull[r]
            if dx is not None:
                dx[r] = gr @ w
            if dw is not None:
                dw.addmm_(gr.reshape(-1, gr.shape[-1]).t(), x[r].reshape(-1, x.shape[-1]))

        gather_rows(mod.bwd, g.contiguous(), each, mod.stats, mod.kind, mod.node)
        return None, None, dx, dw


class LinearScatter(nn.Module):
    """A graph node: a bias-free linear whose partial sums go through the re-layout ``fwd``, a reduce-scatter that
    moves whole rows (``bwd``: the gradient's exchange, or ``None``), fused (module docstring). Called with the
    input and the weight."""

    def __init__(
        self,
        fwd: ReduceScatter,
        bwd: Exchange | None,
        stats: CommStats,
        what: str = "",
        node: str = "",
        kind: str = "redistribution",
    ) -> None:
        super().__init__()
        if not moves_rows(fwd) or not (bwd is None or bwd.identity or moves_rows(bwd)):
            raise ValueError("LinearScatter needs a reduce-scatter (and an exchange back) that moves whole rows")
        self.fwd, self.bwd, self.stats, self.what, self.node, self.kind = fwd, bwd, stats, what, node, kind

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _LinearScatterFn.apply(self, _KeepFn.apply(x, w), x, w)
        return self.fwd.run(F.linear(x, w), self.stats, self.kind, self.node)

    def extra_repr(self) -> str:
        return (
            f"{self.what}: linear, then reduce-scatter {self.fwd.in_shape}->{self.fwd.out_shape} over "
            f"{list(self.fwd.ranks)} by rows"
        )
