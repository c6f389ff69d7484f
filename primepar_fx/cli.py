"""The ``primepar-fx`` command line.

    primepar-fx explain MODEL --world-size N [--batch B --seq S]
    primepar-fx plan MODEL --world-size N --cluster NAME|spec.toml --batch B --seq S [-o plan.json]
    primepar-fx calibrate [--world-size N] [--quick] -o spec.toml
    primepar-fx dump MODEL --world-size N [--plan plan.json|searched|megatron|prime|...] [--batch B --seq S] -o DIR

MODEL is a zoo name (``primepar-fx explain --list`` shows them), ``hf:FAMILY`` for a tiny Hugging Face model
(gpt2, llama, opt, bloom; needs ``transformers``), or ``package.module:callable`` returning a module, or a tuple
``(module, args, kwargs)`` with example inputs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import torch

log = logging.getLogger("primepar_fx")


def _example_inputs(
    model: torch.nn.Module, device: torch.device, batch: int = 2, seq: int = 16
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from primepar_fx.models import Decoder, example_inputs, hf_example_inputs

    if isinstance(model, Decoder):
        return example_inputs(model.config, batch, seq, device=device)
    if hasattr(getattr(model, "config", None), "vocab_size"):
        args, kwargs = hf_example_inputs(model, batch, seq)
        return args, {k: v.to(device) for k, v in kwargs.items()}
    raise SystemExit(
        f"cannot make example inputs for {type(model).__name__}: have your callable return (model, args, kwargs)"
    )


def load_model(
    spec: str, *, meta: bool = True, batch: int = 2, seq: int = 16
) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """Resolve a MODEL argument to ``(module, example_args, example_kwargs, name)``; example inputs of ``batch`` x
    ``seq`` tokens unless a ``package.module:callable`` returns its own."""
    from primepar_fx.models import ZOO, build, build_hf_tiny, load_model_spec

    if spec in ZOO:
        model = build(spec, device="meta" if meta else None)
    elif spec.startswith("hf:"):
        model = build_hf_tiny(spec[3:])
    else:
        try:
            got = load_model_spec(spec)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if isinstance(got, tuple):
            model, args, kwargs = got
            return model, tuple(args), dict(kwargs), spec
        model = got
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = _example_inputs(model, device, batch, seq)
    return model, args, kwargs, spec


def _mesh(args: argparse.Namespace):
    from primepar_fx.partition import DeviceMesh

    if args.digits:
        mesh = DeviceMesh(tuple(int(d) for d in args.digits.split(",")))
        if mesh.size != args.world_size:
            raise SystemExit(f"error: digits {args.digits} multiply to {mesh.size}, not --world-size {args.world_size}")
        return mesh
    return DeviceMesh.for_world_size(args.world_size, args.devices_per_node)


def cmd_explain(args: argparse.Namespace) -> int:
    from primepar_fx.api import analyze
    from primepar_fx.explain import explain_table
    from primepar_fx.models import ZOO

    if args.list:
        for name, cfg in ZOO.items():
            print(f"{name:12s} {cfg.description}")
        return 0
    if not args.model:
        raise SystemExit("error: explain needs a MODEL (or --list)")
    if (args.batch is None) != (args.seq is None):
        raise SystemExit("error: give both --batch and --seq, or neither")
    mesh = _mesh(args)
    t0 = time.perf_counter()
    model, ex_args, ex_kwargs, name = load_model(args.model)
    replicate = not args.full_capture
    graph = analyze(model, ex_args, ex_kwargs, name=name, fallback=args.fallback, replicate_layers=replicate)
    print(
        explain_table(graph, mesh, batch=args.batch, seq=args.seq, allow_prime=not args.no_prime, tablefmt=args.format)
    )
    print(f"\nanalysed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"30GiB"``, ``"512MB"``, ``"1e9"`` -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 30GiB, 512MB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cmd_plan(args: argparse.Namespace) -> int:
    from primepar_fx.api import analyze
    from primepar_fx.planner import plan_graph

    t0 = time.perf_counter()
    model, ex_args, ex_kwargs, name = load_model(args.model)
    replicate = not args.full_capture
    graph = analyze(model, ex_args, ex_kwargs, name=name, fallback=args.fallback, replicate_layers=replicate)
    digits = tuple(int(d) for d in args.digits.split(",")) if args.digits else None
    plan = plan_graph(
        graph,
        world_size=args.world_size,
        cluster=args.cluster,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        memory_budget=args.memory_budget,
        alpha=args.alpha,
        method=args.method,
        allow_prime=not args.no_prime,
        baselines=not args.no_baselines,
        digits=digits,
        canonical=args.canonical,
        grouped=args.grouped,
        progress=sys.stderr.isatty(),
    )
    print(plan.summary_table(tablefmt=args.format))
    mega = plan.baselines.get("megatron")
    if mega is not None:
        speed = mega.predicted.step_time_s / plan.predicted.step_time_s
        mem = plan.predicted.peak_memory_bytes / max(1, mega.predicted.peak_memory_bytes)
        print(f"\nvs best Megatron ({mega.config.get('name')}): {speed:.2f}x throughput, {mem:.0%} of its peak memory")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    print(f"planned in {time.perf_counter() - t0:.1f} s (search {plan.search.get('search_s')} s)", file=sys.stderr)
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    from primepar_fx.api import analyze
    from primepar_fx.compile import resolve_plan
    from primepar_fx.dump import dump
    from primepar_fx.plan import Plan

    t0 = time.perf_counter()
    given = Plan.load(args.plan) if args.plan.endswith(".json") or os.path.isfile(args.plan) else None
    batch = args.batch or (given.batch if given else 2)
    seq = args.seq or (given.seq if given else 16)
    if given is not None and (given.batch, given.seq, given.world_size) != (batch, seq, args.world_size):
        raise SystemExit(
            f"error: {args.plan} is for B={given.batch}, S={given.seq} on {given.world_size} devices, not "
            f"B={batch}, S={seq} on {args.world_size}"
        )
    model, ex_args, ex_kwargs, name = load_model(args.model, batch=batch, seq=seq)
    graph = analyze(model, ex_args, ex_kwargs, name=name, fallback=args.fallback)
    if (graph.captured.example_batch, graph.captured.example_seq) != (batch, seq):
        raise SystemExit(
            f"error: {name} returned example inputs of B={graph.captured.example_batch}, "
            f"S={graph.captured.example_seq}; pass those as --batch/--seq"
        )
    plan = given or resolve_plan(
        graph, args.plan, world_size=args.world_size, cluster=args.cluster, memory_budget=None, dtype=args.dtype
    )
    files = dump(graph, plan, args.output)
    p = plan.predicted
    print(f"{plan.model} on {plan.world_size} devices {list(plan.digits)}, B={batch}, S={seq}, plan {args.plan}:")
    print(f"  predicted step {p.step_time_s * 1e3:.4g} ms, peak memory {p.peak_memory_bytes / 2**20:.4g} MiB")
    print(f"wrote {len(files)} files to {args.output}: {', '.join(f.name for f in files)}")
    print(f"dumped in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-n", type=int, default=1, help="number of devices (default 1)")
    p.add_argument("--digits", help="device-ID digit radices, most significant first, e.g. 3,2,2")
    p.add_argument("--fallback", choices=["replicate"], help="run ops without a rule replicated")
    p.add_argument(
        "--full-capture",
        action="store_true",
        help="export every layer instead of two replicated (for models whose later layers differ)",
    )
    p.add_argument("--no-prime", action="store_true", help="leave P(S x S) out of the space (split-only)")
    p.add_argument("--format", default="simple", help="tabulate table format (simple, github, ...)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="primepar-fx", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (PRIMEPAR_LOG=DEBUG for more)")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("explain", help="per-node table: op, symbolic shape, FLOPs, legal partition sequences")
    e.add_argument("model", nargs="?", help="zoo name, hf:FAMILY, or package.module:callable")
    e.add_argument("--list", action="store_true", help="list the zoo models and exit")
    _add_model_args(e)
    e.add_argument("--devices-per-node", type=int, help="devices per node (node digits come first)")
    e.add_argument("--batch", type=int, help="evaluate at this batch size")
    e.add_argument("--seq", type=int, help="evaluate at this sequence length")
    e.set_defaults(func=cmd_explain)
    pl = sub.add_parser("plan", help="search the cheapest plan and compare it with Megatron and data parallelism")
    pl.add_argument("model", help="zoo name, hf:FAMILY, or package.module:callable")
    _add_model_args(pl)
    pl.add_argument("--cluster", default="v100-paper", help="preset name or spec file (.json/.toml)")
    pl.add_argument("--batch", type=int, required=True, help="global batch size the plan is priced at")
    pl.add_argument("--seq", type=int, required=True, help="sequence length the plan is priced at")
    pl.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    pl.add_argument("--memory-budget", type=parse_bytes, help="hard per-device budget, e.g. 30GiB")
    pl.add_argument("--alpha", type=float, default=0.0, help="weight of memory (per byte) in the objective")
    pl.add_argument("--method", default="auto", choices=["auto", "dp", "ilp"])
    pl.add_argument("--canonical", action="store_true", help="search one split order per network level (faster)")
    pl.add_argument(
        "--grouped",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="merge the leading (inter-node) device digits for the search (default: with more than 3 digits)",
    )
    pl.add_argument("--no-baselines", action="store_true", help="skip pricing Megatron / data-parallel / split-only")
    pl.add_argument("-o", "--output", help="write the plan JSON here")
    pl.set_defaults(func=cmd_plan)
    d = sub.add_parser("dump", help="write the captured graph, plan, per-node table, per-rank code and a picture")
    d.add_argument("model", help="zoo name, hf:FAMILY, or package.module:callable")
    d.add_argument("--world-size", "-n", type=int, required=True, help="number of ranks")
    d.add_argument(
        "--plan",
        default="searched",
        help="a plan JSON, 'searched' (default), 'megatron', 'megatron-sp', 'data_parallel', 'prime' or 'random:SEED'",
    )
    d.add_argument("--batch", type=int, help="global batch size (default: the plan's, else 2)")
    d.add_argument("--seq", type=int, help="sequence length (default: the plan's, else 16)")
    d.add_argument("--cluster", default="cpu-gloo", help="preset name or spec file the plan is priced on")
    d.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    d.add_argument("--fallback", choices=["replicate"], help="run ops without a rule replicated")
    d.add_argument("-o", "--output", required=True, help="the folder to write into (created if missing)")
    d.set_defaults(func=cmd_dump)
    from primepar_fx.cost.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = os.environ.get("PRIMEPAR_LOG", "INFO" if args.verbose else "WARNING").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from primepar_fx.capture import ShapeSpecializationError
    from primepar_fx.rules.registry import MissingRuleError, RuleError
    from primepar_fx.search import SearchError

    try:
        return args.func(args)
    except (MissingRuleError, RuleError, ShapeSpecializationError, SearchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
