"""Collective matmul: the fused re-layout + linear nodes give the plain nodes' values, gradients and bytes.

Every rank runs on a thread of its own over :class:`~fake_transport.FakeTransport`. The layouts are sequence
parallelism's on a mesh of 4: a ``(B, S, H)`` activation split by ``S`` (a slab of rows per rank), gathered whole
before a column-parallel linear; a row-parallel linear's partial sums reduce-scattered back to the slabs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fake_transport import FakeTransport

from primepar_fx.partition import DeviceMesh
from primepar_fx.runtime.collective_matmul import GatherLinears, LinearScatter, moves_rows
from primepar_fx.runtime.collectives import ReduceScatter
from primepar_fx.runtime.exchange import Exchange, Redistribute, full_layout
from primepar_fx.runtime.stats import CommStats

WORLD, BATCH, SEQ = 4, 2, 8
MESH = DeviceMesh((WORLD,))
RANKS = tuple(range(WORLD))
ROWS = SEQ // WORLD


def slabs(width: int) -> tuple:
    """Every rank's layout of a ``(BATCH, SEQ, width)`` tensor split by sequence."""
    return tuple((((0, BATCH),), ((r * ROWS, (r + 1) * ROWS),), ((0, width),)) for r in range(WORLD))


def whole(width: int) -> tuple:
    return full_layout((BATCH, SEQ, width), WORLD)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def mine(t: torch.Tensor, me: int) -> torch.Tensor:
    return t[:, me * ROWS : (me + 1) * ROWS]


# ------------------------------------------------------------------------------------ all-gather + linears
HIDDEN, OUTS = 6, (5, 3)  # two linears read the gathered input, the second with a bias
X = rand(BATCH, SEQ, HIDDEN, seed=1)
WEIGHTS = [[rand(n, HIDDEN, seed=10 * r + i) for i, n in enumerate(OUTS)] for r in RANKS]  # each rank its shard
BIAS = [rand(OUTS[1], seed=100 + r) for r in RANKS]
GRADS = [[rand(BATCH, SEQ, n, seed=200 + 10 * r + i) for i, n in enumerate(OUTS)] for r in RANKS]


def gather_moves(me: int) -> tuple[Exchange, ReduceScatter]:
    fwd = Exchange.plan(slabs(HIDDEN), whole(HIDDEN), MESH, me)
    return fwd, ReduceScatter.plan(whole(HIDDEN), slabs(HIDDEN), MESH, me, None, RANKS)


def gather_step(me: int, fused: bool) -> tuple:
    stats = CommStats()
    fwd, bwd = gather_moves(me)
    x = mine(X, me).clone().requires_grad_()
    (w1, w2), b2 = (w.clone().requires_grad_() for w in WEIGHTS[me]), BIAS[me].clone().requires_grad_()
    if fused:
        outs = GatherLinears(fwd, bwd, (False, True), stats, node="linear")(x, w1, w2, b2)
    else:
        full = Redistribute(fwd, bwd, stats, node="linear")(x)
        outs = (F.linear(full, w1), F.linear(full, w2, b2))
    torch.autograd.backward(outs, GRADS[me])
    return [o.detach() for o in outs], [t.grad for t in (x, w1, w2, b2)], stats


def gather_reference(me: int) -> tuple:
    (w1, w2), b2 = WEIGHTS[me], BIAS[me]
    outs = [F.linear(X, w1), F.linear(X, w2, b2)]
    dx = sum(mine(g1 @ v1 + g2 @ v2, me) for (g1, g2), (v1, v2) in zip(GRADS, WEIGHTS))
    (g1, g2) = GRADS[me]
    flat = X.reshape(-1, HIDDEN)
    grads = [dx, g1.reshape(-1, OUTS[0]).t() @ flat, g2.reshape(-1, OUTS[1]).t() @ flat, g2.sum((0, 1))]
    return outs, grads


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_an_all_gather_into_two_linears_gives_one_device_s_values_and_gradients(fused, monkeypatch) -> None:
    fake = FakeTransport(WORLD)
    fake.install(monkeypatch)
    for me, (outs, grads, _) in enumerate(fake.on_every_rank(lambda me: gather_step(me, fused))):
        want_outs, want_grads = gather_reference(me)
        for got, want in zip([*outs, *grads], [*want_outs, *want_grads]):
            torch.testing.assert_close(got, want)


def test_the_fused_all_gather_sends_the_plain_re_layout_s_bytes(monkeypatch) -> None:
    fake = FakeTransport(WORLD)
    fake.install(monkeypatch)
    plain = fake.on_every_rank(lambda me: gather_step(me, False))
    fused = fake.on_every_rank(lambda me: gather_step(me, True))
    for (_, _, a), (_, _, b) in zip(plain, fused):
        assert a.bytes == b.bytes and a.calls == b.calls and a.by_node == b.by_node
        assert b.bytes["redistribution"] > 0 and b.bytes["collective"] > 0


# ------------------------------------------------------------------------------- linear + reduce-scatter
INNER, OUT = 4, 5  # each rank holds its own slice of the contracted dim
XS = [rand(BATCH, SEQ, INNER, seed=300 + r) for r in RANKS]
WS = [rand(OUT, INNER, seed=400 + r) for r in RANKS]
G = rand(BATCH, SEQ, OUT, seed=500)  # the gradient of the summed output; each rank gets its rows


def scatter_step(me: int, fused: bool) -> tuple:
    stats = CommStats()
    fwd = ReduceScatter.plan(whole(OUT), slabs(OUT), MESH, me, None, RANKS)
    bwd = Exchange.plan(slabs(OUT), whole(OUT), MESH, me)
    x, w = XS[me].clone().requires_grad_(), WS[me].clone().requires_grad_()
    if fused:
        out = LinearScatter(fwd, bwd, stats, node="linear")(x, w)
    else:
        out = Redistribute(fwd, bwd, stats, node="linear")(F.linear(x, w))
    out.backward(mine(G, me))
    return out.detach(), x.grad, w.grad, stats


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_linear_reduce_scattered_gives_one_device_s_values_and_gradients(fused, monkeypatch) -> None:
    fake = FakeTransport(WORLD)
    fake.install(monkeypatch)
    total = sum(F.linear(x, w) for x, w in zip(XS, WS))
    for me, (out, dx, dw, _) in enumerate(fake.on_every_rank(lambda me: scatter_step(me, fused))):
        torch.testing.assert_close(out, mine(total, me))
        torch.testing.assert_close(dx, G @ WS[me])
        torch.testing.assert_close(dw, G.reshape(-1, OUT).t() @ XS[me].reshape(-1, INNER))


def test_the_fused_reduce_scatter_sends_the_plain_re_layout_s_bytes(monkeypatch) -> None:
    fake = FakeTransport(WORLD)
    fake.install(monkeypatch)
    plain = fake.on_every_rank(lambda me: scatter_step(me, False))
    fused = fake.on_every_rank(lambda me: scatter_step(me, True))
    for a, b in zip(plain, fused):
        assert a[-1].bytes == b[-1].bytes and a[-1].calls == b[-1].calls
    rs = ReduceScatter.plan(whole(OUT), slabs(OUT), MESH, 0, None, RANKS)
    assert fused[0][-1].bytes["collective"] == rs.nbytes(8) == (WORLD - 1) * BATCH * ROWS * OUT * 8


# ---------------------------------------------------------------------------------------------- moves_rows
def test_only_re_layouts_whose_pieces_span_the_last_dim_move_rows() -> None:
    assert moves_rows(gather_moves(0)[0]) and moves_rows(gather_moves(0)[1])
    by_columns = tuple((((0, BATCH),), ((0, SEQ),), ((r * 2, r * 2 + 2),)) for r in RANKS)  # (B, S, 8) by its last dim
    assert not moves_rows(Exchange.plan(by_columns, full_layout((BATCH, SEQ, 8), WORLD), MESH, 0))
    assert not moves_rows(ReduceScatter.plan(full_layout((BATCH, SEQ, 8), WORLD), by_columns, MESH, 0, None, RANKS))
