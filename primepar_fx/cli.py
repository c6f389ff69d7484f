"""The ``primepar-fx`` command line.

    primepar-fx explain MODEL --world-size N [--batch B --seq S]
    primepar-fx plan MODEL --world-size N --cluster NAME|spec.toml --batch B --seq S [-o plan.json]
    primepar-fx calibrate [--world-size N] [--quick] -o spec.toml
    primepar-fx dump MODEL --world-size N [--plan plan.json|searched|megatron|prime|...] [--batch B --seq S] -o DIR

MODEL: a zoo name (``primepar-fx explain --list``), ``hf:FAMILY`` for a tiny Hugging Face model (gpt2, llama, opt,
bloom, falcon, any causal-LM ``model_type``; needs ``transformers``), the path of a Hugging Face ``config.json``
(``hf:`` before it optional: built offline on the meta device; ``--layers N`` keeps its first N layers), or
``package.module:callable`` returning a module or a tuple ``(module, args, kwargs)`` with example inputs.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import os
import sys
import time
from typing import Any

import torch

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.planning.options import DEVICE_MEMORY_RESERVE, PlanOptions, parse_plan
from primepar_fx.planning.workers import default_workers
from primepar_fx.record.plan import Plan
from primepar_fx.search import InfeasibleBudget
from primepar_fx.utils.cliargs import digit_list, non_negative_float, parse_budget, positive_int, table_format
from primepar_fx.utils.malloc import steady_malloc
from primepar_fx.utils.units import format_bytes

log = logging.getLogger("primepar_fx")


MODEL_HELP = "zoo name, hf:FAMILY, a Hugging Face config.json, or package.module:callable"


class CliError(Exception):
    """A bad argument or input the command line found itself: ``error: ...`` on stderr, exit status 2."""


DEFAULT_BATCH, DEFAULT_SEQ = 2, 16  # the example inputs' sizes where the command line does not set them


def load_model(
    spec: str, *, meta: bool = True, batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ, layers: int | None = None
) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """:func:`primepar_fx.models.resolve_model`, its errors as the command line's."""
    from primepar_fx.models import resolve_model

    try:
        return resolve_model(spec, meta=meta, batch=batch, seq=seq, layers=layers)
    except ValueError as e:
        raise CliError(str(e)) from None


def _check_digits(args: argparse.Namespace) -> None:
    if args.digits and math.prod(args.digits) != args.world_size:
        digits = ",".join(map(str, args.digits))
        raise CliError(f"--digits {digits} multiply to {math.prod(args.digits)}, not --world-size {args.world_size}")


def _mesh(args: argparse.Namespace):
    from primepar_fx.partition import DeviceMesh

    _check_digits(args)
    if args.digits:
        return DeviceMesh(args.digits)
    return DeviceMesh.for_world_size(args.world_size, args.devices_per_node)


def _check_seq(model: torch.nn.Module, seq: int | None, name: str) -> None:
    from primepar_fx.frontend.capture import config_seq_max

    limit = config_seq_max(model)
    if seq is not None and limit is not None and seq > limit:
        raise CliError(f"--seq {seq} exceeds the maximum sequence length of {name} ({limit})")


def _at_seq(
    model: torch.nn.Module, ex_args: tuple[Any, ...], ex_kwargs: dict[str, Any], args: argparse.Namespace
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example inputs to capture with: ``--seq`` tokens long where that is longer than the default and the CLI
    makes them (not a ``package.module:callable``), so that a model whose length cannot stay symbolic is captured
    once, at the length planned (a symbolic capture is the same graph at any example length)."""
    from primepar_fx.models import builds_examples, model_example_inputs

    seq = getattr(args, "seq", None)
    if seq is None or seq <= DEFAULT_SEQ or not builds_examples(args.model):
        return ex_args, ex_kwargs
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return model_example_inputs(model, device, DEFAULT_BATCH, seq)


def _analyze_model(
    model: torch.nn.Module, ex_args: tuple[Any, ...], ex_kwargs: dict[str, Any], name: str, args: argparse.Namespace
) -> Any:
    """The model's graph (two layers replicated unless ``--full-capture``), for planning at ``--seq``: a model whose
    sequence length cannot stay symbolic is captured at the example's (:func:`_at_seq`), and again at another
    ``--seq`` (a shorter one) where its inputs can be made (:func:`primepar_fx.api.analyze_at`)."""
    from primepar_fx.api import analyze_at

    seq, replicate = getattr(args, "seq", None), not args.full_capture
    return analyze_at(model, ex_args, ex_kwargs, seq, name=name, fallback=args.fallback, replicate_layers=replicate)


def cmd_explain(args: argparse.Namespace) -> int:
    from primepar_fx.models import ZOO
    from primepar_fx.report.explain import explain_table

    if args.list:
        for name, cfg in ZOO.items():
            print(f"{name:12s} {cfg.description}")
        return 0
    if not args.model:
        raise CliError("explain needs a MODEL (or --list)")
    if (args.batch is None) != (args.seq is None):
        raise CliError("give both --batch and --seq, or neither")
    mesh = _mesh(args)
    t0 = time.perf_counter()
    model, ex_args, ex_kwargs, name = load_model(args.model, layers=args.layers)
    _check_seq(model, args.seq, name)
    graph = _analyze_model(model, *_at_seq(model, ex_args, ex_kwargs, args), name, args)
    print(
        explain_table(
            graph,
            mesh,
            batch=args.batch,
            seq=args.seq,
            allow_prime=not args.no_prime,
            tablefmt=args.format,
            fold=not args.all_nodes,
        )
    )
    print(f"\nanalysed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``primepar-fx plan``: capture the model, search its plan, print it against the baselines and write it."""
    from primepar_fx.planning.planner import plan_graph

    t0 = time.perf_counter()
    _check_digits(args)
    _check_output_files(args)
    options = _plan_options(args)  # every option checked before the capture
    model, ex_args, ex_kwargs, name = load_model(args.model, layers=args.layers)
    built_s = time.perf_counter() - t0
    _check_seq(model, args.seq, name)
    graph = _analyze_model(model, *_at_seq(model, ex_args, ex_kwargs, args), name, args)
    captured_s = time.perf_counter() - t0 - built_s
    try:
        plan = plan_graph(graph, options)
    except InfeasibleBudget as e:
        raise CliError(_infeasible(e, options, args.memory_budget is None)) from None
    print(plan.summary_table(tablefmt=args.format, fold=not args.all_nodes))
    _print_baselines(plan, options)
    for warning in plan_warnings(plan, options.cluster, options.memory_budget, graph):
        print(f"warning: {warning}", file=sys.stderr)
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    if args.report:
        from primepar_fx.report.html import write_report

        print(f"wrote {write_report(args.report, graph, plan)}")
    print(
        f"planned in {time.perf_counter() - t0:.1f} s: model {built_s:.2f} s, capture {captured_s:.2f} s, "
        f"{plan.search.describe_times(plan.digits)}, baselines {plan.search.baselines_s or 0.0:.2f} s",
        file=sys.stderr,
    )
    return 0


def _check_output_files(args: argparse.Namespace) -> None:
    """``-o`` and ``--report`` name files, not folders."""
    if args.output and os.path.isdir(args.output):
        raise CliError(f"-o {args.output} is a folder; give the plan's file name, e.g. {args.output}/plan.json")
    if args.report and os.path.isdir(args.report):
        raise CliError(f"--report {args.report} is a folder; give the report's file name, e.g. {args.report}/plan.html")


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """``plan``'s options, every one checked (:meth:`PlanOptions.make`)."""
    return PlanOptions.make(
        cluster=args.cluster,
        world_size=args.world_size,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        grad_dtype=args.grad_dtype,
        master_weights=args.master_weights,
        state_dtype=args.state_dtype,
        recompute=args.recompute,
        zero=args.zero,
        micro_batches=args.micro_batches,
        stages=None if args.stages == "auto" else args.stages,
        schedule=args.schedule,
        memory_budget="device" if args.memory_budget is None else args.memory_budget,
        alpha=args.alpha,
        method=args.method,
        allow_prime=not args.no_prime,
        baselines=not args.no_baselines,
        digits=args.digits,
        canonical=args.canonical,
        grouped=args.grouped,
        group_digits=args.group_digits,
        fallback=args.fallback,
        progress=sys.stderr.isatty(),
        workers=default_workers() if args.workers is None else args.workers,
    )


def _print_baselines(plan: Plan, options: PlanOptions) -> None:
    """The plan against the best Megatron and FSDP configurations: its throughput and peak memory relative to
    theirs, or that none of them fits the budget."""
    if plan.baselines:
        print()
    for key, title in (
        ("megatron", "Megatron configuration"),
        ("megatron_pipelined", "Megatron configuration with pipeline stages"),
        ("fsdp", "FSDP configuration"),
        ("fsdp_pipelined", "FSDP configuration with pipeline stages"),
    ):
        base = plan.baselines.get(key)
        if base is None:
            continue
        name = base.config.get("name", key)
        if base.config.get("fits_budget") is False:
            print(
                f"no {title} fits the budget of {format_bytes(options.memory_budget)}: the fastest, {name}, needs "
                f"{format_bytes(base.predicted.peak_memory_bytes)} (not compared)"
            )
            continue
        speed = base.predicted.step_time_s / plan.predicted.step_time_s
        mem = plan.predicted.peak_memory_bytes / max(1, base.predicted.peak_memory_bytes)
        best = {
            "megatron": "best Megatron",
            "megatron_pipelined": "best Megatron with pipelines",
            "fsdp": "best FSDP",
            "fsdp_pipelined": "best FSDP with pipelines",
        }[key]
        print(f"vs {best} ({name}): {speed:.2f}x throughput, {mem:.0%} of its peak memory")
        if base.config.get("fallback_nodes"):
            print(
                f"  ({base.config['fallback_nodes']} of {len(plan.nodes)} nodes could not take that configuration's "
                "split on some digit (it does not divide their dim, or they may not split it) and are replicated there)"
            )


def _infeasible(e: InfeasibleBudget, options: PlanOptions, default: bool) -> str:
    """What to tell a user whose budget no plan meets: the smallest one that would, and what lowers it."""
    spec, budget = options.cluster, format_bytes(e.budget)
    if default:
        budget += (
            f" (the default: {1 - DEVICE_MEMORY_RESERVE:.0%} of the {format_bytes(spec.device.memory_capacity)} of "
            f"a {spec.device.name}; --memory-budget none lifts it)"
        )
    levers = ["more devices (-n)"] if e.floor else ["more devices (-n)", "a smaller --batch"]
    if options.dtype == "fp32" and not e.floor:
        levers.append("--dtype bf16 (half the activations)")
    costs = options.cost_options()
    if costs.optimizer_states and costs.state_dtype == "fp32":
        levers.append("--state-dtype bf16 (half the optimizer state)")
    if costs.keeps_master:
        levers.append("--no-master-weights")
    if not e.floor:  # a bound from the state alone: activations and replicas are not what is over
        if options.recompute in ("none", "selective"):
            levers.append("--recompute auto or full (recompute the layers' activations in Backward)")
        if options.zero in (0, 1):
            levers.append("--zero auto or 2 (gradients and optimizer state split over each parameter's replicas)")
        elif options.zero == 2:
            levers.append("--zero auto or 3 (the parameters split too, gathered only around their uses)")
        if options.micro_batches != "auto":
            levers.append("--micro-batches auto or more (a smaller micro-batch's activations)")
    searched = {"auto": "with or without recomputation", "none": "without recomputation"}.get(
        options.recompute, f"with {options.recompute} recomputation"
    )
    searched += " and ZeRO-2 or 3" if options.zero == "auto" else f" and ZeRO stage {options.zero}"
    if options.micro_batches == "auto":
        from primepar_fx.levers.choices import micro_batch_tries

        tries = micro_batch_tries(options.micro_batches, options.memory_budget, options.batch)  # type: ignore[arg-type]
        searched += f", in up to {max(tries)} micro-batches"
    else:
        searched += f", in {options.micro_batches} micro-batches"
    if e.floor:
        need = f"no plan can need less than {format_bytes(e.min_memory)} per device, {e.floor}"
    else:
        need = (
            f"the smallest needs {format_bytes(e.min_memory)} per device ({math.ceil(e.min_memory):,} bytes) {searched}"
        )
    return f"no plan fits the memory budget of {budget}: {need}. What would lower it: {', '.join(levers)}"


def plan_warnings(plan: Plan, spec: ClusterSpec, memory_budget: int | None, graph: Any = None) -> list[str]:
    """What a plan's reader should know although it is a valid plan: it does not fit in the devices' memory, or
    no node of ``graph`` (the planned :class:`~primepar_fx.graph.OpGraph`) can split at the plan's sizes."""
    out = []
    peak, capacity = plan.predicted.peak_memory_bytes, spec.device.memory_capacity
    if memory_budget is None and peak > capacity:
        out.append(
            f"the plan needs {peak / 2**30:.1f} GiB per device, more than the {capacity / 2**30:.1f} GiB of a "
            f"{spec.device.name} in {spec.name!r}: leave out --memory-budget none to search within it, or use "
            f"more devices or a smaller --batch{' or --dtype bf16' if plan.dtype == 'fp32' else ''}"
        )
    replicated = all(set(n.partition.split(",")) <= {"R"} for n in plan.nodes)
    if graph is not None and plan.world_size > 1 and replicated and not _any_split(graph, plan):
        out.append(
            f"every node runs replicated: no dim divides over the device digits {list(plan.digits)} at "
            f"B={plan.batch}, S={plan.seq}; choose sizes divisible by the world size, or other --digits"
        )
    return out


def _any_split(graph: Any, plan: Plan) -> bool:
    """Whether some node of ``graph`` has a legal partition other than full replication at the plan's sizes."""
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.partition import DeviceMesh, Replicate, enumerate_sequences

    mesh, values, seen = DeviceMesh(plan.digits), {B: plan.batch, S: plan.seq}, set()
    for node in graph.nodes.values():
        if node.dims not in seen:
            seen.add(node.dims)
            seqs = enumerate_sequences(node.dims, mesh, values=values)
            if any(not isinstance(e, Replicate) for seq in seqs for e in seq.elements):
                return True
    return False


def cmd_dump(args: argparse.Namespace) -> int:
    from primepar_fx.api import analyze
    from primepar_fx.compiler.agree import check_runnable, compile_options, resolve_plan
    from primepar_fx.report.dump import dump

    t0 = time.perf_counter()
    options = compile_options(cluster=args.cluster, dtype=args.dtype).replace(world_size=args.world_size)
    try:
        kind, value = parse_plan(args.plan)
    except ValueError as e:
        raise CliError(f"--plan: {e}") from None
    given = Plan.load(value) if kind == "file" else None
    if given is not None:
        try:
            check_runnable(given, pipelines=False, what="the graph dump")
        except NotImplementedError as e:
            raise CliError(f"--plan {args.plan}: {e}") from None
    batch = args.batch or (given.batch if given else 2)
    seq = args.seq or (given.seq if given else 16)
    if given is not None and (given.batch, given.seq, given.world_size) != (batch, seq, args.world_size):
        raise CliError(
            f"{args.plan} is for B={given.batch}, S={given.seq} on {given.world_size} devices, not "
            f"B={batch}, S={seq} on {args.world_size}"
        )
    model, ex_args, ex_kwargs, name = load_model(args.model, batch=batch, seq=seq, layers=args.layers)
    graph = analyze(model, ex_args, ex_kwargs, name=name, fallback=args.fallback)
    if (graph.captured.example_batch, graph.captured.example_seq) != (batch, seq):
        raise CliError(
            f"{name} returned example inputs of B={graph.captured.example_batch}, "
            f"S={graph.captured.example_seq}; pass those as --batch/--seq"
        )
    plan = given or resolve_plan(graph, args.plan, options)
    files = dump(graph, plan, args.output)
    p = plan.predicted
    print(f"{plan.model} on {plan.world_size} devices {list(plan.digits)}, B={batch}, S={seq}, plan {args.plan}:")
    print(f"  predicted step {p.step_time_s * 1e3:.4g} ms, peak memory {p.peak_memory_bytes / 2**20:.4g} MiB")
    print(f"wrote {len(files)} files to {args.output}: {', '.join(f.name for f in files)}")
    print(f"dumped in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-n", type=positive_int, default=1, help="number of devices (default 1)")
    p.add_argument("--digits", type=digit_list, help="device-ID digit radices, most significant first, e.g. 3,2,2")
    p.add_argument("--fallback", choices=["replicate"], help="run ops without a rule replicated")
    p.add_argument(
        "--layers", type=positive_int, help="a Hugging Face config file's model cut to its first N layers (quick look)"
    )
    p.add_argument(
        "--full-capture",
        action="store_true",
        help="export every layer instead of two (or two units) replicated (for models whose later layers differ)",
    )
    p.add_argument("--no-prime", action="store_true", help="leave P(S x S) out of the space (split-only)")
    p.add_argument(
        "--all-nodes",
        action="store_true",
        help="print every node; by default the copies of a repeated block of rows (identical layers) are folded",
    )
    p.add_argument("--format", default="simple", type=table_format, help="tabulate table format (simple, github, ...)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="primepar-fx",
        description="Explain, plan and dump spatial-temporal partitions of a model (PrimePar), or calibrate a "
        "cluster spec.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (PRIMEPAR_LOG=DEBUG for more)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_explain_parser(sub)
    _add_plan_parser(sub)
    _add_dump_parser(sub)
    from primepar_fx.calibrate.measure import add_calibrate_parser

    add_calibrate_parser(sub)
    return p


def _add_explain_parser(sub: Any) -> None:
    e = sub.add_parser("explain", help="per-node table: op, symbolic shape, FLOPs, legal partition sequences")
    e.add_argument("model", nargs="?", help=MODEL_HELP)
    e.add_argument("--list", action="store_true", help="list the zoo models and exit")
    _add_model_args(e)
    e.add_argument("--devices-per-node", type=positive_int, help="devices per node (node digits come first)")
    e.add_argument("--batch", type=positive_int, help="evaluate at this batch size (with --seq)")
    e.add_argument("--seq", type=positive_int, help="evaluate at this sequence length (with --batch)")
    e.set_defaults(func=cmd_explain)


def _add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="search the cheapest plan and compare it with Megatron and data parallelism")
    pl.add_argument("model", help=MODEL_HELP)
    _add_model_args(pl)
    _add_priced_at_args(pl)
    _add_dtype_args(pl)
    _add_memory_args(pl)
    _add_search_args(pl)
    pl.add_argument("-o", "--output", help="write the plan JSON here")
    pl.add_argument("--report", metavar="HTML", help="write a self-contained HTML report of the plan here")
    pl.set_defaults(func=cmd_plan)


def _add_priced_at_args(pl: argparse.ArgumentParser) -> None:
    """``plan``'s cluster, batch and sequence length: what the plan is priced at."""
    pl.add_argument(
        "--cluster",
        help="preset name or spec file (.json/.toml) (default: $PRIMEPAR_CLUSTER, else v100-paper)",
    )
    pl.add_argument("--batch", type=positive_int, required=True, help="global batch size the plan is priced at")
    pl.add_argument("--seq", type=positive_int, required=True, help="sequence length the plan is priced at")


def _add_dtype_args(pl: argparse.ArgumentParser) -> None:
    """``plan``'s dtypes: of parameters and activations, gradients, master weights and optimizer moments."""
    pl.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of parameters and activations (default fp32)",
    )
    pl.add_argument(
        "--grad-dtype",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of parameter gradients (default: --dtype)",
    )
    pl.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        help="keep an fp32 master copy of every parameter (default: when --dtype is bf16 or fp16)",
    )
    pl.add_argument(
        "--state-dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the optimizer's two moments (default fp32)",
    )


def _add_memory_args(pl: argparse.ArgumentParser) -> None:
    """``plan``'s memory levers (recomputation, ZeRO, micro-batches), its budget and the weight of memory."""
    pl.add_argument(
        "--recompute",
        default="auto",
        choices=["auto", "none", "selective", "full"],
        help="activation recomputation per layer: auto (default: none unless the budget needs it, then the "
        "fastest that fits), or none / selective / full on every layer",
    )
    pl.add_argument(
        "--zero",
        default="auto",
        choices=["auto", "0", "1", "2", "3"],
        help="ZeRO stage for the parameters a plan replicates: auto (default: 0 unless the budget needs it, then "
        "2, then 3 where nothing fits at 2), 0, 1 (optimizer state split over the replicas), 2 (gradients too) or 3 "
        "(the parameters too, gathered around their uses)",
    )
    pl.add_argument(
        "--micro-batches",
        default="auto",
        metavar="{auto,M}",
        help="gradient accumulation over M micro-batches of --batch / M: auto (default: 1 unless the budget needs "
        "more, then the fastest of 1, 2, 4, 8 that divide the batch) or a count",
    )
    pl.add_argument(
        "--stages",
        type=_stages,
        default="auto",
        metavar="{auto,P}",
        help="pipeline stages: auto (default: searched beside the plan without stages where the devices span "
        "nodes), 1 (none) or P (the plan runs as P stages of -n / P devices each)",
    )
    pl.add_argument(
        "--schedule",
        default=None,
        help="the pipeline schedule: GPipe, 1F1B or Interleaved1F1B (default: 1F1B and Interleaved1F1B searched)",
    )
    pl.add_argument(
        "--memory-budget",
        type=parse_budget,
        help="hard per-device budget, e.g. 30GiB; 'none' lifts it (default: the device's memory less 10%%)",
    )
    pl.add_argument(
        "--alpha", type=non_negative_float, default=0.0, help="weight of memory (per byte) in the objective"
    )


def _stages(text: str) -> str | int:
    """``--stages``: ``auto`` or a whole number >= 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number >= 1, got {text!r}")
    return int(text)


def _add_search_args(pl: argparse.ArgumentParser) -> None:
    """How ``plan`` searches: the solver, the split orders and digit groupings searched, the baselines, the
    workers."""
    pl.add_argument(
        "--method",
        default="auto",
        choices=["auto", "dp", "ilp"],
        help="auto (default: the DP, the ILP where the DP's tables would be too large), dp or ilp",
    )
    pl.add_argument("--canonical", action="store_true", help="search one split order per network level (faster)")
    grouping = pl.add_mutually_exclusive_group()
    grouping.add_argument(
        "--grouped",
        nargs="?",
        const="leading",
        choices=["leading", "all"],
        default=None,
        help="past 3 device digits, search the digits merged into 3: every grouping, the cheapest plan kept (all, "
        "the default), or the leading (inter-node) digits merged only (leading, what --grouped alone means)",
    )
    grouping.add_argument(
        "--no-grouped",
        dest="grouped",
        action="store_false",
        help="search the full mesh (slow past 3 digits), then every grouping; the cheapest plan kept",
    )
    pl.add_argument(
        "--group-digits",
        type=positive_int,
        default=3,
        metavar="N",
        help="with the groupings of every digit (the default), also search those into 4..N digits: finer plans, "
        "slower (32 GPUs, N=4: ~1 minute); N >= the mesh's digits: the full mesh",
    )
    pl.add_argument("--no-baselines", action="store_true", help="skip pricing Megatron / data-parallel / split-only")
    pl.add_argument(
        "--workers",
        type=positive_int,
        help="processes that price and search the groupings of the digits side by side (default: one per core; "
        "1: this process alone)",
    )


def _add_dump_parser(sub: Any) -> None:
    d = sub.add_parser("dump", help="write the captured graph, plan, per-node table, per-rank code and a picture")
    d.add_argument("model", help=MODEL_HELP)
    d.add_argument("--world-size", "-n", type=positive_int, required=True, help="number of ranks")
    d.add_argument(
        "--layers", type=positive_int, help="a Hugging Face config file's model cut to its first N layers (quick look)"
    )
    d.add_argument(
        "--plan",
        default="searched",
        help="a plan JSON, 'searched' (default), 'megatron', 'megatron-sp', 'data_parallel', 'prime' or 'random:SEED'",
    )
    d.add_argument("--batch", type=positive_int, help="global batch size (default: the plan's, else 2)")
    d.add_argument("--seq", type=positive_int, help="sequence length (default: the plan's, else 16)")
    d.add_argument(
        "--cluster",
        help="preset name or spec file the plan is priced on (default: $PRIMEPAR_CLUSTER, else this machine's: "
        "cpu-gloo without CUDA)",
    )
    d.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of parameters and activations (default fp32)",
    )
    d.add_argument("--fallback", choices=["replicate"], help="run ops without a rule replicated")
    d.add_argument("-o", "--output", required=True, help="the folder to write into (created if missing)")
    d.set_defaults(func=cmd_dump)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = os.environ.get("PRIMEPAR_LOG", "INFO" if args.verbose else "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        print(f"error: PRIMEPAR_LOG={level} is not a log level (DEBUG, INFO, WARNING, ERROR)", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    steady_malloc()  # capture and planning allocate alike from the start (utils.malloc)
    from primepar_fx.frontend.specialize import ShapeSpecializationError
    from primepar_fx.rules.registry import MissingRuleError, RuleError
    from primepar_fx.search import SearchError

    try:
        return args.func(args)
    except (CliError, MissingRuleError, RuleError, ShapeSpecializationError, SearchError, ValueError) as e:
        logging.getLogger("primepar_fx.cli").debug("where the error arose", exc_info=True)  # PRIMEPAR_LOG=DEBUG
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None) -> None:
    """The console entry point (``primepar-fx``, ``python -m primepar_fx``): :func:`main`, then a quick exit.

    A planning process ends holding millions of objects (torch's and transformers' modules, the priced graph), which
    the interpreter's exit would free, a noticeable wait after the answer is printed
    (docs/benchmarks/measured_in_code.md). Exit status, streams and ``atexit`` handlers are a normal exit's; only
    that teardown is skipped (``os._exit``, as mypy's command line does). Other exceptions than :class:`SystemExit`
    leave with their traceback. :func:`main` returns.
    """
    try:
        code: Any = main(argv)
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    if code is not None and not isinstance(code, int):  # SystemExit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``) or stream: nothing more can reach it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    run()
