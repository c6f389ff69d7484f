"""Shared re-layouts: one re-layout of a tensor for all of its consumers, when they all need it the same way.

A tensor that several nodes read is re-laid out once per consumer (:mod:`primepar_fx.cost.redistribute`) and
each consumer all-reduces its own partial input gradient (:func:`~primepar_fx.partition.collectives`). When every
consumer needs the tensor in the same layout, holds its gradient in the same layout and all-reduces it over the
same device digits -- q, k and v reading one normed, sequence-split input in Megatron's sequence parallelism;
gate and up in a SwiGLU MLP -- the runtime re-lays it out once, sums the consumers' partial gradients locally
(autograd does, at the shared node) and all-reduces the sum once: the sum of all-reduces is the all-reduce of the
sum. This is what DTensor and Megatron-LM do: one all-gather of the sequence-split input, one reduce-scatter of the
summed gradient.

The rule, which the graph pass (:func:`primepar_fx.passes.share.share_relayouts`) applies and the plan's
prediction (:func:`primepar_fx.pricing.summary.summarize`) prices, is all or nothing per tensor: the consumers of
a producer's output that the cost model prices (a data-flow edge each) share when there are at least two, none
reads the tensor twice, and :func:`signature` is the same for all of them. The first consumer in graph order keeps
its re-layout and all-reduce (and their fusion into a reduce-scatter, :mod:`primepar_fx.cost.scatter`); every other
consumer's edge and input-gradient all-reduce are not run, so not priced.

Also here, for a consumer that reads a tensor its producer computes alike on every rank of a group (a learned
position table looked up by every rank) and sums that input's gradient over the group: the sum may wait until the
end of backward (:func:`deferred_input_sum`, :func:`moves_nothing`, :func:`flat_arguments`;
:func:`primepar_fx.passes.gradsync.defer_input_gradient_sums` applies it).
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import fx

from primepar_fx.cost.blocks import in_bucket
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.model import collective_price
from primepar_fx.cost.redistribute import backward_held, backward_needed, forward_held, forward_needed
from primepar_fx.cost.scatter import performed_inside
from primepar_fx.partition import OpPartition, collectives
from primepar_fx.partition.comm import Collective
from primepar_fx.partition.enumerate import ValuesKey


def input_all_reduces(part: OpPartition, target: object, k: int) -> list[Collective]:
    """The all-reduces of input ``k``'s gradient that the passes emit as nodes of their own (not the statistics a
    local form reduces itself): what a consumer runs on the gradient it holds before it leaves the node."""
    tensor = f"d_in{k}"
    return [c for c in collectives(part) if c.tensor == tensor and not performed_inside(target, part.op, c)]


def signature(part: OpPartition, target: object, k: int, vkey: ValuesKey) -> Hashable:
    """What a consumer does with input ``k`` at its boundary: the layout it needs, the layout its gradient is held
    in, and the digits of that gradient's all-reduces. Consumers with equal signatures may share one re-layout and
    one all-reduce (module docstring); the value is only compared for equality within one process."""
    needed = forward_needed(part, k).layout_ids(vkey)
    grad = backward_held(part, k)
    held = None if grad is None else grad.layout_ids(vkey)
    reduces = tuple((c.kind, c.digits) for c in input_all_reduces(part, target, k))
    return (needed.shape, needed.tobytes(), None if held is None else (held.shape, held.tobytes()), reduces)


def input_all_reduce_price(
    part: OpPartition,
    target: object,
    k: int,
    cluster: ClusterSpec,
    vkey: ValuesKey,
    itemsize: int,
    micro_batches: int = 1,
) -> tuple[float, int]:
    """Seconds and bus bytes of :func:`input_all_reduces`: what a consumer that shares its input no longer runs
    (a parameter gradient's, summed once a step, at its share of one of ``micro_batches``)."""
    seconds, nbytes = 0.0, 0
    for c in input_all_reduces(part, target, k):
        bucketed = in_bucket(part.op, c)
        s, b = collective_price(part, c, cluster, vkey, itemsize, bucketed=bucketed)
        if bucketed and micro_batches > 1:
            s, b = s / micro_batches, int(round(b / micro_batches))
        seconds, nbytes = seconds + s, nbytes + b
    return seconds, nbytes


def input_all_reduce_latency(
    part: OpPartition, target: object, k: int, cluster: ClusterSpec, vkey: ValuesKey, itemsize: int
) -> float:
    """Seconds that the bucketed price of :func:`input_all_reduces` leaves out: the per-message latency of those the
    runtime sums in a gradient bucket (:func:`~primepar_fx.cost.model.in_bucket`). A parameter read by several nodes
    whose gradients are not summed once keeps its all-reduces in the graph, one message each, and pays this."""
    extra = 0.0
    for c in input_all_reduces(part, target, k):
        if in_bucket(part.op, c):
            alone, _ = collective_price(part, c, cluster, vkey, itemsize)
            bucketed, _ = collective_price(part, c, cluster, vkey, itemsize, bucketed=True)
            extra += alone - bucketed
    return extra


def deferred_input_sum(
    consumer: OpPartition, target: object, k: int, cluster: ClusterSpec, vkey: ValuesKey, itemsize: int
) -> tuple[float, tuple[int, ...]] | None:
    """``(seconds saved, digits)`` when the one all-reduce of input ``k``'s gradient may run asynchronously and be
    waited at the end of backward (its producer's parameters take their gradients from the sum then:
    :class:`~primepar_fx.runtime.pending.DeferredGradients`); ``None`` when ``k`` has no such single plain
    all-reduce. The saving is its latency and the overlapped share of its bytes, as a gradient bucket's."""
    found = input_all_reduces(consumer, target, k)
    if len(found) != 1:
        return None
    c = found[0]
    if c.kind != "all-reduce" or c.block is not None or c.count != 1 or in_bucket(consumer.op, c):
        return None
    alone, _ = collective_price(consumer, c, cluster, vkey, itemsize)
    overlapped, _ = collective_price(consumer, c, cluster, vkey, itemsize, bucketed=True)
    return alone - overlapped, c.digits


def moves_nothing(producer: OpPartition, out_index: int, consumer: OpPartition, k: int, vkey: ValuesKey) -> bool:
    """Whether the edge from ``producer``'s output ``out_index`` to ``consumer``'s input ``k`` needs no re-layout on
    any device, in either direction (the passes put no node on it)."""
    if forward_held(producer, out_index).layout(vkey) != forward_needed(consumer, k).layout(vkey):
        return False
    grad = backward_held(consumer, k)
    return grad is None or grad.layout(vkey) == backward_needed(producer, out_index).layout(vkey)


def flat_arguments(node: fx.Node) -> bool:
    """Whether ``node``'s arguments are plain (no list of nodes, no node passed by keyword): what
    :class:`~primepar_fx.runtime.pending.DeferredGradients` can call ``node``'s op with."""
    if any(isinstance(a, (list, tuple, dict)) for a in (*node.args, *node.kwargs.values())):
        return False
    return not any(isinstance(a, fx.Node) for a in node.kwargs.values())
