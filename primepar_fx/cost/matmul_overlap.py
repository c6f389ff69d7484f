"""Collective matmul priced: the re-layouts the runtime overlaps with the linears beside them.

The runtime cuts a linear by rows next to a re-layout that moves whole rows
(:mod:`primepar_fx.runtime.collective_matmul`, put in the graph by
:func:`primepar_fx.passes.overlap.overlap_collective_matmuls`). The rules that say where, one for the pass and the
cost model alike:

* the layouts: every device holds and needs the whole last dim of the tensor, in both directions
  (:func:`rows_only`), so every piece the re-layout moves spans it;
* a gather (:func:`feeds_linears`): every reader of the producer's output is an ``aten.linear`` that reads it once,
  as its input (q, k and v of one norm; gate and up), and the producer has no Forward all-reduce of its own there
  (:func:`has_collective`); the consumer's input-gradient all-reduce, if it has one, is fused into the
  reduce-scatter;
* a scatter (:func:`linear_into`): the producer is an ``aten.linear`` read only by this consumer, its Forward
  all-reduce is fused into the reduce-scatter, and the gradient's way back is not a reduce-scatter.

The graph passes apply the same rules to the modules they find (:mod:`primepar_fx.passes.overlap`); the facts
about the graph come from the callers as :data:`Reader` rows, since the cost model does not read the graph.

What each hides, Eq. 7's ``max(compute, communication)`` for the part of a phase the schedule runs between a
message's start and its wait. A transfer of ``C`` seconds that has ``W`` seconds of compute beside it costs
``max(0, C - W)``, so the saving on the edge is ``min(C, W)``, times the spec's
:attr:`~primepar_fx.cost.cluster.ClusterSpec.matmul_overlap` (1 by default: the whole of it):

========================  ===========================================  =============================================
pair                      ``C``                                        ``W``
========================  ===========================================  =============================================
gather, Forward           the edge's Forward re-layout                 the consumer's Forward on the rows it holds
gather, Backward          the consumer's reduce-scatter of ``d_in``    its Backward on one group member's rows plus
                                                                       its Gradient (the weight's), after the last
                                                                       piece is sent
scatter, Forward          the producer's reduce-scatter                its Forward on its own rows, after the last
                                                                       piece is sent
scatter, Backward         the edge's Backward re-layout (the           its Backward and Gradient on the rows it holds
                          gradient's all-gather)
========================  ===========================================  =============================================

"The rows it holds" is the share of the needed block a device holds already (``1 - received / needed``, the
gather's own slab: ``1/g``). Where several linears read one gathered input the runtime runs all of them beside it;
each edge is priced with its own consumer's compute, and the re-layout is paid by the first consumer only
(:mod:`primepar_fx.cost.share`), so the saving priced is its consumer's alone: a lower bound. A recomputed Forward
runs the fused pairs again and hides the same (:attr:`OverlapSaving.forward_s`, :mod:`primepar_fx.levers.recompute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

from primepar_fx.cost.model import NodeCost
from primepar_fx.cost.redistribute import backward_held, forward_held, forward_needed, source_grad_needed
from primepar_fx.cost.scatter import ScatterSaving, performed_inside
from primepar_fx.partition import OpPartition, Phase, collectives
from primepar_fx.partition.enumerate import ValuesKey
from primepar_fx.partition.layouts import Layout

aten = torch.ops.aten
LINEAR = aten.linear.default


# ------------------------------------------------------------------------------------------------ the rules
def rows_only(*layouts: Layout | None) -> bool:
    """Whether every device holds (or needs) the whole last dim in each of ``layouts`` (``None``: no gradient)."""
    for lay in layouts:
        if lay is None or not lay or not lay[0]:
            continue
        end = max(b for rank in lay for _, b in rank[-1])
        if any(rank[-1] != ((0, end),) for rank in lay):
            return False
    return True


#: a reader of a tensor as the graph rules see it: its target and the names of its inputs, in order
Reader = tuple[object, Sequence[str | None]]


def feeds_linears(u: str, readers: Sequence[Reader]) -> bool:
    """Whether every one of ``readers`` (all the readers of ``u``) is an ``aten.linear`` that reads ``u`` once, as
    its input (not its weight)."""
    return bool(readers) and all(
        t is LINEAR and names and names[0] == u and list(names).count(u) == 1 for t, names in readers
    )


def linear_into(u: str, target: object, readers: Sequence[Reader]) -> bool:
    """Whether ``u`` (of ``target``) is an ``aten.linear`` whose one reader (``readers``) reads it once."""
    return target is LINEAR and len(readers) == 1 and list(readers[0][1]).count(u) == 1


def has_collective(part: OpPartition, target: object, tensor: str, phases: Sequence[Phase]) -> bool:
    """Whether ``part`` has a collective on ``tensor`` (``out0``, ``d_in1``, ...) that the graph runs as a node of
    its own (not one a local form performs inside)."""
    return any(
        c.tensor == tensor and c.phase in phases and not performed_inside(target, part.op, c) for c in collectives(part)
    )


# ------------------------------------------------------------------------------------------------ the saving
@dataclass(frozen=True)
class OverlapSaving:
    """Seconds an edge's overlapped pairs hide, per (producer, consumer) strategy pair (zero where none runs):

    * ``forward_relayout_s``: the gather's Forward re-layout, under the consumer's Forward;
    * ``consumer_s``: the consumer's reduce-scatter of its input gradient, under its Backward and Gradient;
    * ``producer_s``: the producer's reduce-scatter of its output, under its Forward;
    * ``backward_relayout_s``: the gradient's gather back to the producer, under the producer's Backward and
      Gradient.

    :attr:`forward_s` is what a recomputed Forward hides again."""

    forward_relayout_s: np.ndarray
    consumer_s: np.ndarray
    producer_s: np.ndarray
    backward_relayout_s: np.ndarray

    @property
    def seconds(self) -> np.ndarray:
        return self.forward_relayout_s + self.consumer_s + self.producer_s + self.backward_relayout_s

    @property
    def forward_s(self) -> np.ndarray:
        return self.forward_relayout_s + self.producer_s


@dataclass(frozen=True)
class EdgeSides:
    """One edge ``u -> v`` as :func:`overlap_saving` reads it: both ends' partitions, costs and targets, the tensor's
    indices and element size, and which rule's graph facts hold (:func:`feeds_linears`, :func:`linear_into`)."""

    producers: Sequence[OpPartition]
    producer_costs: Sequence[NodeCost]
    u_target: object
    out_index: int
    consumers: Sequence[OpPartition]
    consumer_costs: Sequence[NodeCost]
    v_target: object
    in_index: int
    gather: bool
    scatter: bool


def _mean_elems(lay: Layout) -> float:
    return sum(prod(sum(b - a for a, b in s) for s in rank) for rank in lay) / len(lay)


def _held_share(moved_bytes: np.ndarray, needed_elems: np.ndarray, world: int, item: int) -> np.ndarray:
    """Per pair, the share of its needed block a device already holds: ``1 - received / needed`` (means over
    devices)."""
    need = np.maximum(needed_elems * item * world, 1.0)
    return np.clip(1.0 - moved_bytes / need, 0.0, 1.0)


def overlap_saving(
    edge: EdgeSides,
    forward: tuple[np.ndarray, np.ndarray],
    backward: tuple[np.ndarray, np.ndarray],
    scatter: ScatterSaving | None,
    groups: tuple[np.ndarray, np.ndarray],
    vkey: ValuesKey,
    item: int,
    share: float = 1.0,
) -> OverlapSaving | None:
    """The saving of one edge (module docstring), or ``None`` where no pair overlaps. ``forward`` and ``backward``:
    the ``(seconds, bytes summed over devices)`` of each direction of its re-layout; ``scatter``: its
    reduce-scatter fusions; ``groups``: per producer and per consumer strategy, the group size of its fusable
    all-reduce (1 where none); ``share``: the fraction of the compute beside a transfer that hides it
    (:attr:`~primepar_fx.cost.cluster.ClusterSpec.matmul_overlap`)."""
    if not (edge.gather or edge.scatter) or share <= 0:
        return None
    pu, pv, k_out, k_in = edge.producers, edge.consumers, edge.out_index, edge.in_index
    world = pu[0].mesh.size
    rows_u = np.array([rows_only(forward_held(p, k_out).layout(vkey), _grad(p, k_out, vkey)) for p in pu])
    rows_v = np.array([rows_only(forward_needed(p, k_in).layout(vkey), _grad_held(p, k_in, vkey)) for p in pv])
    rows = rows_u[:, None] & rows_v[None, :]
    phase_u = np.array([c.phase_s for c in edge.producer_costs])
    phase_v = np.array([c.phase_s for c in edge.consumer_costs])
    shape = (len(pu), len(pv))
    zero = np.zeros(shape)
    fused_fwd = scatter.forward_scattered > 0 if scatter is not None else np.zeros(shape, bool)
    fused_bwd = scatter.backward_scattered > 0 if scatter is not None else np.zeros(shape, bool)
    gathered, consumer, producer, scattered = zero.copy(), zero.copy(), zero.copy(), zero.copy()
    if edge.gather:
        own = np.array([not has_collective(p, edge.u_target, f"out{k_out}", (Phase.FORWARD,)) for p in pu])
        reduced = np.array(
            [has_collective(p, edge.v_target, f"d_in{k_in}", (Phase.BACKWARD, Phase.GRADIENT)) for p in pv]
        )
        ok = rows & own[:, None] & (forward[1] > 0) & (~reduced[None, :] | fused_bwd)
        needed = np.array([_mean_elems(forward_needed(p, k_in).layout(vkey)) for p in pv])
        held = _held_share(forward[1], needed[None, :], world, item)
        gathered += np.where(ok, np.minimum(forward[0], held * phase_v[None, :, 0]), 0.0)
        if scatter is not None:
            after = phase_v[:, 1] / groups[1] + phase_v[:, 2]  # one member's rows of d_in, then the weight's
            consumer += np.where(ok & fused_bwd, np.minimum(scatter.backward_rs_s, after[None, :]), 0.0)
    if edge.scatter and scatter is not None:
        ok = rows & fused_fwd & ~fused_bwd
        producer += np.where(ok, np.minimum(scatter.forward_rs_s, (phase_u[:, 0] / groups[0])[:, None]), 0.0)
        needed = np.array([_mean_elems(source_grad_needed(p, k_out, False).layout(vkey)) for p in pu])
        held = _held_share(backward[1], needed[:, None], world, item)
        scattered += np.where(ok, np.minimum(backward[0], held * (phase_u[:, 1] + phase_u[:, 2])[:, None]), 0.0)
    found = tuple(a * share for a in (gathered, consumer, producer, scattered))
    if not any(a.any() for a in found):
        return None
    for a in found:
        a.flags.writeable = False
    return OverlapSaving(*found)


def _grad(p: OpPartition, k_out: int, vkey: ValuesKey) -> Layout:
    return source_grad_needed(p, k_out, False).layout(vkey)


def _grad_held(p: OpPartition, k_in: int, vkey: ValuesKey) -> Layout | None:
    use = backward_held(p, k_in)
    return None if use is None else use.layout(vkey)
