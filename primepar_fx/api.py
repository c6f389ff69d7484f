"""Public entry points. This module only orchestrates the pipeline stages; it holds no logic of its own.

capture (torch.export) -> symbolic shapes -> op dimension rules -> partition space -> ...
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from primepar_fx.frontend.capture import capture, config_seq_max
from primepar_fx.frontend.specialize import StaticSeqWarning
from primepar_fx.graph import OpGraph, check_fallback, graph_of
from primepar_fx.graph.replicate import analyze_replicated
from primepar_fx.models import model_example_inputs
from primepar_fx.planning.options import PlanOptions
from primepar_fx.planning.planner import plan_graph
from primepar_fx.planning.workers import default_workers
from primepar_fx.record.plan import Plan
from primepar_fx.report.explain import Explanation, explain_choice
from primepar_fx.utils.gcpause import gc_paused

log = logging.getLogger(__name__)


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


def analyze_at(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None,
    seq: int | None,
    **options: Any,
) -> OpGraph:
    """:func:`analyze` (``options``: its keywords) for a graph to be planned at ``seq`` tokens.

    A model whose sequence length cannot stay symbolic is captured at the example's (``graph.captured.static_seq``);
    where ``seq`` differs, it is captured again from inputs of ``seq`` tokens and the example's batch
    (:func:`~primepar_fx.models.model_example_inputs`), and only that capture's
    :class:`~primepar_fx.frontend.specialize.StaticSeqWarning` is shown. A model whose inputs that function cannot
    make, or makes other than the example's (other arguments), keeps the first graph, which the planner refuses to
    plan at ``seq``."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        graph = analyze(model, example_args, example_kwargs, **options)
    captured, again = graph.captured, None
    if seq is not None and captured.static_seq and captured.example_seq != seq:
        again = _inputs_at(model, example_args, example_kwargs, captured.example_batch, seq)
    for w in said:
        if again is None or not issubclass(w.category, StaticSeqWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if again is None:
        return graph
    log.info("%s: captured again at S=%d, since its sequence length cannot stay symbolic", graph.name, seq)
    return analyze(model, *again, **options)


def _inputs_at(
    model: torch.nn.Module, args: Any, kwargs: dict[str, Any] | None, batch: int, seq: int
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Inputs of ``batch`` x ``seq`` tokens (:func:`~primepar_fx.models.model_example_inputs`) passed as ``args``
    and ``kwargs`` are (as many positional, the same keywords); ``None`` where they cannot be made so."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        made = model_example_inputs(model, device, batch, seq)
    except ValueError:  # a model with inputs of its own
        return None
    args = (args,) if isinstance(args, torch.Tensor) else args
    return made if len(made[0]) == len(args) and set(made[1]) == set(kwargs or {}) else None


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
    differ from the example's, since the graph is symbolic in ``B`` and ``S``. A model whose sequence length cannot
    stay symbolic (GPT-Neo, MPT) is captured again at ``seq`` (:func:`analyze_at`); where its inputs cannot be
    made (its own), plan it from examples of ``seq`` tokens. Works on meta-device models.

    ``memory_budget``: a hard limit on each device's predicted peak (bytes, or a size such as ``"30GiB"``);
    ``"device"`` (the default) is the cluster's device memory less a reserve, ``None`` no limit. ``dtype`` may also
    be a torch dtype. ``workers``: processes that price and search side by side; ``None`` (the default) is one per
    core. ``replicate_layers`` (default) captures two of the model's identical layers and replicates them
    (:mod:`primepar_fx.graph.replicate`); pass ``False`` for a model whose forward treats later layers differently.
    Train a ZeRO plan (``zero``) with ``module.optimizer(torch.optim.AdamW, ...)``. Every other option is the
    attribute of that name of :class:`~primepar_fx.planning.options.PlanOptions` (the search: ``alpha``,
    ``method``, ``allow_prime``, ``baselines``, ``grouped``, ``group_digits``; what a device keeps per parameter:
    ``grad_dtype``, ``master_weights``, ``state_dtype``; the levers ``recompute``, ``zero``, ``micro_batches``), and
    every option is checked (:meth:`PlanOptions.make <primepar_fx.planning.options.PlanOptions.make>`) before the
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
    graph = analyze_at(model, args, kwargs, seq, fallback=fallback, replicate_layers=replicate_layers)
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
