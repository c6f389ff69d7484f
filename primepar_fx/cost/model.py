"""Intra- and inter-operator cost (paper §4, Eq. 7-10) of one node under one partition sequence.

Intra-operator cost (Eq. 7), per training step, for node ``n`` under partition ``P``::

    intraC(n, P) = sum_phase sum_t max(compute(n, P, phase, t), ring(n, P, phase, t))
                   + collectives(n, P) + alpha * memory(n, P)

* ``compute``: one sub-operator per step: ``flops_phase / prod_X parts_X`` FLOPs and the bytes of the local
  blocks of the phase's tensors, priced by the cluster's per-family :class:`~primepar_fx.cost.latency.ComputeModel`.
  Forward FLOPs are the rule's; a matrix product's Backward (dI) and Gradient (dW) each cost the same again when
  they exist; attention's backward costs twice its forward; other ops are priced by the bytes they move.
* ``ring``: the transfers :func:`~primepar_fx.partition.transfers` derives for step ``t`` (the blocks that move
  overlap the compute of that step), priced as P2P shifts at the slowest link they cross, to one peer each (at
  the level's ``peer_bandwidth`` where it has one).
* ``collectives``: an all-reduce per :class:`~primepar_fx.partition.Collective` of the local result block over its
  group indicator, priced at the slowest level the group touches. The all-reduce of a parameter's gradient
  (:func:`in_bucket`) travels in one of the runtime's gradient buckets, so it pays its bytes but not the per-step
  latency, which the bucket pays once for many.
* ``memory`` (bytes per device): parameters with their gradients, master copies and optimizer moments
  (:attr:`~primepar_fx.cost.blocks.CostOptions.param_state_bytes` per element: 16 by default), activations stashed for
  backward, and the ring's second (receive) buffer for every block that moves in a phase, in the phase that
  needs the most.

Inter-operator cost (Eq. 8-9): the redistribution traffic of :mod:`primepar_fx.cost.redistribute`. Each direction
(Forward, and Backward for the gradient) is priced as the cheaper of two ways to move it:

* an all-to-all in which every device exchanges as many bytes as the busiest receiver's Eq. 9 term, inside a node
  when every device finds its data there and across the mesh otherwise (:func:`all_to_all_levels`);
* the point-to-point exchange the runtime runs (:class:`~primepar_fx.runtime.exchange.Exchange`,
  :func:`p2p_seconds`): device ``k`` receives its Eq. 9 term ``bytes_k`` in ``m_k`` messages, one from each rank
  that sends it something (the holder nearest in device-ID digits), at the ``"p2p"`` latency of the slowest level
  one of them crosses, ``m_k * fixed + bytes_k * bytes_coeff``, the rate lowered to one peer's links where a level
  has ``peer_bandwidth`` and the ``m_k`` messages cannot use all of a device's links. All messages are posted at
  once, so the exchange takes ``max_k`` of that. Only receives are priced: the nearest-holder rule spreads the
  sends (a replicated block comes from the holder that shares the receiver's other digits, not from one rank to
  all), and in the gathers and permutations that re-layouts mostly are a device sends as many messages and bytes
  as it receives. A Cannon skew (P(S x S) to P(S x S)) is a permutation: one message per receiving device.

The p2p price is the cheaper for gathers and small exchanges (a message costs one p2p intercept where an all-to-all
of ``g`` devices pays ``g - 1`` ring steps, and p2p moves bytes at a higher efficiency). Both directions are priced
on the busiest device, so a re-layout that loads a few devices (a Cannon skew moves blocks to half of them) costs
what those devices take to receive, whichever way it runs.

Sizes are sympy expressions in ``B`` and ``S`` evaluated at the caller's ``values``; results are floats (seconds)
and ints (bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np
import sympy
import torch

from primepar_fx.cost.blocks import CostOptions, block_bytes, in_bucket, tensor_map, zero_gather_share
from primepar_fx.cost.cluster import ClusterSpec, LinkLevel, dtype_key
from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.redistribute import DIRECTIONS, LayoutPairs, clear_redistribution_caches, edge_pairs
from primepar_fx.cost.scatter import SCATTERS
from primepar_fx.partition import PHASES, DeviceMesh, OpPartition, Phase, collectives, phase_tensors, transfers
from primepar_fx.partition.comm import Collective, Transfer
from primepar_fx.partition.enumerate import ValuesKey, values_key
from primepar_fx.rules.spec import OpDims, TensorMap

aten = torch.ops.aten
#: element-wise ops whose backward needs none of their inputs (nothing is stashed for them)
_LINEAR_POINTWISE = frozenset(
    {
        aten.add.Tensor,
        aten.add.Scalar,
        aten.sub.Tensor,
        aten.sub.Scalar,
        aten.neg.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.alias.default,
        aten.detach.default,
        aten.to.dtype,
        aten.to.dtype_layout,
        aten.to.device,
        aten._to_copy.default,
        aten.dropout.default,
    }
)


@dataclass(frozen=True, slots=True)
class NodeCost:
    """The modelled cost of one node under one partition, per training step and per device."""

    phase_s: tuple[float, float, float]  # Forward, Backward, Gradient: sum_t max(compute, ring)
    compute_s: float
    ring_s: float
    collective_s: float
    param_bytes: int  # this device's parameter blocks in the plan's dtype (gradients and optimizer state scale)
    stash_bytes: int
    buffer_bytes: int
    comm_bytes: dict[str, int] = field(default_factory=dict)  # bytes this device sends, by kind
    #: Forward's own share of ``compute_s``, ``ring_s`` and ``collective_s``, and the bytes its ring and collectives
    #: send: what running it again costs (activation recomputation)
    forward_compute_s: float = 0.0
    forward_ring_s: float = 0.0
    forward_collective_s: float = 0.0
    forward_ring_bytes: int = 0
    forward_collective_bytes: int = 0
    #: this device's share of ``param_bytes`` when each parameter block is split over the devices that hold it
    #: (ZeRO, :attr:`~primepar_fx.cost.blocks.CostOptions.zero`); ``None``: no block is replicated
    shard_bytes: int | None = None
    #: ZeRO-3: the seconds and bytes of gathering the weights its Backward does not read once more before Backward,
    #: which it needs where its Forward runs again (activation recomputation)
    recompute_gather_s: float = 0.0
    recompute_gather_bytes: int = 0
    #: ZeRO stages 1 and 3: per weight input, the seconds of its all-gathers in ``collective_s`` (what the node's
    #: own compute does not hide), as ``(input, seconds)``, and the bytes they send, as ``(input, bytes)``
    zero_gather_s: tuple[tuple[int, float], ...] = ()
    zero_gather_bytes: tuple[tuple[int, int], ...] = ()

    @property
    def forward_s(self) -> float:
        """Forward's seconds, its collectives included."""
        return self.phase_s[0] + self.forward_collective_s

    @property
    def forward_bytes(self) -> int:
        return self.forward_ring_bytes + self.forward_collective_bytes

    @property
    def time_s(self) -> float:
        return sum(self.phase_s) + self.collective_s

    def state_bytes(self, opts: CostOptions) -> int:
        """This device's parameter blocks with their gradients, master copies and optimizer moments (``opts``)."""
        shard = None if self.shard_bytes is None else -(-self.shard_bytes // opts.itemsize)
        return opts.state_bytes(self.param_bytes // opts.itemsize, shard)

    def held_state_bytes(self, opts: CostOptions) -> int:
        """:meth:`state_bytes` as the search counts it: its ``1 / opts.stages`` share in one stage's plan of a
        pipeline (:attr:`~primepar_fx.cost.blocks.CostOptions.stages`)."""
        return -(-self.state_bytes(opts) // opts.stages)

    def memory_bytes(self, opts: CostOptions) -> int:
        return self.held_state_bytes(opts) + self.stash_bytes + self.buffer_bytes

    def objective(self, opts: CostOptions) -> float:
        return self.time_s + opts.alpha * self.memory_bytes(opts)


@lru_cache(maxsize=1 << 14)
@lru_cache(maxsize=1 << 14)
def _num(expr: sympy.Expr, vkey: ValuesKey) -> float:
    return float(sympy.sympify(expr).xreplace({k: sympy.Integer(v) for k, v in vkey}))


@lru_cache(maxsize=1 << 14)
def phase_flops(op: OpDims, target: object) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """Forward, Backward and Gradient FLOPs of the whole (unpartitioned) node."""
    fwd = sympy.sympify(op.flops)
    tensors = phase_tensors(op)
    has_b = any(t.result for t in tensors[Phase.BACKWARD])
    has_g = any(t.result for t in tensors[Phase.GRADIENT])
    if op.kind == "attention":
        return fwd, 2 * fwd if has_b else sympy.Integer(0), sympy.Integer(0)
    if op.kind == "matmul":
        bwd = (2 if op.extra.get("recomputes") else 1) * fwd  # an op that runs its forward again in Backward
        return fwd, bwd if has_b else sympy.Integer(0), fwd if has_g else sympy.Integer(0)
    return fwd, sympy.Integer(0), sympy.Integer(0)


def stashed_inputs(op: OpDims, target: object) -> list[int]:
    """Inputs a node keeps from Forward for its Backward/Gradient (non-parameter, gradient-carrying, float)."""
    if op.kind in ("view", "factory", "meta", "reduce", "embedding") or target in _LINEAR_POINTWISE:
        return []
    live = [k for k, m in enumerate(op.inputs) if m is not None and k not in op.weights and k not in op.no_grad]
    if op.kind in ("norm", "loss"):
        return live[:1]
    return live


def checkpoint_stop(nodes: Mapping[str, Any], run: Sequence[str]) -> int:
    """The position in ``run`` (node names of a checkpointed run, in graph order; ``nodes``: name -> a node with
    ``dims`` and ``target``) of its last node that keeps a tensor for Backward, ``-1`` if none: non-reentrant
    checkpointing recomputes the run only up to there, that node's collectives after its compute excluded
    (:mod:`primepar_fx.levers.recompute`)."""
    savers = [i for i, n in enumerate(run) if stashed_inputs(nodes[n].dims, nodes[n].target)]
    return savers[-1] if savers else -1


def weights_read_in_backward(op: OpDims, target: object) -> list[int]:
    """Weight inputs that autograd keeps for the node's Backward (ZeRO-3 gathers them again for it): a matmul's
    matrix (not its bias), every weight of another op that keeps its inputs (a product; a layer norm keeps its
    shift as well as its scale); none of an embedding, a view or a sum."""
    if op.kind in ("view", "factory", "meta", "reduce", "embedding") or target in _LINEAR_POINTWISE:
        return []
    weights = [k for k in sorted(op.weights) if op.inputs[k] is not None]
    if op.kind == "matmul":
        return [k for k in weights if len(op.inputs[k]) >= 2]  # type: ignore[arg-type]
    return weights


@lru_cache(maxsize=65536)
def _transfers(part_key: tuple) -> tuple[Transfer, ...]:
    op, seq, mesh = part_key
    return tuple(transfers(OpPartition(op, seq, mesh)))


@dataclass
class _NodePricing:
    """The terms of :func:`node_cost` for one node under one partition, summed as each is priced (the fields of
    :class:`NodeCost` of the same names), and the bytes sent, by kind."""

    part: OpPartition
    target: object
    cluster: ClusterSpec
    opts: CostOptions
    vkey: ValuesKey
    #: the ring's transfers (none in one step)
    moves: tuple[Transfer, ...]
    comm: dict[str, int] = field(default_factory=dict)
    phase_s: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    ring_s: float = 0.0
    collective_s: float = 0.0
    forward_compute_s: float = 0.0
    forward_ring_s: float = 0.0
    forward_collective_s: float = 0.0
    forward_ring_bytes: int = 0
    forward_collective_bytes: int = 0
    #: weight input -> the size and digits of its replicas (the group its gradient is summed over)
    replicas: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    shard_bytes: int | None = None
    recompute_gather_s: float = 0.0
    recompute_gather_bytes: int = 0
    zero_gather_s: list[tuple[int, float]] = field(default_factory=list)
    zero_gather_bytes: list[tuple[int, int]] = field(default_factory=list)

    def block(self, tmap: TensorMap) -> int:
        """The bytes of this device's block of a tensor of map ``tmap``."""
        return block_bytes(self.part, tmap, self.vkey, self.opts.itemsize)

    def send(self, kind: str, nbytes: int) -> None:
        self.comm[kind] = self.comm.get(kind, 0) + nbytes

    def price_phases(self) -> None:
        """Each phase's ``sum_t max(compute, ring)``, with its compute and ring seconds and Forward's share."""
        op = self.part.op
        subops, tensors, dtype = prod(self.part.parts.values()), phase_tensors(op), dtype_key(self.opts.dtype)
        for phase, flops in zip(PHASES, phase_flops(op, self.target)):
            if phase is not Phase.FORWARD and not any(t.result for t in tensors[phase]):
                self.phase_s.append(0.0)
                continue
            nbytes = sum(self.block(t.tmap) for t in tensors[phase])
            step_compute = self.cluster.device.compute_time(op.kind, _num(flops, self.vkey) / subops, nbytes, dtype)
            total = 0.0
            for t in range(self.part.steps):
                ring = self._ring_step(phase, t)
                total += max(step_compute, ring)
                self.compute_s += step_compute
                self.ring_s += ring
            if phase is Phase.FORWARD:
                self.forward_compute_s, self.forward_ring_s = self.compute_s, self.ring_s
            self.phase_s.append(total)

    def _ring_step(self, phase: Phase, t: int) -> float:
        """The seconds of the P2P shifts that step ``t`` of ``phase`` overlaps with its compute."""
        ring = 0.0
        for tr in (m for m in self.moves if m.src == (phase, t)):
            block = self.block(tensor_map(self.part.op, tr.tensor))
            ring += self.cluster.shift_time(block, tr.senders)
            self.send("p2p", block)
            self.forward_ring_bytes += block if phase is Phase.FORWARD else 0
        return ring

    def price_collectives(self) -> None:
        """The all-reduces (a bucketed gradient's once a step: its share of each micro-batch), and the replicas of
        each weight whose gradient travels in a bucket."""
        op, opts, cluster = self.part.op, self.opts, self.cluster
        for c in collectives(self.part):
            bucketed = asynchronous(op, self.target, c)
            seconds, nbytes = collective_price(self.part, c, cluster, self.vkey, opts.itemsize, bucketed=bucketed)
            if in_bucket(op, c) and opts.micro_batches > 1:  # once a step: its share of each micro-batch
                seconds, nbytes = seconds / opts.micro_batches, int(round(nbytes / opts.micro_batches))
            self.collective_s += seconds
            self.send(c.kind, nbytes)
            if c.phase is Phase.FORWARD:
                self.forward_collective_s += seconds
                self.forward_collective_bytes += nbytes
            if in_bucket(op, c):
                self.replicas[int(c.tensor[4:])] = (cluster.group_size(self.part.mesh, c.digits), c.digits)

    def price_zero(self, weights: dict[int, int], kept: tuple[int, ...] = ()) -> int:
        """ZeRO over the replicas of each weight (``weights``: input -> its block's bytes): this device's shard and
        the all-gathers of stages 1 and 3. ``kept``: weights that stage 3 keeps whole from Forward to Backward
        (:func:`~primepar_fx.pricing.zero3.kept_whole`): gathered once a micro-batch. Returns the bytes of those
        that Backward reads, held whole from Forward to Backward beyond this device's shard of them."""
        if not self.replicas:
            return 0
        opts, replicas = self.opts, self.replicas
        self.shard_bytes = sum(-(-b // replicas[k][0]) if k in replicas else b for k, b in weights.items())
        # stage 1 all-gathers the updated shards after the step (stage 2 swaps the all-reduce for a reduce-scatter
        # and this all-gather: the same bytes); stage 3 gathers before Forward and before Backward of every
        # micro-batch, and reduce-scatters once a step: per micro-batch the all-reduce's 1/m above and (2 - 1/m)
        # all-gathers here (with one micro-batch: one more all-gather than stage 2)
        if opts.zero not in (1, 3):
            return 0
        read = list(replicas) if opts.regather_all else weights_read_in_backward(self.part.op, self.target)
        held = [k for k in read if k in kept] if opts.zero == 3 else []
        read = [k for k in read if k not in held]
        # stage 3 prefetches (:mod:`primepar_fx.runtime.zero3`): a unit's gather travels while the unit before it
        # computes; stage 1's all-gathers after the step travel while the next Forward computes, each waited for
        # before its bucket's first reader (:mod:`primepar_fx.runtime.zero`). Priced per node: hidden behind the
        # node's own compute of the phase that needs it (Forward; Backward for stage 3's gather again), as far as
        # that compute goes, the rest exposed
        room = [self.phase_s[0], self.phase_s[1] + self.phase_s[2] if opts.zero == 3 else 0.0]
        for k in replicas:
            seconds, gathered = zero_gather_price(self.part, k, self.cluster, self.vkey, opts.itemsize)
            if opts.zero == 3 and k not in read:
                self.recompute_gather_s += seconds
                self.recompute_gather_bytes += gathered
            share = zero_gather_share(opts, k in read)
            priced = seconds * share
            for phase in (0, 1) if k in read else (0,):
                hidden = min(seconds, room[phase], priced)
                room[phase] -= hidden
                priced -= hidden
            self.collective_s += priced
            sent = int(round(gathered * share)) if share != 1 else gathered
            self.zero_gather_s.append((k, priced))
            self.zero_gather_bytes.append((k, sent))
            self.send("all-gather", sent)
        return sum(weights[k] - -(-weights[k] // replicas[k][0]) for k in held if k in replicas)

    def buffer_bytes(self) -> int:
        """One receive buffer per tensor that moves in a phase, in the phase that needs the most (phases run one
        after another)."""
        op = self.part.op
        return max(
            (
                sum(self.block(tensor_map(op, n)) for n in {m.tensor for m in self.moves if m.src[0] is ph})
                for ph in PHASES
            ),
            default=0,
        )


def node_cost(
    part: OpPartition,
    target: object,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    kept: tuple[int, ...] = (),
) -> NodeCost:
    """Eq. 7 for one node (``part`` binds its OpDims, partition sequence and mesh), priced term by term
    (:class:`_NodePricing`): phases, collectives, ZeRO, memory. ``kept``: its weight inputs that ZeRO-3 keeps
    whole from Forward to Backward (:func:`~primepar_fx.pricing.zero3.kept_whole`)."""
    op = part.op
    moves = _transfers((op, part.seq, part.mesh)) if part.steps > 1 else ()
    pr = _NodePricing(part, target, cluster, opts, values_key(values), moves)
    pr.price_phases()
    pr.price_collectives()
    weights = {k: pr.block(op.inputs[k]) for k in op.weights if op.inputs[k] is not None}
    params = sum(weights.values())
    held = pr.price_zero(weights, kept)
    stash = held + sum(pr.block(op.inputs[k]) for k in stashed_inputs(op, target))
    buffers = pr.buffer_bytes()
    if opts.zero == 3 and pr.shard_bytes is not None:  # its replicated blocks gathered whole while it runs (this
        buffers += params - pr.shard_bytes  # rank's chunk of them is in the state already)
    return NodeCost(
        tuple(pr.phase_s),  # type: ignore[arg-type]
        pr.compute_s,
        pr.ring_s,
        pr.collective_s,
        params,
        stash,
        buffers,
        pr.comm,
        forward_compute_s=pr.forward_compute_s,
        forward_ring_s=pr.forward_ring_s,
        forward_collective_s=pr.forward_collective_s,
        forward_ring_bytes=pr.forward_ring_bytes,
        forward_collective_bytes=pr.forward_collective_bytes,
        shard_bytes=pr.shard_bytes,
        recompute_gather_s=pr.recompute_gather_s,
        recompute_gather_bytes=pr.recompute_gather_bytes,
        zero_gather_s=tuple(pr.zero_gather_s),
        zero_gather_bytes=tuple(pr.zero_gather_bytes),
    )


def zero_gather_price(
    part: OpPartition, k: int, cluster: ClusterSpec, vkey: ValuesKey, itemsize: int
) -> tuple[float, int]:
    """Seconds and bus bytes of ZeRO stage 1's all-gather of weight input ``k`` after the step, over the group
    that sums its gradient; ``(0, 0)`` when none does."""
    for c in collectives(part):
        if in_bucket(part.op, c) and int(c.tensor[4:]) == k:
            block = block_bytes(part, part.op.inputs[k], vkey, itemsize)
            seconds = cluster.collective_time("all-gather", block, part.mesh, c.digits, bucketed=True)
            bus, _ = ring_factors("all-gather", cluster.group_size(part.mesh, c.digits))
            return seconds, int(round(bus * block))
    return 0.0, 0


def collective_price(
    part: OpPartition, c: Collective, cluster: ClusterSpec, vkey: ValuesKey, itemsize: int, bucketed: bool = False
) -> tuple[float, int]:
    """Seconds and bus bytes one device spends on collective ``c`` of ``part`` (Eq. 7's collective term)."""
    block = c.count * block_bytes(
        part, c.block if c.block is not None else tensor_map(part.op, c.tensor), vkey, itemsize
    )
    seconds = cluster.collective_time(c.kind, block, part.mesh, c.digits, bucketed=bucketed)
    bus, _ = ring_factors(c.kind, cluster.group_size(part.mesh, c.digits))
    return seconds, int(round(bus * block))


def loss_row_sums(op: OpDims, target: object, c: Collective) -> bool:
    """Whether ``c`` sums a cross-entropy over rows split across devices (the loss and the count of targets). The
    runtime sends both asynchronously (:mod:`primepar_fx.runtime.pending`): the count while forward runs, the loss
    while backward runs, which reads neither; like a gradient bucket, they cost their bytes, not a wait."""
    return (
        target is aten.cross_entropy_loss.default
        and c.phase is Phase.FORWARD
        and c.tensor == "out0"
        and c.block is None
        and not (c.dims & op.stats)
    )


def asynchronous(op: OpDims, target: object, c: Collective) -> bool:
    """Whether the runtime runs ``c`` asynchronously, overlapped with compute (priced ``bucketed``)."""
    return in_bucket(op, c) or loss_row_sums(op, target, c)


def edge_cost_matrix(
    producers: list[OpPartition],
    out_index: int,
    consumers: list[OpPartition],
    in_index: int,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    shared: bool = False,
    itemsize: int | None = None,
    pairs: tuple[LayoutPairs, LayoutPairs | None] | None = None,
    keys: tuple[tuple | None, tuple | None] = (None, None),
) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds, bytes)`` of Eq. 8-9 redistribution for every (producer, consumer) partition pair.

    ``shared``: a parameter both nodes read (see :func:`~primepar_fx.cost.redistribute.redistribution_matrix`).
    ``itemsize``: bytes per element of this tensor when it is not a floating-point activation of ``opts.dtype``
    (token ids, masks). ``pairs``: the edge's :func:`~primepar_fx.cost.redistribute.edge_pairs`, when the caller
    has them (from per-node sides it reuses across edges), and ``keys`` their :func:`direction_key` when known.

    ``bytes`` is the Forward plus Backward traffic summed over devices. Each direction costs the cheaper of
    :func:`p2p_seconds` and :func:`all_to_all_levels` (module docstring); which level the all-to-all runs at is
    found only where it could be the cheaper.
    """
    item = opts.itemsize if itemsize is None else itemsize
    if not producers or not consumers:
        empty = np.zeros((len(producers), len(consumers)))
        return empty, empty.astype(np.int64)
    fwd, bwd = pairs or edge_pairs(producers, out_index, consumers, in_index, values, shared)
    mesh = producers[0].mesh
    seconds, total = np.zeros((len(producers), len(consumers))), np.zeros((len(producers), len(consumers)), np.int64)
    for direction, flip, known in ((fwd, False, keys[0]), (bwd, True, keys[1])):
        if direction is None:
            continue
        key = known or direction_key(direction, mesh, cluster, item)
        if key not in DIRECTIONS:
            DIRECTIONS[key] = _direction(direction, mesh, cluster, item)
        time, elems = (a[direction.held_of][:, direction.needed_of] for a in DIRECTIONS[key])
        seconds += time.T if flip else time
        total += elems.T if flip else elems
    return seconds, total * item


def direction_key(pairs: LayoutPairs, mesh: DeviceMesh, cluster: ClusterSpec, item: int) -> tuple:
    """The :data:`~primepar_fx.cost.redistribute.DIRECTIONS` key of one direction of a re-layout."""
    return (pairs.digest(), mesh, cluster, item)


#: (held layout, needed layout, device) entries of all the directions to price below which threads do not pay
#: (measured: docs/benchmarks/measured_in_code.md)
THREADED_WORK = 2**22


def price_directions(
    jobs: Mapping[tuple, LayoutPairs],
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    workers: int,
    alongside: Callable[[], None] | None = None,
) -> None:
    """Price every direction of ``jobs`` (keyed by :func:`direction_key`) that is not in ``DIRECTIONS`` yet, on up
    to ``workers`` threads; ``alongside()`` runs on the calling thread meanwhile (it must number no new index set).

    The work is numpy on arrays of (held layout, needed layout, device), which runs without the GIL, so two
    threads use two cores where the arrays are large; below :data:`THREADED_WORK` entries in all, the Python
    around them dominates and everything runs on the calling thread, ``alongside()`` first. Each key's price is
    computed by one thread from the same inputs as alone, so the result does not depend on the threads. What the
    threads share: the overlap memo of
    :data:`~primepar_fx.partition.layouts.SETS`, where a lost write is recomputed later (no set is numbered while they
    run), and ``lru_cache``d sender tables, which a race at worst computes twice.
    """
    todo = [(key, pairs) for key, pairs in jobs.items() if key not in DIRECTIONS]
    if sum(len(pairs.held) * len(pairs.needed) for _, pairs in todo) * mesh.size < THREADED_WORK:
        workers = 1  # little numpy work: the threads would mostly wait on each other for the GIL
    if workers <= 1 or not todo:
        if alongside is not None:
            alongside()
        for key, pairs in todo:
            DIRECTIONS[key] = _direction(pairs, mesh, cluster, key[3])
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="primepar-price") as pool:
        priced = [pool.submit(_direction, pairs, mesh, cluster, key[3]) for key, pairs in todo]
        if alongside is not None:
            try:
                alongside()
            except BaseException:
                for future in priced:
                    future.cancel()  # what has started ends before the pool is left
                raise
        for (key, _), future in zip(todo, priced):
            DIRECTIONS[key] = future.result()


def _direction(pairs: LayoutPairs, mesh: DeviceMesh, cluster: ClusterSpec, item: int) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds, elements)`` of one direction of a re-layout per pair of distinct layouts (not strategies)."""
    received = pairs.received()
    elems = received.sum(axis=-1)
    time = np.zeros(elems.shape)
    if mesh.size > 1 and elems.any():
        count, cross, local = pairs.exchange(mesh, cluster.devices_per_node, received=received)
        time = _p2p_distinct(count, cross, received, cluster, item)
        inside, across = all_to_all_levels(received.max(axis=-1), mesh, cluster, item)
        if (time > np.minimum(inside, across)).any():  # else no all-to-all is cheaper, wherever it runs
            time = np.minimum(time, np.where(local, inside, across))
    return time, elems


def all_to_all_levels(
    busiest: np.ndarray, mesh: DeviceMesh, cluster: ClusterSpec, itemsize: int
) -> tuple[np.ndarray, np.ndarray]:
    """One direction of a re-layout as an all-to-all, per strategy pair, from ``busiest``, the elements the busiest
    device receives: every device's part of the all-to-all is priced at that many bytes (the slowest device sets the
    time). ``(inside, across)``: run inside each node (over its devices), which is the price when every device finds
    its needed block on its own node (:meth:`~primepar_fx.cost.redistribute.LayoutPairs.node_local`), or across the
    whole mesh at the inter-node level. Zero where nothing moves."""
    world = mesh.size
    per_node = min(world, cluster.devices_per_node)
    per_device = busiest * itemsize
    out = []
    for level, group in ((0, per_node), (len(cluster.levels) - 1, world)):
        price = cluster.levels[level].collective_time
        unit = price("all-to-all", group, 1.0) - price("all-to-all", group, 0.0)
        fixed = price("all-to-all", group, 0.0)
        out.append(np.where(busiest > 0, per_device * unit + fixed, 0.0) if group > 1 else np.zeros(busiest.shape))
    return out[0], out[1]


def p2p_seconds(
    pairs: LayoutPairs, received: np.ndarray, mesh: DeviceMesh, cluster: ClusterSpec, itemsize: int
) -> np.ndarray:
    """One direction of a re-layout as the runtime's point-to-point exchange, per strategy pair.

    Device ``k`` receives ``received[..., k]`` elements in ``m_k`` messages
    (:meth:`~primepar_fx.cost.redistribute.LayoutPairs.messages`), priced with the ``"p2p"`` latency of the slowest
    level one of them crosses: ``m_k * fixed + bytes_k * bytes_coeff``, one p2p intercept per message, where a level
    whose one peer gets less than the whole bandwidth raises ``bytes_coeff`` for few messages
    (:meth:`~primepar_fx.cost.cluster.LinkLevel.p2p_coefficients`, the messages taken as equal). Every message is
    posted at once, so the exchange takes the time of the busiest receiver: ``max_k``.
    """
    count, cross = pairs.messages(mesh, cluster.devices_per_node)
    return _p2p_distinct(count, cross, received, cluster, itemsize)[pairs.held_of][:, pairs.needed_of]


def _p2p_distinct(
    count: np.ndarray, cross: np.ndarray, received: np.ndarray, cluster: ClusterSpec, itemsize: int
) -> np.ndarray:
    """:func:`p2p_seconds` per pair of distinct layouts, from the ``(count, cross)`` of ``LayoutPairs.messages``.

    A device's time is ``count * fixed + received * per_element`` at its level (the inner one, or an outer one when
    a message crosses nodes), where the per-element one depends on the count only where one peer's links bind: it
    is looked up in a table indexed by the count, computed with the same float operations, so that each element is
    priced as if alone."""
    counts = np.arange(int(count.max(initial=0)) + 1)
    if len(cluster.levels) == 2:  # one table per term, indexed by (level, count): two lookups, not a pass per level
        tables = [_p2p_tables(link, counts, itemsize) for link in cluster.levels]
        at = count + len(counts) * cross  # cross selects the outer level's half of each table
        fixed_s, per_element = (np.concatenate(t) for t in zip(*tables))
        return (np.take(fixed_s, at) + received * np.take(per_element, at)).max(axis=-1)
    inner = outer = None
    for level, link in enumerate(cluster.levels):
        fixed_s, per_element = _p2p_tables(link, counts, itemsize)
        seconds = np.take(fixed_s, count) + received * np.take(per_element, count)
        if level == 0:
            inner = seconds
        else:
            outer = seconds if outer is None else np.maximum(outer, seconds)
    if outer is None:
        return np.where(cross, 0.0, inner).max(axis=-1)
    return np.where(cross, outer, inner).max(axis=-1)


def _p2p_tables(link: LinkLevel, counts: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """Per message count ``c`` of ``counts``, at ``link``'s level: ``c * fixed`` and the seconds per element received
    (the busiest peer's links bind below ``peer_factor`` messages: ``LinkLevel.p2p_coefficients``)."""
    p2p = link.collectives["p2p"]
    fixed, unit = p2p.fixed + p2p.call, p2p.bytes_coeff
    if link.peer_factor > 1:
        per_element = itemsize * (unit * np.maximum(1.0, link.peer_factor / np.maximum(counts, 1)))
    else:
        per_element = np.full(counts.shape, itemsize * unit)
    return counts * fixed, per_element


def clear_caches() -> None:
    """Drop the memoised sizes, layouts, overlaps, re-layout prices and reduce-scatter tests (e.g. between models)."""
    clear_redistribution_caches()
    SCATTERS.clear()
