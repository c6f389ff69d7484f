"""A plan run as a pipeline: the graph's layers cut into stages, priced one micro-batch at a time and replayed under a
schedule (:func:`price_pipeline`).

The plan is one choice of strategies for the whole graph on the mesh of one stage (``world / stages`` devices), priced
at one micro-batch (``CostOptions.micro_batches``: what runs once a step is priced at ``1/m`` of a micro-batch). The
stages are contiguous runs of pieces (:func:`stage_pieces`: each layer of the stack, the nodes before it with the
first, the head and the loss with the last), cut where the slowest stage is fastest
(:func:`~primepar_fx.search.stages.balance_stages`). Per piece, per micro-batch:

* **Forward** is its nodes' Forward with its collectives and half of the re-layouts into them (a re-layout's gradient
  runs the other way in Backward); **Backward** is the rest of their priced time (input and weight gradients,
  recomputation, the gradient sums: priced at ``1/m`` a micro-batch, they are spread over the Backwards, which adds
  at most ``(p - 1) / m`` of them to the step next to running them once at its end);
* the **transfers** between stages are the tensors that cross the cut, each device's block of them in the
  consumer's layout, Forward's outputs forward and their gradients back, point to point on the link between the
  stages (:meth:`~primepar_fx.cost.cluster.ClusterSpec.shift_time`: stage ``s`` is the ranks ``s * q`` to
  ``(s + 1) * q - 1``, so the cut crosses nodes where a stage fills whole nodes);
* **memory**: a rank holds its stages' parameter state, its largest buffer, recomputation's lift, and each
  micro-batch's stashed activations from the start of its Forward to the end of its Backward, as many at once as
  the schedule's replay finds (:func:`~primepar_fx.cost.pipeline.replay`).

The step is the replay's seconds (bubble, warm-up and cool-down included).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from primepar_fx.cost.blocks import CostOptions, block_bytes
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.latency import ring_factors
from primepar_fx.cost.pipeline import INTERLEAVED, StageTimes, Timeline, step_time
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units
from primepar_fx.partition import OpPartition
from primepar_fx.partition.comm import collectives
from primepar_fx.partition.enumerate import ValuesKey
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.pricing.summary import node_seconds
from primepar_fx.search.stages import balance_stages


@dataclass(frozen=True, slots=True)
class PipelinePricing:
    """A plan priced as a pipeline (module docstring): ``stages`` ranks a replica, ``virtual`` stages a rank,
    ``starts``: the first piece of each of the ``stages * virtual`` stages, ``layers``: each one's layers."""

    stages: int
    schedule: str
    virtual: int
    micro_batches: int
    starts: tuple[int, ...]
    layers: tuple[int, ...]
    #: the step's seconds, and the share of it the ranks wait
    step_s: float
    bubble: float
    #: each rank's peak bytes (rank ``r`` runs stages ``r, r + stages, ...``)
    peak_bytes: tuple[int, ...]
    #: bytes one device sends point to point a step (the mean over the devices)
    p2p_bytes: int

    @property
    def peak(self) -> int:
        return max(self.peak_bytes)


def stage_pieces(graph: OpGraph) -> tuple[tuple[str, ...], ...] | None:
    """The pieces stages are cut from, in graph order: each layer of the stack, the nodes before the first layer
    with it and the nodes after the last with that; ``None`` for a graph without a layer stack."""
    kept = _PIECES.get(id(graph))
    if kept is not None and kept[0] is graph:
        return kept[1]
    units = layer_units(graph)
    pieces = None if units is None else _cut(units.units, tuple(graph.nodes))
    if len(_PIECES) >= 8:
        _PIECES.pop(next(iter(_PIECES)))
    _PIECES[id(graph)] = (graph, pieces)
    return pieces


#: the pieces of the last few graphs asked for, by id (with the graph, so an id reused is not read)
_PIECES: dict[int, tuple[OpGraph, tuple[tuple[str, ...], ...] | None]] = {}


def _cut(units: tuple[tuple[str, ...], ...], order: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    first, last = order.index(units[0][0]), order.index(units[-1][-1])
    pieces = list(units)
    pieces[0] = (*order[:first], *pieces[0])
    pieces[-1] = (*pieces[-1], *order[last + 1 :])
    return tuple(pieces)


@dataclass(frozen=True, slots=True)
class Crossing:
    """A tensor made in piece ``made`` and read in a later piece ``read``: the bytes of its block each device
    receives, in the layout of its first reader there, and of its gradient sent back (0 for a tensor without)."""

    made: int
    read: int
    forward: int
    backward: int


@dataclass(frozen=True, slots=True)
class PlanPieces:
    """One plan at one micro-batch, piece by piece (module docstring): what :func:`price_pipeline` cuts into
    stages."""

    #: Forward and Backward seconds of each piece
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    #: each piece's stashed activations, parameter state and largest buffer, bytes a device
    stash: tuple[int, ...]
    state: tuple[int, ...]
    buffer: tuple[int, ...]
    #: the tensors that leave their piece: per producer, its first reader in each later piece that reads it
    crossings: tuple[tuple[Crossing, ...], ...]
    #: devices of one stage
    devices: int

    def __len__(self) -> int:
        return len(self.forward)

    def cut_bytes(self, cut: int) -> tuple[int, int]:
        """The bytes one device receives of the tensors that cross from pieces before ``cut`` to pieces from it on,
        and of their gradients sent back (each tensor once, in its first reader's layout)."""
        forward = backward = 0
        for reads in self.crossings:
            if reads[0].made >= cut:
                continue
            first = next((c for c in reads if c.read >= cut), None)
            if first is not None:
                forward, backward = forward + first.forward, backward + first.backward
        return forward, backward


def plan_pieces(
    graph: OpGraph,
    priced: PricedGraph,
    choice: dict[str, int],
    costs: CostOptions,
    vkey: ValuesKey,
    seconds: dict[str, tuple[float, float]] | None = None,
    crossings: tuple[tuple[Crossing, ...], ...] | None = None,
) -> PlanPieces:
    """``choice`` on ``priced`` (one stage's mesh, one micro-batch), piece by piece (:func:`stage_pieces`).
    ``seconds`` (:func:`~primepar_fx.pricing.summary.node_seconds`) and ``crossings`` (:func:`crossings`), where
    the caller has them: variants of one choice that differ only in their training state share them."""
    pieces = stage_pieces(graph)
    if pieces is None:
        raise ValueError(f"{graph.name} has no stack of layers to cut into pipeline stages")
    if seconds is None:
        seconds = node_seconds(graph, priced, choice)
    forward, backward, stash, state, buffer = [], [], [], [], []
    for piece in pieces:
        f = b = 0.0
        held = kept = largest = 0
        for name in piece:
            c = priced.node_costs[name][choice[name]]
            step, redistribution = seconds[name]
            ahead = c.forward_s + redistribution / 2
            f, b = f + ahead, b + max(0.0, step - ahead)
            held, kept, largest = held + c.stash_bytes, kept + c.state_bytes(costs), max(largest, c.buffer_bytes)
        forward.append(f)
        backward.append(b)
        stash.append(held)
        state.append(kept)
        buffer.append(largest)
    if crossings is None:
        crossings = plan_crossings(graph, priced, choice, costs.itemsize, vkey)
    return PlanPieces(*map(tuple, (forward, backward, stash, state, buffer)), crossings, priced.mesh.size)


def plan_crossings(
    graph: OpGraph, priced: PricedGraph, choice: dict[str, int], itemsize: int, vkey: ValuesKey
) -> tuple[tuple[Crossing, ...], ...]:
    """The tensors of ``choice`` that leave their piece (:attr:`PlanPieces.crossings`), ``itemsize`` bytes an
    element."""
    pieces = stage_pieces(graph)
    assert pieces is not None
    piece_of = {n: i for i, piece in enumerate(pieces) for n in piece}
    found: dict[str, dict[int, Crossing]] = {}
    for name in graph.nodes:  # graph order: a piece's first reader comes first
        read = piece_of[name]
        for u, _, data in graph.graph.in_edges(name, data=True):
            made = piece_of[u]
            if made >= read or read in found.get(u, {}):
                continue
            node = graph.nodes[name]
            part = OpPartition(node.dims, priced.strategies[name][choice[name]], priced.mesh)
            nbytes = block_bytes(part, node.dims.inputs[data["dst_in"]], vkey, element_bytes(graph, u, itemsize))
            back = nbytes if graph.nodes[u].requires_grad else 0
            found.setdefault(u, {})[read] = Crossing(made, read, nbytes, back)
    return tuple(tuple(sorted(reads.values(), key=lambda c: c.read)) for reads in found.values())


def shared_parameter_bytes(
    graph: OpGraph,
    priced: PricedGraph,
    choice: dict[str, int],
    pp: PipelinePricing,
    vkey: ValuesKey,
    costs: CostOptions,
) -> int:
    """The bytes a device sends a step (the mean over the pipeline's devices) for the parameters that stages share
    (a tied embedding and head), which the plan, priced as one graph, sums once: each stage holding a copy beyond
    the first sums the copy's gradient over its replicas again (its first reader's sum), and the copies' ranks then
    sum them between them (an all-reduce over the pipeline ranks holding one). Under ZeRO-1 each copy beyond the
    first is also gathered again after the optimizer's step."""
    pieces = stage_pieces(graph)
    assert pieces is not None
    ends = [*pp.starts[1:], len(pieces)]
    chunk_of = {n: k for k, (a, z) in enumerate(zip(pp.starts, ends)) for piece in pieces[a:z] for n in piece}
    readers: dict[str, list[tuple[str, int]]] = {}
    for name, node in graph.nodes.items():  # graph order: the first reader first
        for fqn, index in zip(node.params, sorted(node.dims.weights)):
            readers.setdefault(fqn, []).append((name, index))
    mesh, q, total = priced.mesh, priced.mesh.size, 0.0
    for reads in readers.values():
        chunks = {chunk_of[n] for n, _ in reads}
        if len(chunks) < 2:
            continue
        first, index = reads[0]
        node = graph.nodes[first]
        part = OpPartition(node.dims, priced.strategies[first][choice[first]], mesh)
        block = block_bytes(part, node.dims.inputs[index], vkey, costs.itemsize)
        summed = next((c for c in collectives(part) if c.tensor == f"d_in{index}" and c.kind == "all-reduce"), None)
        group = 1 if summed is None else prod(mesh.digits[d] for d in summed.digits)
        again = ring_factors("all-reduce", group)[0] * block if group > 1 else 0.0
        if costs.zero and group > 1:
            again += ring_factors("all-gather", group)[0] * block
        holders = len({k % pp.stages for k in chunks})
        between = ring_factors("all-reduce", holders)[0] * block if holders > 1 else 0.0
        total += q * ((len(chunks) - 1) * again + holders * between)
    return round(total / (q * pp.stages))


def element_bytes(graph: OpGraph, name: str, itemsize: int) -> int:
    """Bytes an element of node ``name``'s output: a floating tensor's are the plan's ``itemsize``; a mask's or an
    index's, its own dtype's (an attention mask crosses as booleans)."""
    try:
        val = graph.fx_node(name).meta.get("val")
    except (AttributeError, KeyError):  # a graph without its capture
        return itemsize
    if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
        return val.dtype.itemsize
    return itemsize


def price_pipeline(
    pieces: PlanPieces,
    cluster: ClusterSpec,
    micro_batches: int,
    *,
    stages: int,
    schedule: str,
    virtual: int = 1,
    extra_peak: int = 0,
) -> PipelinePricing:
    """A plan, ``pieces`` at one of ``micro_batches`` micro-batches, run as a pipeline of ``stages`` ranks a
    replica, ``virtual`` stages a rank, under ``schedule`` (module docstring); ``extra_peak``: recomputation's lift
    of the peak."""
    m = micro_batches
    if virtual > 1 and schedule not in INTERLEAVED:
        raise ValueError(f"{schedule} runs one stage a rank, got {virtual} virtual stages (use Interleaved1F1B)")
    count = stages * virtual
    if count > len(pieces):
        raise ValueError(f"{stages} stages x {virtual} virtual stages need {count} layers; the graph has {len(pieces)}")
    starts = balance_stages([f + b for f, b in zip(pieces.forward, pieces.backward)], count)
    ends = [*starts[1:], len(pieces)]
    q = pieces.devices
    world = q * stages
    link = [(k - q) % world for k in range(world)]  # every rank hears from the rank a stage before it
    sends, moved = [], 0
    for cut in starts[1:]:
        ahead, back = pieces.cut_bytes(cut)
        sends.append(cluster.shift_time(max(ahead, back), link))
        moved += (ahead + back) * q * m
    state, buffers = [0] * stages, [0] * stages
    for s, (a, z) in enumerate(zip(starts, ends)):
        state[s % stages] += sum(pieces.state[a:z])
        buffers[s % stages] = max(buffers[s % stages], *pieces.buffer[a:z])
    times = StageTimes(
        tuple(sum(pieces.forward[a:z]) for a, z in zip(starts, ends)),
        tuple(sum(pieces.backward[a:z]) for a, z in zip(starts, ends)),
        tuple(sends),
        tuple(float(sum(pieces.stash[a:z])) for a, z in zip(starts, ends)),
    )
    line: Timeline = step_time(schedule, times, m, virtual)
    peaks = tuple(int(state[r] + buffers[r] + line.peak[r] + extra_peak) for r in range(stages))
    layers = tuple(z - a for a, z in zip(starts, ends))  # a piece is a layer
    return PipelinePricing(
        stages, schedule, virtual, m, tuple(starts), layers, line.seconds, line.bubble, peaks, round(moved / world)
    )
