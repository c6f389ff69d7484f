"""``Exchange.plan`` against the cost model's Eq. 9 and against a one-process run of every rank's plan.

Layouts are built the way the passes build them (:mod:`primepar_fx.passes.layouts`): a producer holds ``out_j`` at
its last Forward step and a consumer needs ``in_k`` at its first; the gradient goes back from the consumer's
``d_in_k`` at the end of its Backward (Gradient for a parameter) to the producer's ``d_out_j`` at the start of its
Backward. The pairs come from the edges of gpt2-tiny (``primepar_fx.analyze``) and from hand-built ops whose sizes
radix-3 digits divide.

Two ways to run the plans without ``torch.distributed``:

* :func:`simulate` reads the plans as data. A sender packs its pieces for one peer, flattened and in order, into
  one message; the receiver cuts the message into the pieces it expects from that peer, in order. That is the
  wire format of :meth:`Exchange.run`.
* :class:`FakeTransport` runs the real :meth:`Exchange.run` (and the autograd :class:`Redistribute`) of every rank,
  one thread per rank. It replaces ``torch.distributed``'s point-to-point calls with in-process mailboxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from math import prod

import pytest
import sympy
import torch
from fake_transport import FakeTransport
from hypothesis import given, settings
from hypothesis import strategies as st
from opdims import linear_dims

import primepar_fx
from primepar_fx.cost.redistribute import (
    backward_held,
    backward_needed,
    forward_held,
    forward_needed,
    per_device_traffic,
    redistribution,
)
from primepar_fx.cost.share import signature
from primepar_fx.frontend.symbols import META_DTYPES, B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, enumerate_sequences
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import Layout
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.price import out_index, shared_parameters
from primepar_fx.rules.spec import OpDims
from primepar_fx.runtime import CommStats, Exchange, Redistribute
from primepar_fx.runtime.exchange import full_layout

VALUES = {B: 4, S: 16}
VKEY = values_key(VALUES)
MESHES = ((2,), (2, 2), (2, 2, 2), (3,), (2, 3))


# ----------------------------------------------------------------------------------------------- pairs
@dataclass(frozen=True)
class Edge:
    """Output ``out`` of ``producer`` feeds input ``inp`` of ``consumer``."""

    name: str
    producer: OpDims
    out: int
    consumer: OpDims
    inp: int


@lru_cache(maxsize=1)
def gpt2_graph() -> primepar_fx.OpGraph:
    config = get_config("gpt2-tiny")
    return primepar_fx.analyze(build(config), *example_inputs(config, VALUES[B], VALUES[S]))


def gpt2_edges() -> tuple[Edge, ...]:
    g = gpt2_graph()
    return tuple(
        Edge(f"{u} -> {v}", g.nodes[u].dims, out_index(g.nodes[v]), g.nodes[v].dims, data["dst_in"])
        for u, v, data in g.graph.edges(data=True)
    )


def hand_built_edges() -> tuple[Edge, ...]:
    """Linears and a head-split view whose sizes 2 and 3 both divide, so radix-3 digits split them."""
    lin = linear_dims(6, 6, 12, 12)
    heads_map = (("B",), ("M",), ("H", "E"))
    heads = OpDims(
        "pointwise", ("B", "M", "H", "E"), tuple(map(sympy.Integer, (6, 6, 3, 4))), (heads_map,), (heads_map,)
    )
    return (
        Edge("linear -> linear", lin, 0, lin, 0),
        Edge("linear -> heads", lin, 0, heads, 0),
        Edge("heads -> linear", heads, 0, lin, 0),
    )


@cache
def all_edges() -> tuple[Edge, ...]:
    return gpt2_edges() + hand_built_edges()


@cache
def sequences(op: OpDims, digits: tuple[int, ...]) -> tuple[PartitionSeq, ...]:
    return tuple(enumerate_sequences(op, DeviceMesh(digits), values=VALUES))


def layout_pairs(edge: Edge, p_seq: PartitionSeq, c_seq: PartitionSeq, mesh: DeviceMesh) -> list[tuple[Layout, ...]]:
    """``(held, needed)`` of the activation and, unless the input takes none, of its gradient."""
    producer, consumer = OpPartition(edge.producer, p_seq, mesh), OpPartition(edge.consumer, c_seq, mesh)
    pairs = [(forward_held(producer, edge.out).layout(VKEY), forward_needed(consumer, edge.inp).layout(VKEY))]
    grad = backward_held(consumer, edge.inp)
    if grad is not None:
        pairs.append((grad.layout(VKEY), backward_needed(producer, edge.out).layout(VKEY)))
    return pairs


# ------------------------------------------------------------------------------------------- tensors
def full_shape(layout: Layout) -> tuple[int, ...]:
    """The whole tensor's shape: per dim, the largest end any rank's intervals reach."""
    return tuple(max(stop for rank in layout for _, stop in rank[d]) for d in range(len(layout[0])))


def random_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Distinct values in random order, so a misplaced element never matches by chance."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(prod(shape), generator=gen).to(torch.float64).reshape(shape)


def block(x: torch.Tensor, sets: tuple) -> torch.Tensor:
    """The block of ``x`` that one rank's per-dim interval sets describe."""
    for d, s in enumerate(sets):
        x = x.index_select(d, torch.cat([torch.arange(a, b) for a, b in s]))
    return x


def piece_shape(piece: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in piece)


# ------------------------------------------------------------------------------------------ simulator
def simulate(plans: list[Exchange], blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's output block: local copies, then the pieces of one message per peer (module docstring)."""
    wire = {}
    for me, (ex, x) in enumerate(zip(plans, blocks, strict=True)):
        assert tuple(x.shape) == ex.in_shape
        for peer, pieces in ex.sends:
            wire[me, peer] = torch.cat([x[s].reshape(-1) for s in pieces])
    outs = []
    for me, (ex, x) in enumerate(zip(plans, blocks)):
        if ex.identity:  # held == needed: the block is passed through untouched
            outs.append(x)
            continue
        out = x.new_full(ex.out_shape, float("nan"))
        writes = torch.zeros(ex.out_shape, dtype=torch.int64)
        for src, dst in ex.local:
            out[dst] = x[src]
            writes[dst] += 1
        for peer, pieces in ex.recvs:
            assert (peer, me) in wire, f"rank {me} expects a message from {peer} that was never sent"
            message = wire.pop((peer, me))
            sizes = [prod(shape) for _, shape in pieces]
            assert message.numel() == sum(sizes), (peer, me)
            for (dst, shape), flat in zip(pieces, message.split(sizes)):
                out[dst] = flat.view(shape)
                writes[dst] += 1
        assert bool((writes == 1).all()), f"rank {me} writes some elements of its block twice or never"
        outs.append(out)
    assert not wire, f"messages sent but never received: {sorted(wire)}"
    return outs


def assert_senders_and_receivers_agree(plans: list[Exchange]) -> None:
    """What rank a sends b is, piece by piece, what b expects from a; nobody messages itself."""
    for a, ex in enumerate(plans):
        assert a not in dict(ex.sends) and a not in dict(ex.recvs)
        for b, pieces in ex.sends:
            expected = dict(plans[b].recvs).get(a)
            assert expected is not None, f"rank {a} sends to {b}, which expects nothing from it"
            assert [piece_shape(p) for p in pieces] == [shape for _, shape in expected], (a, b)
            for p in pieces:
                assert all(0 <= s.start < s.stop <= n for s, n in zip(p, ex.in_shape)), (a, b, p)
        for b, pieces in ex.recvs:
            assert a in dict(plans[b].sends), f"rank {a} expects a message from {b}, which sends it nothing"
            for dst, shape in pieces:
                assert piece_shape(dst) == shape
                assert all(0 <= s.start < s.stop <= n for s, n in zip(dst, ex.out_shape)), (a, b, dst)


def check_exchange(held: Layout, needed: Layout, mesh: DeviceMesh, seed: int = 0) -> list[Exchange]:
    """Eq. 9 per rank, senders and receivers agree, and the simulated exchange delivers every needed block."""
    plans = [Exchange.plan(held, needed, mesh, me) for me in range(mesh.size)]
    traffic = per_device_traffic(held, needed)
    for ex in plans:
        assert ex.received == traffic
        assert ex.comm == any(traffic)
    assert [sum(prod(shape) for _, pieces in ex.recvs for _, shape in pieces) for ex in plans] == list(traffic)
    assert_senders_and_receivers_agree(plans)
    x = random_tensor(full_shape(held), seed)
    outs = simulate(plans, [block(x, h) for h in held])
    for me, out in enumerate(outs):
        assert torch.equal(out, block(x, needed[me])), f"rank {me} ends with the wrong block"
    return plans


# --------------------------------------------------------------------------------------- property test
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_rank_receives_its_eq9_traffic_and_ends_with_its_needed_block(data) -> None:
    digits = data.draw(st.sampled_from(MESHES), label="mesh")
    edge = data.draw(st.sampled_from(all_edges()), label="edge")
    p_seq = data.draw(st.sampled_from(sequences(edge.producer, digits)), label="producer")
    c_seq = data.draw(st.sampled_from(sequences(edge.consumer, digits)), label="consumer")
    mesh = DeviceMesh(digits)
    for held, needed in layout_pairs(edge, p_seq, c_seq, mesh):
        check_exchange(held, needed, mesh)


@pytest.mark.parametrize("digits", MESHES)
def test_every_gpt2_edge_under_seeded_random_partitions_moves_exactly_eq9(digits: tuple[int, ...]) -> None:
    mesh, gen = DeviceMesh(digits), torch.Generator().manual_seed(sum(digits))
    for edge in gpt2_edges():
        producers, consumers = sequences(edge.producer, digits), sequences(edge.consumer, digits)
        for _ in range(2):
            p_seq = producers[int(torch.randint(len(producers), (), generator=gen))]
            c_seq = consumers[int(torch.randint(len(consumers), (), generator=gen))]
            for held, needed in layout_pairs(edge, p_seq, c_seq, mesh):
                check_exchange(held, needed, mesh)


# ------------------------------------------------------------------------------------- whole plans
@pytest.mark.parametrize("name", ["prime", "megatron", "random:3"])
def test_the_exchanges_of_a_forced_plan_receive_what_the_plan_predicts(name: str) -> None:
    """Sum the Eq. 9 receipts of every edge (and of every later reader of a shared parameter) into each node, in
    bytes of the tensor's own dtype (fp32 for activations): per device they are the node's predicted
    ``redistribution`` bytes. An edge whose reader shares the first reader's re-layout (all readers of the tensor
    alike, :mod:`primepar_fx.cost.share`) receives nothing of its own. Loading and gathering a parameter's storage
    layout are exchanges too (a load moves nothing)."""
    graph, world = gpt2_graph(), 4
    plan = forced_plan(graph, name, world_size=world, batch=VALUES[B], seq=VALUES[S])
    mesh = DeviceMesh(tuple(plan.digits))
    parts = {n: OpPartition(graph.nodes[n].dims, seq, mesh) for n, seq in plan.partitions().items()}
    fx_nodes = {n.name: n for n in graph.captured.gm.graph.nodes}
    received = dict.fromkeys(graph.nodes, 0)
    readers: dict[str, list[tuple[str, int]]] = {}  # the rule of cost.share: all readers alike -> one re-layout
    for u, v, data in graph.graph.edges(data=True):
        if graph.nodes[v].dims.inputs[data["dst_in"]] is not None and len(graph.nodes[u].dims.outputs) == 1:
            readers.setdefault(u, []).append((v, data["dst_in"]))
    order = {n: i for i, n in enumerate(graph.nodes)}
    skipped = set()
    for u, group in readers.items():
        group.sort(key=lambda vk: order[vk[0]])
        alike = {signature(parts[v], graph.nodes[v].target, k, VKEY) for v, k in group}
        twice = any(graph.input_names(v).count(u) > 1 for v, _ in group)
        if len(group) > 1 and len(alike) == 1 and not twice:
            skipped |= {(u, v) for v, _ in group[1:]}
    for u, v, data in graph.graph.edges(data=True):
        if (u, v) in skipped:
            continue
        edge = Edge(f"{u} -> {v}", graph.nodes[u].dims, out_index(graph.nodes[v]), graph.nodes[v].dims, data["dst_in"])
        dtype = fx_nodes[u].meta[META_DTYPES][edge.out]
        itemsize = 4 if dtype.is_floating_point else torch.empty((), dtype=dtype).element_size()
        for held, needed in layout_pairs(edge, parts[u].seq, parts[v].seq, mesh):
            received[v] += itemsize * sum(check_exchange(held, needed, mesh)[0].received)
    for u, k_u, v, k_v in shared_parameters(graph):  # the first reader stores it in its Forward-start layout
        storage = forward_needed(parts[u], k_u).layout(VKEY)
        pairs = [(storage, forward_needed(parts[v], k_v).layout(VKEY))]
        grad = backward_held(parts[v], k_v)
        if grad is not None:
            pairs.append((grad.layout(VKEY), storage))
        for held, needed in pairs:
            received[v] += 4 * sum(check_exchange(held, needed, mesh)[0].received)
    for node in plan.nodes:
        assert node.cost is not None
        assert received[node.name] // world == node.cost.comm_bytes.get("redistribution", 0), node.name
    for ph in graph.captured.gm.graph.nodes:
        readers = [n for n in ph.users if n.name in parts] if ph.name in graph.captured.params else []
        if readers:
            storage = forward_needed(parts[readers[0].name], readers[0].all_input_nodes.index(ph)).layout(VKEY)
            full = full_layout(full_shape(storage), world)
            assert not any(check_exchange(full, storage, mesh)[0].received)  # load: every rank slices its own
            check_exchange(storage, full, mesh)  # gather


# ------------------------------------------------------------------------------------------ hand cases
def prime_linears(size: int) -> tuple[OpPartition, OpPartition]:
    mesh, seq = DeviceMesh((size, size)), PartitionSeq.parse(f"P{size}x{size}")
    return OpPartition(linear_dims(2, 6, 6, 6), seq, mesh), OpPartition(linear_dims(2, 6, 6, 6), seq, mesh)


def test_cannon_skew_between_two_p2x2_linears_swaps_one_block_within_row_one() -> None:
    # O lands as [M=r, K=c]; the next linear needs I[M=r, N=r+c]: row 0 keeps its block, row 1 swaps.
    producer, consumer = prime_linears(2)
    held, needed = forward_held(producer, 0).layout(VKEY), forward_needed(consumer, 0).layout(VKEY)
    plans = check_exchange(held, needed, producer.mesh)
    piece = (2, 3, 3)
    assert plans[0].received == (0, 0, prod(piece), prod(piece))
    assert [dict(ex.sends) for ex in plans[:2]] == [{}, {}]
    assert [[piece_shape(p) for p in dict(ex.sends)[5 - me]] for me, ex in enumerate(plans[2:], 2)] == [[piece]] * 2
    assert redistribution(producer, 0, consumer, 0, VALUES).is_permutation


def test_cannon_skew_between_two_p3x3_linears_rotates_rows_one_and_two() -> None:
    producer, consumer = prime_linears(3)
    held, needed = forward_held(producer, 0).layout(VKEY), forward_needed(consumer, 0).layout(VKEY)
    plans = check_exchange(held, needed, producer.mesh)
    assert plans[0].received == (0, 0, 0) + (2 * 2 * 2,) * 6
    for me in range(3, 9):  # rank (r, c) receives I[M=r, N=r+c] from (r, r+c), the one message it gets
        r, c = divmod(me, 3)
        assert [peer for peer, _ in plans[me].recvs] == [3 * r + (r + c) % 3]


def test_a_missing_block_comes_from_the_holder_differing_in_the_fewest_digits() -> None:
    # Halves of dim 0 over digit 1 (ranks 0, 2 hold half 0; ranks 1, 3 half 1); everybody needs the whole.
    mesh = DeviceMesh((2, 2))
    halves = (((0, 4),), ((4, 8),))
    held = tuple((halves[r % 2], ((0, 3),)) for r in range(4))
    plans = check_exchange(held, full_layout((8, 3), 4), mesh)
    # rank 0 = (0, 0) could take half 1 from rank 1 = (0, 1) or rank 3 = (1, 1): one digit differs from rank 1
    assert [[peer for peer, _ in ex.recvs] for ex in plans] == [[1], [0], [3], [2]]


def test_a_layout_to_itself_is_the_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    for digits in MESHES:
        mesh = DeviceMesh(digits)
        for edge in gpt2_edges():
            seqs = sequences(edge.producer, digits)
            part = OpPartition(edge.producer, seqs[int(torch.randint(len(seqs), (), generator=gen))], mesh)
            lay = forward_held(part, edge.out).layout(VKEY)
            for me in range(mesh.size):
                ex = Exchange.plan(lay, lay, mesh, me)
                assert ex.identity and not ex.comm and ex.received == (0,) * mesh.size
                assert ex.local == ex.sends == ex.recvs == ()
                x = torch.zeros(ex.in_shape)
                assert ex.run(x) is x


def test_an_exchange_that_stays_local_runs_without_a_process_group() -> None:
    # Replicated -> split: every rank slices its own block and sends nothing.
    mesh = DeviceMesh((2, 3))
    full = full_layout((4, 6, 6), mesh.size)
    split = OpPartition(linear_dims(4, 6, 6, 6), PartitionSeq.parse("B,N"), mesh)
    needed = forward_needed(split, 0).layout(VKEY)
    x = random_tensor((4, 6, 6))
    for me in range(mesh.size):
        ex = Exchange.plan(full, needed, mesh, me)
        assert not ex.identity and not ex.comm and ex.sends == ex.recvs == ()
        assert torch.equal(ex.run(x), block(x, needed[me]))


def test_plan_raises_a_value_error_when_held_does_not_cover_needed() -> None:
    mesh = DeviceMesh((2,))
    held = ((((0, 4),), ((0, 3),)),) * 2  # both ranks hold rows 0..3 of 8
    with pytest.raises(ValueError, match="no rank holds a block that rank 0 needs"):
        Exchange.plan(held, full_layout((8, 3), 2), mesh, 1)


def test_plan_raises_a_value_error_for_layouts_of_another_world_or_tensor_rank() -> None:
    mesh = DeviceMesh((2, 2))
    with pytest.raises(ValueError, match="the mesh has 4"):
        Exchange.plan(full_layout((8,), 2), full_layout((8,), 4), mesh, 0)
    with pytest.raises(ValueError, match="tensors of different ranks"):
        Exchange.plan(full_layout((8,), 4), full_layout((8, 2), 4), mesh, 0)


# --------------------------------------------------------------------------------------- fake transport
REAL_CASES = [  # (id, mesh, edge, producer partition, consumer partition)
    ("cannon skew", (2, 2), "linear -> linear", "P2x2", "P2x2"),
    ("strided heads", (2, 2, 2), "linear -> view", "S,P2x2", "d4,d2,B"),
    ("radix 3", (2, 3), "linear -> heads", "M,K", "E,H"),
]


@pytest.mark.parametrize("case", REAL_CASES, ids=lambda c: c[0])
def test_redistribute_over_a_fake_transport_moves_activation_and_gradient_and_counts_the_bytes(
    case, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, digits, name, p_text, c_text = case
    edge = next(e for e in all_edges() if e.name == name)
    mesh = DeviceMesh(digits)
    (held, needed), (g_held, g_needed) = layout_pairs(
        edge, PartitionSeq.parse(p_text), PartitionSeq.parse(c_text), mesh
    )
    x, g = random_tensor(full_shape(held), 1), random_tensor(full_shape(g_held), 2)
    fake = FakeTransport(mesh.size)
    fake.install(monkeypatch)

    def step(me: int) -> tuple[torch.Tensor, torch.Tensor, CommStats]:
        stats = CommStats()
        fwd, bwd = Exchange.plan(held, needed, mesh, me), Exchange.plan(g_held, g_needed, mesh, me)
        node = Redistribute(fwd, bwd, stats, what="edge", node="consumer")
        mine = block(x, held[me]).requires_grad_()
        y = node(mine)
        y.backward(block(g, g_held[me]))  # CPU autograd runs on this thread, so the rank is still known
        return y.detach(), mine.grad, stats

    results = fake.on_every_rank(step)
    for me, (y, grad, stats) in enumerate(results):
        assert torch.equal(y, block(x, needed[me]))
        assert torch.equal(grad, block(g, g_needed[me]))
        plans = (Exchange.plan(held, needed, mesh, me), Exchange.plan(g_held, g_needed, mesh, me))
        sent = sum(prod(piece_shape(p)) for ex in plans for _, pieces in ex.sends for p in pieces)
        assert stats.bytes["redistribution"] == stats.by_node["consumer"] == 8 * sent  # float64
    received = sum(per_device_traffic(held, needed)) + sum(per_device_traffic(g_held, g_needed))
    assert sum(stats.bytes["redistribution"] for _, _, stats in results) == 8 * received > 0
