"""The P(S x S) ring operator (paper §3.2, Table 1) as one ``torch.autograd.Function``.

Forward runs the Forward phase, backward the Backward (dI) and Gradient (dW) phases, ``S`` steps each. Which
block moves where between two steps is not tabulated here: it is :func:`primepar_fx.partition.transfers`, derived
from the DSIs. At step ``t`` the shifts of the operand blocks for step ``t + 1`` are posted
(``batch_isend_irecv``, into a second buffer) *before* the block product of step ``t`` runs, so communication
overlaps computation; a result that moves (the partial dW before the last Gradient step) moves after its
product. Every block of W is held by exactly one rank at every step.

The parameter itself never moves. The paper shifts W in place and finally shifts it back (the last Backward step
to the Forward-start layout); here Forward shifts a working copy and Backward fetches W once from its Forward-start
layout into its Backward-start layout: one block per rank either way, the volume the cost model counts, and the
parameter the optimizer sees is always in its Forward-start layout, as is its gradient (the dW alignment). When W
is an activation (attention's batched products) the copy Forward leaves is kept for Backward instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from primepar_fx.partition import OpPartition, Phase, transfers
from primepar_fx.partition.comm import shift_senders
from primepar_fx.runtime.groups import global_rank, wait_p2p
from primepar_fx.runtime.stats import CommStats

aten = torch.ops.aten


def block_product(target: object) -> tuple:
    """``(fwd(a, b), grad_a(g, a, b), grad_b(g, a, b))`` for the op's two matrix operands in argument order."""
    if target is aten.linear.default:
        return (
            lambda a, b: F.linear(a, b),
            lambda g, a, b: g @ b,
            lambda g, a, b: g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1]),
        )
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
        mm = torch.mm if target in (aten.mm.default, aten.addmm.default) else torch.bmm
        return (
            lambda a, b: mm(a, b),
            lambda g, a, b: mm(g, b.transpose(-1, -2)),
            lambda g, a, b: mm(a.transpose(-1, -2), g),
        )

    return (
        lambda a, b: torch.matmul(a, b),
        lambda g, a, b: torch.matmul(g, b.transpose(-1, -2)),
        lambda g, a, b: torch.matmul(a.transpose(-1, -2), g),
    )


class _Mover:
    """This rank's side of one transfer: whom it sends its block to, whom it receives from."""

    def __init__(self, senders: tuple[int, ...], me: int) -> None:
        self.send_to = tuple(k for k, s in enumerate(senders) if s == me and k != me)
        self.recv_from = senders[me] if senders[me] != me else None

    def start(self, x: torch.Tensor, stats: CommStats, node: str = "") -> tuple[list, torch.Tensor | None]:
        ops = [dist.P2POp(dist.isend, x, global_rank(k)) for k in self.send_to]
        buf = None
        if self.recv_from is not None:
            buf = torch.empty_like(x)
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(self.recv_from)))
        for _ in self.send_to:
            stats.add("ring", x.numel() * x.element_size(), node)
        return (dist.batch_isend_irecv(ops) if ops else []), buf

    def now(self, x: torch.Tensor, stats: CommStats, node: str = "") -> torch.Tensor:
        reqs, buf = self.start(x.contiguous(), stats, node)
        for r in reqs:
            wait_p2p(r)
        return x if buf is None else buf


class RingMatmul(nn.Module):
    """One P(S x S)-partitioned matrix product: ``O = I . W`` with the ring schedule of Table 1."""

    def __init__(self, part: OpPartition, target: object, me: int, stats: CommStats, name: str = "") -> None:
        super().__init__()
        op = part.op
        if op.matmul_operands is None or part.steps < 2:
            raise ValueError(f"{name}: a ring operator needs a matrix product partitioned with P(S x S)")
        self.part, self.target, self.me, self.stats, self.name = part, target, me, stats, name
        self.i_idx, self.w_idx = op.matmul_operands
        self.i_first = self.i_idx < self.w_idx  # operand order in the op's own arguments
        self.fwd_fn, self.grad_a, self.grad_b = block_product(target)
        self.steps = part.steps
        i_name, w_name = f"in{self.i_idx}", f"in{self.w_idx}"
        self.names = {
            "I": i_name,
            "W": w_name,
            "O": "out0",
            "dO": "d_out0",
            "dI": f"d_in{self.i_idx}",
            "dW": f"d_in{self.w_idx}",
        }
        self.moves: dict[tuple[Phase, int, str], _Mover] = {}
        for tr in transfers(part):
            if tr.wrap or (tr.tensor == w_name and tr.src[0] is Phase.FORWARD and tr.dst[0] is not Phase.FORWARD):
                continue  # W's return trip is replaced by one fetch from the Forward-start layout (module doc)
            self.moves[(tr.src[0], tr.src[1], tr.tensor)] = _Mover(tr.senders, me)
        self.w_is_param = self.w_idx in op.weights
        w_map = op.inputs[self.w_idx]
        self.w_fetch = _Mover(shift_senders(part, w_map, (Phase.FORWARD, 0), (Phase.BACKWARD, 0)), me)

    # -- block products in terms of I and W, whatever their argument order
    def product(self, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.fwd_fn(i, w) if self.i_first else self.fwd_fn(w, i)

    def grad_i(self, g: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.grad_a(g, i, w) if self.i_first else self.grad_b(g, w, i)

    def grad_w(self, g: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.grad_b(g, i, w) if self.i_first else self.grad_a(g, w, i)

    def run_phase(self, phase: Phase, slots: dict[str, torch.Tensor], result: str, compute) -> torch.Tensor:
        """``S`` steps of one phase: post the operand shifts, multiply, wait, move the result if it moves."""
        acc = None
        for t in range(self.steps):
            pending = []
            for key, x in list(slots.items()):
                mover = self.moves.get((phase, t, self.names[key]))
                if mover is not None:
                    pending.append((key, *mover.start(x.contiguous(), self.stats, self.name)))
            part = compute(t, slots)
            acc = part if acc is None else acc + part
            for key, reqs, buf in pending:
                for r in reqs:
                    wait_p2p(r)
                if buf is not None:
                    slots[key] = buf
            mover = self.moves.get((phase, t, self.names[result]))
            if mover is not None:
                acc = mover.now(acc, self.stats, self.name)
        return acc  # type: ignore[return-value]

    def forward(self, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _RingFn.apply(i, w, self)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.part.seq}, {self.steps} steps, {len(self.moves)} shifts"


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, i, w, ring):  # type: ignore[override]
        slots = {"I": i, "W": w}
        out = ring.run_phase(Phase.FORWARD, slots, "O", lambda t, s: ring.product(s["I"], s["W"]))
        ctx.ring = ring
        # I in its Gradient-start layout; a parameter W in its Forward-start layout (fetched again in backward),
        # an activation W where Forward left it, its Backward-start layout (nothing to fetch, one block either way)
        ctx.save_for_backward(slots["I"], w if ring.w_is_param else slots["W"])
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        ring = ctx.ring
        i, w = ctx.saved_tensors
        w = ring.w_fetch.now(w.detach(), ring.stats, ring.name) if ring.w_is_param else w
        slots = {"dO": d_out.contiguous(), "W": w}
        d_i = None
        if ctx.needs_input_grad[0]:
            d_i = ring.run_phase(Phase.BACKWARD, slots, "dI", lambda t, s: ring.grad_i(s["dO"], None, s["W"]))
        else:
            ring.run_phase(Phase.BACKWARD, slots, "dI", lambda t, s: 0)
        slots.pop("W")
        slots["I"] = i
        d_w = None
        if ctx.needs_input_grad[1]:
            d_w = ring.run_phase(Phase.GRADIENT, slots, "dW", lambda t, s: ring.grad_w(s["dO"], s["I"], None))
        return d_i, d_w, None
