"""Plans that follow a named strategy instead of the free search (:func:`forced_plan`), to run or compare it:
``"megatron"`` (the configuration :func:`~primepar_fx.planning.compare.price_baselines` picks; ``"megatron-sp"`` the
best one with sequence parallelism), ``"data_parallel"``, ``"prime"`` (P(S x S) on every node where it is legal, the
rest searched, on the meshes the free search runs on: past three digits, the groupings of the digits) or
``"random:SEED"`` (a seeded, uniformly random legal sequence per node)."""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

import sympy

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.levers.recompute import choose_recompute, layer_pricing
from primepar_fx.partition import DeviceMesh, PartitionSeq, enumerate_sequences
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.planning.compare import best_megatron
from primepar_fx.planning.groupings import search_meshes
from primepar_fx.planning.options import PlanOptions, forced_seed
from primepar_fx.planning.planner import make_plan, resolve_options
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import Summary, per_step, summarize
from primepar_fx.record.levers import Recompute
from primepar_fx.record.plan import Plan
from primepar_fx.record.search import SearchRecord
from primepar_fx.search import InfeasibleBudget, SearchError, TableTooLarge


def _prime_only(seqs: list[PartitionSeq]) -> list[PartitionSeq]:
    """The sequences that use P(S x S), or all of them where none does."""
    return [s for s in seqs if s.prime is not None] or seqs


def random_assignment(
    graph: OpGraph, mesh: DeviceMesh, values: dict[sympy.Symbol, int], seed: int
) -> dict[str, PartitionSeq]:
    """A uniformly random legal sequence per node (constants included), drawn in graph order from ``seed``."""
    rng = random.Random(seed)
    legal: dict[object, list[PartitionSeq]] = {}  # the repeated layers' nodes share their dims: enumerated once
    out = {}
    for name, node in graph.nodes.items():
        if node.dims not in legal:
            legal[node.dims] = enumerate_sequences(node.dims, mesh, values=values, allow_prime=True)
        out[name] = rng.choice(legal[node.dims])
    return out


def forced_plan(graph: OpGraph, name: str, options: PlanOptions | None = None, /, **kwargs: Any) -> Plan:
    """A full :class:`~primepar_fx.record.plan.Plan` that follows the named strategy instead of the free search
    (module docstring).

    ``name`` is one of :data:`~primepar_fx.planning.options.FORCED_NAMES`; ``options`` or keywords as for
    :func:`~primepar_fx.planning.planner.plan_graph` (only the cluster, world size or digits, sizes, dtype, memory
    budget and the levers asked for matter: a forced plan recomputes, shards and accumulates only what it is told
    to). ``memory_budget`` picks the Megatron configuration (:func:`~primepar_fx.planning.compare.price_baselines`'
    rule) and bounds the ``"prime"`` search; the fixed strategies ignore it. The plan has no baselines;
    ``search.forced`` names the strategy.
    """
    seed = forced_seed(name)
    opts = resolve_options(graph, options, kwargs)
    at = _Setting.of(opts)
    start, mesh = time.perf_counter(), at.mesh
    if name == "prime":
        mesh, summary, recompute, record = _prime_plan(graph, opts, at)
    elif name in ("megatron", "megatron-sp"):
        summary, recompute, record = _megatron_plan(graph, opts, at, sequence_parallel=name == "megatron-sp")
    else:
        if name == "data_parallel":
            assignment = data_parallel_assignment(graph, at.mesh, values=at.values)
        else:
            assignment = random_assignment(graph, at.mesh, at.values, seed)  # type: ignore[arg-type]
        summary, recompute = _assigned(graph, opts, at, assignment)
        record = SearchRecord(seed=seed)
    record = record.replace(
        forced=name, memory_budget=opts.memory_budget, seconds=round(time.perf_counter() - start, 4),
        grouped=mesh != at.mesh,
    )  # fmt: skip
    return make_plan(graph, opts, mesh, summary, baselines={}, search=record, recompute=recompute, costs=at.costs)


@dataclass(frozen=True)
class _Setting:
    """What a forced plan is priced at: the mesh, the micro-batch's sizes, the cost options (the ZeRO stage and
    micro-batch count asked for, none where ``"auto"``) and the recomputation mode on every layer."""

    mesh: DeviceMesh
    values: dict[sympy.Symbol, int]
    costs: CostOptions
    mode: str

    @classmethod
    def of(cls, opts: PlanOptions) -> _Setting:
        m = 1 if opts.micro_batches == "auto" else int(opts.micro_batches)  # as told, like the ZeRO stage
        zero = 0 if opts.zero == "auto" else opts.zero  # a forced plan shards only what it is told to
        costs = dataclasses.replace(opts.cost_options(), alpha=0.0, zero=zero, micro_batches=m)
        mode = opts.recompute if opts.recompute != "auto" else "none"
        return cls(opts.mesh(), {B: opts.batch // m, S: opts.seq}, costs, mode)  # type: ignore[operator]


def _prime_plan(
    graph: OpGraph, opts: PlanOptions, at: _Setting
) -> tuple[DeviceMesh, Summary, Recompute | None, SearchRecord]:
    """P(S x S) on every node where it is legal, the rest searched (under the budget, with the mode asked for), on
    the meshes the free search runs on (:func:`~primepar_fx.planning.groupings.search_meshes`: past three digits,
    the groupings of the digits). The plan kept is the one with P(S x S) on the most nodes (a grouping without two
    equal consecutive digits has none), the cheapest of those, a tie keeping the first mesh's. A mesh whose tables are
    too large for the dynamic program, or on which nothing fits the budget, is passed over; where every mesh is,
    the error of the first (the smallest budget any of them needs, where none fits) is raised."""
    best: tuple[DeviceMesh, Summary, Recompute | None, SearchRecord] | None = None
    errors: list[SearchError] = []
    for mesh in search_meshes(at.mesh, opts.grouped, opts.cluster, opts.group_digits):
        try:
            found = _prime_on(graph, opts, dataclasses.replace(at, mesh=mesh))
        except (TableTooLarge, InfeasibleBudget) as err:
            errors.append(err)
            continue
        if best is None or _prime_rank(found) < _prime_rank(best[1:]):
            best = (mesh, *found)
    if best is None:
        budgets = [e for e in errors if isinstance(e, InfeasibleBudget)]
        if budgets:
            raise InfeasibleBudget(opts.memory_budget, min(e.min_memory for e in budgets))  # type: ignore[arg-type]
        raise errors[0]
    return best


def _prime_rank(found: tuple[Summary, Recompute | None, SearchRecord]) -> tuple[int, float]:
    """The order of :func:`_prime_plan`'s plans: most nodes with P(S x S) first, then the cheapest."""
    summary, _, record = found
    return -sum(node.seq.prime is not None for node in summary.nodes), record.objective  # type: ignore[return-value]


def _prime_on(graph: OpGraph, opts: PlanOptions, at: _Setting) -> tuple[Summary, Recompute | None, SearchRecord]:
    """:func:`_prime_plan` on one mesh, ``at.mesh``."""
    priced = price_graph(graph, at.mesh, opts.cluster, at.values, at.costs, restrict=lambda _, seqs: _prime_only(seqs))
    chosen = choose_recompute(
        graph, priced, at.values, at.costs, choice=at.mode, memory_budget=opts.memory_budget, alpha=0.0, method="dp"
    )
    sol = chosen.solution
    summary = summarize(graph, chosen.priced, sol.choice, at.costs, extra_peak=chosen.extra_peak)
    record = SearchRecord(method=sol.method, proven_optimal=sol.proven_optimal, objective=sol.cost)
    return per_step(summary, at.costs.micro_batches), chosen.recompute, record


def _megatron_plan(
    graph: OpGraph, opts: PlanOptions, at: _Setting, *, sequence_parallel: bool
) -> tuple[Summary, Recompute | None, SearchRecord]:
    """The best Megatron configuration (with sequence parallelism only, where asked), without the distributed
    optimizer (a plan our runtime runs keeps whole optimizer state)."""
    (config, summary, assignment), _ = best_megatron(
        graph, at.mesh, opts.cluster, at.values, at.costs, opts.memory_budget, True if sequence_parallel else None,
        distributed_optimizer=False,
    )  # fmt: skip
    if at.mode != "none":
        summary, recompute = _assigned(graph, opts, at, assignment)
        return summary, recompute, SearchRecord(config=config)
    return per_step(summary, at.costs.micro_batches), None, SearchRecord(config=config)


def _assigned(
    graph: OpGraph, opts: PlanOptions, at: _Setting, assignment: dict[str, PartitionSeq]
) -> tuple[Summary, Recompute | None]:
    """A fixed assignment priced and read back, with the recomputation mode asked for on every layer."""
    priced, (choice,) = price_assignments(graph, [assignment], at.mesh, opts.cluster, at.values, at.costs)
    recompute, extra = None, 0
    if at.mode != "none":
        layers = layer_pricing(graph, priced, at.values, at.costs)
        if layers is None:
            raise ValueError(f"recompute={at.mode!r}: {graph.name} has no layer stack to recompute")
        recompute = Recompute.uniform(layers.units.stack, len(layers.units), at.mode)
        applied = layers.apply(recompute)
        extra = layers.extra_peak(recompute, applied, choice)
        priced = applied
    return per_step(summarize(graph, priced, choice, at.costs, extra_peak=extra), at.costs.micro_batches), recompute
