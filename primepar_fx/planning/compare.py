"""The baselines, priced with our cost model: Megatron-LM's best configuration (with its distributed optimizer and
recomputation under a budget), data parallelism and FSDP (:func:`price_baselines`), and fixed assignments read
back as plans (:func:`price_fixed`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.frontend.moe import MOE_EXPERTS
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units
from primepar_fx.levers.choices import MICRO_BATCH_TRIES
from primepar_fx.levers.recompute import Chosen, LayerPricing, layer_pricing, restricted
from primepar_fx.partition import DeviceMesh, PartitionSeq
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning.baselines import config_name, data_parallel_assignment, megatron_assignments, megatron_configs
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.pipelines import pipeline_micro_batches, schedules, stage_counts
from primepar_fx.planning.workers import Forked
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import PipelinePricing, plan_crossings, plan_pieces, price_pipeline, stage_pieces
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.pricing.summary import Summary, node_seconds, per_step, summarize
from primepar_fx.record.levers import Recompute
from primepar_fx.record.plan import Baseline, Predicted

log = logging.getLogger(__name__)

#: a baseline found at some micro-batch count: ``(config, ...)``, its prediction read by the caller
Found = tuple[Any, ...]


def best_megatron(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
    sequence_parallel: bool | None = None,
    also: Sequence[Mapping[str, PartitionSeq]] = (),
    distributed_optimizer: bool = True,
) -> tuple[tuple[dict[str, Any], Summary, dict[str, PartitionSeq]], list[Predicted]]:
    """The fastest Megatron configuration (that fits ``memory_budget``, if any does) as ``(config, summary,
    assignment)``, and the predictions of the assignments ``also``, priced with them.

    ``sequence_parallel`` keeps only the configurations with (``True``) or without (``False``) it. Under a budget
    each configuration with data parallelism is also tried with Megatron-LM's distributed optimizer (the master
    copies and moments of each parameter block split over its replicas, the ``dp`` ranks, or none for experts split
    over them: ``"distributed_optimizer": true``, :class:`~primepar_fx.cost.blocks.CostOptions`); it moves as many
    bytes as the all-reduce it replaces, so it ties in time and is kept only where the configuration fits with it
    and not without. Every one of those is also tried with Megatron-LM's activation recomputation of every layer,
    full and (where the model keeps attention scores) selective (``"recompute": "full"``), priced like ours
    (:mod:`~primepar_fx.levers.recompute`); the fastest that fits wins, fewer levers breaking ties.
    ``distributed_optimizer=False`` leaves it out (a Megatron plan our runtime runs, which keeps whole optimizer
    state).
    """
    configs, assignments, priced_graph, choices, variants = megatron_variants(
        graph, mesh, cluster, values, opts, memory_budget, sequence_parallel, also, distributed_optimizer
    )
    ranked = []
    for k, (i, cfg, costs, rec) in enumerate(variants):
        pred = variant_summary(graph, priced_graph, choices[i], costs, rec, nodes=False).predicted
        log.info("%s: %.4g s, %.3g GiB", config_name(cfg), pred.step_time_s, pred.peak_memory_bytes / 2**30)
        fits = memory_budget is None or pred.peak_memory_bytes <= memory_budget
        levers = ("distributed_optimizer" in cfg) + ("recompute" in cfg)
        ranked.append((not fits, pred.step_time_s, levers, pred.peak_memory_bytes, k))
    unfit, *_, best = min(ranked)
    i, cfg, costs, rec = variants[best]
    config = {**cfg, "name": config_name(cfg)}
    if assignments[i].fallbacks:  # nodes where a split of the configuration did not divide, replicated there
        config["fallback_nodes"] = len(assignments[i].fallback_nodes())
    if memory_budget is not None:
        config["fits_budget"] = not unfit
    summary = variant_summary(graph, priced_graph, choices[i], costs, rec)
    others = [summarize(graph, priced_graph, c, opts, nodes=False).predicted for c in choices[len(assignments) :]]
    return (config, summary, assignments[i]), others


#: one Megatron variant: (the index of its configuration, the configuration with its levers, its cost options, its
#: recomputation as ``(layers, policy, applied pricing)`` or ``None``)
Variant = tuple[int, dict[str, Any], CostOptions, Any]


def megatron_variants(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
    sequence_parallel: bool | None = None,
    also: Sequence[Mapping[str, PartitionSeq]] = (),
    distributed_optimizer: bool = True,
    configs: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list, PricedGraph, list[dict[str, int]], list[Variant]]:
    """Megatron's configurations on ``mesh`` (``configs``, default all of
    :func:`~primepar_fx.planning.baselines.megatron_configs`), their assignments priced with ``also`` (one pricing,
    one choice each) and the variants :func:`best_megatron` ranks: each configuration as it is and, under a budget,
    with the distributed optimizer and with full and selective recomputation."""
    experts = any(node.target is MOE_EXPERTS for node in graph.nodes.values())
    if configs is None:
        configs = megatron_configs(mesh, experts=experts)
    configs = [c for c in configs if sequence_parallel in (None, c["sequence_parallel"])]
    if not configs:
        raise ValueError(f"no Megatron configuration with sequence_parallel={sequence_parallel} on {mesh.digits}")
    assignments = megatron_assignments(graph, mesh, configs, values=values)
    priced_graph, choices = price_assignments(graph, [*assignments, *also], mesh, cluster, values, opts)
    variants: list[Variant] = [(i, cfg, opts, None) for i, cfg in enumerate(configs)]
    if memory_budget is not None and distributed_optimizer:
        distributed = dataclasses.replace(opts, zero=2, distributed_optimizer=True)
        variants += [
            (i, {**cfg, "distributed_optimizer": True}, distributed, None)
            for i, cfg in enumerate(configs)
            if cfg["dp"] > 1
        ]
        # Megatron-LM's activation recomputation: full (every layer) and selective (attention scores)
        layers = layer_pricing(graph, priced_graph, values, opts)
        modes = [] if layers is None else ["full"] + (["selective"] if layers.selective_differs else [])
        plain = list(variants)
        for mode in modes:
            assert layers is not None
            policy = Recompute.uniform(layers.units.stack, len(layers.units), mode)
            applied = (layers, policy, layers.apply(policy))
            variants += [(i, {**cfg, "recompute": mode}, costs, applied) for i, cfg, costs, _ in plain]
    return configs, assignments, priced_graph, choices, variants


def variant_summary(
    graph: OpGraph,
    priced: PricedGraph,
    choice: dict[str, int],
    costs: CostOptions,
    rec: Any,
    *,
    nodes: bool = True,
    extra: int = 0,
) -> Summary:
    """:func:`summarize` of a baseline's choice, with its recomputation ``rec`` (``(layers, policy, applied)``)
    and ``extra`` bytes on its peak."""
    if rec is None:
        return summarize(graph, priced, choice, costs, nodes=nodes, extra_peak=extra)
    layers, policy, applied = rec
    extra += layers.extra_peak(policy, applied, choice)
    return summarize(graph, applied, choice, costs, nodes=nodes, extra_peak=extra)


#: how many layers' parameters FSDP holds gathered at once: the one running and the next, prefetched
FSDP_GATHERED_LAYERS = 2


def best_fsdp(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
    dp: Mapping[str, PartitionSeq],
) -> Baseline:
    """FSDP (ZeRO-3 data parallelism, each layer a unit): every parameter, gradient and optimizer state split over
    all devices, a layer's parameters all-gathered before its Forward and again before its Backward and its
    gradients reduce-scattered (``CostOptions.zero`` 3), :data:`FSDP_GATHERED_LAYERS` layers' parameters whole at
    a time; with activation recomputation of every layer (full, or selective where the model keeps attention
    scores) or none, the fastest that fits the budget (the fastest, marked not fitting, when none does).

    Under a budget FSDP also accumulates gradients over micro-batches as Megatron does
    (:func:`best_micro_batches`): the parameters gathered again for every micro-batch, the local gradients
    accumulated whole and reduce-scattered once a step (FSDP2's ``set_requires_gradient_sync(False)`` until the
    last micro-batch); config ``"micro_batches"``."""
    config, predicted = fsdp_at(graph, mesh, cluster, values, opts, memory_budget, dp)
    if memory_budget is not None:
        batch = values[B]

        def find(m: int) -> tuple[dict[str, Any], Predicted] | None:
            micro = {**values, B: batch // m}
            if micro[B] % mesh.size:
                return None  # its ranks would share a sample
            costs = dataclasses.replace(opts, micro_batches=m)
            config, p = fsdp_at(
                graph, mesh, cluster, micro, costs, memory_budget, data_parallel_assignment(graph, mesh, values=micro)
            )
            config = {**config, "micro_batches": m}
            config["name"] += f" +{m} micro-batches"
            return config, Predicted(p.step_time_s * m, p.peak_memory_bytes, p.comm_bytes * m)

        config, predicted = best_micro_batches(batch, (config, predicted), find, lambda found: found[1])
    return Baseline("fsdp", config, predicted, {n: str(s) for n, s in dp.items()})


def fsdp_at(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
    dp: Mapping[str, PartitionSeq],
) -> tuple[dict[str, Any], Predicted]:
    """FSDP at ``values``' batch in one micro-batch of ``opts``' (:func:`best_fsdp`): its config and prediction."""
    costs = dataclasses.replace(opts, zero=3, distributed_optimizer=False, regather_all=True)
    priced, (choice,) = price_assignments(graph, [dp], mesh, cluster, values, costs)
    gathered = fsdp_gathered(graph, priced, choice)
    variants = fsdp_variants(graph, priced, values, costs, memory_budget)
    ranked = []
    for k, (_, rec) in enumerate(variants):
        pred = variant_summary(graph, priced, choice, costs, rec, nodes=False, extra=gathered).predicted
        fits = memory_budget is None or pred.peak_memory_bytes <= memory_budget
        ranked.append((not fits, pred.step_time_s, k, pred))
    unfit, _, best, pred = min(ranked, key=lambda r: r[:3])
    mode = variants[best][0]
    config: dict[str, Any] = {"dp": mesh.size, "zero": 3, "recompute": mode}
    config["name"] = f"fsdp{mesh.size} (ZeRO-3)" + (f" +{mode} recompute" if mode != "none" else "")
    if memory_budget is not None:
        config["fits_budget"] = not unfit
    return config, pred


def fsdp_gathered(graph: OpGraph, priced: PricedGraph, choice: Mapping[str, int]) -> int:
    """The bytes FSDP holds gathered beyond ZeRO-3's own model: the :data:`FSDP_GATHERED_LAYERS` largest units'
    parameters whole (the layers, and the nodes outside the stack as one unit), less the largest node's own gathered
    blocks, which its buffer holds already (ZeRO-3's cost model gathers one node at a time)."""
    units = layer_units(graph)
    if units is None:  # no layer stack: each node its own unit
        groups = [[n] for n in graph.nodes]
    else:  # the layers, and the root unit: the nodes outside the stack (embeddings, final norm, head)
        groups = [list(u) for u in units.units] + [[n for n in graph.nodes if n not in units.layer_of]]
    layer_bytes = [sum(priced.node_costs[n][choice[n]].param_bytes for n in g) for g in groups]
    gathered = sum(sorted(layer_bytes, reverse=True)[:FSDP_GATHERED_LAYERS])
    return max(0, gathered - max(priced.node_costs[n][choice[n]].buffer_bytes for n in graph.nodes))


def fsdp_variants(
    graph: OpGraph,
    priced: PricedGraph,
    values: dict[sympy.Symbol, int],
    costs: CostOptions,
    memory_budget: float | None,
) -> list[tuple[str, Any]]:
    """FSDP's recomputation variants, ``(mode, (layers, policy, applied pricing) or None)``: none, and under a budget
    full and (where the model keeps attention scores) selective recomputation of every layer (recomputation only
    adds time: without a budget the plain variant is the fastest, and the others are not priced)."""
    variants: list[tuple[str, Any]] = [("none", None)]
    layers = None if memory_budget is None else layer_pricing(graph, priced, values, costs)
    if layers is not None:
        modes = ["full"] + (["selective"] if layers.selective_differs else [])
        for mode in modes:
            policy = Recompute.uniform(layers.units.stack, len(layers.units), mode)
            variants.append((mode, (layers, policy, layers.apply(policy))))
    return variants


def price_baselines(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None = None,
) -> dict[str, Baseline]:
    """The best Megatron configuration, pure data parallelism and FSDP (:func:`best_fsdp`), priced with our cost
    model.

    With a memory budget, the best Megatron configuration is the fastest one that fits (the fastest overall,
    marked ``"fits_budget": false``, when none does); data parallelism says whether it fits the same way. Megatron
    then also accumulates gradients over micro-batches (:func:`best_megatron_micro_batches`).
    """
    out: dict[str, Baseline] = {}
    dp = data_parallel_assignment(graph, mesh, values=values)
    (config, summary, assignment), (dp_predicted,) = best_megatron(
        graph, mesh, cluster, values, opts, memory_budget, also=[dp]
    )
    if memory_budget is not None:
        config, summary, assignment = best_megatron_micro_batches(
            graph, mesh, cluster, values, opts, memory_budget, (config, summary, assignment)
        )
    out["megatron"] = Baseline("megatron", config, summary.predicted, {n: str(s) for n, s in assignment.items()})
    dp_config: dict[str, Any] = {"dp": mesh.size}
    if memory_budget is not None:
        dp_config["fits_budget"] = dp_predicted.peak_memory_bytes <= memory_budget
    out["data_parallel"] = Baseline("data_parallel", dp_config, dp_predicted, {n: str(s) for n, s in dp.items()})
    out["fsdp"] = best_fsdp(graph, mesh, cluster, values, opts, memory_budget, dp)
    return out


def best_megatron_micro_batches(
    graph: OpGraph,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float,
    whole: tuple[dict[str, Any], Summary, dict[str, PartitionSeq]],
) -> tuple[dict[str, Any], Summary, dict[str, PartitionSeq]]:
    """Megatron-LM's gradient accumulation: the best configuration of :func:`best_megatron` at ``m`` micro-batches
    of ``B / m`` (activations of one micro-batch held, gradients reduced once a step: ``CostOptions.micro_batches``),
    priced as the whole step (:func:`~primepar_fx.pricing.summary.per_step`), for the counts of
    :data:`~primepar_fx.levers.choices.MICRO_BATCH_TRIES` that leave every data-parallel rank a whole sample.
    ``whole`` is the best at one micro-batch. As for our plans, more micro-batches are tried only while the best so
    far needs recomputation or does not fit, and not after one that is slower; the fastest that fits wins (config
    ``"micro_batches"``)."""
    batch = values[B]

    def find(m: int) -> tuple[dict[str, Any], Summary, dict[str, PartitionSeq]] | None:
        micro = {**values, B: batch // m}
        config, summary, assignment = best_megatron(
            graph, mesh, cluster, micro, dataclasses.replace(opts, micro_batches=m), memory_budget
        )[0]
        if (batch // m) % config["dp"]:
            return None  # its data-parallel ranks would share a sample (the split falls back): not Megatron's
        config = {**config, "micro_batches": m}
        return {**config, "name": config_name(config)}, per_step(summary, m), assignment

    return best_micro_batches(batch, whole, find, lambda found: found[1].predicted)


def best_micro_batches(
    batch: int, whole: Found, find: Callable[[int], Found | None], predicted: Callable[[Found], Predicted]
) -> Found:
    """A baseline's gradient accumulation: ``whole`` (``(config, ...)`` at one micro-batch) or ``find(m)`` at ``m``
    micro-batches, priced per step, for the counts of :data:`~primepar_fx.levers.choices.MICRO_BATCH_TRIES` that
    divide ``batch`` (``find`` returns ``None`` for a count the baseline cannot run). More micro-batches are tried
    while the best so far recomputes or does not fit, past a count that is slower too (the step is not unimodal in
    the count, as for our plans: :func:`~primepar_fx.planning.planner.plan_graph`); the fastest that fits wins."""
    best = whole

    def rank(found: Found) -> tuple[bool, float]:
        return (not found[0].get("fits_budget", True), predicted(found).step_time_s)

    for m in MICRO_BATCH_TRIES[1:]:
        if batch % m:
            continue
        config = best[0]
        if config.get("fits_budget", True) and config.get("recompute", "none") == "none":
            break  # it fits holding every activation: more micro-batches would only run smaller ones
        found = find(m)
        if found is None:
            continue
        if rank(found) < rank(best):
            best = found
    return best


def fixed_baselines(graph: OpGraph, full: DeviceMesh, opts: PlanOptions) -> dict[str, Baseline]:
    """Megatron-LM, data parallelism and FSDP, and Megatron-LM and FSDP with pipeline stages where the graph has
    layers to cut (:func:`best_megatron_pipelined`, :func:`best_fsdp_pipelined`): they bring their own levers (the
    distributed optimizer, not our ZeRO), from the whole batch (Megatron tries its micro-batches itself:
    :func:`best_megatron_micro_batches`), so they do not depend on the plan found."""
    whole = dataclasses.replace(opts.cost_options(), zero=0, micro_batches=1)
    values = {B: opts.batch, S: opts.seq}
    out = price_baselines(graph, full, opts.cluster, values, whole, opts.memory_budget)
    for staged in (best_megatron_pipelined, best_fsdp_pipelined):
        pipelined = staged(graph, full, opts.cluster, values, whole, opts.memory_budget)
        if pipelined is not None:
            out[pipelined.name] = pipelined
    return out


def plan_baselines(
    graph: OpGraph,
    priced: PricedGraph | None,
    full: DeviceMesh,
    opts: PlanOptions,
    costs: CostOptions,
    early: Forked | None = None,
    fastest: tuple[Mapping[str, int], Summary] | None = None,
    split: tuple[Chosen, bool] | None = None,
    recompute: Recompute | None = None,
) -> dict[str, Baseline]:
    """Megatron-LM, data parallelism and FSDP (:func:`fixed_baselines`, from ``early`` where it was priced in a
    fork) and, when the plan's space has P(S x S), split-only: our search on the strategies without it, on our
    pricing ``priced`` (:func:`split_only`).

    ``fastest``: our plan, where it is proven optimal on ``priced`` (within the budget, under its recomputation), as
    its choice and per-step summary. Where it uses no P(S x S) it is a split-only plan that no split-only plan
    beats, so it is the split-only baseline, not searched again (``recompute``: its recomputation policy).
    ``split``: the split-only search's plan and whether it fits, where the planner ran it already. ``priced``
    ``None`` (no plan fits without pipeline stages): no split-only baseline."""
    ok, base = early.result() if early is not None else (False, None)
    if not ok:
        if early is not None:
            log.debug("the baselines' fork gave no result (%s): priced here", base)
        base = fixed_baselines(graph, full, opts)
    if not opts.allow_prime or priced is None:
        return base
    config: dict[str, Any] = {"search": "no P(S x S)"}
    if split is None and fastest is not None and not uses_prime(priced, fastest[0]):
        summary = fastest[1]
        fits = opts.memory_budget is None or summary.predicted.peak_memory_bytes <= opts.memory_budget
    else:
        chosen, fits = split if split is not None else split_only(graph, priced, opts, costs)
        summary = per_step(
            summarize(graph, chosen.priced, chosen.solution.choice, costs, extra_peak=chosen.extra_peak),
            costs.micro_batches,
        )
        recompute = chosen.recompute
    if recompute is not None and recompute.active:
        config["recompute"] = list(recompute.layers)
    if opts.memory_budget is not None:
        config["fits_budget"] = fits
    base["split_only"] = Baseline("split_only", config, summary.predicted, _partitions(summary))
    return base


def split_only(
    graph: OpGraph,
    priced: PricedGraph,
    opts: PlanOptions,
    costs: CostOptions,
    recompute: Recompute | None = None,
    layers: LayerPricing | None = None,
) -> tuple[Chosen, bool]:
    """The split-only baseline: our search on ``priced`` (micro-batches and ZeRO stage of ``costs``, the budget of
    ``opts``, the recomputation policy ``recompute`` that ``layers`` applied to it) run on the strategies without
    P(S x S), and whether its plan fits (:func:`~primepar_fx.levers.recompute.restricted`)."""
    values = {B: opts.batch // costs.micro_batches, S: opts.seq}  # type: ignore[operator]
    return restricted(
        graph,
        priced,
        _split,
        values,
        costs,
        memory_budget=opts.memory_budget,
        alpha=opts.alpha,
        method=opts.method,
        recompute=recompute,
        layers=layers,
    )


def split_only_search(
    graph: OpGraph, opts: PlanOptions, chosen: Chosen, costs: CostOptions
) -> tuple[tuple[Chosen, bool] | None, bool]:
    """The split-only search (:func:`split_only`) where the plan's space has P(S x S) and either the baselines
    want it or the plan is not proven optimal, and whether its plan replaces ``chosen``: it fits, and it is cheaper.
    It lies in our space (our strategies less P(S x S), the same pricing, ZeRO stage, micro-batches and
    recomputation), so where the budgeted search, which is not exact across a duality gap
    (:mod:`primepar_fx.search.budget`), or a narrowed DP lands above it, it is the better plan of ours; it is
    returned with our search's lower bound, proven optimal only where it meets it. A proven optimum that uses no
    P(S x S) is the split-only optimum too: not searched again."""
    sol = chosen.solution
    if not opts.allow_prime:
        return None, False
    if sol.proven_optimal and (not opts.baselines or not uses_prime(chosen.priced, sol.choice)):
        return None, False  # (plan_baselines reads a proven optimum without P(S x S) as the split-only baseline)
    split = split_only(graph, chosen.priced, opts, costs, chosen.recompute, chosen.layers)
    better = split[1] and split[0].solution.cost < sol.cost - SPLIT_MARGIN * abs(sol.cost)
    if not better:
        return split, False
    log.info(
        "the split-only search's plan (%.6g s) beats the search's (%.6g s, not proven optimal): kept",
        split[0].solution.cost,
        sol.cost,
    )
    kept = split[0]
    proven = kept.solution.cost <= sol.bound + 1e-9 * max(1.0, abs(sol.bound))
    kept = dataclasses.replace(
        kept, solution=dataclasses.replace(kept.solution, bound=sol.bound, proven_optimal=proven)
    )
    return (kept, True), True


#: how much cheaper (relative) the split-only search's plan must be to replace ours: not rounding noise
SPLIT_MARGIN = 1e-12


def _split(seq: PartitionSeq) -> bool:
    return seq.prime is None


def uses_prime(priced: PricedGraph, choice: Mapping[str, int]) -> bool:
    """Whether ``choice`` runs a P(S x S) on some node."""
    return any(seqs[choice[name]].prime is not None for name, seqs in priced.strategies.items())


def _partitions(summary: Summary) -> dict[str, str]:
    return {n.name: n.partition for n in summary.nodes}


def best_megatron_pipelined(
    graph: OpGraph,
    full: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
) -> Baseline | None:
    """Megatron-LM with pipeline stages: ``tp x pp x dp`` (+SP, the distributed optimizer, full or selective
    recomputation under a budget), the stage count of :func:`stage_counts`, the micro-batches of
    :func:`pipeline_micro_batches` and the schedules of :data:`MEGATRON_SCHEDULES`, priced as a pipeline; the
    fastest that fits (the fastest, marked not fitting, where none does). ``None`` where the graph has no layer
    stack or the world no stage count."""

    def price(sub: DeviceMesh, micro: dict[sympy.Symbol, int], p: int, m: int, configs: Any, best: _Best) -> None:
        _price_at(graph, sub, cluster, micro, opts, p, m, configs, best)

    best = _pipelines(graph, full, cluster, values, memory_budget, _counts, price)
    return None if best is None else best.baseline("megatron_pipelined")


#: a pipelined baseline's micro-batch counts on a stage's mesh: ``(batch, stages, mesh) -> [(m, what runs it)]``
Counts = Callable[[int, int, DeviceMesh], list[tuple[int, Any]]]
#: a pipelined baseline's pricing at one count: ``(mesh, micro-batch values, stages, m, what runs it, best)``
PriceAt = Callable[[DeviceMesh, dict, int, int, Any, "_Best"], None]


def _pipelines(
    graph: OpGraph,
    full: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    memory_budget: float | None,
    counts: Counts,
    price: PriceAt,
) -> _Best | None:
    """A pipelined baseline's search: ``price`` at each of ``counts`` of each stage count of
    :func:`stage_counts`; the best found, ``None`` where the graph has no layer stack or nothing was priced."""
    pieces = stage_pieces(graph)
    if pieces is None:
        return None
    batch, best = values[B], _Best(memory_budget)
    for p in stage_counts(full.size, len(pieces), cluster.devices_per_node):
        sub = DeviceMesh.for_world_size(full.size // p, cluster.devices_per_node)
        for m, what in counts(batch, p, sub):
            price(sub, {**values, B: batch // m}, p, m, what, best)
    return None if best.config is None else best


class _Best:
    """The best pipelined plan so far: the fastest that fits the budget, fewer levers breaking ties (the fastest
    where none fits)."""

    def __init__(self, memory_budget: float | None) -> None:
        self.budget = memory_budget
        self.rank: tuple[bool, float, int, int] | None = None
        self.config: dict[str, Any] | None = None
        self.predicted: Predicted | None = None

    def baseline(self, key: str) -> Baseline:
        """The best plan as baseline ``key``, saying whether it fits under a budget."""
        assert self.config is not None and self.predicted is not None
        config = dict(self.config)
        if self.budget is not None:
            config["fits_budget"] = self.predicted.peak_memory_bytes <= self.budget
        return Baseline(key, config, self.predicted)

    def beats(self, seconds: float) -> bool:
        """Whether a plan that fits is already as fast as ``seconds`` (so a slower one need not be priced)."""
        return self.rank is not None and not self.rank[0] and self.rank[1] <= seconds

    def offer(
        self, pp: PipelinePricing, cfg: dict[str, Any], comm: Callable[[], int], name: Callable[[dict], str]
    ) -> None:
        """Keep ``cfg`` run as ``pp`` if it is the best so far; ``comm()``: its bytes a step but the pipeline's,
        ``name(config)``: its name."""
        fits = self.budget is None or pp.peak <= self.budget
        levers = ("distributed_optimizer" in cfg) + (cfg.get("recompute", "none") != "none")
        rank = (not fits, pp.step_s, levers, pp.peak)
        if self.rank is None or rank < self.rank:
            self.rank, self.config = rank, _config(cfg, pp, name)
            self.predicted = Predicted(pp.step_s, pp.peak, comm() + pp.p2p_bytes)


def _counts(batch: int, stages: int, sub: DeviceMesh) -> list[tuple[int, list[dict[str, Any]]]]:
    """Each micro-batch count of a pipeline of ``stages`` on ``sub`` with the Megatron configurations that run it."""
    by_count: dict[int, list[dict[str, Any]]] = {}
    for cfg in megatron_configs(sub):
        for m in pipeline_micro_batches(batch, stages, cfg["dp"]):
            by_count.setdefault(m, []).append(cfg)
    return sorted(by_count.items(), reverse=True)


def _price_at(
    graph: OpGraph,
    sub: DeviceMesh,
    cluster: ClusterSpec,
    micro: dict[sympy.Symbol, int],
    opts: CostOptions,
    stages: int,
    m: int,
    configs: list[dict[str, Any]],
    best: _Best,
) -> None:
    """Offer ``best`` every variant of ``configs`` on a stage's mesh ``sub`` at micro-batch values ``micro``, run as
    a pipeline of ``stages`` over ``m`` micro-batches; a variant that even without a bubble, perfectly balanced, is
    no faster than a plan that fits is not replayed."""
    costs = dataclasses.replace(opts, micro_batches=m)
    _, _, priced, choices, variants = megatron_variants(graph, sub, cluster, micro, costs, best.budget, configs=configs)
    vkey = values_key(micro)
    seconds: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}  # by (pricing, choice)
    crossings: dict[int, tuple] = {}
    for i, cfg, variant_costs, rec in variants:
        applied, extra = (priced, 0) if rec is None else (rec[2], rec[0].extra_peak(rec[1], rec[2], choices[i]))
        if (id(applied), i) not in seconds:
            seconds[id(applied), i] = node_seconds(graph, applied, choices[i])
        if i not in crossings:
            crossings[i] = plan_crossings(graph, priced, choices[i], costs.itemsize, vkey)
        pieces = plan_pieces(graph, applied, choices[i], variant_costs, vkey, seconds[id(applied), i], crossings[i])
        if best.beats(m * (sum(pieces.forward) + sum(pieces.backward)) / stages):
            continue

        def comm(i: int = i, variant_costs: CostOptions = variant_costs, rec: Any = rec) -> int:
            """The mean device's bytes a step: each node runs on one stage's devices, ``m`` times."""
            summary = variant_summary(graph, priced, choices[i], variant_costs, rec, nodes=False)
            return round(summary.predicted.comm_bytes * m / stages)

        for name, virtual in schedules(stages, len(pieces), m):
            pp = price_pipeline(pieces, cluster, m, stages=stages, schedule=name, virtual=virtual, extra_peak=extra)
            log.info("%s: %.4g s, %.3g GiB", _config(cfg, pp, config_name)["name"], pp.step_s, pp.peak / 2**30)
            best.offer(pp, cfg, comm, config_name)


def _config(cfg: dict[str, Any], pp: PipelinePricing, name: Callable[[dict], str]) -> dict[str, Any]:
    """A baseline's configuration with its pipeline (the plan JSON's ``pipeline`` fields) and its ``name``."""
    config = {
        **cfg,
        "pp": pp.stages,
        "schedule": pp.schedule,
        "virtual_stages": pp.virtual,
        "micro_batches": pp.micro_batches,
        "layers_per_stage": list(pp.layers),
        "bubble": round(pp.bubble, 4),
    }
    return {**config, "name": name(config)}


def best_fsdp_pipelined(
    graph: OpGraph,
    full: DeviceMesh,
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    opts: CostOptions,
    memory_budget: float | None,
) -> Baseline | None:
    """FSDP with pipeline stages (torchtitan's FSDP x PP): each stage's parameters, gradients and optimizer state
    split over its devices as :func:`best_fsdp` splits them over all (ZeRO-3, gathered again every micro-batch,
    :data:`FSDP_GATHERED_LAYERS` units whole at a time), with or without full or selective recomputation under a
    budget, over the stage counts, micro-batches and schedules Megatron's pipelines use
    (:func:`best_megatron_pipelined`); the fastest that fits. ``None`` where the graph has no layer stack or the
    world no stage count."""

    def counts(batch: int, p: int, sub: DeviceMesh) -> list[tuple[int, Any]]:
        return [(m, None) for m in pipeline_micro_batches(batch, p, sub.size)]

    def price(sub: DeviceMesh, micro: dict[sympy.Symbol, int], p: int, m: int, _: Any, best: _Best) -> None:
        _fsdp_price_at(graph, sub, cluster, micro, opts, p, m, best)

    best = _pipelines(graph, full, cluster, values, memory_budget, counts, price)
    return None if best is None else best.baseline("fsdp_pipelined")


def _fsdp_price_at(
    graph: OpGraph,
    sub: DeviceMesh,
    cluster: ClusterSpec,
    micro: dict[sympy.Symbol, int],
    opts: CostOptions,
    stages: int,
    m: int,
    best: _Best,
) -> None:
    """Offer ``best`` FSDP on a stage's mesh ``sub`` at micro-batch values ``micro``, each recomputation variant run
    as a pipeline of ``stages`` over ``m`` micro-batches (as :func:`_price_at` does Megatron's)."""
    costs = dataclasses.replace(opts, zero=3, distributed_optimizer=False, regather_all=True, micro_batches=m)
    dp = data_parallel_assignment(graph, sub, values=micro)
    priced, (choice,) = price_assignments(graph, [dp], sub, cluster, micro, costs)
    gathered, vkey = fsdp_gathered(graph, priced, choice), values_key(micro)
    crossings = plan_crossings(graph, priced, choice, costs.itemsize, vkey)
    for mode, rec in fsdp_variants(graph, priced, micro, costs, best.budget):
        applied, extra = (priced, 0) if rec is None else (rec[2], rec[0].extra_peak(rec[1], rec[2], choice))
        pieces = plan_pieces(graph, applied, choice, costs, vkey, crossings=crossings)
        if best.beats(m * (sum(pieces.forward) + sum(pieces.backward)) / stages):
            continue

        def comm(rec: Any = rec) -> int:
            """The mean device's bytes a step: each node runs on one stage's devices, ``m`` times."""
            summary = variant_summary(graph, priced, choice, costs, rec, nodes=False)
            return round(summary.predicted.comm_bytes * m / stages)

        cfg = {"dp": sub.size, "zero": 3, "recompute": mode}
        for name, virtual in schedules(stages, len(pieces), m):
            pp = price_pipeline(
                pieces, cluster, m, stages=stages, schedule=name, virtual=virtual, extra_peak=extra + gathered
            )
            best.offer(pp, cfg, comm, _fsdp_name)


def _fsdp_name(config: dict[str, Any]) -> str:
    """``"fsdp8 x pp4 (ZeRO-3) +full recompute +32 micro-batches +interleaved v2"``."""
    name = f"fsdp{config['dp']} x pp{config['pp']} (ZeRO-3)"
    if config.get("recompute", "none") != "none":
        name += f" +{config['recompute']} recompute"
    name += f" +{config['micro_batches']} micro-batches"
    return name + (f" +interleaved v{config['virtual_stages']}" if config.get("virtual_stages", 1) > 1 else "")
