"""Explanations: what the graph is, and why a plan chose what it chose.

* :func:`explain_table` (``primepar-fx explain``): a per-node table of the captured graph and the size of its
  partition space.
* :func:`explain_choice`: why one node of a :class:`~primepar_fx.record.plan.Plan` got its partition. The node's legal
  sequences are priced with the plan's cost model (:func:`~primepar_fx.cost.model.node_cost`, Eq. 7) and with the
  redistribution to and from its neighbours (:func:`~primepar_fx.cost.model.edge_cost_matrix`, Eq. 8-9), every
  other node held at the plan's choice::

      objective(s) = node_time(s) + alpha * memory(s) + sum_{u -> n} edge(p_u, s) + sum_{n -> v} edge(s, p_v)

  This is exactly the change in the search's objective when node ``n`` alone switches to ``s``, so no alternative
  of a plan the search proved optimal (without a memory budget) is cheaper.

  An edge's cost in the priced graph is net of what fusing an all-reduce with the re-layout after it into a
  reduce-scatter saves (:mod:`primepar_fx.cost.scatter`). The parts of an :class:`Option` attribute that saving as
  :func:`~primepar_fx.pricing.summary.summarize` does for a plan: the re-layout counts whole in the redistribution, and
  the saving comes off the collectives of the node that runs the all-reduce: this node's (``collective_s``,
  ``node_s``, ``comm_bytes``) or a neighbour's (``neighbour_collective_s``). The objective is unchanged. What a
  reduce-scatter overlapped with a linear hides (:mod:`primepar_fx.cost.matmul_overlap`) is attributed the same way;
  what it hides of a re-layout stays off the redistribution.

This module is also callable: ``primepar_fx.explain(plan, node_name, graph=graph)`` is :func:`explain_choice`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy
from tabulate import tabulate

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.matmul_overlap import OverlapSaving
from primepar_fx.cost.model import NodeCost
from primepar_fx.cost.scatter import ScatterSaving
from primepar_fx.frontend.symbols import B, S, Shape
from primepar_fx.graph import OpGraph
from primepar_fx.levers.recompute import layer_pricing
from primepar_fx.partition import DeviceMesh, PartitionSeq, enumerate_sequences
from primepar_fx.planning.options import resolve_cluster
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.record.plan import MiB, Plan
from primepar_fx.rules.spec import OpDims
from primepar_fx.utils.tables import fold_repeats


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One row of ``primepar-fx explain``: a node, its op and shape, forward FLOPs and legal sequences."""

    name: str
    op: str
    shape: str
    flops: sympy.Expr
    sequences: int
    source: str


def fmt_shape(shape: Shape | None) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(str(s) for s in shape) + ")"


def fmt_count(x: float | int) -> str:
    x = float(x)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}" if x != int(x) else str(int(x))


@lru_cache(maxsize=4096)
def _count(op: OpDims, mesh: DeviceMesh, values: tuple[tuple[sympy.Symbol, int], ...], allow_prime: bool) -> int:
    return len(enumerate_sequences(op, mesh, values=dict(values) or None, allow_prime=allow_prime))


def explain_rows(
    graph: OpGraph, mesh: DeviceMesh, *, batch: int | None = None, seq: int | None = None, allow_prime: bool = True
) -> list[NodeRow]:
    values = tuple((sym, v) for sym, v in ((B, batch), (S, seq)) if v is not None)
    rows = []
    for node in graph.nodes.values():
        shape = node.out_shapes[0] if node.out_shapes else None
        rows.append(
            NodeRow(
                node.name,
                node.op,
                fmt_shape(shape),
                node.flops,
                _count(node.dims, mesh, values, allow_prime),
                node.source,
            )
        )
    return rows


def explain_table(
    graph: OpGraph,
    mesh: DeviceMesh,
    *,
    batch: int | None = None,
    seq: int | None = None,
    allow_prime: bool = True,
    tablefmt: str = "simple",
    fold: bool = False,
) -> str:
    """The table ``primepar-fx explain`` prints: node, op, symbolic shape, FLOPs, legal sequences, and totals.

    ``fold`` prints the copies of the longest repeated block of rows (identical layers) as one marker row, with a
    note under the table (:func:`~primepar_fx.utils.tables.fold_repeats`)."""
    rows = explain_rows(graph, mesh, batch=batch, seq=seq, allow_prime=allow_prime)
    subs = {k: v for k, v in ((B, batch), (S, seq)) if v is not None}
    concrete = len(subs) == 2

    def flops_cell(expr: sympy.Expr) -> str:
        if expr == 0:
            return "0"
        return fmt_count(float(expr.subs(subs))) if concrete else str(expr)

    body = [[r.name, r.op, r.shape, flops_cell(r.flops), r.sequences] for r in rows]
    note = None
    if fold:
        body, note = fold_repeats(body)
    total_flops = graph.total_flops()
    body.append(
        [
            "TOTAL",
            f"{len(rows)} nodes",
            f"{fmt_count(graph.param_count())} params",
            flops_cell(total_flops),
            sum(r.sequences for r in rows),
        ]
    )
    flops_head = f"FLOPs (fwd, B={batch}, S={seq})" if concrete else "FLOPs (fwd)"
    table = tabulate(body, headers=["node", "op", "shape", flops_head, "sequences"], tablefmt=tablefmt)
    if note is not None:
        table += f"\n\n{note}"
    head = (
        f"model {graph.name}: {len(rows)} compute nodes, world size {mesh.size} "
        f"(device digits {mesh.digits or '()'}), forward FLOPs {sympy.factor(total_flops)}"
    )
    return head + "\n" + table


# ---------------------------------------------------------------------------------------------- explain_choice
def price_plan(
    graph: OpGraph, plan: Plan, *, free: str | None = None, cluster: ClusterSpec | str | None = None
) -> PricedGraph:
    """``graph`` priced as ``plan`` prices it, every node pinned to the plan's partition except ``free``.

    ``free`` gets every legal sequence (the plan's own first among equals, added if the enumeration lacks it).
    ``cluster`` defaults to the plan's (a preset name or a spec file path). A plan's recomputed layers are priced
    with their recomputation (:mod:`~primepar_fx.levers.recompute`).
    """
    spec = resolve_cluster(cluster or plan.cluster)
    plan.check_model((n.name, n.op) for n in graph.nodes.values())
    mesh = DeviceMesh(tuple(plan.digits))
    chosen = plan.partitions()
    fixed = {n: s for n, s in chosen.items() if n != free}
    opts = plan.cost_options()

    def keep_chosen(_: str, seqs: list[PartitionSeq]) -> list[PartitionSeq]:
        return seqs if free is None or chosen[free] in seqs else [*seqs, chosen[free]]

    values = {B: plan.batch // plan.micro_batches, S: plan.seq}  # priced at the micro-batch, as the plan was
    priced = price_graph(
        graph,
        mesh,
        spec,
        values,
        opts,
        allow_prime=plan.search.allow_prime is not False,
        canonical=bool(plan.search.canonical),
        fixed=fixed,
        replicate_constants=False,  # every other node is pinned; the free one shows its whole space
        restrict=keep_chosen,
    )
    if plan.recompute is not None and plan.recompute.active:  # the plan's recomputed layers priced as it prices them
        layers = layer_pricing(graph, priced, values, opts)
        if layers is not None:
            priced = layers.apply(plan.recompute)
    return priced


@dataclass(frozen=True, slots=True)
class Option:
    """One partition of a node, priced with its neighbours held at the plan's choice (seconds per step; bytes
    per device and step)."""

    partition: str
    objective_s: float  # node_s + redistribution_s + neighbour_collective_s (+ alpha * memory)
    node_s: float  # Eq. 7: sum_t max(compute, ring) + collectives
    compute_s: float
    ring_s: float
    collective_s: float  # less what this node's all-reduces that become reduce-scatters save
    redistribution_s: float  # to and from the neighbours (Eq. 8-9), before any reduce-scatter saving; >= 0
    comm_bytes: int  # ring shifts and collectives (reduce-scatters counted as such)
    redistribution_bytes: int  # mean per device, to and from the neighbours
    memory_bytes: int
    chosen: bool = False
    #: the change in the neighbours' collective time (<= 0): their all-reduces that become reduce-scatters when
    #: this node takes this partition (a row-parallel producer's output all-reduce, for a sequence-split consumer)
    neighbour_collective_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why ``node`` got its partition: the chosen :class:`Option` and every alternative, cheapest first."""

    node: str
    op: str
    shape: str
    constant: bool  # gradient-free: the search runs it replicated
    plan: str  # one line about the plan
    why_not: str  # why the plan may pass over a cheaper alternative (forced, memory budget, not proven optimal)
    chosen: Option
    alternatives: tuple[Option, ...]

    @property
    def cheaper(self) -> tuple[Option, ...]:
        """Alternatives with a lower objective than the chosen one (none for an optimal, unconstrained plan)."""
        return tuple(o for o in self.alternatives if o.objective_s < self.chosen.objective_s * (1 - 1e-9))

    def reason(self) -> str:
        c = self.chosen
        if not self.alternatives:
            return f"{self.node} has no other legal partition on these devices."
        if self.constant:
            return f"{self.node} is gradient-free (mask, position table, labels): the search runs it replicated."
        if self.cheaper:
            best = self.cheaper[0]
            return (
                f"{len(self.cheaper)} alternative(s) are cheaper with the neighbours held fixed "
                f"(best {best.partition}, {_ms(c.objective_s - best.objective_s)} ms less): {self.why_not}."
            )
        best = self.alternatives[0]
        parts = {
            "compute and ring": (best.node_s - best.collective_s) - (c.node_s - c.collective_s),
            "collectives": (best.collective_s + best.neighbour_collective_s)
            - (c.collective_s + c.neighbour_collective_s),
            "redistribution": best.redistribution_s - c.redistribution_s,
        }
        what, gap = max(parts.items(), key=lambda kv: kv[1])
        return (
            f"{c.partition} is the cheapest with the neighbours held fixed; the runner-up {best.partition} costs "
            f"{_ms(best.objective_s - c.objective_s)} ms more, mostly {what} (+{_ms(gap)} ms)."
        )

    def table(self, top: int = 5, tablefmt: str = "simple") -> str:
        """The chosen partition first (marked ``*``), then the ``top`` cheapest alternatives."""
        shown = (self.chosen, *self.alternatives[:top])
        # a column for the neighbours' reduce-scatter savings only where a shown row has one
        neighbours = any(o.neighbour_collective_s for o in shown)
        rows = []
        for o in shown:
            delta = o.objective_s - self.chosen.objective_s
            row = [
                "*" if o.chosen else "",
                o.partition,
                _ms(o.objective_s),
                "" if o.chosen else f"{'+' if delta >= 0 else '-'}{_ms(abs(delta))}",
                _ms(o.node_s),
                _ms(o.collective_s),
            ]
            row += [_ms(o.neighbour_collective_s)] if neighbours else []
            row += [
                _ms(o.redistribution_s),
                f"{o.comm_bytes:,}",
                f"{o.redistribution_bytes:,}",
                f"{o.memory_bytes / MiB:.3f}",
            ]
            rows.append(row)
        head = ["", "partition", "objective ms", "vs chosen", "node ms", "collective ms"]
        head += ["neighbours' coll. ms"] if neighbours else []
        head += ["redistr. ms", "comm B", "redistr. B", "memory MiB"]
        return tabulate(rows, head, tablefmt=tablefmt, disable_numparse=True)

    def __str__(self) -> str:
        more = len(self.alternatives) - 5
        tail = f"\n... and {more} more alternative(s)" if more > 0 else ""
        head = f"{self.node} ({self.op}, output {self.shape}) in {self.plan}"
        return f"{head}\n{self.table()}{tail}\n{self.reason()}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def explain_choice(
    plan: Plan, node_name: str, *, graph: OpGraph, cluster: ClusterSpec | str | None = None
) -> Explanation:
    """Why ``plan`` gave ``node_name`` its partition (module docstring); ``print()`` the result for a table.

    ``graph`` is the model's :class:`OpGraph` (the plan stores partitions, not the model); ``cluster`` overrides the
    plan's cluster (needed when the plan was made from a spec file that is not at hand).

    The steps: price the node's every legal partition with the rest of the plan pinned (:func:`price_plan`), add
    up what its edges cost per partition (:func:`_edge_parts`), make each partition an :class:`Option`
    (:func:`_options`) and say what the plan was (:func:`_plan_line`, :func:`_why_not`).
    """
    _check_request(plan, node_name, graph)
    priced = price_plan(graph, plan, free=node_name, cluster=cluster)
    seqs, costs = priced.strategies[node_name], priced.node_costs[node_name]
    opts = plan.cost_options()
    parts = _edge_parts(priced, node_name, len(seqs), plan.world_size)
    options = _options(seqs, costs, parts, opts, plan.partitions()[node_name])
    chosen = next(o for o in options if o.chosen)
    others = sorted((o for o in options if not o.chosen), key=lambda o: (o.objective_s, o.partition))
    node = graph.nodes[node_name]
    return Explanation(
        node=node_name,
        op=node.op,
        shape=fmt_shape(node.out_shapes[0] if node.out_shapes else None),
        constant=not node.requires_grad,
        plan=_plan_line(plan),
        why_not=_why_not(plan),
        chosen=chosen,
        alternatives=tuple(others),
    )


def _check_request(plan: Plan, node_name: str, graph: OpGraph) -> None:
    if not isinstance(plan, Plan) or not isinstance(node_name, str):
        raise TypeError(
            f"explain_choice(plan, node_name, graph=...) takes a Plan and a node name, got {type(plan).__name__} "
            f"and {type(node_name).__name__}"
        )
    if node_name not in graph.nodes:
        raise KeyError(f"no node {node_name!r} in {graph.name}; nodes are e.g. {list(graph.nodes)[:5]}")


@dataclass(frozen=True, slots=True)
class _EdgeParts:
    """Per partition of the explained node, what its edges add (lists indexed by partition).

    ``edge_s`` are the edges' costs as the search sees them, net of reduce-scatter savings; ``redis_b`` the bytes
    they move, mean per device. The reduce-scatter savings (:mod:`primepar_fx.cost.scatter`) are attributed as
    :func:`~primepar_fx.pricing.summary.summarize` does, off the collectives of the node that runs the all-reduce
    (the producer in Forward, the consumer in Backward), not off the redistribution: ``own_s`` and ``own_b`` where
    that node is the explained one, ``others_s`` where it is a neighbour.
    """

    edge_s: list[float]
    redis_b: list[float]
    own_s: list[float]
    own_b: list[int]
    others_s: list[float]


def _edge_parts(priced: PricedGraph, node_name: str, count: int, world: int) -> _EdgeParts:
    """The :class:`_EdgeParts` of ``node_name`` (``count`` partitions) from a pricing that pins its neighbours."""
    parts = _EdgeParts([0.0] * count, [0.0] * count, [0.0] * count, [0] * count, [0.0] * count)
    pinned = dict.fromkeys(priced.strategies, 0)  # the neighbours are pinned: their only strategy is number 0
    for i in range(count):  # consumers that share another's re-layout (cost.share) skip their edge and all-reduce
        for skip in priced.not_run({**pinned, node_name: i}):
            if node_name not in (skip.u, skip.v, *priced.fanout.get(skip.u, ())):
                continue  # sharing between other nodes, whatever this one takes
            parts.edge_s[i] -= skip.relayout_s + (0.0 if skip.tied else skip.reduce_s)  # tied: already off the edge
            parts.redis_b[i] -= skip.relayout_bytes / world
            if skip.v == node_name:
                parts.own_s[i] += skip.reduce_s
                parts.own_b[i] += skip.reduce_bytes
            else:
                parts.others_s[i] += skip.reduce_s
    for (u, v), mat in priced.cost_graph.edge_cost.items():
        if node_name not in (u, v):
            continue
        nbytes = priced.edge_bytes[(u, v)]
        incoming = v == node_name
        sec, byt = (mat[0, :], nbytes[0, :]) if incoming else (mat[:, 0], nbytes[:, 0])
        sav, hidden = priced.scatter.get((u, v)), priced.overlap.get((u, v))
        for i in range(count):
            parts.edge_s[i] += float(sec[i])
            parts.redis_b[i] += float(byt[i]) / world
            if (sav is not None or hidden is not None) and not _skipped(priced, (u, v), pinned, node_name, i):
                ij = (0, i) if incoming else (i, 0)
                if sav is not None:
                    _attribute_saving(parts, i, sav, ij, (u, v), node_name)
                if hidden is not None:
                    _attribute_hidden(parts, i, hidden, ij, (u, v), node_name)
    return parts


def _skipped(priced: PricedGraph, edge: tuple[str, str], pinned: dict[str, int], node_name: str, i: int) -> bool:
    """Whether ``edge`` does not run when ``node_name`` takes partition ``i`` (it shares another's re-layout)."""
    u, v = edge
    return v in priced.shared_consumers({**pinned, node_name: i}).get(u, ())


def _attribute_saving(
    parts: _EdgeParts, i: int, sav: ScatterSaving, ij: tuple[int, int], edge: tuple[str, str], node_name: str
) -> None:
    """Add partition ``i``'s share of the saving ``sav`` of ``edge`` (at entry ``ij`` of its matrices) to the node
    that runs each all-reduce: the edge's producer in Forward, its consumer in Backward."""
    u, v = edge
    for owner, s_, b_, rs in (
        (u, sav.forward_s, sav.forward_bytes, sav.forward_scattered),
        (v, sav.backward_s, sav.backward_bytes, sav.backward_scattered),
    ):
        if not rs[ij]:
            continue
        if owner == node_name:
            parts.own_s[i] += float(s_[ij])
            parts.own_b[i] += int(b_[ij])
        else:
            parts.others_s[i] += float(s_[ij])


def _attribute_hidden(
    parts: _EdgeParts, i: int, hidden: OverlapSaving, ij: tuple[int, int], edge: tuple[str, str], node_name: str
) -> None:
    """Add partition ``i``'s share of what overlapping ``edge``'s reduce-scatters with a linear hides
    (:mod:`primepar_fx.cost.matmul_overlap`) to the node that runs each: the producer's in Forward, the consumer's
    in Backward (the re-layouts' share stays the edge's)."""
    u, v = edge
    for owner, seconds in ((u, hidden.producer_s), (v, hidden.consumer_s)):
        sec = float(seconds[ij])
        if not sec:
            continue
        if owner == node_name:
            parts.own_s[i] += sec
        else:
            parts.others_s[i] += sec


def _options(
    seqs: list[PartitionSeq], costs: list[NodeCost], parts: _EdgeParts, opts: CostOptions, chosen: PartitionSeq
) -> list[Option]:
    """One :class:`Option` per partition, in the pricing's order; ``chosen`` is the plan's."""
    options, m = [], opts.micro_batches  # priced at one of m micro-batches: m of them make the step
    for i, (seq, c) in enumerate(zip(seqs, costs)):
        memory = c.memory_bytes(opts)
        own_s = parts.own_s[i]
        options.append(
            Option(
                partition=str(seq),
                objective_s=m * (c.time_s + parts.edge_s[i]) + opts.alpha * memory,
                node_s=m * (c.time_s - own_s),
                compute_s=m * c.compute_s,
                ring_s=m * c.ring_s,
                collective_s=m * (c.collective_s - own_s),
                redistribution_s=m * (parts.edge_s[i] + own_s + parts.others_s[i]),
                comm_bytes=m * (sum(c.comm_bytes.values()) - parts.own_b[i]),
                redistribution_bytes=int(round(m * parts.redis_b[i])),
                memory_bytes=memory,
                chosen=seq == chosen,
                neighbour_collective_s=-m * parts.others_s[i] or 0.0,
            )
        )
    return options


def _plan_line(plan: Plan) -> str:
    """One line about the plan: model, devices, cluster, sizes, dtype, how it was made."""
    how = plan.search.forced or plan.search.method or "given"
    budget = plan.search.memory_budget
    return (
        f"plan for {plan.model} on {plan.world_size} devices {list(plan.digits)} of {plan.cluster} "
        f"(B={plan.batch}, S={plan.seq}, {plan.dtype}; {how}{f', memory budget {budget:.4g} B' if budget else ''})"
    )


def _why_not(plan: Plan) -> str:
    """Why the plan may pass over an alternative that is cheaper with the neighbours held fixed."""
    if plan.search.forced:
        return f"the plan was forced ({plan.search.forced!r}), not searched"
    if plan.search.memory_budget:
        return "the plan was searched under a memory budget, which the cheaper ones may exceed"
    if not plan.search.proven_optimal:
        return "the search did not prove its plan optimal"
    return "unexpected for a proven-optimal plan without a memory budget: was it priced on another cluster?"
