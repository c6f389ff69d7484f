"""One prepared device check (issue 21): what one GPU can tell about primepar_fx, in one short run.

Three parts, each written to a JSON file and a markdown page:

1. **Equivalence on the device.** ``compile(model, ..., world_size=1)`` against eager PyTorch on the same device,
   fp32 and bf16: the loss of every AdamW step and the largest gradient difference after the first.
2. **A rank's computation against the cost model.** One GPU cannot run several NCCL ranks, so the per-rank graph of
   a 4- and an 8-rank plan (P(S x S), Megatron, searched) runs as rank 0 of a *fake* process group
   (``torch.testing``'s ``FakeStore``: every collective and transfer is a no-op of the right shape). The measured
   forward + backward time of that rank is set against the plan's predicted compute for it (the sum of its nodes'
   ``compute_s``; communication is not measured here, it is free in a fake group), and its Forward is timed node
   by node, summed per op kind, against the same nodes' predicted Forward (:func:`forward_by_kind`).
3. **Compute calibration.** The kernels of ``primepar-fx calibrate`` timed on the device and fitted into the
   ``h100-dgx`` preset as ``h200-measured``, the matrix products with an efficiency table by size (how far small
   calls run from the fastest one's rate) (single-node link numbers stay the preset's data-sheet values, stated as
   such, until a multi-GPU machine measures them).

    python bench/gpu_check.py                        # on CUDA: the full run (a few minutes), docs/benchmarks/gpu.md
    python bench/gpu_check.py --device cpu --quick   # the same code on tiny sizes (tests/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
#: (zoo model, its overrides, batch, seq) for the device run and for --quick
FULL = ("llama-tiny", {"hidden": 2048, "layers": 4, "heads": 16, "kv_heads": 16, "ffn_hidden": 5504,
                       "vocab_size": 32000, "max_seq": 1024}, 8, 1024)  # fmt: skip
QUICK = ("llama-tiny", {"layers": 2}, 4, 32)
PLANS = ("prime", "megatron", "searched")
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def _model(spec: tuple, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from primepar_fx.models import build, example_inputs, get_config

    name, overrides, batch, seq = spec
    config = dataclasses.replace(get_config(name), **overrides)
    torch.manual_seed(seed)
    model = build(config).to(device=device, dtype=dtype)
    args, kwargs = example_inputs(config, batch, seq)
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return model, tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def equivalence(spec: tuple, device: torch.device, dtype_name: str, steps: int) -> dict:
    """Losses of ``steps`` AdamW steps, compiled (world_size=1) and eager, and the first step's gradient gap."""
    import primepar_fx

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    eager, args, kwargs = _model(spec, device, dtype)
    source, _, _ = _model(spec, device, dtype)
    compiled = primepar_fx.compile(source, args, kwargs, world_size=1, cluster="h100-dgx")
    out: dict = {"dtype": dtype_name, "losses": [], "eager_losses": []}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (compiled, eager)]
    for step in range(steps):
        for m, opt, key in ((compiled, opts[0], "losses"), (eager, opts[1], "eager_losses")):
            opt.zero_grad(set_to_none=True)
            loss = m(*args, **kwargs)
            loss.backward()
            out[key].append(float(loss.detach()))
        if step == 0:
            mine = compiled.gather_grads()
            gaps = [
                float((mine[n].float() - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-12))
                for n, p in eager.named_parameters()
            ]
            out["max_grad_gap"] = max(gaps)
        for opt in opts:
            opt.step()
    tol = TOLERANCE[dtype_name]
    out["equal"] = out["max_grad_gap"] <= tol and all(
        abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(out["losses"], out["eager_losses"])
    )
    return out


def rank_compute(spec: tuple, device: torch.device, world: int, plans: tuple[str, ...], reps: int) -> list[dict]:
    """Rank 0's forward + backward time under each plan in a fake ``world``, and the plan's predicted compute."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from primepar_fx.compiler.module import compile_graph
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    # a fake receive leaves its buffer as allocated: on a CPU, denormal garbage there makes every later op slow
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    rows = []
    try:
        model, args, kwargs = _model(spec, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        graph = build_graph(capture(model, args, kwargs))
        for plan in plans:
            module = compile_graph(graph, plan=None if plan == "searched" else plan, cluster="h100-dgx")
            module.check_sizes = False
            times = []
            for r in range(reps + 1):
                _sync(device)
                t0 = time.perf_counter()
                module(*args, **kwargs).backward()
                _sync(device)
                if r:  # the first run warms up
                    times.append(time.perf_counter() - t0)
                for p in module.parameters():
                    p.grad = None
            predicted = sum(n.cost.compute_s for n in module.plan.nodes)
            measured = statistics.median(times)
            rows.append(
                {
                    "world": world,
                    "plan": plan,
                    "partition": module.plan.summary_table().splitlines()[0][:80],
                    "measured_s": measured,
                    "predicted_compute_s": predicted,
                    "ratio": measured / predicted if predicted else float("nan"),
                    "forward_by_kind": forward_by_kind(module, graph, args, kwargs, device, reps),
                }
            )
    finally:
        dist.destroy_process_group()
        if flushed:
            torch.set_flush_denormal(False)
    return rows


def forward_by_kind(module, graph, args, kwargs, device: torch.device, reps: int) -> dict[str, dict[str, float]]:
    """Rank 0's forward, node by node: the median seconds of each op kind (the rule's ``OpDims.kind``: matmul,
    attention, pointwise, ...) against the plan's predicted Forward time of the same nodes.

    The rank graph runs through an ``fx.Interpreter`` that synchronises the device around every node, so each
    node's time is its own (the sum is slower than an unsynchronised run). Nodes the passes inserted (collectives,
    re-layouts, ring transfers: free in a fake group) are the kind ``"inserted"``, with nothing predicted. A P(S x S)
    node's predicted Forward is the larger of compute and ring shift per step, so it is an upper bound there.
    """
    from torch import fx

    from primepar_fx.passes.common import META

    kinds = {name: node.dims.kind for name, node in graph.nodes.items()}
    totals: dict[str, list[float]] = {}

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node):  # type: ignore[override]
            if n.op in ("placeholder", "output", "get_attr"):
                return super().run_node(n)
            _sync(device)
            t0 = time.perf_counter()
            out = super().run_node(n)
            _sync(device)
            me = n.meta.get(META)  # a node the passes replaced (a ring product, a sharded loss) keeps its binding
            kind = me.part.op.kind if me is not None else kinds.get(n.name, "inserted")
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
            return out

    gm = module.graph_module
    try:
        for r in range(reps + 1):
            interpreter = Timed(gm)
            interpreter.seconds = {}
            gm.forward = interpreter.run  # the module calls the graph through forward
            with torch.no_grad():
                module(*args, **kwargs)
            if r:  # the first run warms up
                for kind, seconds in interpreter.seconds.items():
                    totals.setdefault(kind, []).append(seconds)
    finally:
        del gm.forward  # the class's generated forward again
    predicted: dict[str, float] = {}
    for node in module.plan.nodes:
        if node.cost is not None and node.cost.phase_s:
            predicted[kinds[node.name]] = predicted.get(kinds[node.name], 0.0) + node.cost.phase_s["forward"]
    return {
        kind: {"measured_s": statistics.median(totals.get(kind, [0.0])), "predicted_s": predicted.get(kind, 0.0)}
        for kind in sorted(set(totals) | set(predicted))
    }


def calibrate(device: torch.device, quick: bool) -> tuple[dict, str]:
    """Compute models measured on ``device``, and the ``h200-measured`` spec made of them (JSON text)."""
    from primepar_fx.calibrate.measure import measure_compute
    from primepar_fx.cost.cluster import load_cluster

    compute = measure_compute(device, quick=quick, efficiency=True)  # matmul efficiency by size: a table
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    base = load_cluster("h100-dgx")
    spec = base.with_calibration(
        source=f"bench/gpu_check.py on {where} at {time.strftime('%Y-%m-%d %H:%M')}: compute measured; links are "
        "h100-dgx's data-sheet numbers (NVLink 4, 900 GB/s), not measured",
        compute=compute,
    )
    spec = dataclasses.replace(spec, name="h200-measured", description=f"compute measured on {where}")
    return {k: dataclasses.asdict(v) for k, v in compute.items()}, spec.to_json()


def page(result: dict) -> str:
    eq = [
        [r["dtype"], "yes" if r["equal"] else "NO", f"{r['max_grad_gap']:.2e}", f"{r['losses'][-1]:.6f}"]
        for r in result["equivalence"]
    ]
    rk = [
        [
            r["world"],
            r["plan"],
            f"{r['measured_s'] * 1e3:.2f}",
            f"{r['predicted_compute_s'] * 1e3:.2f}",
            f"{r['ratio']:.2f}",
        ]
        for r in result["rank_compute"]
    ]
    ratios = [r["ratio"] for r in result["rank_compute"]]
    kind_rows, kind_ratios = [], []
    for r in result["rank_compute"]:
        for kind, t in r["forward_by_kind"].items():
            ratio = t["measured_s"] / t["predicted_s"] if t["predicted_s"] else None
            if ratio is not None:
                kind_ratios.append(ratio)
            shown = f"{ratio:.2f}" if ratio is not None else "-"
            kind_rows.append(
                [r["world"], r["plan"], kind, f"{t['measured_s'] * 1e3:.3f}", f"{t['predicted_s'] * 1e3:.3f}", shown]
            )
    kind_median = f"{statistics.median(kind_ratios):.2f}" if kind_ratios else "-"
    return "\n".join(
        [
            "# One device check",
            "",
            f"Device: {result['device']}; torch {torch.__version__}; model {result['model']}; "
            f"{result['seconds']:.0f} s in all. Reproduce: `{result['command']}`.",
            "",
            "## Compiled (world_size=1) against eager on the device",
            "",
            tabulate(eq, ["dtype", "equal", "max gradient gap (relative)", "last loss"], tablefmt="github"),
            "",
            "## Rank 0 of a fake process group: measured forward + backward against predicted compute",
            "",
            tabulate(
                rk, ["world", "plan", "measured ms", "predicted compute ms", "measured / predicted"], tablefmt="github"
            ),  # fmt: skip
            "",
            f"Median measured / predicted: {statistics.median(ratios):.2f} (communication is free in a fake group, "
            "so this is compute and the runtime's own overhead).",
            "",
            "## Rank 0's Forward by op kind: measured against predicted",
            "",
            "Each node timed on its own (the device synchronised around it) through an `fx.Interpreter`, no autograd; "
            "`inserted` is what the passes added (collectives, re-layouts, ring shifts), free in a fake group.",
            "",
            tabulate(
                kind_rows,
                ["world", "plan", "kind", "measured ms", "predicted ms", "measured / predicted"],
                tablefmt="github",
            ),
            "",
            f"Median measured / predicted over the kinds with a prediction: {kind_median}.",
            "",
            "## Compute calibration",
            "",
            "Fitted compute models per op family (``compute`` in the JSON); the `h200-measured` spec is written next "
            "to it.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps")
    p.add_argument("--out", default=None, help="markdown page (default docs/benchmarks/gpu.md; --quick: none)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = QUICK if args.quick else FULL
    steps, reps = (2, 2) if args.quick else (5, 10)
    t0 = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    result["model"] = f"{spec[0]} {spec[1]} B={spec[2]} S={spec[3]}"
    result["command"] = " ".join(["python", "bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    dtypes = ("fp32", "bf16") if device.type == "cuda" or not args.quick else ("fp32",)
    result["equivalence"] = [equivalence(spec, device, d, steps) for d in dtypes]
    result["rank_compute"] = [row for w in (4, 8) for row in rank_compute(spec, device, w, PLANS, reps)]
    result["compute"], spec_json = calibrate(device, quick=args.quick)
    result["seconds"] = time.perf_counter() - t0
    for r in result["equivalence"]:
        print(
            f"equivalence {r['dtype']}: {'equal' if r['equal'] else 'DIFFERS'} (gradient gap {r['max_grad_gap']:.2e})"
        )
    for r in result["rank_compute"]:
        print(f"world {r['world']} {r['plan']:9s} measured {r['measured_s'] * 1e3:8.2f} ms, "
              f"predicted compute {r['predicted_compute_s'] * 1e3:8.2f} ms")  # fmt: skip
    out = args.out or (None if args.quick else str(ROOT / "docs" / "benchmarks" / "gpu.md"))
    if out:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(page(result) + "\n", encoding="utf-8")
        out_path.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        out_path.with_name("h200-measured.json").write_text(spec_json, encoding="utf-8")
        print(f"wrote {out_path}, {out_path.with_suffix('.json')} and {out_path.with_name('h200-measured.json')}")
    return 0 if all(r["equal"] for r in result["equivalence"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
