"""The intra-operator cost model (Eq. 7) and the pricing of an edge (Eq. 8-9), checked against hand derivations.

A linear ``O[B,M,K] = I[B,M,N] . W[N,K]`` (W a parameter) is priced on four devices, digits ``(2, 2)``. Every
expected byte count below is written out from the sizes; nothing is read back from the code under test.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import sympy
from opdims import linear_dims as linear

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.cost.latency import LinearLatency, ring_factors
from primepar_fx.cost.model import NodeCost, edge_cost_matrix, node_cost
from primepar_fx.cost.redistribute import (
    backward_held,
    backward_needed,
    forward_held,
    forward_needed,
    redistribution,
    redistribution_matrix,
)
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Phase, enumerate_sequences, transfers
from primepar_fx.partition.layouts import Layout
from primepar_fx.rules.spec import OpDims
from primepar_fx.runtime.exchange import Exchange

F, Bk, G = Phase.FORWARD, Phase.BACKWARD, Phase.GRADIENT
CLUSTER = load_cluster("v100-paper")
MESH = DeviceMesh((2, 2))
NO_VALUES: dict[sympy.Symbol, int] = {}

# the small linear: B=8, M=16, N=32, K=64
SB, SM, SN, SK = 8, 16, 32, 64
I_ELEMS, W_ELEMS, O_ELEMS = SB * SM * SN, SN * SK, SB * SM * SK  # 4096, 2048, 8192


def cost(
    op: OpDims, seq: str, dtype: str = "fp32", mesh: DeviceMesh = MESH, cluster: ClusterSpec = CLUSTER
) -> NodeCost:
    part = OpPartition(op, PartitionSeq.parse(seq), mesh)
    return node_cost(part, None, cluster, NO_VALUES, CostOptions(dtype=dtype))


def switched(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with a switch inside the node: one peer can use a device's whole NVLink bandwidth."""
    levels = (dataclasses.replace(cluster.levels[0], peer_bandwidth=None), *cluster.levels[1:])
    return dataclasses.replace(cluster, name=f"{cluster.name}-switched", levels=levels)


def all_reduce_bytes(elems: int, itemsize: int, group: int) -> int:
    """Bytes one device sends in a ring all-reduce of ``elems`` elements: ``bus(all-reduce, g) * block bytes``."""
    return int(round(2 * (group - 1) / group * elems * itemsize))


SMALL = linear(SB, SM, SN, SK)
DTYPES = [("fp32", 4), ("bf16", 2)]


# ------------------------------------------------------------------------------------------ communication bytes
@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_batch_and_contraction_split_all_reduces_the_output_and_the_weight_gradient(dtype: str, item: int) -> None:
    # "B,N": B on digit 0, N on digit 1.
    # Forward sums over N (split on digit 1): all-reduce of the local O block (B/2, M, K) over 2 devices.
    # Gradient sums dW over B and M (B split on digit 0): all-reduce of the local dW block (N/2, K) over 2 devices.
    # Backward sums dI over K, which is whole: nothing.
    forward = all_reduce_bytes(SB // 2 * SM * SK, item, 2)
    gradient = all_reduce_bytes(SN // 2 * SK, item, 2)
    assert forward == 4096 * item and gradient == 1024 * item  # bus(all-reduce, 2) = 1
    assert cost(SMALL, "B,N", dtype).comm_bytes == {"all-reduce": forward + gradient}


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_batch_and_output_feature_split_all_reduces_the_input_gradient(dtype: str, item: int) -> None:
    # "B,K": Backward sums dI over K (digit 1): all-reduce of the local dI block (B/2, M, N) over 2 devices;
    # Gradient sums dW over B (digit 0): all-reduce of the local dW block (N, K/2); Forward sums over N, whole.
    backward = all_reduce_bytes(SB // 2 * SM * SN, item, 2)
    gradient = all_reduce_bytes(SN * SK // 2, item, 2)
    assert cost(SMALL, "B,K", dtype).comm_bytes == {"all-reduce": backward + gradient}


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_contraction_and_output_feature_split_all_reduces_output_and_input_gradient(dtype: str, item: int) -> None:
    # "N,K": Forward all-reduce of O (B, M, K/2) over digit 0 (N), Backward all-reduce of dI (B, M, N/2) over
    # digit 1 (K); dW sums over B and M, both whole: nothing in Gradient.
    forward = all_reduce_bytes(SB * SM * SK // 2, item, 2)
    backward = all_reduce_bytes(SB * SM * SN // 2, item, 2)
    assert cost(SMALL, "N,K", dtype).comm_bytes == {"all-reduce": forward + backward}


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_pure_data_parallel_all_reduces_the_whole_weight_gradient_over_four_devices(dtype: str, item: int) -> None:
    # "B,B": dW (N, K) whole on every device, all-reduced over both digits: bus(all-reduce, 4) = 2 * 3 / 4 = 1.5
    assert ring_factors("all-reduce", 4) == (1.5, 6)
    assert cost(SMALL, "B,B", dtype).comm_bytes == {"all-reduce": int(1.5 * W_ELEMS * item)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_replication_communicates_nothing(dtype: str) -> None:
    c = cost(SMALL, "R,R", dtype)
    assert c.comm_bytes == {}
    assert c.collective_s == 0.0 and c.ring_s == 0.0 and c.buffer_bytes == 0


# P(2x2) moves, derived by hand from the DSIs (r = row, c = column, every index mod 2, delta = 1 at t = 1):
#   Forward   (M, N, K) = (r, r+c+t, c)      Backward (r, r+c-1, c+t)      Gradient (r+t, r+c-1+delta, c-1+delta)
#   I  = (M, N): F0 (r, r+c) -> F1 (r, r+c+1) moves; F1 -> G0 (r, r+c+1) stays; G0 -> G1 (r+1, r+c) moves.
#   W  = (N, K): F0 (r+c, c) -> F1 (r+c+1, c) moves; F1 -> B0 stays; B0 -> B1 (r+c+1, c+1) moves;
#                the return shift B1 -> F0 (r+c, c) moves.
#   dO = (M, K): B0 (r, c) -> B1 (r, c+1) moves; B1 -> G0 (r, c+1) stays; G0 -> G1 (r+1, c) moves.
#   dW = (N, K): G0 (r+c+1, c+1) -> G1 (r+c, c) moves (the partial sum).   O and dI stay put.
P2_MOVES = Counter(
    {("in0", F): 1, ("in1", F): 1, ("d_out0", Bk): 1, ("in1", Bk): 2, ("in0", G): 1, ("d_out0", G): 1, ("d_in1", G): 1}
)
# local blocks under P(2x2): M, N and K are each cut in two
P2_BLOCK = {"in0": SB * (SM // 2) * (SN // 2), "in1": (SN // 2) * (SK // 2), "d_out0": SB * (SM // 2) * (SK // 2)}
P2_BLOCK["d_in1"] = P2_BLOCK["in1"]


def test_p2x2_ring_moves_match_the_hand_derivation_from_the_dsis() -> None:
    part = OpPartition(SMALL, PartitionSeq.parse("P2x2"), MESH)
    moved = Counter((tr.tensor, tr.src[0]) for tr in transfers(part))
    assert moved == P2_MOVES
    assert all(tr.moves == 4 for tr in transfers(part))  # for S = 2 every device receives in every shift


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_p2x2_sends_the_moving_blocks_point_to_point_and_needs_no_all_reduce(dtype: str, item: int) -> None:
    # Forward: I + W; Backward: dO + 2 W; Gradient: I + dO + dW  (blocks of the local shapes above)
    expected = sum(n * P2_BLOCK[name] * item for (name, _), n in P2_MOVES.items())
    assert expected == (2 * 1024 + 3 * 512 + 2 * 2048 + 512) * item
    assert cost(SMALL, "P2x2", dtype).comm_bytes == {"p2p": expected}


# -------------------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize(("dtype", "item"), DTYPES)
@pytest.mark.parametrize(
    ("seq", "w_block", "i_block"),
    [
        ("B,N", (SN // 2) * SK, (SB // 2) * SM * (SN // 2)),
        ("B,K", SN * (SK // 2), (SB // 2) * SM * SN),
        ("N,K", (SN // 2) * (SK // 2), SB * SM * (SN // 2)),
        ("R,R", W_ELEMS, I_ELEMS),
        ("B,B", W_ELEMS, I_ELEMS // 4),
    ],
)
def test_memory_is_weight_block_times_sixteen_bytes_plus_the_stashed_input_block(
    seq: str, w_block: int, i_block: int, dtype: str, item: int
) -> None:
    c = cost(SMALL, seq, dtype)
    assert c.param_bytes == w_block * item
    assert c.stash_bytes == i_block * item  # a linear keeps its (local) input for the Gradient phase
    assert c.buffer_bytes == 0  # one step: nothing moves, no ring buffers
    # weight, gradient, (at 16 bits) an fp32 master copy and two fp32 Adam moments: 16 bytes an element; the stash
    assert c.memory_bytes(CostOptions(dtype=dtype)) == 16 * w_block + i_block * item
    # without moments, a 16-bit weight keeps its master copy: 2 + 2 + 4; fp32: 4 + 4
    no_moments = CostOptions(dtype=dtype, optimizer_states=0)
    assert c.memory_bytes(no_moments) == 8 * w_block + i_block * item
    assert c.memory_bytes(CostOptions(dtype=dtype, optimizer_states=0, master_weights=False)) == (
        2 * item * w_block + i_block * item
    )


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
@pytest.mark.parametrize(("seq", "replicas"), [("B,K", 2), ("B,B", 4), ("N,K", 1)])
def test_megatrons_distributed_optimizer_splits_each_blocks_optimizer_state_over_its_replicas_only(
    seq: str, replicas: int, dtype: str, item: int
) -> None:
    """Its master copy and moments are split over the devices holding the same weight block (none for a block with
    no replicas, as an expert split over the data-parallel ranks); the parameter and its gradient stay whole (the
    gradient in its contiguous buffer), and an fp32 shard is stepped in place (ZeRO-2 keeps a gradient shard, and
    an fp32 copy of the shard without master weights)."""
    c = cost(SMALL, seq, dtype)
    w, stash = c.param_bytes // item, c.stash_bytes
    optimizer = 12 if item == 2 else 8  # fp32 master (16-bit parameters only) and two fp32 moments
    megatron = CostOptions(dtype=dtype, zero=2, distributed_optimizer=True)
    assert c.memory_bytes(megatron) == w * 2 * item + w // replicas * optimizer + stash
    zero2 = CostOptions(dtype=dtype, zero=2)
    if replicas > 1:
        copy = 0 if item == 2 else 4
        assert c.memory_bytes(zero2) == w * item + w // replicas * (item + optimizer + copy) + stash
    else:  # nothing to split
        assert c.memory_bytes(megatron) == c.memory_bytes(zero2) == c.memory_bytes(CostOptions(dtype=dtype))
    # the same bytes moved as the all-reduce it replaces: the time is the unsharded plan's
    part = OpPartition(SMALL, PartitionSeq.parse(seq), MESH)
    assert c.time_s == node_cost(part, None, CLUSTER, NO_VALUES, megatron).time_s
    with pytest.raises(ValueError, match="zero must be 2"):
        CostOptions(dtype=dtype, distributed_optimizer=True)


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_p2x2_memory_adds_one_receive_buffer_per_moving_block_of_the_busiest_phase(dtype: str, item: int) -> None:
    # the receive buffers of a phase: one per tensor that moves in it (P2_MOVES); phases run one after another,
    # so the largest phase counts: Forward I + W = 1536, Backward dO + W = 2560, Gradient I + dO + dW = 3584
    per_phase = {
        phase: sum(P2_BLOCK[name] for name in {n for (n, ph) in P2_MOVES if ph is phase}) for phase in (F, Bk, G)
    }
    assert per_phase == {F: 1536, Bk: 2560, G: 3584}
    c = cost(SMALL, "P2x2", dtype)
    w_block, i_block, buffers = P2_BLOCK["in1"] * item, P2_BLOCK["in0"] * item, 3584 * item
    assert (c.param_bytes, c.stash_bytes, c.buffer_bytes) == (w_block, i_block, buffers)
    opts = CostOptions(dtype=dtype, alpha=1e-9)
    assert c.memory_bytes(opts) == 16 * P2_BLOCK["in1"] + i_block + buffers
    assert c.objective(opts) == pytest.approx(c.time_s + 1e-9 * c.memory_bytes(opts), rel=1e-12)


# --------------------------------------------------------------------------------------- time of a large linear
# B=8, S=2048 (M), 4096 -> 4096, fp16, on one v100-paper node of 4 devices
LB, LM, LN, LK, ITEM = 8, 2048, 4096, 4096, 2
LARGE = linear(LB, LM, LN, LK)
FLOPS = 2 * LB * LM * LN * LK
LARGE_I, LARGE_W, LARGE_O = LB * LM * LN * ITEM, LN * LK * ITEM, LB * LM * LK * ITEM  # bytes of the whole tensors
LARGE_MESH = CLUSTER.mesh(4)


def compute(flops: float, nbytes: float) -> float:
    return CLUSTER.device.compute_time("matmul", flops, nbytes, "fp16")


def test_the_large_linear_lives_on_one_node() -> None:
    assert LARGE_MESH.digits == (2, 2)
    assert CLUSTER.group_level(LARGE_MESH, (0, 1)) == 0


def test_replicating_a_linear_costs_three_unpartitioned_phases_and_nothing_else() -> None:
    c = cost(LARGE, "R,R", "fp16", LARGE_MESH)
    # every phase reads/writes the three whole tensors and does 2 B M N K FLOPs (dI and dW cost a forward each)
    phase = compute(FLOPS, LARGE_I + LARGE_W + LARGE_O)
    assert c.phase_s == pytest.approx((phase, phase, phase), rel=1e-12)
    assert c.time_s == pytest.approx(3 * phase, rel=1e-12)
    assert c.collective_s == 0.0


def test_every_partition_of_a_large_linear_obeys_the_bounds_of_eq_7_and_beats_replication() -> None:
    # sum_t max(compute, ring) lies between sum_t compute and sum_t (compute + ring); collectives add on top.
    # Splitting over 4 devices cuts compute by ~3 x 5.8 ms, more than the largest collective here (a 4-way
    # all-reduce of a 134 MB activation, ~1.7 ms), so every partition beats replication.
    replicated = cost(LARGE, "R,R", "fp16", LARGE_MESH).time_s
    seqs = enumerate_sequences(LARGE, LARGE_MESH)
    assert len(seqs) > 20
    for seq in seqs:
        c = cost(LARGE, str(seq), "fp16", LARGE_MESH)
        low, high = c.compute_s + c.collective_s, c.compute_s + c.ring_s + c.collective_s
        assert low * (1 - 1e-12) <= c.time_s <= high * (1 + 1e-12), seq
        if str(seq) != "R,R":
            assert c.time_s < replicated, seq


def p2x2_rings(cluster: ClusterSpec) -> list[float]:
    """The ring shifts of LARGE's P2x2 steps that move something (P2_MOVES): F0 I+W, B0 dO+W, B1 W (return),
    G0 I+dO+dW; nothing at F1 and G1. Each device sends its quarter block to one peer."""
    shift = {n: cluster.shift_time(b / 4, [1, 0, 3, 2]) for n, b in (("I", LARGE_I), ("W", LARGE_W), ("O", LARGE_O))}
    return [shift["I"] + shift["W"], shift["O"] + shift["W"], shift["W"], shift["I"] + shift["O"] + shift["W"]]


def test_p2x2_on_one_nvlink_peer_shows_its_ring_and_loses_to_data_parallelism() -> None:
    """On v100-paper's board one peer gets 2 of the 6 NVLinks: the first Gradient step's ring outlasts its compute,
    each step costs its max(compute, ring), and P2x2 no longer beats data parallelism (it does on a switch,
    below), though it still beats Megatron's column and row splits."""
    prime = cost(LARGE, "P2x2", "fp16", LARGE_MESH)
    step = compute(FLOPS / 8, (LARGE_I + LARGE_W + LARGE_O) / 4)
    rings = p2x2_rings(CLUSTER)
    assert rings[3] > step and max(rings[:3]) < step  # G0 moves three blocks: I, dO and dW
    assert prime.ring_s == pytest.approx(sum(rings), rel=1e-12)
    assert prime.time_s == pytest.approx(sum(max(step, r) for r in rings) + 2 * step, rel=1e-12)
    assert prime.time_s < min(cost(LARGE, s, "fp16", LARGE_MESH).time_s for s in ("K,K", "N,N"))
    assert prime.time_s > cost(LARGE, "B,B", "fp16", LARGE_MESH).time_s


def test_p2x2_hides_its_ring_and_beats_megatron_column_and_row_splits() -> None:
    """With a switch in the node (one peer can use all of a device's NVLink bandwidth)."""
    cluster = switched(CLUSTER)
    prime = cost(LARGE, "P2x2", "fp16", LARGE_MESH, cluster)
    # per step: 1/8 of the FLOPs (M, N, K each halved), quarter blocks of I, W and O (or dO, W, dI / dO, I, dW)
    step = compute(FLOPS / 8, (LARGE_I + LARGE_W + LARGE_O) / 4)
    rings = p2x2_rings(cluster)
    assert max(rings) < step  # every ring hides behind its step's compute
    assert prime.ring_s == pytest.approx(sum(rings), rel=1e-12)
    assert prime.time_s == pytest.approx(6 * step, rel=1e-12)
    assert prime.collective_s == 0.0

    # Megatron column parallel "K,K": a quarter of the FLOPs, the whole I, and a 4-way all-reduce of dI in Backward
    column = cost(LARGE, "K,K", "fp16", LARGE_MESH)
    col_phase = compute(FLOPS / 4, LARGE_I + (LARGE_W + LARGE_O) / 4)
    col_reduce = CLUSTER.collective_time("all-reduce", LARGE_I, LARGE_MESH, (0, 1))
    assert column.time_s == pytest.approx(3 * col_phase + col_reduce, rel=1e-12)
    # row parallel "N,N": a quarter of I and W, the whole O, and a 4-way all-reduce of O in Forward
    row = cost(LARGE, "N,N", "fp16", LARGE_MESH)
    row_phase = compute(FLOPS / 4, LARGE_O + (LARGE_I + LARGE_W) / 4)
    row_reduce = CLUSTER.collective_time("all-reduce", LARGE_O, LARGE_MESH, (0, 1))
    assert row.time_s == pytest.approx(3 * row_phase + row_reduce, rel=1e-12)

    assert prime.time_s < column.time_s and prime.time_s < row.time_s
    # and it beats data parallelism, whose 4-way all-reduce of dW is not hidden; it travels in a gradient bucket,
    # so it pays its bytes and not the per-step latency
    data = cost(LARGE, "B,B", "fp16", LARGE_MESH)
    bucketed = CLUSTER.collective_time("all-reduce", LARGE_W, LARGE_MESH, (0, 1), bucketed=True)
    assert data.collective_s == pytest.approx(bucketed)
    assert bucketed < CLUSTER.collective_time("all-reduce", LARGE_W, LARGE_MESH, (0, 1))
    assert prime.time_s < data.time_s


# --------------------------------------------------------------------------------------------------------- edges
def a2a_seconds(cluster: ClusterSpec, level: int, group: int, busiest: int, item: int) -> float:
    """An all-to-all of ``group`` devices, each exchanging the ``busiest`` receiver's elements."""
    return cluster.levels[level].collective_time("all-to-all", group, busiest * item)


def runtime_p2p_seconds(cluster: ClusterSpec, held: Layout, needed: Layout, mesh: DeviceMesh, item: int) -> float:
    """What the runtime's exchange costs, read off :meth:`Exchange.plan` of every rank: each rank receives its
    ``received`` elements in one message per sender, at the slowest level a sender is on; the busiest rank wins."""
    worst, node = 0.0, cluster.devices_per_node
    for k in range(mesh.size):
        plan = Exchange.plan(held, needed, mesh, k)
        senders = [peer for peer, _ in plan.recvs]
        if not senders:
            continue
        level = int(any(s // node != k // node for s in senders))
        worst = max(worst, p2p_seconds(level, len(senders), plan.received[k], item, cluster))
    return worst


def p2p_seconds(level: int, messages: int, elems: int, item: int, cluster: ClusterSpec = CLUSTER) -> float:
    """``messages`` equal messages from as many peers: each pays the intercept; the bytes move at the device's
    p2p rate, or at one peer's (``peer_bandwidth``) if the busiest peer's ``1/messages`` share binds."""
    link = cluster.levels[level]
    p2p = link.collectives["p2p"]
    peer = link.bandwidth / (link.peer_bandwidth or link.bandwidth)
    return messages * p2p.fixed + elems * item * p2p.bytes_coeff * max(1.0, peer / messages)


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_edge_cost_is_the_cheaper_of_an_all_to_all_and_the_runtime_exchange(dtype: str, item: int) -> None:
    first, second = linear(SB, SM, SN, SK), linear(SB, SM, SK, SN)  # first's O[B,M,K] is second's I[B,M,N=K]
    producers = [OpPartition(first, s, MESH) for s in enumerate_sequences(first, MESH)]
    consumers = [OpPartition(second, s, MESH) for s in enumerate_sequences(second, MESH)]
    fwd, bwd = redistribution_matrix(producers, 0, consumers, 0, NO_VALUES)
    seconds, nbytes = edge_cost_matrix(producers, 0, consumers, 0, CLUSTER, NO_VALUES, CostOptions(dtype=dtype))

    np.testing.assert_array_equal(nbytes, (fwd + bwd) * item)
    moving = (fwd + bwd) > 0
    assert moving.any() and (~moving).any()
    assert (seconds[~moving] == 0.0).all()
    assert (seconds[moving] > 0.0).all()

    # four devices share one node: each direction with traffic is the cheaper of one intra-node all-to-all of the
    # 4 devices, each exchanging the busiest receiver's bytes, and the exchange the runtime plans
    def a2a(elems: int) -> float:
        return a2a_seconds(CLUSTER, 0, 4, elems, item) if elems else 0.0

    p2p, only_a2a = np.zeros(seconds.shape), np.zeros(seconds.shape)
    for i, j in np.argwhere(moving):
        p, c = producers[i], consumers[j]
        r = redistribution(p, 0, c, 0, NO_VALUES)
        busiest_f, busiest_b = max(r.per_device_forward), max(r.per_device_backward)
        uses = [(forward_held(p, 0), forward_needed(c, 0)), (backward_held(c, 0), backward_needed(p, 0))]
        p2p_f, p2p_b = (runtime_p2p_seconds(CLUSTER, h.layout(()), n.layout(()), MESH, item) for h, n in uses)
        p2p[i, j] = min(a2a(busiest_f), p2p_f) if fwd[i, j] else 0.0
        p2p[i, j] += min(a2a(busiest_b), p2p_b) if bwd[i, j] else 0.0
        only_a2a[i, j] = a2a(busiest_f) + a2a(busiest_b)
    np.testing.assert_allclose(seconds, p2p, rtol=1e-9, atol=0.0)
    assert (seconds <= only_a2a).all() and (seconds < only_a2a).any()

    names = [str(p.seq) for p in producers], [str(c.seq) for c in consumers]
    same = names[0].index("B,B"), names[1].index("B,B")
    assert nbytes[same] == 0  # batch-split output feeds a batch-split input in place
    # Megatron's column -> row pair (K,K then N,N) keeps the split features in place too
    assert nbytes[names[0].index("K,K"), names[1].index("N,N")] == 0
    # replicated output to a batch split: nothing moves forward (each device slices its own rows), but each
    # device lacks 3/4 of the replicated gradient the producer needs: 4 devices x 3/4 of dO
    rep = names[0].index("R,R"), names[1].index("B,B")
    assert fwd[rep] == 0 and bwd[rep] == 4 * (3 * O_ELEMS // 4)
    assert nbytes[rep] == 3 * O_ELEMS * item
    # ... which every device gathers from the 3 others, a quarter each: 3 messages beat the all-to-all
    assert seconds[rep] == pytest.approx(p2p_seconds(0, 3, 3 * O_ELEMS // 4, item), rel=1e-12)
    assert seconds[rep] < a2a(3 * O_ELEMS // 4)


@pytest.mark.parametrize(("dtype", "item"), DTYPES)
def test_cannon_skew_edge_is_one_message_per_receiving_device(dtype: str, item: int) -> None:
    # P2x2 -> P2x2: forward the devices of row 1 swap their blocks, backward those of row 0
    # (tests/cost/test_redistribute.py derives the skew); each receiver gets one block from one peer
    first, second = linear(SB, SM, SN, SK), linear(SB, SM, SK, SN)
    producer = [OpPartition(first, PartitionSeq.parse("P2x2"), MESH)]
    consumer = [OpPartition(second, PartitionSeq.parse("P2x2"), MESH)]
    block = SB * (SM // 2) * (SK // 2)
    seconds, nbytes = edge_cost_matrix(producer, 0, consumer, 0, CLUSTER, NO_VALUES, CostOptions(dtype=dtype))
    assert nbytes[0, 0] == (2 * block + 2 * block) * item
    assert seconds[0, 0] == pytest.approx(2 * p2p_seconds(0, 1, block, item), rel=1e-12)
    # an all-to-all would take 3 ring steps each way for the block the busiest devices receive
    assert seconds[0, 0] < 2 * a2a_seconds(CLUSTER, 0, 4, block, item)


def test_all_gather_like_relayout_keeps_the_cheaper_of_all_to_all_and_p2p() -> None:
    # O split by M four ways feeds a replicated input: every device gathers 3 quarters from 3 peers. Backward the
    # replicated dI is complete on every device, so only Forward moves.
    first, second = linear(SB, SM, SN, SK), linear(SB, SM, SK, SN)
    producer = [OpPartition(first, PartitionSeq.parse("M,M"), MESH)]
    consumer = [OpPartition(second, PartitionSeq.parse("R,R"), MESH)]
    gathered = 3 * O_ELEMS // 4
    a2a = a2a_seconds(CLUSTER, 0, 4, gathered, 4)
    p2p = p2p_seconds(0, 3, gathered, 4)
    seconds, nbytes = edge_cost_matrix(producer, 0, consumer, 0, CLUSTER, NO_VALUES, CostOptions())
    assert nbytes[0, 0] == 4 * gathered * 4
    assert p2p < a2a and seconds[0, 0] == pytest.approx(p2p, rel=1e-12)
    # a p2p message ten times dearer than a ring step of the all-to-all: the all-to-all is kept
    intra = CLUSTER.levels[0]
    slow = CLUSTER.with_calibration(
        source="test", collectives={0: {"p2p": LinearLatency(intra.collectives["p2p"].bytes_coeff, 20e-6)}}
    )
    seconds, _ = edge_cost_matrix(producer, 0, consumer, 0, slow, NO_VALUES, CostOptions())
    assert p2p_seconds(0, 3, gathered, 4, slow) > a2a and seconds[0, 0] == pytest.approx(a2a, rel=1e-12)


def test_edge_cost_prices_each_receiver_at_the_level_its_senders_are_on() -> None:
    # eight devices on two v100-paper nodes: digit 0 picks the node
    mesh = CLUSTER.mesh(8)
    assert mesh.digits == (2, 2, 2) and CLUSTER.group_level(mesh, (0,)) == 1
    first, second = linear(SB, SM, SN, SK), linear(SB, SM, SK, SN)
    producer = [OpPartition(first, PartitionSeq.parse("B,R,R"), mesh)]  # each node holds its half of the batch
    consumers = [OpPartition(second, PartitionSeq.parse(s), mesh) for s in ("B,B,B", "R,B,B")]
    seconds, nbytes = edge_cost_matrix(producer, 0, consumers, 0, CLUSTER, NO_VALUES, CostOptions())

    # "B,B,B" needs an eighth of the node's half: nothing moves forward. Backward the producer needs its node's
    # half of dO on each device and holds an eighth: 8 devices x 3/8 of dO, each device gathering an eighth from
    # each of the 3 others on its node (the all-to-all inside the node is dearer).
    assert nbytes[0, 0] == 3 * O_ELEMS * 4
    assert a2a_seconds(CLUSTER, 0, 4, 3 * O_ELEMS // 8, 4) > p2p_seconds(0, 3, 3 * O_ELEMS // 8, 4)
    assert seconds[0, 0] == pytest.approx(p2p_seconds(0, 3, 3 * O_ELEMS // 8, 4), rel=1e-12)
    # "R,B,B" splits the batch in four inside each node: the devices whose quarter lies in the other node's
    # half lack it (4 x 1/4 of O) and fetch it from the device of the other node that differs only in the node
    # digit: one inter-node message each, against an all-to-all over all 8 devices. Backward each node holds all
    # four quarters of dI; a device needs its node's half, one or two quarters it lacks, from peers on its node.
    assert nbytes[0, 1] == (O_ELEMS + 3 * O_ELEMS) * 4
    forward = p2p_seconds(1, 1, O_ELEMS // 4, 4)
    backward = p2p_seconds(0, 2, O_ELEMS // 2, 4)
    assert forward < a2a_seconds(CLUSTER, 1, 8, O_ELEMS // 4, 4)
    assert backward < a2a_seconds(CLUSTER, 0, 4, O_ELEMS // 2, 4)
    assert seconds[0, 1] == pytest.approx(forward + backward, rel=1e-12)


def test_edges_with_the_same_distinct_layouts_share_one_priced_direction():
    """The memo of re-layout prices (keyed by the distinct layouts) changes no edge's matrix, and is shared."""
    import dataclasses

    from primepar_fx import analyze
    from primepar_fx.cost.model import clear_caches
    from primepar_fx.cost.redistribute import DIRECTIONS
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.models import build, example_inputs, get_config
    from primepar_fx.pricing.price import price_graph

    config = dataclasses.replace(get_config("llama-tiny"), layers=2)
    graph = analyze(build(config, device="meta"), *example_inputs(config, 2, 16, device="meta"))
    cluster = load_cluster("v100-paper")
    mesh, values = cluster.mesh(8), {B: 8, S: 64}
    clear_caches()
    priced = price_graph(graph, mesh, cluster, values, CostOptions())
    shared = len(DIRECTIONS)
    fresh = 0
    for (u, v), matrix in priced.cost_graph.edge_cost.items():
        if (u, v) in priced.scatter or u == v:
            continue
        pu, pv = graph.nodes[u], graph.nodes[v]
        k_in = graph.graph.edges[u, v]["dst_in"]
        if pv.dims.inputs[k_in] is None or not pu.dims.outputs:
            continue
        DIRECTIONS.clear()
        seconds, _ = edge_cost_matrix(
            [OpPartition(pu.dims, s, mesh) for s in priced.strategies[u]],
            0,
            [OpPartition(pv.dims, s, mesh) for s in priced.strategies[v]],
            k_in,
            cluster,
            values,
            CostOptions(),
        )
        if len(pu.dims.outputs) == 1 and not pu.params and not pv.params:
            np.testing.assert_array_equal(seconds, matrix, err_msg=f"{u} -> {v}")
            fresh += 1
    assert fresh > 20
    assert shared < fresh  # edges share priced directions


@pytest.mark.parametrize("world", [8, 32])
def test_pricing_on_two_threads_gives_the_costs_of_one(world, monkeypatch):
    """``price_graph(workers=2)`` prices the re-layouts on two threads; every cost and byte count is bit-identical
    to one thread, each priced from empty caches."""
    from primepar_fx.cost import model
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.planning.groupings import leading_grouping
    from primepar_fx.pricing.price import price_graph

    graph = _tiny_llama_graph()
    cluster = load_cluster("v100-paper")
    mesh = leading_grouping(cluster.mesh(world))
    monkeypatch.setattr(model, "THREADED_WORK", 0)  # a tiny model's re-layouts are too small to be threaded
    pools = []
    real_pool = model.ThreadPoolExecutor
    monkeypatch.setattr(model, "ThreadPoolExecutor", lambda **kw: pools.append(kw) or real_pool(**kw))
    priced = []
    for workers in (1, 2):
        model.clear_caches()
        priced.append(price_graph(graph, mesh, cluster, {B: 16, S: 64}, CostOptions(), workers=workers))
    assert [kw["max_workers"] for kw in pools] == [2]
    assert_same_pricing(*priced)


def test_little_relayout_work_is_priced_on_the_calling_thread(monkeypatch):
    """Below ``THREADED_WORK`` entries in all, ``workers=2`` starts no thread (they would wait on the GIL)."""
    from primepar_fx.cost import model
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.pricing.price import price_graph

    def no_pool(**_):
        raise AssertionError("a thread pool was started")

    cluster = load_cluster("v100-paper")
    monkeypatch.setattr(model, "ThreadPoolExecutor", no_pool)
    model.clear_caches()
    priced = price_graph(_tiny_llama_graph(), cluster.mesh(8), cluster, {B: 16, S: 64}, CostOptions(), workers=2)
    assert priced.cost_graph.edge_cost


def _tiny_llama_graph():
    import dataclasses

    from primepar_fx import analyze
    from primepar_fx.models import build, example_inputs, get_config

    config = dataclasses.replace(get_config("llama-tiny"), layers=2)
    return analyze(build(config, device="meta"), *example_inputs(config, 2, 16, device="meta"))


def assert_same_pricing(one, two) -> None:
    """Every strategy, node cost, memory, edge cost, byte count and reduce-scatter saving of two pricings is equal,
    bit for bit."""
    import dataclasses

    assert one.strategies == two.strategies and one.node_costs == two.node_costs
    for n in one.cost_graph.nodes:
        np.testing.assert_array_equal(one.cost_graph.node_cost[n], two.cost_graph.node_cost[n], err_msg=n)
        np.testing.assert_array_equal(one.cost_graph.node_memory[n], two.cost_graph.node_memory[n], err_msg=n)
    assert one.cost_graph.edge_cost.keys() == two.cost_graph.edge_cost.keys() == one.edge_bytes.keys()
    for e, cost in one.cost_graph.edge_cost.items():
        np.testing.assert_array_equal(cost, two.cost_graph.edge_cost[e], err_msg=str(e))
        np.testing.assert_array_equal(one.edge_bytes[e], two.edge_bytes[e], err_msg=str(e))
    assert one.scatter.keys() == two.scatter.keys()
    for e, saving in one.scatter.items():
        for f in dataclasses.fields(saving):
            np.testing.assert_array_equal(getattr(saving, f.name), getattr(two.scatter[e], f.name), err_msg=str(e))


def test_the_split_only_subset_of_a_pricing_is_the_pricing_without_prime():
    """The planner reads its split-only baseline off its own pricing (:meth:`PricedGraph.subset`): that equals
    pricing the space without P(S x S), strategy order included, and keeps shared arrays shared."""
    from primepar_fx.cost.model import clear_caches
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.partition import Prime
    from primepar_fx.pricing.price import price_graph

    graph = _tiny_llama_graph()
    cluster, values = load_cluster("v100-paper"), {B: 16, S: 64}
    mesh = cluster.mesh(8)
    clear_caches()
    full = price_graph(graph, mesh, cluster, values, CostOptions())
    subset = full.subset(lambda seq: not any(isinstance(e, Prime) for e in seq.elements))
    clear_caches()
    split = price_graph(graph, mesh, cluster, values, CostOptions(), allow_prime=False)
    assert_same_pricing(subset, split)
    dropped = sum(len(full.strategies[n]) - len(split.strategies[n]) for n in graph.nodes)
    assert dropped > 0 and subset.scatter  # the test sees P(S x S) dropped and reduce-scatter savings sliced
    arrays = {id(subset.cost_graph.node_cost[n]) for n in graph.nodes}
    assert len(arrays) == len({id(full.cost_graph.node_cost[n]) for n in graph.nodes}) < len(graph.nodes)
    with pytest.raises(ValueError, match="no strategy is kept"):
        full.subset(lambda seq: False)


def test_a_pricing_sent_from_another_process_searches_like_the_one_made_here():
    """A worker sends its pricing back pickled (``planning.groupings``). Its search graph, and the split-only one read
    off it, keep the share nodes and the arrays identical layers share: the same graphs and optima as here. (After
    unpickling, an array's float64 dtype is not numpy's own instance; converting it made a new view of every edge,
    which lost the share nodes' identity checks: the split-only baseline came out slower than the plan.)"""
    import pickle

    from primepar_fx.cost.model import clear_caches
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.partition import Prime
    from primepar_fx.pricing.price import price_graph
    from primepar_fx.search import solve

    cluster = load_cluster("v100-paper")
    clear_caches()
    here = price_graph(_tiny_llama_graph(), cluster.mesh(8), cluster, {B: 16, S: 64}, CostOptions())
    sent = pickle.loads(pickle.dumps(here))
    no_prime = lambda seq: not any(isinstance(e, Prime) for e in seq.elements)  # noqa: E731
    for a, b in ((here, sent), (here.subset(no_prime), sent.subset(no_prime))):
        ga, gb = a.search_graph, b.search_graph
        assert ga.nodes == gb.nodes and any(n.endswith("@share") for n in ga.nodes)
        for n in ga.nodes:
            np.testing.assert_array_equal(ga.node_cost[n], gb.node_cost[n], err_msg=n)
        assert ga.edge_cost.keys() == gb.edge_cost.keys()
        shared = lambda g: len({id(m) for m in g.edge_cost.values()})  # noqa: E731
        assert shared(ga) == shared(gb) < len(ga.edge_cost)
        assert solve(ga).cost == solve(gb).cost
