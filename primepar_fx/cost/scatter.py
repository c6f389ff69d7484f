"""When an all-reduce followed by a re-layout is a reduce-scatter.

An all-reduce leaves every rank of a group with the whole sum. If the next layout keeps, on every rank, only a
piece of what it holds, and the pieces of a group's ranks are disjoint and equal and together make up the group's
block, then the all-reduce and the slice are one reduce-scatter: each rank receives the sum of its piece only,
which sends half the bytes of the all-reduce ((g-1)/g of the block instead of 2(g-1)/g). This is Megatron's
sequence parallelism: a row-parallel output all-reduced and then split by sequence, and, in Backward, the input
gradient of a column-parallel linear all-reduced and then split by sequence for a sequence-split producer.

:func:`scatters` is the test the graph passes apply (:func:`primepar_fx.passes.collectives.fuse_reduce_scatters`,
which emits the fused pair) to one layout pair; :func:`scatters_many` is the same test on set numbers, one held
layout against many needed ones, which the cost model (:mod:`primepar_fx.pricing.price`) applies to every strategy
pair. ``tests/cost/test_scatter.py`` checks that the two agree on the hand cases and on every linear pair of a 2x2x2
mesh, so the plan's predicted bytes stay the bytes the ranks send. :func:`fusable_forward` and
:func:`fusable_backward` are the conditions on the graph both apply first: a plain sum all-reduce that the passes
emit as a node of its own, whose result goes only to the re-layout (a single user, no bias added in between).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import sympy
import torch
from torch import fx

from primepar_fx.cost.blocks import CostOptions, block_bytes, in_bucket, tensor_map, zero_gather_share
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.redistribute import EdgeUse, backward_held, forward_held, forward_needed, source_grad_needed
from primepar_fx.partition import DeviceMesh, OpPartition, Phase, collectives
from primepar_fx.partition.comm import Collective
from primepar_fx.partition.enumerate import ValuesKey, values_key
from primepar_fx.partition.layouts import SETS, IndexSet, Layout, array_digest, block_overlaps, intern_rows
from primepar_fx.rules.spec import OpDims

aten = torch.ops.aten
#: ops with a bias input: its position (the passes add the bias after the product's all-reduce)
BIASED = {aten.linear.default: 2, aten.addmm.default: 0, aten.baddbmm.default: 0}


def _size(s: IndexSet) -> int:
    return sum(b - a for a, b in s)


def _within(inner: IndexSet, outer: IndexSet) -> bool:
    return all(any(lo <= a and b <= hi for lo, hi in outer) for a, b in inner)


def _meets(x: IndexSet, y: IndexSet) -> bool:
    return any(a < d and c < b for a, b in x for c, d in y)


def scatters(held: Layout, needed: Layout, groups: Sequence[Sequence[int]]) -> bool:
    """Whether going from ``held`` (all-reduced over each of ``groups``) to ``needed`` is a reduce-scatter.

    True when every rank of a group holds the same block, every rank needs a part of it, and the parts of a
    group's ranks are disjoint, of equal size and cover the block. Groups of one rank never scatter.
    """
    if held == needed:
        return False
    for group in groups:
        if len(group) < 2:
            return False
        block = held[group[0]]
        if any(held[r] != block for r in group):
            return False
        parts = [needed[r] for r in group]
        if not all(_within(s, h) for part in parts for s, h in zip(part, block)):
            return False
        volume = prod(_size(s) for s in block)
        sizes = [prod(_size(s) for s in part) for part in parts]
        if len(set(sizes)) != 1 or sizes[0] * len(group) != volume:
            return False
        for i, a in enumerate(parts):
            for b in parts[i + 1 :]:
                if all(_meets(x, y) for x, y in zip(a, b)):
                    return False
    return True


def scatters_many(held: np.ndarray, needed: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """:func:`scatters` of held layouts to many needed ones at once, on :data:`~primepar_fx.partition.layouts.SETS`
    numbers: ``held`` is a ``(world, tensor dims)`` array (or a stack of them, ``(h, world, tensor dims)``),
    ``needed`` an ``(n, world, tensor dims)`` one; the answer is a boolean array of ``n`` (``(h, n)`` for a stack).
    Equal index sets have equal numbers, so layouts and blocks compare as ints. The cheap tests run on every pair,
    the containment of parts in blocks only on the pairs that pass them."""
    if held.ndim == 2:
        return scatters_many(held[None], needed, groups)[0]
    out = np.zeros((len(held), len(needed)), dtype=bool)
    ranks = np.asarray(groups, dtype=np.int64)  # (groups, group size): a mesh's groups have one size
    if ranks.ndim != 2 or ranks.shape[1] < 2 or not len(held) or not len(needed):
        return out  # one-rank groups
    sizes = np.array(SETS.sizes, dtype=np.int64)
    whole = (held[:, ranks] == held[:, ranks[:, :1]]).all(axis=(1, 2, 3))  # a group's ranks hold one block
    block = held[:, ranks[:, 0]]  # (h, groups, dims)
    parts = needed[:, ranks]  # (n, groups, group size, dims)
    part_size = sizes[parts].prod(axis=-1)
    equal = (part_size == part_size[..., :1]).all(axis=(1, 2))  # a group's parts are of one size
    ok = whole[:, None] & equal[None, :]
    # group size times that size is the block's, and the layouts differ
    ok &= (part_size[None, :, :, 0] * ranks.shape[1] == sizes[block].prod(axis=-1)[:, None]).all(axis=-1)
    ok &= ~(needed[None] == held[:, None]).all(axis=(2, 3))
    ok[:, ok.any(axis=0)] &= _distinct_parts(parts[ok.any(axis=0)])[None]
    h, n = np.nonzero(ok)
    if len(h):  # every part inside its group's block, dim by dim
        inside = (SETS.pairwise(block[h][:, :, None], parts[n]) == sizes[parts[n]]).all(axis=(1, 2, 3))
        out[h[inside], n[inside]] = True
    return out


def _distinct_parts(parts: np.ndarray) -> np.ndarray:
    """Per candidate, whether the parts of each group are pairwise disjoint; ``parts`` is ``(candidates, groups,
    group size, dims)`` of set numbers from one layout. Blocks of one layout are equal or disjoint, so the parts
    are disjoint when no two are equal: sorted as mixed-radix codes, no two neighbours match."""
    base = max(1, len(SETS.sets))
    if parts.shape[-1] * base.bit_length() > 62:  # too many dims to code in one int64: test every pair
        a, b = np.triu_indices(parts.shape[2], 1)
        return (block_overlaps(parts[:, :, a], parts[:, :, b]) == 0).all(axis=(1, 2))
    code = np.zeros(parts.shape[:-1], dtype=np.int64)
    for d in range(parts.shape[-1]):
        code = code * base + parts[..., d]
    code.sort(axis=-1)
    return (np.diff(code, axis=-1) != 0).all(axis=(1, 2))


def broadcasts_many(op: OpDims, bias: int, held: np.ndarray, needed: np.ndarray) -> np.ndarray:
    """:func:`bias_broadcasts` for many needed layouts (arrays as in :func:`scatters_many`, ``held`` one layout or a
    stack of them)."""
    if held.ndim == 2:
        return broadcasts_many(op, bias, held[None], needed)[0]
    bias_map = op.inputs[bias]
    assert bias_map is not None
    spanned = {d for group in bias_map for d in group}
    out_dims = [dim for dim, group in enumerate(op.outputs[0]) if spanned & set(group)]
    return (needed[None][..., out_dims] == held[:, None][..., out_dims]).all(axis=(2, 3))


def has_bias(node: fx.Node) -> bool:
    pos = BIASED.get(node.target)  # type: ignore[call-overload]
    return pos is not None and len(node.args) > pos and isinstance(node.args[pos], fx.Node)


def performed_inside(target: object, op: OpDims, c: Collective) -> bool:
    """Collectives a local form performs itself (statistics, loss reductions), not an all-reduce node."""
    if target is aten.cross_entropy_loss.default:
        return c.tensor in ("out0", "d_in0")
    if target is aten.layer_norm.default and (op.stats & c.dims):
        return c.tensor in ("out0", "d_in0")
    return False


def _plain(part: OpPartition, target: object, tensor: str, phases: tuple[Phase, ...]) -> Collective | None:
    found = [
        c
        for c in collectives(part)
        if c.tensor == tensor and c.phase in phases and not performed_inside(target, part.op, c)
    ]
    if len(found) != 1 or found[0].block is not None or found[0].count != 1 or found[0].kind != "all-reduce":
        return None
    return found[0]


@dataclass(frozen=True, slots=True)
class Fusable:
    """An all-reduce that may fuse with the re-layout after it; ``bias``: the input index of a bias the passes add
    after the all-reduce (it is then added to the scattered piece, and its gradient all-reduced over the group)."""

    collective: Collective
    bias: int | None = None


def graph_facts(node: fx.Node, k: int | None = None) -> tuple:
    """What :func:`fusable_forward` (``k=None``) or :func:`fusable_backward` needs to know of the captured graph's
    ``node`` besides its partition: whether it has one user and its bias input, or whether it reads input ``k``
    exactly once."""
    if k is None:
        bias = node.all_input_nodes.index(node.args[BIASED[node.target]]) if has_bias(node) else None  # type: ignore[index]
        return len(node.users) == 1, bias
    if k >= len(node.all_input_nodes):
        return (False,)
    uses: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), uses.append)
    return (uses.count(node.all_input_nodes[k]) == 1,)  # read twice: two gradients meet in one all-reduce


def fusable_forward(part: OpPartition, node: fx.Node) -> Fusable | None:
    """The Forward all-reduce of ``node``'s output that may fuse with its one consumer's re-layout, if any.

    ``node`` is the captured graph's node: one output and exactly one user.
    """
    single, bias = graph_facts(node)
    if len(part.op.outputs) != 1 or not single:
        return None
    c = _plain(part, node.target, "out0", (Phase.FORWARD,))
    return None if c is None else Fusable(c, bias)


def bias_broadcasts(op: OpDims, bias: int, held: Layout, needed: Layout) -> bool:
    """Whether the bias (input ``bias``) still broadcasts over the piece: no output dim it spans is sliced."""
    out_map, bias_map = op.outputs[0], op.inputs[bias]
    assert bias_map is not None
    spanned = {d for group in bias_map for d in group}
    for dim, group in enumerate(out_map):
        if spanned & set(group) and any(h[dim] != n[dim] for h, n in zip(held, needed)):
            return False
    return True


def fusable_backward(part: OpPartition, node: fx.Node, k: int) -> Fusable | None:
    """The all-reduce of the gradient of ``node``'s input ``k`` that may fuse with the re-layout that carries the
    gradient back to the producer, if any (``node`` is the captured graph's node)."""
    if not graph_facts(node, k)[0]:
        return None
    c = _plain(part, node.target, f"d_in{k}", (Phase.BACKWARD, Phase.GRADIENT))
    return None if c is None else Fusable(c)


@dataclass(frozen=True)
class ScatterSaving:
    """What fusing an edge's all-reduces into reduce-scatters saves, per (producer, consumer) partition pair.

    ``forward_*``: the producer's output all-reduce (attributed to the producer); ``backward_*``: the consumer's
    input-gradient all-reduce (attributed to the consumer). Seconds and bytes saved per device, net of a bias
    gradient's all-reduce; ``*_scattered`` the bytes the reduce-scatter itself sends; ``forward_bias_*`` the bias
    gradient's all-reduce netted out of ``forward_*`` (it runs in Backward: a recomputed Forward saves without it);
    ``*_rs_s`` the seconds the reduce-scatter itself takes (what overlapping it with a product can hide:
    :mod:`primepar_fx.cost.matmul_overlap`); ``forward_regather_*`` the seconds and bytes of the bias's ZeRO-3
    all-gather when the producer's Forward runs again (recomputation gathers it again: netted out of what a
    recomputed Forward saves). Zero where no fusion.
    """

    forward_s: np.ndarray
    forward_bytes: np.ndarray
    forward_scattered: np.ndarray
    backward_s: np.ndarray
    backward_bytes: np.ndarray
    backward_scattered: np.ndarray
    forward_bias_s: np.ndarray
    forward_bias_bytes: np.ndarray
    forward_rs_s: np.ndarray
    backward_rs_s: np.ndarray
    forward_regather_s: np.ndarray
    forward_regather_bytes: np.ndarray


def reduce_scatter_seconds(cluster: ClusterSpec, block: float, mesh: DeviceMesh, digits: tuple[int, ...]) -> float:
    """Seconds of the runtime's reduce-scatter of a ``block``-byte block over the groups of ``digits``
    (:class:`~primepar_fx.runtime.collectives.ReduceScatter`): each device sends each of the ``g - 1`` others of its
    group their piece, ``block / g`` bytes, and receives its own from each, all posted at once. That is the
    point-to-point exchange the re-layouts are priced as (:func:`~primepar_fx.cost.model.p2p_seconds`): ``g - 1``
    messages of ``(g-1)/g`` of the block in all, at the ``"p2p"`` latency of the level the group uses."""
    g = cluster.group_size(mesh, digits)
    if g < 2:
        return 0.0
    level = cluster.levels[cluster.group_level(mesh, digits)]
    return level.p2p_time(ring_factors("reduce-scatter", g)[0] * block, messages=g - 1)


def _saving(
    cluster: ClusterSpec,
    part: OpPartition,
    c: Collective,
    tensor: str,
    vkey,
    item: int,
    bias: int | None = None,
    opts: CostOptions | None = None,
) -> tuple[float, int, int, float, int, float, float, int]:
    """Seconds and bytes one device saves when all-reduce ``c`` becomes a reduce-scatter of the same block (less a
    bias gradient's all-reduce over the same group), the bytes the reduce-scatter sends, the seconds and bytes
    of that bias all-reduce (zero without a bias), the seconds of the reduce-scatter, and the seconds and bytes
    of gathering the bias once more where Forward runs again (ZeRO-3; else zero). A bias that is a
    parameter, whose gradient no other all-reduce sums, has it summed in a bucket
    (:mod:`~primepar_fx.passes.gradsync`): its all-reduce is priced as a parameter's, once a step of
    ``opts.micro_batches``, and with ZeRO (``opts.zero``) the bucket is
    sharded over that group, so the bias is all-gathered as a weight that Backward does not read (at stage 3 once
    more before a recomputed Forward, which reads it again)."""
    block = block_bytes(part, tensor_map(part.op, tensor), vkey, item)
    group = cluster.group_size(part.mesh, c.digits)
    mesh, digits = part.mesh, c.digits
    scatter_s = reduce_scatter_seconds(cluster, block, mesh, digits)
    seconds = cluster.collective_time("all-reduce", block, mesh, digits) - scatter_s
    ar, _ = ring_factors("all-reduce", group)
    rs, _ = ring_factors("reduce-scatter", group)
    saved, scattered = int(round(ar * block)) - int(round(rs * block)), int(round(rs * block))
    if bias is not None:
        extra = block_bytes(part, part.op.inputs[bias], vkey, item)  # type: ignore[arg-type]
        bias_s, bias_bytes = cluster.collective_time("all-reduce", extra, mesh, digits), int(round(ar * extra))
        # (its own all-reduce is the only sum of the bias's gradient: one that also sums it over other digits, in a
        # bucket, keeps this one in the graph, every micro-batch)
        own = any(in_bucket(part.op, k) and k.tensor == f"d_in{bias}" for k in collectives(part))
        regather_s, regather_bytes = 0.0, 0
        if opts is not None and bias in part.op.weights and not own:
            m, share = opts.micro_batches, zero_gather_share(opts, read=False)
            bias_s = cluster.collective_time("all-reduce", extra, mesh, digits, bucketed=True) / m
            bias_bytes = int(round(ar * extra / m))
            if share or opts.zero == 3:
                ag, _ = ring_factors("all-gather", group)
                gather_s = cluster.collective_time("all-gather", extra, mesh, digits, bucketed=True)
                bias_s += share * gather_s
                bias_bytes += int(round(ag * extra * share))
                if opts.zero == 3:
                    regather_s, regather_bytes = gather_s, int(round(ag * extra))
        saving = seconds - bias_s, saved - bias_bytes, scattered, bias_s, bias_bytes, scatter_s
        return *saving, regather_s, regather_bytes
    return seconds, saved, scattered, 0.0, 0, scatter_s, 0.0, 0


def scatter_saving(
    producers: Sequence[OpPartition],
    out_index: int,
    consumers: Sequence[OpPartition],
    in_index: int,
    forward: Sequence[Fusable | None],
    backward: Sequence[Fusable | None],
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    shared: bool = False,
) -> ScatterSaving | None:
    """The savings of an edge whose producer partitions have the fusable Forward all-reduces ``forward`` and whose
    consumer partitions have the fusable input-gradient all-reduces ``backward`` (:func:`fusable_forward`,
    :func:`fusable_backward`); ``None`` when no pair fuses. ``shared``: the edge is a parameter both read
    (``out_index`` the producer's input that stores it): the consumer's gradient all-reduce may fuse with the
    re-layout back to the storage layout, as it does after any other re-layout."""
    vkey, item = values_key(values), opts.itemsize
    shape = (len(producers), len(consumers))
    out = ScatterSaving(*(np.zeros(shape) for _ in dataclasses.fields(ScatterSaving)))
    found = False
    mesh = producers[0].mesh
    needed = _Distinct([forward_needed(c, in_index) for c in consumers], vkey) if any(forward) else None
    grad_needed = None
    if any(backward):
        grad_needed = _Distinct([source_grad_needed(p, out_index, shared) for p in producers], vkey)
    op = producers[0].op

    def biased(f: Fusable) -> tuple[OpDims, int] | None:
        return None if f.bias is None else (op, f.bias)

    rows = [i for i, f in enumerate(forward) if f is not None] if needed is not None else []
    tests = [(forward_held(producers[i], out_index).layout_ids(vkey), forward[i]) for i in rows]
    for i, hits in zip(rows, needed.hits_many(tests, mesh, biased) if needed is not None else []):
        if len(hits):
            found, f = True, forward[i]
            saving = _saving(cluster, producers[i], f.collective, f"out{out_index}", vkey, item, f.bias, opts)
            out.forward_s[i, hits], out.forward_bytes[i, hits], out.forward_scattered[i, hits] = saving[:3]
            out.forward_bias_s[i, hits], out.forward_bias_bytes[i, hits], out.forward_rs_s[i, hits] = saving[3:6]
            out.forward_regather_s[i, hits], out.forward_regather_bytes[i, hits] = saving[6:]
    uses = {j: backward_held(q, in_index) for j, q in enumerate(consumers) if backward[j] is not None}
    cols = [j for j, use in uses.items() if use is not None] if grad_needed is not None else []
    tests = [(uses[j].layout_ids(vkey), backward[j]) for j in cols]  # type: ignore[union-attr]
    for j, hits in zip(cols, grad_needed.hits_many(tests, mesh, lambda _: None) if grad_needed is not None else []):
        if len(hits):
            found, f = True, backward[j]
            saving = _saving(cluster, consumers[j], f.collective, f"d_in{in_index}", vkey, item)  # type: ignore[union-attr]
            out.backward_s[hits, j], out.backward_bytes[hits, j], out.backward_scattered[hits, j] = saving[:3]
            out.backward_rs_s[hits, j] = saving[5]
    return out if found else None


#: :meth:`_Distinct.hits_many` per distinct needed layout, keyed by the held layout, the distinct needed layouts, the
#: groups and the bias: edges whose layouts agree (q, k and v; the layers) test each pair once
SCATTERS: dict[tuple, np.ndarray] = {}


class _Distinct:
    """The needed layouts of one side of an edge, each distinct one tested once per (held layout, groups, bias)."""

    def __init__(self, uses: Sequence[EdgeUse], vkey: ValuesKey) -> None:
        self.needed, self.of = intern_rows(np.stack([u.layout_ids(vkey) for u in uses]))
        self.digest = array_digest(self.needed)

    def hits_many(
        self, tests: Sequence[tuple[np.ndarray, Fusable]], mesh: DeviceMesh, bias_of: Callable[[Fusable], Any]
    ) -> list[np.ndarray]:
        """Per ``(held, fusable)`` of ``tests``: the strategies whose needed layout ``held`` (all-reduced over the
        groups of the fusable's digits on ``mesh``) reduce-scatters to (:func:`scatters_many`), and that keep
        ``bias_of(fusable) = (op, input)`` (or ``None``) broadcasting over the piece. The distinct held layouts of
        one (digits, bias) are tested together, each once (:data:`SCATTERS`)."""
        keys = [(held.tobytes(), self.digest, mesh, f.collective.digits, bias_of(f)) for held, f in tests]
        todo: dict[tuple, dict[bytes, np.ndarray]] = {}
        for key, (held, _) in zip(keys, tests):
            if key not in SCATTERS:
                todo.setdefault(key[3:], {})[key[0]] = held
        for (digits, bias), helds in todo.items():
            stack = np.stack(list(helds.values()))
            ok = scatters_many(stack, self.needed, mesh.groups(digits))
            if bias is not None:
                ok &= broadcasts_many(bias[0], bias[1], stack, self.needed)
            for raw, row in zip(helds, ok):
                SCATTERS[raw, self.digest, mesh, digits, bias] = row
        return [np.flatnonzero(SCATTERS[key][self.of]) for key in keys]
