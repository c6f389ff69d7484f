"""Public entry points. This module only orchestrates the pipeline stages; it holds no logic of its own.

capture (torch.export) -> symbolic shapes -> op dimension rules -> partition space -> ...
"""

from __future__ import annotations

from typing import Any

import torch

from primepar_fx.frontend.capture import capture, config_seq_max
from primepar_fx.graph import OpGraph, check_fallback, graph_of
from primepar_fx.graph.replicate import analyze_replicated
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import plan_graph
from primepar_fx.planning.workers import default_workers
from primepar_fx.record.plan import Plan
from primepar_fx.report.explain import Explanation, explain_choice
from primepar_fx.utils.gcpause import gc_paused


@gc_paused
def analyze(
    model: torch.nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    fallback: str | None = None,
    seq_max: int | None = None,
    replicate_layers: bool = False,
) -> OpGraph:
    """Capture ``model`` with symbolic batch ``B`` and sequence ``S`` and apply the op dimension rules.

    ``example_args`` (a tuple, or one tensor) and ``example_kwargs`` are one call of ``model``, the batch in dim 0
    and the sequence in dim 1 of the token inputs. ``name`` names the graph in reports; ``seq_max`` bounds the
    sequence length the capture allows (default: the model config's ``max_position_embeddings`` or ``max_seq``).

    ``fallback="replicate"`` runs ops without a rule replicated instead of raising
    :class:`~primepar_fx.rules.registry.MissingRuleError`. ``replicate_layers=True`` captures two layers (two
    units where the config's layer types alternate) of the model's layer stack and replicates them
    (:mod:`primepar_fx.graph.replicate`): the same nodes, names and edges, in a fraction of the time, but a graph
    that can be planned and not compiled.
    """
    check_fallback(fallback)
    if isinstance(example_args, torch.Tensor):  # one tensor, not a tuple of them
        example_args = (example_args,)
    if replicate_layers:
        return analyze_replicated(model, example_args, example_kwargs, name=name, fallback=fallback, seq_max=seq_max)
    return graph_of(
        lambda static: capture(model, example_args, example_kwargs, name=name, seq_max=seq_max, static_seq=static),
        fallback=fallback,
    )


def plan(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] | tuple[tuple[Any, ...], dict[str, Any]] = (),
    *,
    world_size: int,
    cluster: Any = None,
    batch: int | None = None,
    seq: int | None = None,
    memory_budget: float | str | None = "device",
    dtype: Any = "fp32",
    alpha: float = 0.0,
    method: str = "auto",
    allow_prime: bool = True,
    baselines: bool = True,
    fallback: str | None = None,
    grouped: bool | str | None = None,
    group_digits: int = 3,
    progress: bool = False,
    replicate_layers: bool = True,
    grad_dtype: Any = None,
    master_weights: bool | None = None,
    state_dtype: Any = "fp32",
    recompute: str = "auto",
    zero: str | int = "auto",
    micro_batches: str | int = "auto",
    workers: int | None = None,
) -> Plan:
    """Capture ``model``, price its partition space on ``cluster`` and search the cheapest plan.

    ``example_inputs`` is the tuple of positional example arguments, or ``(args, kwargs)``. ``world_size`` devices
    of ``cluster`` (a preset name, a spec file or a :class:`~primepar_fx.cost.cluster.ClusterSpec`; default:
    :func:`~primepar_fx.planning.options.default_cluster`, ``v100-paper`` unless ``$PRIMEPAR_CLUSTER`` names
    another). ``batch`` and ``seq`` (default: the example's sizes) are the sizes the plan is priced at; they may
    differ from the example's, since the graph is symbolic in ``B`` and ``S``. Works on meta-device models.

    ``memory_budget``: a hard limit on each device's predicted peak (bytes, or a size such as ``"30GiB"``);
    ``"device"`` (the default) is the cluster's device memory less a reserve
    (:func:`~primepar_fx.planning.options.device_budget`), ``None`` no limit.
    ``dtype``: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or a torch dtype. ``alpha``: seconds per byte of
    memory added to the objective. ``method``: ``"dp"``, ``"ilp"`` or ``"auto"``. ``allow_prime=False`` leaves
    P(S x S) out (the split-only space). ``baselines``: also price Megatron, data parallelism and split-only.
    ``fallback="replicate"`` runs ops without a rule replicated. ``grouped``: past three device digits
    (16 or more GPUs on 4-GPU nodes) the search runs on the digits merged into three: every such grouping, the
    cheapest plan kept (``None``, the default, or ``"all"``), only the leading digits merged (``True`` or
    ``"leading"``), or the full mesh and then every grouping (``False``); see
    :func:`~primepar_fx.planning.groupings.search_meshes`. ``group_digits`` (above 3) adds the groupings into 4, ...,
    that many digits to the default's, finer and slower.
    ``progress`` shows the pricing's progress bars on stderr.
    ``grad_dtype`` (default: ``dtype``), ``master_weights`` (an fp32 copy of every parameter; default: when
    ``dtype`` is 16 bits) and ``state_dtype`` (the optimizer's two moments, default fp32) say what a device keeps
    per parameter besides it: by default 16 bytes a parameter in every dtype, as mixed-precision Adam keeps.
    ``recompute``: activation recomputation per layer (:mod:`~primepar_fx.levers.recompute`): ``"auto"`` (the
    default: none when the fastest plan fits the budget, else the fastest of none, selective and full on the
    fewest first layers that fit), or ``"none"``, ``"selective"``, ``"full"`` on every layer.
    ``zero``: ZeRO's stage for the parameters the plan replicates (:mod:`~primepar_fx.runtime.zero`): ``"auto"``
    (the default: 0 when the plan fits without, else 2, which splits gradients and optimizer state over the
    replicas at no extra time), or 0, 1, 2. Train a ZeRO plan with ``module.optimizer(torch.optim.AdamW, ...)``.
    ``micro_batches``: gradient accumulation over micro-batches of ``batch / micro_batches``: ``"auto"`` (the
    default: 1 unless the budget binds, then the fastest of 1, 2, 4, 8 that divide the batch) or a count; the
    compiled module splits the batch itself (:mod:`~primepar_fx.compiler.microbatch`).
    ``workers``: processes that price and search the groupings of the digits side by side (forked, where the
    platform can fork: :mod:`~primepar_fx.planning.workers`); ``None`` (the default) is one per core.
    ``replicate_layers`` (default) captures two of the model's identical layers and replicates them
    (:mod:`primepar_fx.graph.replicate`); pass ``False`` for a model whose forward treats later layers differently.
    Every option is checked (:meth:`PlanOptions.make <primepar_fx.planning.options.PlanOptions.make>`) before the
    capture.
    """
    options = PlanOptions.make(
        cluster=cluster,
        world_size=world_size,
        batch=batch,
        seq=seq,
        memory_budget=memory_budget,
        dtype=dtype,
        alpha=alpha,
        method=method,
        allow_prime=allow_prime,
        baselines=baselines,
        fallback=fallback,
        grouped=grouped,
        group_digits=group_digits,
        progress=progress,
        grad_dtype=grad_dtype,
        master_weights=master_weights,
        state_dtype=state_dtype,
        recompute=recompute,
        zero=zero,
        micro_batches=micro_batches,
        workers=default_workers() if workers is None else workers,
    )
    limit = config_seq_max(model)
    if seq is not None and limit is not None and seq > limit:
        raise ValueError(f"seq={seq} exceeds the model's maximum sequence length of {limit} (its config)")
    args, kwargs = _split_inputs(example_inputs)
    graph = analyze(model, args, kwargs, fallback=fallback, replicate_layers=replicate_layers)
    return plan_graph(graph, options)


def explain(plan: Plan, node_name: str, *, graph: OpGraph, cluster: Any = None) -> Explanation:
    """Why ``plan`` gave node ``node_name`` its partition: :func:`~primepar_fx.report.explain.explain_choice`."""
    return explain_choice(plan, node_name, graph=graph, cluster=cluster)


def _split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        return example_inputs[0], example_inputs[1]
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}
