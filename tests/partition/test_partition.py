"""The partition algebra: DSIs, derived ring senders and collectives, executed numerically.

The executor below runs a linear operator ``O[B,M,K] = I[B,M,N] . W[N,K]`` through Forward, Backward and Gradient
on simulated devices. Blocks move only through the transfers that :func:`transfers` derived from the DSIs, and
partial sums are combined only over the groups :func:`collectives` derived. The results must equal the
single-device products exactly (integer-valued float64 data).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from opdims import biased_linear_dims, linear_dims

from primepar_fx.partition import (
    DeviceMesh,
    OpPartition,
    PartitionError,
    PartitionSeq,
    Phase,
    Prime,
    Replicate,
    Split,
    alignments,
    collectives,
    enumerate_sequences,
    replicated_tensors,
    transfers,
)
from primepar_fx.rules.spec import OpDims

F, Bk, G = Phase.FORWARD, Phase.BACKWARD, Phase.GRADIENT


def block(full: np.ndarray, tslice) -> np.ndarray:
    idx = []
    for size, group in zip(full.shape, tslice):
        ((i, p),) = group
        step = size // p
        idx.append(slice(i * step, (i + 1) * step))
    return full[tuple(idx)]


def execute(part: OpPartition, rng: np.random.Generator) -> None:
    """Run all three phases of the linear op on simulated devices and check every result block."""
    op = part.op
    b, m, n, k = (int(s) for s in op.sizes)
    I, W, dO = (rng.integers(-3, 4, size=s).astype(np.float64) for s in ((b, m, n), (n, k), (b, m, k)))
    truth = {"out0": np.einsum("bmn,nk->bmk", I, W), "d_in0": np.einsum("bmk,nk->bmn", dO, W)}
    truth["d_in1"] = np.einsum("bmn,bmk->nk", I, dO)
    fulls = {"in0": I, "in1": W, "d_out0": dO}
    maps = {"in0": op.inputs[0], "in1": op.inputs[1], "out0": op.outputs[0], "d_out0": op.outputs[0]}
    maps["d_in0"], maps["d_in1"] = op.inputs[0], op.inputs[1]
    devices = list(part.mesh.devices())
    moves = transfers(part)
    colls = collectives(part)
    held = {
        name: [block(fulls[name], part.tensor_slice(F if name != "d_out0" else Bk, maps[name], c)) for c in devices]
        for name in fulls
    }
    product = {
        F: ("out0", "in0", "in1", lambda a, w, _: np.einsum("bmn,nk->bmk", a, w)),
        Bk: ("d_in0", "d_out0", "in1", lambda g, w, _: np.einsum("bmk,nk->bmn", g, w)),
        G: ("d_in1", "in0", "d_out0", lambda a, g, _: np.einsum("bmn,bmk->nk", a, g)),
    }
    for phase in (F, Bk, G):
        res, x, y, fn = product[phase]
        acc = [np.zeros(block(truth[res], part.tensor_slice(phase, maps[res], c, 0)).shape) for c in devices]
        held[res] = acc
        for t in range(part.steps):
            for r, c in enumerate(devices):
                assert np.array_equal(
                    held[x][r], block(fulls.get(x, truth.get(x)), part.tensor_slice(phase, maps[x], c, t))
                )
                acc[r] = acc[r] + fn(held[x][r], held[y][r], t)
            for tr in moves:
                if tr.src == (phase, t):
                    held[tr.tensor] = [held[tr.tensor][s] for s in tr.senders]
            acc = held[res]
        for coll in (cl for cl in colls if cl.phase is phase and cl.tensor == res):
            for group in part.mesh.groups(coll.digits):
                total = sum(acc[r] for r in group)
                for r in group:
                    acc[r] = total
        last = part.steps - 1
        for r, c in enumerate(devices):
            want = block(truth[res], part.tensor_slice(phase, maps[res], c, last))
            assert np.array_equal(acc[r], want), f"{part.seq}: {res} wrong on device {c}"
    # after a full iteration the weight is back in its Forward-start layout
    for r, c in enumerate(devices):
        assert np.array_equal(held["in1"][r], block(W, part.tensor_slice(F, maps["in1"], c, 0)))


# --------------------------------------------------------------------------------------- unit tests
def test_device_ids_are_mixed_radix_with_the_first_digit_most_significant() -> None:
    mesh = DeviceMesh((3, 2, 2))
    assert mesh.size == 12
    assert [mesh.coords(k) for k in (0, 1, 2, 4, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (2, 1, 1)]
    assert all(mesh.rank(mesh.coords(k)) == k for k in range(12))
    assert mesh.groups((2,)) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_world_sizes_factor_into_digits_with_node_digits_first() -> None:
    assert DeviceMesh.for_world_size(8).digits == (2, 2, 2)
    assert DeviceMesh.for_world_size(12).digits == (3, 2, 2)
    assert DeviceMesh.for_world_size(24, devices_per_node=8).digits == (3, 2, 2, 2)
    assert DeviceMesh.for_world_size(1).digits == ()


def test_partition_text_round_trips() -> None:
    for text in ("B,P2x2,N", "K,R", "P3x3", "-"):
        assert str(PartitionSeq.parse(text)) == text
    assert PartitionSeq.parse("B,P2x2").elements == (Split("B"), Prime(2))
    with pytest.raises(ValueError, match="square"):
        PartitionSeq.parse("P2x3")
    with pytest.raises(ValueError, match="at most one"):
        PartitionSeq.parse("P2x2,P2x2")


def test_split_dsis_follow_algorithm_1() -> None:
    part = OpPartition(linear_dims(4, 4, 4, 4), PartitionSeq.parse("B,N"), DeviceMesh((2, 2)))
    got = {c: part.dsis(F, c) for c in part.mesh.devices()}
    assert got == {(d1, d2): {"B": d1, "M": 0, "N": d2, "K": 0} for d1, d2 in itertools.product((0, 1), (0, 1))}
    nested = OpPartition(linear_dims(4, 4, 4, 4), PartitionSeq.parse("K,K"), DeviceMesh((2, 2)))
    assert [nested.dsis(F, c)["K"] for c in nested.mesh.devices()] == [0, 1, 2, 3]


def test_prime_2x2_dsis_match_eq_4_to_6() -> None:
    part = OpPartition(linear_dims(1, 2, 2, 2), PartitionSeq.parse("P2x2"), DeviceMesh((2, 2)))
    for (r, c), t in itertools.product(part.mesh.devices(), range(2)):
        delta = int(t == 1)
        assert part.dsis(F, (r, c), t) == {"B": 0, "M": r, "N": (r + c + t) % 2, "K": c}
        assert part.dsis(Bk, (r, c), t) == {"B": 0, "M": r, "N": (r + c - 1) % 2, "K": (c + t) % 2}
        assert part.dsis(G, (r, c), t) == {
            "B": 0,
            "M": (r + t) % 2,
            "N": (r + c - 1 + delta) % 2,
            "K": (c - 1 + delta) % 2,
        }


def test_prime_on_binary_digits_reads_rows_and_columns_interleaved() -> None:
    part = OpPartition(linear_dims(1, 4, 4, 4), PartitionSeq.parse("P4x4"), DeviceMesh((2, 2, 2, 2)))
    assert part.row_col((1, 0, 1, 1)) == (3, 1)
    assert part.row_col((0, 1, 1, 0)) == (1, 2)


def relative_senders(part: OpPartition) -> dict[tuple[str, Phase, int], set[tuple[int, int]]]:
    s = part.steps
    out: dict[tuple[str, Phase, int], set[tuple[int, int]]] = {}
    for tr in transfers(part):
        for k, src in enumerate(tr.senders):
            r, c = part.row_col(part.mesh.coords(k))
            rs, cs = part.row_col(part.mesh.coords(src))
            out.setdefault((tr.tensor, tr.src[0], tr.src[1]), set()).add(((rs - r) % s, (cs - c) % s))
    return out


@pytest.mark.parametrize("s", [2, 3, 4, 5])
def test_derived_ring_senders_reproduce_table_1(s: int) -> None:
    part = OpPartition(linear_dims(1, s, s, s), PartitionSeq.parse(f"P{s}x{s}"), DeviceMesh((s, s)))
    got = relative_senders(part)
    want: dict[tuple[str, Phase, int], set[tuple[int, int]]] = {}
    for t in range(s - 1):
        want[("in0", F, t)] = {(0, 1)}  # I from (r, c+1)
        want[("in1", F, t)] = {(1, 0)}  # W from (r+1, c)
        want[("d_out0", Bk, t)] = {(0, 1)}  # dO from (r, c+1)
        want[("in1", Bk, t)] = {(s - 1, 1)}  # W from (r-1, c+1)
    want[("in1", Bk, s - 1)] = {(0, 1)}  # W back to its Forward-start layout, from (r, c+1)
    for t in range(s - 2):
        want[("in0", G, t)] = {(1, s - 1)}  # I from (r+1, c-1)
        want[("d_out0", G, t)] = {(1, 0)}  # dO from (r+1, c)
    want[("in0", G, s - 2)] = {(1, 0)}  # I from (r+1, c)
    want[("d_out0", G, s - 2)] = {(1, 1)}  # dO from (r+1, c+1)
    want[("d_in1", G, s - 2)] = {(0, 1)}  # the partial dW from (r, c+1), added at the last step
    assert got == want


@pytest.mark.parametrize("s", [2, 3, 4])
def test_prime_needs_no_collective_replicates_nothing_and_aligns_phases(s: int) -> None:
    part = OpPartition(linear_dims(1, s, s, s), PartitionSeq.parse(f"P{s}x{s}"), DeviceMesh((s, s)))
    assert collectives(part) == []
    for phase, t in itertools.product((F, Bk, G), range(s)):
        assert set(replicated_tensors(part, phase, t).values()) == {1}
    assert all(alignments(part).values())


def test_megatron_column_then_row_collectives_are_derived() -> None:
    mesh = DeviceMesh((2, 2))
    col = collectives(OpPartition(linear_dims(4, 4, 4, 4), PartitionSeq.parse("B,K"), mesh))
    assert {(c.phase, c.tensor, c.dims, c.digits) for c in col} == {
        (Bk, "d_in0", frozenset({"K"}), (1,)),
        (G, "d_in1", frozenset({"B"}), (0,)),
    }
    row = collectives(OpPartition(linear_dims(4, 4, 4, 4), PartitionSeq.parse("B,N"), mesh))
    assert {(c.phase, c.tensor, c.digits) for c in row} == {(F, "out0", (1,)), (G, "d_in1", (0,))}


def test_illegal_partitions_name_the_dim() -> None:
    op = linear_dims(4, 4, 4, 4)
    with pytest.raises(PartitionError, match="no dim 'Q'"):
        OpPartition(op, PartitionSeq.parse("Q,B"), DeviceMesh((2, 2)))
    with pytest.raises(PartitionError, match="spreads over 2 devices but the world has 4"):
        OpPartition(op, PartitionSeq.parse("B"), DeviceMesh((2, 2)))
    with pytest.raises(PartitionError, match="equal digits"):
        OpPartition(op, PartitionSeq.parse("P2x2"), DeviceMesh((2, 3)))
    part = OpPartition(linear_dims(4, 3, 4, 4), PartitionSeq.parse("M,B"), DeviceMesh((2, 2)))
    with pytest.raises(PartitionError, match="dim 'M' of size 3"):
        part.check_divisible()


def test_enumeration_counts_are_exact_on_two_and_four_devices() -> None:
    op = linear_dims(4, 4, 4, 4)
    assert [str(s) for s in enumerate_sequences(op, DeviceMesh((2,)))] == ["B", "M", "N", "K", "R"]
    seqs = {str(s) for s in enumerate_sequences(op, DeviceMesh((2, 2)))}
    assert len(seqs) == 5 * 5 + 1 and "P2x2" in seqs
    odd = linear_dims(4, 3, 4, 4)  # M = 3 cannot be halved, so neither Split(M) nor P2x2
    assert {str(s) for s in enumerate_sequences(odd, DeviceMesh((2,)))} == {"B", "N", "K", "R"}
    assert "P2x2" not in {str(s) for s in enumerate_sequences(odd, DeviceMesh((2, 2)))}
    no_m = dataclasses.replace(op, no_split=frozenset({"N"}))
    assert all("N" not in str(s) and "P" not in str(s) for s in enumerate_sequences(no_m, DeviceMesh((2, 2))))


def test_enumeration_respects_symbolic_sizes_at_given_values() -> None:
    b = sympy.Symbol("B", positive=True, integer=True)
    op = OpDims("pointwise", ("B", "D"), (b, sympy.Integer(4)), inputs=((("B",), ("D",)),), outputs=((("B",), ("D",)),))
    assert {str(s) for s in enumerate_sequences(op, DeviceMesh((3,)))} == {"B", "R"}
    assert {str(s) for s in enumerate_sequences(op, DeviceMesh((3,)), values={b: 4})} == {"R"}


# ---------------------------------------------------------------------------------- property tests
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=st.integers(2, 8), bm=st.integers(1, 2), bn=st.integers(1, 2), bk=st.integers(1, 2), seed=st.integers(0, 99))
def test_prime_executes_exactly_for_any_s(s: int, bm: int, bn: int, bk: int, seed: int) -> None:
    part = OpPartition(linear_dims(2, s * bm, s * bn, s * bk), PartitionSeq.parse(f"P{s}x{s}"), DeviceMesh((s, s)))
    execute(part, np.random.default_rng(seed))
    assert all(alignments(part).values())
    for phase, t in itertools.product((F, Bk, G), range(s)):
        assert set(replicated_tensors(part, phase, t).values()) == {1}


@st.composite
def mesh_and_sequence(draw: st.DrawFn) -> tuple[OpPartition, int]:
    digits = tuple(draw(st.lists(st.sampled_from([2, 2, 2, 3]), min_size=1, max_size=6)))
    while np.prod(digits) > 64:
        digits = digits[:-1]
    mesh = DeviceMesh(digits)
    op = linear_dims(*(draw(st.sampled_from([6, 12, 24, 48])) for _ in range(4)))
    seqs = enumerate_sequences(op, mesh, allow_replicate=draw(st.booleans()))
    assume(seqs)  # small dims cannot always absorb every digit without Replicate
    return OpPartition(op, draw(st.sampled_from(seqs)), mesh), draw(st.integers(0, 99))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh_and_sequence())
def test_random_sequences_cover_every_sub_operator_once_and_collectives_group_shared_slices(case) -> None:
    part, seed = case
    op = part.op
    replicas = int(np.prod([part.mesh.digits[p] for p in part.replicate_digits])) if part.replicate_digits else 1
    space = list(itertools.product(*(range(part.parts[d]) for d in op.dims)))
    colls = collectives(part)
    for phase in (F, Bk, G):
        seen: dict[tuple[int, ...], int] = {}
        for c, t in itertools.product(part.mesh.devices(), range(part.steps)):
            key = tuple(part.dsis(phase, c, t)[d] for d in op.dims)
            seen[key] = seen.get(key, 0) + 1
        assert seen == {key: replicas for key in space}, f"{part.seq} on {part.mesh.digits}: {phase}"
        result = {F: "out0", Bk: "d_in0", G: "d_in1"}[phase]
        tmap = {F: op.outputs[0], Bk: op.inputs[0], G: op.inputs[1]}[phase]
        by_slice: dict[object, list[int]] = {}
        for k, c in enumerate(part.mesh.devices()):
            by_slice.setdefault(part.tensor_slice(phase, tmap, c, part.steps - 1), []).append(k)
        digits = [cl.digits for cl in colls if cl.phase is phase and cl.tensor == result]
        group_digits = tuple(sorted((digits[0] if digits else ()) + part.replicate_digits))
        assert sorted(by_slice.values()) == sorted(part.mesh.groups(group_digits))
    if not part.replicate_digits:
        execute(part, np.random.default_rng(seed))


def test_replicated_digits_compute_the_same_thing() -> None:
    part = OpPartition(linear_dims(4, 4, 4, 4), PartitionSeq((Split("K"), Replicate())), DeviceMesh((2, 2)))
    assert part.replicate_digits == (1,)
    assert replicated_tensors(part)["in1"] == 2
    assert {(c.phase, c.digits) for c in collectives(part)} == {(Bk, (0,))}


def test_a_bias_gradient_under_prime_is_reduced_over_the_rows_sharing_its_slice() -> None:
    biased = biased_linear_dims(2, 4, 4, 4)
    part = OpPartition(biased, PartitionSeq.parse("P2x2"), DeviceMesh((2, 2)))
    (coll,) = collectives(part)
    assert (coll.phase, coll.tensor, coll.digits) == (G, "d_in2", (0,))  # the row digit: same column, same K slice
    by_slice: dict[object, list[int]] = {}
    for k, c in enumerate(part.mesh.devices()):
        by_slice.setdefault(part.tensor_slice(G, (("K",),), c, 1), []).append(k)
    assert sorted(by_slice.values()) == part.mesh.groups(coll.digits)


def test_a_row_parallel_bias_gradient_needs_no_reduction_over_the_contraction() -> None:
    biased = biased_linear_dims(4, 4, 4, 4)
    part = OpPartition(biased, PartitionSeq.parse("B,N"), DeviceMesh((2, 2)))
    got = {(c.phase, c.tensor): c.digits for c in collectives(part)}
    assert got == {(F, "out0"): (1,), (G, "d_in1"): (0,), (G, "d_in2"): (0,)}  # bias: data-parallel digit only


def test_a_mean_loss_and_a_sum_loss_differ_as_keys_and_in_their_collectives() -> None:
    """OpDims that differ only in ``extra`` (here the loss reduction) are different keys of the memos keyed on them:
    a mean all-reduces its row count alongside the sum, a sum does not, whichever was memoised first."""
    n = sympy.Symbol("N", positive=True, integer=True)

    def loss(reduction: str) -> OpDims:
        return OpDims(
            "loss",
            ("N", "C"),
            (n, sympy.Integer(8)),
            inputs=((("N",), ("C",)), (("N",),)),
            outputs=((),),
            stats=frozenset({"C"}),
            no_grad=frozenset({1}),
            extra={"reduction": reduction},
        )

    total, mean = loss("sum"), loss("mean")
    assert total != mean and hash(total) != hash(mean) and dataclasses.replace(mean) == mean
    assert hash(dataclasses.replace(mean)) == hash(mean) == hash(loss("mean"))  # the cached hash follows equality
    compared = [f.name for f in dataclasses.fields(OpDims) if f.compare]
    assert hash(mean) == hash(tuple(getattr(mean, f) for f in compared))  # a new compared field must be hashed too
    mesh = DeviceMesh((2,))
    counts = {
        op.extra["reduction"]: [c.count for c in collectives(OpPartition(op, PartitionSeq.parse("N"), mesh))]
        for op in (total, mean)
    }
    assert counts == {"sum": [1], "mean": [2]}
    with pytest.raises(ValueError, match=r"hashable.*\['bad'\]"):
        dataclasses.replace(mean, extra={"bad": [1]})


def test_cached_hashes_are_rebuilt_not_copied() -> None:
    """OpDims, PartitionSeq and DeviceMesh cache their hash; copying or pickling them (``__reduce__``) goes through
    the constructor with every init field, so a hash of ``str`` fields, which differs between processes, never
    travels to another one."""
    import copy

    for obj in (linear_dims(4, 4, 4, 4), PartitionSeq.parse("B,K"), DeviceMesh((2, 2))):
        hash(obj)
        assert obj._hash is not None
        make, args = obj.__reduce__()
        init = [f.name for f in dataclasses.fields(obj) if f.init]
        assert make is type(obj) and list(args) == [getattr(obj, name) for name in init]
        for again in (make(*args), copy.deepcopy(obj), copy.copy(obj)):
            assert again == obj and again._hash is None and hash(again) == hash(obj)


def test_canonical_enumeration_keeps_one_order_per_level_and_is_a_subset() -> None:
    b = sympy.Symbol("B", positive=True, integer=True)
    op = OpDims(
        "pointwise",
        ("B", "D"),
        (b, sympy.Integer(8)),
        inputs=((("B",), ("D",)),),
        outputs=((("B",), ("D",)),),
    )
    mesh = DeviceMesh((2, 2, 2))
    full = {str(s) for s in enumerate_sequences(op, mesh)}
    canon = {str(s) for s in enumerate_sequences(op, mesh, levels=(1, 0, 0))}
    assert canon < full
    # digits 1 and 2 share a level: batch before the other dims before R there; digit 0 is free
    assert "D,B,D" in canon and "D,D,B" not in canon and "R,B,R" in canon and "B,R,B" not in canon
    assert {s for s in full if s.split(",")[1:] in (["B", "D"], ["B", "R"], ["D", "R"])} <= canon


@pytest.mark.parametrize("digits", [(2, 2), (2, 2, 2), (3, 2)])
def test_slices_of_every_rank_at_once_equal_the_per_device_slices(digits):
    """``comm._slices_at`` (from the DSI table) equals :meth:`OpPartition.tensor_slice` device by device."""
    from primepar_fx.partition import comm

    mesh = DeviceMesh(digits)
    op = linear_dims(12, 12, 12, 12)
    checked = 0
    for seq in enumerate_sequences(op, mesh):
        part = OpPartition(op, seq, mesh)
        for tmap, uses in comm.tensor_uses(part).values():
            for use in uses:
                slow = {k: part.tensor_slice(use[0], tmap, c, use[1]) for k, c in enumerate(mesh.devices())}
                assert comm._slices_at(part, tmap, use) == slow, (seq, use)
                checked += 1
    assert checked > 50


@pytest.mark.parametrize(("digits", "rings"), [((2, 2), True), ((2, 2, 2), True), ((3, 2), False), ((2, 4, 4), True)])
def test_shift_senders_are_the_nearest_holders_of_each_ranks_slice(digits, rings):
    """``comm.shift_senders`` (slices compared as codes) gives every rank the :func:`nearest_holder` of the slice it
    wants among the ranks that hold it, read off :meth:`OpPartition.tensor_slice`, between every two uses of every
    tensor of every partition of a linear (its ring steps included; ``3 x 2`` has no P(S x S), so nothing moves)."""
    from primepar_fx.partition import comm
    from primepar_fx.partition.mesh import nearest_holder

    mesh = DeviceMesh(digits)
    op = linear_dims(2, 24 * mesh.size, 48, 48)
    checked = moved = 0
    for seq in enumerate_sequences(op, mesh)[:: 1 if mesh.size < 32 else 9]:
        part = OpPartition(op, seq, mesh)
        for tmap, uses in comm.tensor_uses(part).values():
            at = {use: [part.tensor_slice(use[0], tmap, c, use[1]) for c in mesh.devices()] for use in uses}
            for src, dst in itertools.product(uses, uses):
                expected = tuple(
                    nearest_holder([r for r, held in enumerate(at[src]) if held == want], k, mesh)
                    for k, want in enumerate(at[dst])
                )
                senders = comm.shift_senders(part, tmap, src, dst)
                assert senders == expected, (seq, src, dst)
                checked += 1
                moved += any(s != k for k, s in enumerate(senders))
    assert checked > 50 and (moved > 10) == rings
