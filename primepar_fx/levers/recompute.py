"""Activation recomputation: priced per layer by the cost model and chosen by the search with the partitions.

Each layer of the graph's layer stack (:mod:`primepar_fx.graph.layers`) runs in one of three modes:

* ``none``: every node keeps what its Backward needs (the cost model's stash).
* ``selective``: the layer's attention scores (tensors with two sequence dims: ``Q K^T``, its softmax and dropout)
  are not kept: the run of nodes from the first that makes them to the last that reads them is checkpointed
  (Megatron-LM's selective recomputation). A layer whose attention is one fused op
  (``scaled_dot_product_attention`` keeps no score matrix) has nothing to recompute this way, and ``selective``
  is then not offered.
* ``full``: the whole layer is checkpointed (non-reentrant checkpointing at run time, :mod:`passes.recompute`).

A checkpointed run keeps only the tensors that enter it; Backward runs its Forward again first, collectives and
ring transfers included, up to the last node that keeps a tensor for Backward (PyTorch's checkpoint stops
there, so the collectives after that node and the nodes after it do not run again).

Pricing, per node and strategy like everything else in the cost model:

* time: a node that runs again adds its Forward seconds (:attr:`~primepar_fx.cost.model.NodeCost.forward_s`) to
  its Backward (the last one its compute and ring only); a re-layout into a node that runs again (but the run's
  first, whose re-layouts run before the checkpoint) adds the seconds and bytes of its Forward direction (the
  re-layout of the gradient runs once either way), less what fusing the producer's all-reduce into a
  reduce-scatter saves when that all-reduce runs again too; a re-layout shared by several consumers runs again
  once, with its first consumer (the edge flows carry the Forward direction, so the sharing prices it so);
* bytes sent: the Forward bytes sent again, under the kind ``"recomputation"``;
* memory: a node of a checkpointed run keeps, instead of its stash, the blocks of the tensors entering the run
  that it is the first to read;
* the peak is the real peak of the step, not a sum (:meth:`LayerPricing.extra_peak`): Backward visits the
  layers last to first, freeing each one's activations, and a recomputed layer's activations come back while its
  Backward runs; the peak is the larger of the end of Forward and each of those moments.

The layers recomputed in full are the first ``k`` (Megatron-LM's "block" method: the earliest layers keep their
activations longest). :func:`choose_recompute` picks the mode with the search: no recomputation when the fastest
plan fits; otherwise the fastest feasible plan of ``none``, ``selective``, and ``full`` on the first ``k``
layers for ``k`` the fewest that can fit, then twice as many, and so on up to all of them (recomputing more
layers costs time but frees memory for faster partitions).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import sympy

from primepar_fx.cost.blocks import CostOptions, block_bytes
from primepar_fx.cost.model import NodeCost, checkpoint_stop
from primepar_fx.cost.scatter import ScatterSaving
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import LayerUnits, layer_units, selective_nodes, unit_inputs
from primepar_fx.levers.choices import check_choice
from primepar_fx.levers.peak import least_peak, least_plan, plan_peak, ring_buffers, solve_for_peak
from primepar_fx.partition import PartitionSeq
from primepar_fx.partition.enumerate import values_key
from primepar_fx.partition.layouts import bound_partition
from primepar_fx.pricing.price import node_key, out_index, tensor_itemsize
from primepar_fx.pricing.priced import PricedGraph, ShareFlow, frozen
from primepar_fx.pricing.sharing import complete_choice
from primepar_fx.record.levers import RECOMPUTE_KIND, Recompute
from primepar_fx.search import CutOff, InfeasibleBudget, Solution
from primepar_fx.search.problem import evaluate
from primepar_fx.utils.fewest import fewest

log = logging.getLogger(__name__)


class LayerPricing:
    """What each mode costs and saves, per node of the stack and strategy, on one priced graph."""

    def __init__(
        self,
        graph: OpGraph,
        priced: PricedGraph,
        units: LayerUnits,
        values: dict[sympy.Symbol, int],
        opts: CostOptions,
    ) -> None:
        self.graph, self.priced, self.units, self.opts = graph, priced, units, opts
        self.vkey = values_key(values)
        order = list(graph.nodes)
        first, last = order.index(units.units[0][0]), order.index(units.units[-1][-1])
        self.prefix, self.post = order[:first], order[last + 1 :]
        self.runs = {"full": list(units.units), "selective": [selective_nodes(graph, u) for u in units.units]}
        self._how: dict[tuple[str, int], dict[str, tuple[str, list[tuple[str, int]]]]] = {}
        self._memo: dict[tuple, list[NodeCost]] = {}
        self._edges: dict[tuple, tuple] = {}  # _edge_again's, by the ids of its arrays
        self._applied: tuple[Recompute, PricedGraph] | None = None  # apply's last

    def __getstate__(self) -> dict:
        """Pickled (what a worker process sends back: :mod:`~primepar_fx.planning.workers`) without the graph, which
        does not pickle, and without the memos, rebuilt as read; the receiver gives it the graph again
        (:meth:`attach`) before reading it."""
        state = dict(self.__dict__)
        state["graph"] = None
        state["_how"], state["_memo"], state["_edges"], state["_applied"] = {}, {}, {}, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def attach(self, graph: OpGraph) -> None:
        """Give an unpickled copy its graph again (the one it was priced from, as the receiver holds it)."""
        if self.graph is not None and self.graph is not graph:
            raise ValueError("attach: this recomputation pricing has another graph already")
        self.graph = graph

    @property
    def selective_differs(self) -> bool:
        return any(self.runs["selective"])

    def how(self, mode: str, layer: int) -> dict[str, tuple[str, list[tuple[str, int]]]]:
        """Node of the run ``mode`` checkpoints in ``layer`` -> (what of its Forward runs again: ``"all"``,
        ``"compute"`` or ``""``, and the inputs ``(producer, index)`` entering the run that it keeps).

        Backward recomputes a checkpointed run only up to the last node that keeps a tensor for Backward
        (PyTorch's checkpoint stops there): that node's compute and ring run again but not the collectives after
        it, and the nodes after it not at all.
        """
        if (mode, layer) not in self._how:
            run = self.runs[mode][layer]
            keep: dict[str, list[tuple[str, int]]] = {v: [] for v in run}
            for u, v, k in unit_inputs(self.graph, run):
                keep[v].append((u, k))
            last = checkpoint_stop(self.graph.nodes, run)
            self._how[(mode, layer)] = {
                n: ("all" if i < last else "compute" if i == last else "", keep[n]) for i, n in enumerate(run)
            }
        return self._how[(mode, layer)]

    def _input_bytes(self, name: str, inputs: list[tuple[str, int]]) -> list[int]:
        """Per strategy of ``name``: the bytes of its blocks of inputs ``(producer, index)``."""
        node, priced = self.graph.nodes[name], self.priced
        key = ("in", node_key(node), id(priced.strategies[name]), tuple(k for _, k in inputs))
        if key not in self._memo:
            items = [tensor_itemsize(self.graph.fx_node(u), out_index(node), self.opts) for u, _ in inputs]
            out = []
            for seq in priced.strategies[name]:
                part = bound_partition((node.dims, seq, priced.mesh))
                out.append(
                    sum(block_bytes(part, node.dims.inputs[k], self.vkey, it) for (_, k), it in zip(inputs, items))
                )
            self._memo[key] = out  # type: ignore[assignment]
        return self._memo[key]  # type: ignore[return-value]

    def _adjusted(self, name: str, again: str, keep: list[tuple[str, int]]) -> list[NodeCost]:
        """``name``'s costs in a checkpointed run: its stash replaced by the run's inputs it keeps, and its Forward
        (``again``: all of it, its compute and ring only, or none) added to Backward."""
        node, costs = self.graph.nodes[name], self.priced.node_costs[name]
        key = (node_key(node), id(costs), again, tuple(k for _, k in keep))
        if key not in self._memo:
            kept = self._input_bytes(name, keep) if keep else [0] * len(costs)
            out = []
            for c, kb in zip(costs, kept):
                comm = dict(c.comm_bytes)
                if again:  # Backward runs Forward again first
                    f, b, g = c.phase_s
                    coll_s = c.forward_collective_s if again == "all" else 0.0
                    resent = c.forward_bytes if again == "all" else c.forward_ring_bytes
                    if resent:
                        comm[RECOMPUTE_KIND] = comm.get(RECOMPUTE_KIND, 0) + resent
                    c = dataclasses.replace(
                        c,
                        phase_s=(f, b + f, g),
                        compute_s=c.compute_s + c.forward_compute_s,
                        ring_s=c.ring_s + c.forward_ring_s,
                        collective_s=c.collective_s + coll_s,
                    )
                if c.recompute_gather_bytes:  # ZeRO-3: the layer gathers every weight it reads before it runs again
                    comm["all-gather"] = comm.get("all-gather", 0) + c.recompute_gather_bytes
                    c = dataclasses.replace(c, collective_s=c.collective_s + c.recompute_gather_s)
                out.append(dataclasses.replace(c, stash_bytes=kb, comm_bytes=comm))
            self._memo[key] = out
        return self._memo[key]

    def _edge_again(
        self, u: str, v: str, how: Mapping[str, tuple[str, list]], seconds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, ScatterSaving | None, ShareFlow | None]:
        """Edge ``(u, v)``'s seconds and bytes when ``v`` runs again: plus its re-layout's Forward direction; where
        ``u``'s all-reduce runs again too and fuses with it into a reduce-scatter, the seconds less what the fusion
        saves, and that saving (:attr:`~primepar_fx.pricing.priced.PricedGraph.rescattered`: the summary takes the
        bytes off ``u``'s recomputation); and the edge's flow with the same arrays, when the edge's were its flow's
        (a re-layout that several consumers share runs again once, before the first of them: the flows say which
        consumers share it, :mod:`primepar_fx.pricing.sharing`). An edge that re-lays out a tied parameter (no
        data flow) adds half of both directions."""
        priced = self.priced
        flow = priced.flows.get((u, v))
        if flow is None:
            return seconds * 1.5, priced.edge_bytes[(u, v)] * 3 // 2, None, None
        saving = priced.scatter.get((u, v))
        if not (saving is not None and how.get(u, ("",))[0] == "all"):
            saving = None
        overlap = priced.overlap.get((u, v))  # the Forward that runs again overlaps as the first did
        nbytes = priced.edge_bytes[(u, v)]
        # identical layers' edges share their arrays, and so do the results (the search sees them alike)
        key = (id(seconds), id(nbytes), id(flow), id(saving), id(overlap))
        if key not in self._edges:
            fs = flow.forward_s
            if saving is not None:  # runs again as a reduce-scatter (its bias's gradient sum does not run again;
                # at ZeRO-3 its bias is gathered again)
                fs = fs - (saving.forward_s + saving.forward_bias_s - saving.forward_regather_s)
            if overlap is not None:  # the gather under v's Forward; u's reduce-scatter under u's, if it runs again
                fs = fs - overlap.forward_relayout_s - (overlap.producer_s if saving is not None else 0.0)
            again = (frozen(seconds + fs), frozen(nbytes + flow.forward_bytes, np.int64))
            ours = seconds is flow.seconds and nbytes is flow.nbytes
            self._edges[key] = (*again, dataclasses.replace(flow, seconds=again[0], nbytes=again[1]) if ours else None)
        seconds, nbytes, new = self._edges[key]
        return seconds, nbytes, saving, new

    def apply(self, policy: Recompute) -> PricedGraph:
        """The priced graph with ``policy``'s layers recomputed (the same object when nothing is). The last policy's
        is kept: a policy's fastest plan and then its budgeted search read the same one (and so its search graph
        and :meth:`~primepar_fx.pricing.priced.PricedGraph.fastest`), and only one is held at a time."""
        if not policy.active:
            return self.priced
        if self._applied is None or self._applied[0] != policy:
            self._applied = (policy, self._apply(policy))
        return self._applied[1]

    def _apply(self, policy: Recompute) -> PricedGraph:
        priced, cg = self.priced, self.priced.cost_graph
        node_costs = dict(priced.node_costs)
        node_cost, node_memory = dict(cg.node_cost), dict(cg.node_memory or {})
        keys = dict(cg.node_key or {})
        edge_cost, edge_bytes = dict(cg.edge_cost), dict(priced.edge_bytes)
        rescattered: dict[tuple[str, str], ScatterSaving] = {}
        flows = dict(priced.flows)
        vectors: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i, mode in enumerate(policy.layers):
            if mode == "none":
                continue
            how = self.how(mode, i)
            for n, (again, keep) in how.items():
                costs = self._adjusted(n, again, keep)
                if id(costs) not in vectors:
                    vectors[id(costs)] = (
                        frozen([c.time_s for c in costs]),
                        frozen([float(c.memory_bytes(self.opts)) for c in costs]),
                    )
                node_costs[n] = costs
                node_cost[n], node_memory[n] = vectors[id(costs)]
                if n in keys:
                    keys[n] = (keys[n], mode)
            rerun = {n for n, (again, _) in how.items() if again}
            first = self.runs[mode][i][0] if rerun else None
            if rerun:
                for (u, v), m in cg.edge_cost.items():
                    if v in rerun and v != first:
                        edge_cost[(u, v)], edge_bytes[(u, v)], saving, flow = self._edge_again(u, v, how, m)
                        if saving is not None:
                            rescattered[(u, v)] = saving
                        if flow is not None:
                            flows[(u, v)] = flow
        graph = cg.derive(node_cost=node_cost, edge_cost=edge_cost, node_memory=node_memory, node_key=keys or None)
        return dataclasses.replace(
            priced,
            cost_graph=graph,
            node_costs=node_costs,
            edge_bytes=edge_bytes,
            rescattered=rescattered,
            flows=flows,
        )

    def extra_peak(self, policy: Recompute, applied: PricedGraph, choice: Mapping[str, int]) -> int:
        """How far the step's real peak lies above the end of Forward (0 when it is there), for ``choice``.

        Backward runs the nodes after the stack, then the layers last to first; when it reaches layer ``i`` the
        activations of the nodes after the stack and of the layers after ``i`` are freed, and a recomputed layer's
        activations are back: the whole stash of the run it checkpoints.
        """
        if not policy.active:
            return 0
        base = self.priced.node_costs

        def kept(n: str) -> int:
            return applied.node_costs[n][choice[n]].stash_bytes

        def gathered(n: str) -> int:
            c = base[n][choice[n]]
            return 0 if self.opts.zero != 3 or c.shard_bytes is None else c.param_bytes - c.shard_bytes

        freed = sum(kept(n) for n in self.post)
        worst = 0
        for i in reversed(range(len(policy.layers))):
            mode = policy.layers[i]
            if mode != "none":  # the run's whole stash is back (its kept inputs among it: an upper bound), and
                back = sum(base[n][choice[n]].stash_bytes for n in self.runs[mode][i])  # ZeRO-3 gathers all
                back += sum(gathered(n) for n in self.runs[mode][i])  # of its parameters before it runs again
                worst = max(worst, back - freed)
            freed += sum(kept(n) for n in self.units.units[i])
        return max(0, worst)


def layer_pricing(
    graph: OpGraph, priced: PricedGraph, values: dict[sympy.Symbol, int], opts: CostOptions
) -> LayerPricing | None:
    """The recomputation pricing of ``graph``'s stack, or ``None`` when it has no layer stack."""
    units = layer_units(graph)
    return None if units is None else LayerPricing(graph, priced, units, values, opts)


@dataclass
class Chosen:
    """A solution with the recomputation it was found under."""

    solution: Solution
    priced: PricedGraph
    recompute: Recompute | None
    extra_peak: int = 0
    #: the recomputation pricing ``priced`` was applied from (its ``priced`` is the pricing before), where a policy
    #: is active: what :func:`restricted` prices a subspace from
    layers: LayerPricing | None = None

    def attach(self, graph: OpGraph) -> None:
        """Give an unpickled plan's recomputation pricing its graph again (it travels without: a worker's plan)."""
        if self.layers is not None:
            self.layers.attach(graph)


def _solve_policy(
    layers: LayerPricing,
    policy: Recompute,
    budget: float | None,
    alpha: float,
    method: str,
    cutoff: float = math.inf,
) -> Chosen:
    """The fastest plan under ``policy`` whose real peak fits ``budget``: the search's budget is lowered by the
    extra peak of Backward's recomputation until the plan it returns fits (at most :data:`RESERVE_ROUNDS` rounds),
    else the plan of least memory if it fits; :class:`InfeasibleBudget` with that plan's real peak when it does
    not; :class:`~primepar_fx.search.CutOff` when no plan within the budget is cheaper than ``cutoff``.

    A round that overshoots lowers the search's budget by the overshoot, and at least to below that plan's own
    reported peak: a budget the plan still meets could return it again (a search's plans change in steps, so
    shaving the overshoot alone can take many rounds to leave a plan that misses by a MiB)."""
    applied = layers.apply(policy)
    reserve = 0.0
    for _ in range(RESERVE_ROUNDS):
        limit = None if budget is None else budget - reserve
        if limit is not None and limit <= 0:
            break
        try:
            sol = solve_for_peak(applied, memory_budget=limit, alpha=alpha, method=method, cutoff=cutoff)
        except InfeasibleBudget:
            if not policy.active:
                raise
            break
        extra = layers.extra_peak(policy, applied, sol.choice)
        reported = plan_peak(applied, sol.choice)
        peak = reported + extra
        if budget is None or peak <= budget:
            return Chosen(dataclasses.replace(sol, memory=peak), applied, policy, extra, layers)
        reserve = max(reserve + peak - budget, budget - reported + 1.0)  # (1 byte below the plan's reported peak)
    least, choice = _least_real(layers, policy, applied)
    if choice is not None and least <= budget:  # the plan of least memory fits where the search gave up
        graph = applied.search_graph
        choice = complete_choice(graph, choice)
        sol = Solution(choice, evaluate(graph, choice, alpha), least, "dp", False, 0.0)
        return Chosen(sol, applied, policy, int(least - plan_peak(applied, choice)), layers)
    raise InfeasibleBudget(budget, least)  # type: ignore[arg-type]


#: searches :func:`_solve_policy` runs, each at a lower budget, before it falls back to the plan of least memory
RESERVE_ROUNDS = 4


def restricted(
    graph: OpGraph,
    priced: PricedGraph,
    keep: Callable[[PartitionSeq], bool],
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    *,
    memory_budget: float | None,
    alpha: float,
    method: str,
    recompute: Recompute | None = None,
    layers: LayerPricing | None = None,
) -> tuple[Chosen, bool]:
    """The search of a plan run on a subspace of its pricing ``priced``: the strategies ``keep`` accepts
    (``values`` and ``opts`` are the pricing's micro-batch's), under the plan's recomputation policy ``recompute``
    (``priced`` is then ``layers.apply(recompute)``: :attr:`Chosen.layers`), whose extra peak in Backward counts
    against the budget as it does for the plan. Returns the plan and whether it fits ``memory_budget``; where
    nothing in the subspace fits, its fastest plan and ``False``.

    The planner prices its split-only baseline so (``keep``: no P(S x S)), and keeps that plan where it beats its
    own: the subspace's search is a second start for the budgeted search, which is not exact where a duality gap
    remains (:mod:`primepar_fx.search.budget`)."""
    if recompute is None or not recompute.active:
        sub = priced.subset(keep)
        try:
            return Chosen(solve_for_peak(sub, memory_budget=memory_budget, alpha=alpha, method=method), sub, None), True
        except InfeasibleBudget:
            return Chosen(solve_for_peak(sub, memory_budget=None, alpha=alpha, method=method), sub, None), False
    if layers is None:
        raise ValueError("restricted() needs the recomputation pricing (layers) of an active policy")
    narrow = layer_pricing(graph, layers.priced.subset(keep), values, opts)
    assert narrow is not None  # the same graph, the same stack
    try:
        return _solve_policy(narrow, recompute, memory_budget, alpha, method), True
    except InfeasibleBudget:
        return _solve_policy(narrow, recompute, None, alpha, method), False


def _least_real(layers: LayerPricing, policy: Recompute, applied: PricedGraph) -> tuple[float, dict[str, int] | None]:
    """The real peak (Backward's recomputation included) of the plan whose reported peak is least, and the plan (of
    the graph without virtual nodes: :func:`~primepar_fx.pricing.sharing.complete_choice` adds them).

    Memory alone is searched on :attr:`PricedGraph.cost_graph`, without the virtual nodes of shared re-layouts:
    they hold no memory and forbid nothing their pass-through state does not, so the least memory is the same, and
    its DP is smaller, so faster (many of these run under a budget: :func:`_fewest_full`, :func:`_fewest_fitting`)."""
    graph = applied.cost_graph
    static, choice = least_plan(graph, ring_buffers(applied, graph))
    if choice is None:
        return static, None
    return static + layers.extra_peak(policy, applied, choice), choice


def _least(applied: PricedGraph) -> float:
    """A lower bound of the least peak of any plan on ``applied`` (the end of Forward), searched as in
    :func:`_least_real`."""
    graph = applied.cost_graph
    return least_peak(graph, ring_buffers(applied, graph))


def choose_recompute(
    graph: OpGraph,
    priced: PricedGraph,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    *,
    choice: str,
    memory_budget: float | None,
    alpha: float,
    method: str,
    cutoff: float = math.inf,
) -> Chosen:
    """The plan's recomputation and its solution (module docstring); ``choice`` a mode for every layer or
    ``"auto"``. Raises :class:`InfeasibleBudget` with the least peak of the most memory-saving mode when nothing
    fits. ``cutoff``: the caller has a plan of that cost; under a budget the policies and caps that cannot beat it
    are not searched, and :class:`~primepar_fx.search.CutOff` is raised when nothing that fits is cheaper (the
    fastest plan, when it fits, is returned whatever its cost)."""
    check_choice(choice)
    layers = layer_pricing(graph, priced, values, opts) if choice != "none" else None
    if layers is None:
        if choice in ("selective", "full"):
            raise ValueError(f"recompute={choice!r}: {graph.name} has no layer stack to recompute")
        sol = solve_for_peak(priced, memory_budget=memory_budget, alpha=alpha, method=method)
        return Chosen(sol, priced, None)
    stack, count = layers.units.stack, len(layers.units)
    if choice == "selective" and not layers.selective_differs:  # a fused attention keeps no scores
        log.info("recompute='selective': %s keeps no attention scores; nothing to recompute", graph.name)
        return Chosen(solve_for_peak(priced, memory_budget=memory_budget, alpha=alpha, method=method), priced, None)
    if choice != "auto":
        return _solve_policy(layers, Recompute.uniform(stack, count, choice), memory_budget, alpha, method, cutoff)
    free = _solve_policy(layers, Recompute.uniform(stack, count, "none"), None, alpha, method)
    if memory_budget is None or alpha > 0 or free.solution.memory <= memory_budget:
        return dataclasses.replace(free, recompute=None)
    return _PolicySearch(layers, memory_budget, alpha, method, cutoff).run()


class _PolicySearch:
    """:func:`choose_recompute` where the budget binds: the fastest of no recomputation, selective, and full on the
    fewest first layers that fit. Keeps every plan found, what each policy tried needs where nothing fits, and the
    budgeted searches per count of layers recomputed in full."""

    def __init__(self, layers: LayerPricing, budget: float, alpha: float, method: str, cutoff: float) -> None:
        self.layers, self.budget, self.alpha, self.method, self.cutoff = layers, budget, alpha, method, cutoff
        self.stack, self.count = layers.units.stack, len(layers.units)
        self.needs: list[float] = []
        self.cuts: list[CutOff] = []
        self.found: list[Chosen | None] = []
        self.tried: dict[int, tuple[Chosen | None, bool, bool]] = {}

    def run(self) -> Chosen:
        layers, stack, count = self.layers, self.stack, self.count
        none = Recompute.uniform(stack, count, "none")
        self.found.append(_try(layers, none, self.budget, self.alpha, self.method, self.needs, self.cutoff, self.cuts))
        if layers.selective_differs:
            self.found.append(self.bounded(Recompute.uniform(stack, count, "selective"))[0])
        k = _fewest_full(layers, self.budget)
        while k is not None:  # more layers recomputed free memory for faster partitions: k, 2k, 4k, ..., all
            got, searched, unfit = self.full_on(k)
            if not searched:  # recomputing more layers only adds time to every plan: no larger k can beat this bound
                break
            if unfit:  # the fewest k that fits lies above: bisected, not stepped (a 70B stack is 80 layers)
                k = _fewest_fitting(layers, self.budget, k, self.full_on)
                continue
            k = None if k == count else min(count, 2 * k)
        best = min((c for c in self.found if c is not None), key=lambda c: c.solution.cost, default=None)
        if best is None and self.cutoff < math.inf:  # nothing that fits beats the caller's plan (if anything fits)
            raise CutOff(self.cutoff)
        if best is None:
            full = Recompute.uniform(stack, count, "full")
            self.needs.append(_least_real(layers, full, layers.apply(full))[0])
            raise InfeasibleBudget(self.budget, min(self.needs))  # the least of the modes tried
        return best if best.recompute is None or best.recompute.active else dataclasses.replace(best, recompute=None)

    def best_cost(self) -> float:
        return min((c.solution.cost for c in self.found if c is not None), default=self.cutoff)

    def bounded(self, policy: Recompute) -> tuple[Chosen | None, bool]:
        """The plan under ``policy``, and whether a budgeted search found it. The policy's fastest plan without
        a budget bounds it from below: the policy is skipped (``None``) where the bound is no faster than the best
        plan found or the caller's (fitting or not, it cannot win), that plan is the answer where it fits, and only
        otherwise does the budgeted search (several DP runs) run."""
        bound = _solve_policy(self.layers, policy, None, self.alpha, self.method)
        if bound.solution.cost >= self.best_cost():
            return None, False
        if bound.solution.memory <= self.budget:
            return bound, False
        got = _try(self.layers, policy, self.budget, self.alpha, self.method, self.needs, self.best_cost(), self.cuts)
        return got, True

    def full_on(self, k: int) -> tuple[Chosen | None, bool, bool]:
        """The plan with the first ``k`` layers recomputed in full, whether a budgeted search ran, and whether
        nothing fits (once per ``k``)."""
        if k not in self.tried:
            before = len(self.needs)
            got, searched = self.bounded(Recompute.uniform(self.stack, self.count, "full", k))
            self.found.append(got)
            self.tried[k] = (got, searched, len(self.needs) > before)
        return self.tried[k]


def _try(
    layers: LayerPricing,
    policy: Recompute,
    budget: float,
    alpha: float,
    method: str,
    needs: list[float],
    cutoff: float = math.inf,
    cuts: list[CutOff] | None = None,
) -> Chosen | None:
    """The plan under ``policy``, or ``None`` with the least it needs appended to ``needs`` (or, when nothing
    that fits is cheaper than ``cutoff``, the :class:`~primepar_fx.search.CutOff` appended to ``cuts``)."""
    try:
        return _solve_policy(layers, policy, budget, alpha, method, cutoff)
    except InfeasibleBudget as exc:
        needs.append(exc.min_memory)
        return None
    except CutOff as exc:
        if cuts is None:
            raise
        cuts.append(exc)
        return None


def _fewest_fitting(
    layers: LayerPricing,
    budget: float,
    unfit: int,
    full_on: Callable[[int], tuple[Chosen | None, bool, bool]],
) -> int | None:
    """The fewest layers past ``unfit`` (with which nothing fits) recomputed in full with which a plan fits, or
    ``None`` when not even all of them do. Above lies the fewest whose plan of least peak fits (the search falls
    back to that plan, so it fits); between the two ``full_on(k)`` (the budgeted search, whose third item says
    nothing fit) is bisected: recomputing more layers holds less for every plan, so what fits with ``k`` layers
    fits with more."""
    stack, count = layers.units.stack, len(layers.units)

    def least_real(k: int) -> float:
        policy = Recompute.uniform(stack, count, "full", k)
        return _least_real(layers, policy, layers.apply(policy))[0]

    lo = unfit + 1
    hi = None if lo > count else fewest(least_real, budget, lo, count)  # the fewest whose least plan fits
    if hi is None:
        return None if lo > count or full_on(count)[2] else count
    while lo < hi:  # the fewest the search finds a plan with
        mid = (lo + hi) // 2
        _, _, none_fit = full_on(mid)
        if none_fit:
            lo = mid + 1
        else:
            hi = mid
    return hi


def _fewest_full(layers: LayerPricing, budget: float) -> int | None:
    """The fewest first layers recomputed in full whose least peak at the end of Forward fits ``budget`` (a lower
    bound: the search decides), or ``None`` when not even all of them fit."""
    stack, count = layers.units.stack, len(layers.units)
    return fewest(lambda k: _least(layers.apply(Recompute.uniform(stack, count, "full", k))), budget, 1, count)
