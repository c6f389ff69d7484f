"""One prepared device check (issue 21): what one GPU can tell about primepar_fx, in one short run.

Four parts, each written to a JSON file and a markdown page:

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
4. **ZeRO-3 against FSDP2 on one device** (:func:`zero3_against_fsdp2`): what each memory lever costs a rank by
   itself. On rank 0 of a fake group of 4 (every collective a no-op of the right shape), a training step of
   primepar's data-parallel ZeRO-3 plan, of FSDP2 (``fully_shard`` per block, then the model) and of DDP (the
   reference without sharding), steps interleaved: each system's own compute, copies, hooks and Python per step,
   and on CUDA its peak memory. No network is measured; collectives on their own stream need a multi-GPU run.

    python bench/gpu_check.py                        # on CUDA: the full run (a few minutes), docs/benchmarks/gpu.md
    python bench/gpu_check.py --device cpu --quick   # the same code on tiny sizes (tests/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

# pulp (the ILP's solver, imported by the planner) keeps the exception of an optional import that failed (its COPT
# API's module-level ``err``), and with its traceback every frame that was importing it: imported here, those frames
# hold nothing, where imported first inside a part they would keep that part's models alive for the rest of the run
import primepar_fx.search.ilp  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
#: (zoo model, its overrides, batch, seq) for the device run and for --quick
FULL = ("llama-tiny", {"hidden": 2048, "layers": 4, "heads": 16, "kv_heads": 16, "ffn_hidden": 5504,
                       "vocab_size": 32000, "max_seq": 1024}, 8, 1024)  # fmt: skip
QUICK = ("llama-tiny", {"layers": 2}, 4, 32)
PLANS = ("prime", "megatron", "searched")
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
#: part 4's systems, in the order their steps interleave; the ratios' denominators
ZERO3, FSDP2, DDP = "primepar ZeRO-3", "fsdp2", "ddp"


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


@contextlib.contextmanager
def _fake_group(world: int, device: torch.device):
    """Rank 0 of a fake process group of ``world``. On a CPU, one thread that flushes denormals: a fake receive,
    gather or reduce-scatter leaves its output as allocated, and ``set_flush_denormal`` reaches only the calling
    thread, so the intra-op pool's threads would crawl through the denormal garbage there (on QUICK with two
    threads, ZeRO-3's step took 0.1-1.5 s by what the allocator handed out, and P(S x S)'s forward + backward at
    world 4 1.7 s; with one, 10 ms and 16 ms)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    cpu, threads = device.type == "cpu", torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if cpu:
            torch.set_num_threads(threads)
            torch.set_flush_denormal(False)


def rank_compute(spec: tuple, device: torch.device, world: int, plans: tuple[str, ...], reps: int) -> list[dict]:
    """Rank 0's forward + backward time under each plan in a fake ``world``, and the plan's predicted compute."""
    from primepar_fx.compiler.module import compile_graph
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph

    rows = []
    with _fake_group(world, device):
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


@dataclasses.dataclass
class _System:
    """One system of part 4 on rank 0: what a step calls, and what its steps measured."""

    module: torch.nn.Module
    opt: torch.optim.Optimizer
    args: tuple
    kwargs: dict
    batch: int  # the rows this rank computes
    resident: int = 0  # bytes this system holds on the device (CUDA; 0 on CPU), kept up to date step by step
    times: list[float] = dataclasses.field(default_factory=list)
    peaks: list[int] = dataclasses.field(default_factory=list)


def _share(spec: tuple, device: torch.device, world: int):
    """A model built from the same seed, and rank 0's ``B / world`` rows of the batch (ids and labels)."""
    model, args, kwargs = _model(spec, device, torch.float32)
    rows = spec[2] // world
    return model, (args[0][:rows],), {k: v[:rows] for k, v in kwargs.items()}, rows


def _zero3_system(spec: tuple, device: torch.device, world: int) -> _System:
    """primepar's forced data-parallel plan with ZeRO stage 3, on the whole batch (the module takes its rows)."""
    from primepar_fx.compiler.module import compile_graph
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph
    from primepar_fx.planning.forced import forced_plan

    model, args, kwargs = _model(spec, device, torch.float32)
    graph = build_graph(capture(model, args, kwargs))
    plan = forced_plan(graph, "data_parallel", world_size=world, cluster="h100-dgx", batch=spec[2], seq=spec[3], zero=3)
    module = compile_graph(graph, plan=plan, cluster="h100-dgx")  # a cluster named: this machine is not measured
    module.check_sizes = False  # one process: no other rank's sizes to agree with
    program = graph.captured.program
    for fqn in graph.captured.params.values():  # as compile() does: the module holds its chunks, not the weights
        program.state_dict[fqn] = program.state_dict[fqn].detach().to("meta")
    opt = module.optimizer(torch.optim.AdamW, lr=1e-3)
    return _System(module, opt, args, kwargs, batch=spec[2] // world)


def _fsdp2_system(spec: tuple, device: torch.device, world: int) -> _System:
    """``fully_shard`` on every block, then on the model (bench/baselines_step_time.py), on a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, args, kwargs, rows = _share(spec, device, world)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _System(model, torch.optim.AdamW(model.parameters(), lr=1e-3), args, kwargs, batch=rows)


def _ddp_system(spec: tuple, device: torch.device, world: int) -> _System:
    """``DistributedDataParallel``, its buckets all-reduced by a Python hook: the default (C++) hook fails on a fake
    group (the fake work's future holds ``None``, not the bucket: "expected the hook result is either a Tensor or a
    TensorList found None"), so this one issues the same all-reduce and hands back the bucket, already complete."""
    import torch.distributed as dist

    def all_reduce(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        buffer = bucket.buffer().div_(world)
        dist.all_reduce(buffer, async_op=True)
        done = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        done.set_result(buffer)
        return done

    model, args, kwargs, rows = _share(spec, device, world)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, all_reduce)
    return _System(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), args, kwargs, batch=rows)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _step(system: _System, device: torch.device, timed: bool) -> None:
    """One training step, timed between two synchronisations. On CUDA, its peak: the device's peak during the
    step less what the other systems hold (they are idle), and what this system holds after it."""
    _sync(device)
    start = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    system.opt.zero_grad(set_to_none=True)
    system.module(*system.args, **system.kwargs).backward()
    system.opt.step()
    _sync(device)
    seconds = time.perf_counter() - t0
    if timed:
        system.times.append(seconds)
        if device.type == "cuda":
            system.peaks.append(torch.cuda.max_memory_allocated(device) - (start - system.resident))
    system.resident += _allocated(device) - start


def zero3_against_fsdp2(spec: tuple, device: torch.device, world: int, warmup: int, steps: int) -> dict:
    """Rank 0's training step (zero_grad, forward, backward, AdamW) under primepar's ZeRO-3, FSDP2 and DDP in a
    fake group of ``world``: the median of ``steps`` after ``warmup``, the systems' steps interleaved, and on
    CUDA the peak memory of a step (module docstring, part 4). fp32 throughout: at bf16 FSDP2 and DDP would step
    bf16 parameters while ZeRO-3 keeps an fp32 master, not the same work."""
    makers = {ZERO3: _zero3_system, FSDP2: _fsdp2_system, DDP: _ddp_system}
    systems: dict[str, _System] = {}
    with _fake_group(world, device):
        for label, make in makers.items():
            before = _allocated(device)
            systems[label] = make(spec, device, world)
            systems[label].resident = _allocated(device) - before
        for i in range(warmup + steps):
            for system in systems.values():
                _step(system, device, timed=i >= warmup)
        rows = [
            {
                "system": label,
                "batch": s.batch,
                "step_s": statistics.median(s.times),
                "step_min_s": min(s.times),
                "peak_bytes": max(s.peaks) if s.peaks else None,
                "resident_bytes": s.resident if device.type == "cuda" else None,
            }
            for label, s in systems.items()
        ]
        del systems, system
    if device.type == "cuda":
        torch.cuda.empty_cache()
    by = {r["system"]: r for r in rows}
    pairs = ((ZERO3, FSDP2), (ZERO3, DDP), (FSDP2, DDP))
    ratios = {f"{a} / {b}": by[a]["step_s"] / by[b]["step_s"] for a, b in pairs}
    peaks = {f"{a} / {b}": by[a]["peak_bytes"] / by[b]["peak_bytes"] for a, b in pairs if by[b]["peak_bytes"]}
    return {"world": world, "dtype": "fp32", "warmup": warmup, "steps": steps, "rows": rows, "ratios": ratios,
            "peak_ratios": peaks}  # fmt: skip


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
    zf = result["zero3_fsdp2"]
    by = {r["system"]: r for r in zf["rows"]}
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lever = [
        [
            r["system"],
            r["batch"],
            f"{r['step_s'] * 1e3:.2f}",
            f"{r['step_min_s'] * 1e3:.2f}",
            f"{r['step_s'] / by[FSDP2]['step_s']:.2f}",
            f"{r['step_s'] / by[DDP]['step_s']:.2f}",
            mib(r["peak_bytes"]),
            mib(r["resident_bytes"]),
        ]
        for r in zf["rows"]
    ]
    lever_ratios = "; ".join(f"{k}: {v:.2f}" for k, v in zf["ratios"].items())
    peak_ratios = "; ".join(f"{k}: {v:.2f}" for k, v in zf["peak_ratios"].items()) or "not measured (CPU)"
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
            "## ZeRO-3 against FSDP2 on one device: what each memory lever costs a rank by itself",
            "",
            f"Rank 0 of a fake group of {zf['world']}, {zf['dtype']}: a training step (zero_grad, forward, backward, "
            f"AdamW) of each system, steps interleaved, {zf['warmup']} to warm up, then the median of {zf['steps']}. "
            f"Step time ratios: {lever_ratios}. Peak memory ratios: {peak_ratios}.",
            "",
            tabulate(
                lever,
                ["system", "rows on rank 0", "step ms", "min ms", "/ fsdp2", "/ ddp", "peak MiB", "held MiB"],
                tablefmt="github",
            ),
            "",
            "What is measured: each system's own work on one rank, its compute, the copies into and out of its "
            "collectives' buffers, its hooks and its Python, with every collective a no-op of the right shape "
            "(the fake group), so no byte crosses a network and no collective overlaps anything. `peak MiB` is the "
            "device's peak during a step less what the other systems hold, `held MiB` what the system keeps between "
            "steps (its parameters, gradients and AdamW state); both CUDA only. primepar runs its forced "
            "data-parallel plan with ZeRO stage 3 on the whole batch (its rank graph takes rank 0's rows); FSDP2 "
            "(`fully_shard` per block, then the model) and DDP (the reference without sharding, its buckets "
            "all-reduced by a Python hook: the default hook fails on a fake group) get rank 0's rows. What is not "
            "measured: the network, and whether a collective on its own stream (NCCL's, with events, no host "
            "synchronisation per step) hides behind the computing stream; that comparison needs a multi-GPU run.",
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
    result["zero3_fsdp2"] = zero3_against_fsdp2(spec, device, 4, warmup=2 if args.quick else 5, steps=reps)
    result["compute"], spec_json = calibrate(device, quick=args.quick)
    result["seconds"] = time.perf_counter() - t0
    for r in result["equivalence"]:
        print(
            f"equivalence {r['dtype']}: {'equal' if r['equal'] else 'DIFFERS'} (gradient gap {r['max_grad_gap']:.2e})"
        )
    for r in result["rank_compute"]:
        print(f"world {r['world']} {r['plan']:9s} measured {r['measured_s'] * 1e3:8.2f} ms, "
              f"predicted compute {r['predicted_compute_s'] * 1e3:8.2f} ms")  # fmt: skip
    for r in result["zero3_fsdp2"]["rows"]:
        peak = "" if r["peak_bytes"] is None else f", peak {r['peak_bytes'] / 2**20:8.1f} MiB"
        print(f"fake world 4 {r['system']:15s} step {r['step_s'] * 1e3:8.2f} ms (rows {r['batch']}){peak}")
    print("  " + "; ".join(f"{k} {v:.2f}" for k, v in result["zero3_fsdp2"]["ratios"].items()))
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
