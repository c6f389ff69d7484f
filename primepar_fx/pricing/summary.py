"""A plan's whole-plan figures and per-node rows, read back from a priced graph and a choice (:func:`summarize`),
and the same for a step of micro-batches (:func:`per_step`).

The step time is the sum of node times (Eq. 7) and edge times (Eq. 8-9); the peak memory per device is every
node's parameter state and stashed activations (all live at the end of Forward) plus the largest ring double
buffer (only one ring runs at a time); the communication is the bytes one device sends per step (collectives and
ring shifts, plus the mean per-device redistribution traffic).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.graph import OpGraph
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.record.levers import RECOMPUTE_KIND
from primepar_fx.record.plan import CostBreakdown, NodePlan, Predicted


@dataclass(frozen=True, slots=True)
class Summary:
    """A plan's whole-plan figures and its per-node rows, read back from a priced graph and a choice."""

    predicted: Predicted
    nodes: tuple[NodePlan, ...]


#: seconds below which a difference of prices is rounding, not time (a re-layout priced, then taken back)
ROUNDING_S = 1e-12


def _unrounded(seconds: float) -> float:
    """``seconds``, with a rounding residue just below zero read as 0 (a sum less its parts can land at -1e-22)."""
    return 0.0 if -ROUNDING_S < seconds < 0.0 else seconds


def summarize(
    graph: OpGraph,
    priced: PricedGraph,
    choice: dict[str, int],
    opts: CostOptions,
    *,
    nodes: bool = True,
    extra_peak: int = 0,
) -> Summary:
    """Per-node cost breakdowns and the whole-plan prediction of one choice of strategies; with ``nodes=False``
    the prediction only (the same numbers; ``Summary.nodes`` is empty), which is all a baseline that is not
    kept needs. ``extra_peak``: how far recomputation in Backward lifts the peak above the end of Forward
    (:meth:`~primepar_fx.levers.recompute.LayerPricing.extra_peak`)."""
    world = priced.mesh.size
    adj = _Adjustments.of(graph, priced, choice)
    plans, total_s, static, buffers, comm = [], 0.0, 0, 0, 0.0
    for name, node in graph.nodes.items():
        c = priced.node_costs[name][choice[name]]
        step_s = adj.step_s(name, c.time_s)
        total_s += step_s
        static += c.held_state_bytes(opts) + c.stash_bytes
        buffers = max(buffers, c.buffer_bytes)
        moved = (
            adj.saved[name]
            + adj.unshared[name]
            + adj.resaved[name]
            + adj.ungathered.get(name, 0)
            - adj.rereduced.get(name, 0)
        )
        comm += sum(c.comm_bytes.values()) - moved + adj.redis_bytes[name] / world
        if not nodes and 0.0 <= step_s < math.inf:
            continue  # (a node whose time is not a finite number of seconds gets CostBreakdown's error below)
        cost = CostBreakdown(
            compute_s=c.compute_s,
            ring_s=c.ring_s,
            collective_s=_unrounded(c.collective_s - adj.saved_s[name] - adj.unshared_s[name]),
            redistribution_s=_unrounded(adj.redis_s[name]),
            memory_bytes=c.memory_bytes(opts),
            comm_bytes=adj.kinds(name, c.comm_bytes, world),
            step_s=step_s,
            phase_s={"forward": c.phase_s[0], "backward": c.phase_s[1], "gradient": c.phase_s[2]},
        )
        plans.append(NodePlan(name, node.op, str(priced.strategies[name][choice[name]]), cost))
    peak = int(static + buffers + extra_peak)
    return Summary(Predicted(total_s, peak, int(round(comm))), tuple(plans if nodes else ()))


@dataclass
class _Adjustments:
    """Per node, what the edges and savings of a choice add to or take from its own costs: re-layouts into it
    (``redis_*``), all-reduces fused into reduce-scatters (``saved*``, ``scattered``: reported on the node that runs
    the collective), all-reduces of consumers that share the first consumer's re-layout (``unshared*``: they do not
    run), recomputed all-reduces that run again as reduce-scatters (``resaved``), and reduce-scatters hidden under
    a linear (``saved_s`` too)."""

    redis_s: dict[str, float]
    redis_bytes: dict[str, int]
    saved_s: dict[str, float]
    saved: dict[str, int]
    scattered: dict[str, int]
    unshared_s: dict[str, float]
    unshared: dict[str, int]
    resaved: dict[str, int]
    sharing: set[tuple[str, str]]
    #: readers of a tied parameter that no bucket holds (pricing.priced.Apart): their ZeRO all-gathers' bytes that
    #: do not run, their gradient all-reduces' that run every micro-batch
    ungathered: dict[str, int] = dataclasses.field(default_factory=dict)
    rereduced: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, graph: OpGraph, priced: PricedGraph, choice: dict[str, int]) -> _Adjustments:
        zeros, nothing = dict.fromkeys(graph.nodes, 0), dict.fromkeys(graph.nodes, 0.0)
        adj = cls(dict(nothing), dict(zeros), dict(nothing), dict(zeros), dict(zeros), dict(nothing), dict(zeros),
                  dict(zeros), set())  # fmt: skip
        adj.add_not_run(priced, choice)
        adj.add_apart(priced, choice)
        adj.add_scattered(priced, choice)
        adj.add_rescattered(priced, choice)
        adj.add_overlapped(priced, choice)
        for (u, v), d in priced.deferred.items():  # off the edge's cost: report it as the consumer's all-reduce's
            seconds = float(d.seconds[choice[u], choice[v]])
            adj.saved_s[v] += seconds
            adj.redis_s[v] += seconds
        for (u, v), mat in priced.cost_graph.edge_cost.items():
            adj.redis_s[v] += float(mat[choice[u], choice[v]])
            adj.redis_bytes[v] += int(priced.edge_bytes[(u, v)][choice[u], choice[v]])
        return adj

    def step_s(self, name: str, own_s: float) -> float:
        """Node ``name``'s seconds in the plan: its own ``own_s`` with what the edges and savings add or take."""
        return _unrounded(own_s - self.saved_s[name] - self.unshared_s[name] + self.redis_s[name])

    def add_not_run(self, priced: PricedGraph, choice: dict[str, int]) -> None:
        """Consumers that share the first consumer's re-layout (cost.share): their edge and input all-reduces."""
        for skip in priced.not_run(choice):
            self.unshared_s[skip.v] += skip.reduce_s
            self.unshared[skip.v] += skip.reduce_bytes
            if skip.tied:  # a tied parameter's: the edge cost has the all-reduce's seconds off; report them here
                self.redis_s[skip.v] += skip.reduce_s
                continue
            self.sharing.add((skip.u, skip.v))
            self.redis_s[skip.v] -= skip.relayout_s
            self.redis_bytes[skip.v] -= skip.relayout_bytes

    def add_apart(self, priced: PricedGraph, choice: dict[str, int]) -> None:
        """Readers of a tied parameter that do not share (pricing.priced.Apart): the edge cost has their seconds;
        reported as collective time and bytes of the reader."""
        for name, v, seconds, gathered, reduced in priced.apart(choice):
            self.unshared_s[name] -= seconds
            self.redis_s[v] -= seconds
            self.ungathered[name] = self.ungathered.get(name, 0) + gathered
            self.rereduced[name] = self.rereduced.get(name, 0) + reduced

    def add_scattered(self, priced: PricedGraph, choice: dict[str, int]) -> None:
        """An all-reduce fused into a reduce-scatter (cost.scatter): the edge cost has its saving subtracted; it is
        reported on the node that runs the collective, as seconds and bytes moved from all-reduce to
        reduce-scatter."""
        for (u, v), sav in priced.scatter.items():
            if (u, v) in self.sharing:
                continue
            i, j = choice[u], choice[v]
            for owner, sec, nbytes, rs in (
                (u, sav.forward_s, sav.forward_bytes, sav.forward_scattered),
                (v, sav.backward_s, sav.backward_bytes, sav.backward_scattered),
            ):
                if rs[i, j]:
                    self.saved_s[owner] += float(sec[i, j])
                    self.redis_s[v] += float(sec[i, j])
                    self.saved[owner] += int(nbytes[i, j])
                    self.scattered[owner] += int(rs[i, j])

    def add_rescattered(self, priced: PricedGraph, choice: dict[str, int]) -> None:
        """A recomputed all-reduce that runs again as a reduce-scatter (and, overlapped with its producer's Forward,
        hidden again: cost.matmul_overlap)."""
        for (u, v), sav in priced.rescattered.items():
            if (u, v) in self.sharing:
                continue
            i, j = choice[u], choice[v]
            if sav.forward_scattered[i, j]:  # (less the bias's ZeRO-3 gather again)
                sec = float(sav.forward_s[i, j] + sav.forward_bias_s[i, j] - sav.forward_regather_s[i, j])
                overlap = priced.overlap.get((u, v))  # hidden again under the Forward that runs again
                sec += float(overlap.producer_s[i, j]) if overlap is not None else 0.0
                self.saved_s[u] += sec
                self.redis_s[v] += sec
                self.resaved[u] += int(sav.forward_bytes[i, j] + sav.forward_bias_bytes[i, j])
                self.resaved[u] -= int(sav.forward_regather_bytes[i, j])

    def add_overlapped(self, priced: PricedGraph, choice: dict[str, int]) -> None:
        """Re-layouts overlapped with linears (cost.matmul_overlap): the edge cost has the seconds hidden subtracted; a
        reduce-scatter's are reported as less collective time of the node that runs it (the edge's own re-layout's
        stay less redistribution time on the consumer)."""
        for (u, v), sav in priced.overlap.items():
            if (u, v) in self.sharing:
                continue
            i, j = choice[u], choice[v]
            for owner, sec in ((u, float(sav.producer_s[i, j])), (v, float(sav.consumer_s[i, j]))):
                if sec:
                    self.saved_s[owner] += sec
                    self.redis_s[v] += sec

    def kinds(self, name: str, comm_bytes: dict[str, int], world: int) -> dict[str, int]:
        """Node ``name``'s bytes sent by kind, its own ``comm_bytes`` adjusted."""
        kinds = dict(comm_bytes)
        scattered, unshared, resaved = self.scattered[name], self.unshared[name], self.resaved[name]
        if scattered:  # all-reduces that became reduce-scatters (plus a bias gradient's all-reduce)
            kinds["all-reduce"] = kinds.get("all-reduce", 0) - self.saved[name] - scattered
            kinds["reduce-scatter"] = kinds.get("reduce-scatter", 0) + scattered
        if unshared:  # input-gradient all-reduces done once, by the first consumer of a shared re-layout
            reduced = min(unshared, kinds.get("all-reduce", 0))  # (a tied parameter's, with ZeRO stage 1:
            kinds["all-reduce"] = kinds.get("all-reduce", 0) - reduced  # and its all-gather after the step)
            if unshared > reduced:
                kinds["all-gather"] = kinds.get("all-gather", 0) - (unshared - reduced)
        if resaved:
            kinds[RECOMPUTE_KIND] -= resaved
        ungathered, rereduced = self.ungathered.get(name, 0), self.rereduced.get(name, 0)
        if ungathered:
            kinds["all-gather"] -= ungathered
        if rereduced:
            kinds["all-reduce"] = kinds.get("all-reduce", 0) + rereduced
        if scattered or unshared or resaved or ungathered:
            kinds = {k: v for k, v in kinds.items() if v}
        if self.redis_bytes[name]:
            kinds["redistribution"] = self.redis_bytes[name] // world
        return kinds


def node_seconds(graph: OpGraph, priced: PricedGraph, choice: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Per node, its seconds in the plan and the re-layouts' share of them: the ``step_s`` and
    ``redistribution_s`` of :func:`summarize`'s rows, without building the rows."""
    adj = _Adjustments.of(graph, priced, choice)
    return {
        name: (adj.step_s(name, priced.node_costs[name][choice[name]].time_s), _unrounded(adj.redis_s[name]))
        for name in graph.nodes
    }


def per_step(summary: Summary, m: int) -> Summary:
    """A summary priced at one of ``m`` micro-batches, as the whole step: every node's seconds and bytes ``m``
    times (what runs once a step was priced at ``1/m`` a micro-batch); the peak is one micro-batch's."""
    if m == 1:
        return summary
    p = summary.predicted
    predicted = Predicted(p.step_time_s * m, p.peak_memory_bytes, p.comm_bytes * m)
    nodes = []
    for n in summary.nodes:
        c = n.cost
        cost = dataclasses.replace(
            c,
            compute_s=c.compute_s * m,
            ring_s=c.ring_s * m,
            collective_s=c.collective_s * m,
            redistribution_s=c.redistribution_s * m,
            comm_bytes={k: v * m for k, v in c.comm_bytes.items()},
            step_s=c.step_s * m,
            phase_s={k: v * m for k, v in c.phase_s.items()},
        )
        nodes.append(dataclasses.replace(n, cost=cost))
    return Summary(predicted, tuple(nodes))
