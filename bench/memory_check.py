"""Measured peak memory per rank against the plan's predicted peak, for plans with and without memory levers.

    python bench/memory_check.py [--out docs/benchmarks/memory.md]

On 4 gloo ranks, each plan is compiled and trained with AdamW; after a first step (so the optimizer's moments
exist) and ``zero_grad(set_to_none=True)``, one more step (forward, backward, ``optimizer.step``) runs under
``torch.profiler`` with ``profile_memory=True``, which records every allocation and free of a tensor storage with
its size and time. The live bytes at each moment are the storages that existed before the step (parameters,
buffers, the optimizer's moments: their distinct storages' sizes) plus the step's allocations less its frees up
to that moment (gradients, the activations kept for Backward, the collectives' and ring's buffers, temporaries);
the measured peak is the largest. Each rank measures its own; the table shows the largest over the ranks, next
to the plan's ``predicted.peak_memory_bytes`` (per device).

What this measures is what the allocator is asked for, by tensors; it is not the process's resident memory (the
Python heap, gloo's own buffers, the allocator's caching are outside it). The cost model counts parameters with
their gradients and two moments (16 bytes a parameter in fp32), the tensors each node keeps for Backward, and the
largest ring buffer. It does not count Forward's and Backward's temporaries (each op's output before the next
consumes it, gradients of activations), which lifts the measure above it, and it counts a tensor that several
consumers keep once per consumer, which puts the measure below it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WORLD = 4
BATCH, SEQ = 8, 64
#: (model, plan, levers): each plan without levers ("") and with them ("recompute=full+zero=2", as
#: ``distributed_checks.with_levers`` reads them)
CASES = [
    *[
        ("llama-4", plan, levers)
        for plan in ("data_parallel", "megatron", "prime", "searched", "random:7")
        for levers in ("", "recompute=full")
    ],
    *[
        ("hf:bloom", plan, levers)
        for plan in ("data_parallel", "megatron", "prime")
        for levers in ("", "recompute=selective")
    ],
    *[("llama-4", "data_parallel", levers) for levers in ("zero=1", "zero=2", "micro_batches=2")],
    ("llama-4", "data_parallel", "zero=2+micro_batches=2+recompute=full"),
    ("llama-4", "megatron", "zero=2"),
    ("llama-4", "prime", "micro_batches=2"),
    ("llama-4", "random:7", "zero=2+micro_batches=2"),
    *[("llama-4", plan, "zero=3") for plan in ("data_parallel", "megatron", "prime")],
    ("llama-4", "data_parallel", "zero=3+recompute=full"),
    ("hf:bloom", "data_parallel", "zero=3+recompute=selective"),
]


#: what the last run showed (written under its table; rewrite when the numbers move)
READING = """Reading (the run above). 10 of the 20 plans with levers measure within 15% of their prediction, and
every one measures less than the same plan without levers. Recomputation: llama-4 full recomputation measures
0.90-1.01 of the prediction (5.61 -> 4.00 MiB under data parallelism, 5.59 -> 2.38 MiB with P(S x S)); BLOOM's
selective recomputation under data parallelism and Megatron measures 0.80, predicted too high as the same plans
without it are. Micro-batches: 0.92-0.93 alone, 1.03 with ZeRO-2 under a random plan. ZeRO: a reduce-scattered
bucket drops each local gradient once it is flattened (ZeRO-2 and 3 keep no whole gradient), so ZeRO-2 measures
4.57 MiB where the model predicts 5.54 (0.82, below the band: the model also counts the kept activations of every
consumer); ZeRO-1 measures 0.74 for the same reason. ZeRO-3 keeps a quarter of each replicated parameter between
uses and gathers one node's at a time: 3.95 MiB under data parallelism (0.79, the same bias as ZeRO-2's 0.82;
P(S x S) replicates no parameter, so ZeRO-3 changes nothing there), 2.63 with full recomputation (1.15) and 6.70 for
BLOOM with selective recomputation (0.83). Where few activations are kept (full recomputation with ZeRO-2 and 2
micro-batches: 1.22), the peak is set by what the model leaves out, Backward's and the optimizer step's
temporaries (gradients of activations, the flattened bucket, AdamW's intermediate tensors). Why else the model is
off: it counts a tensor that several consumers keep once per consumer (the normed input of the Q, K and V
projections, the input of the gate and up projections), so plans that keep every activation are predicted 12-22%
too high. Not measured: bf16, GPUs (the allocator's caching and fragmentation are outside this count;
DEVICE_MEMORY_RESERVE is there for them)."""


def _model(name: str):
    from primepar_fx.models import build, build_hf_tiny, example_inputs, get_config, hf_example_inputs

    if name.startswith("hf:"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        model = build_hf_tiny(name[3:], layers=4)
        args, kwargs = hf_example_inputs(model, BATCH, SEQ)
        return model, args, kwargs
    config = dataclasses.replace(get_config("llama-tiny"), layers=4, max_seq=SEQ)
    model = build(config)
    args, kwargs = example_inputs(config, BATCH, SEQ)
    return model, args, {"labels": kwargs["labels"].clone()}


def _live_bytes(tensors) -> int:
    """The bytes of the distinct storages of ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _peak(step, module, opt) -> int:
    """What lives before the step (parameters, buffers, the optimizer's moments) plus the most the step's
    allocations add at any moment: the profiler's allocation and free events, in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    state = [t for s in opt.state.values() for t in s.values()]
    masters = [s.master for s in getattr(opt, "shards", ())]  # a ZeRO optimizer's fp32 chunks
    chunks = [u.local for u in module.zero3.units] if module.zero3 is not None else []  # ZeRO-3's parameter chunks
    before = _live_bytes([*module.parameters(), *module.buffers(), *state, *masters, *chunks])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return before + peak


def _step(module, opt, args, kwargs) -> None:
    from distributed_checks import loss_of

    loss_of(module(*args, **kwargs)).backward()
    opt.step()


def _describe(plan) -> str:
    """The plan's levers in a few words: ``"full on 4 of 4 layers; ZeRO-2; 2 micro-batches"``."""
    parts = [f"recompute {plan.recompute.describe()}"] if plan.recompute and plan.recompute.active else []
    parts += [f"ZeRO-{plan.zero}"] if plan.zero else []
    parts += [f"{plan.micro_batches} micro-batches"] if plan.micro_batches > 1 else []
    return "; ".join(parts) or "none"


def measure(rank: int, world: int, cases: list) -> dict:
    from distributed_checks import with_levers

    from primepar_fx.compiler.module import compile_graph
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph

    out = {}
    graphs = {}
    for model_name, plan_name, levers in cases:
        model, args, kwargs = _model(model_name)
        if model_name not in graphs:
            graphs[model_name] = build_graph(capture(model, args, kwargs))
        graph = graphs[model_name]
        asked = "+".join(["recompute=none", "zero=0", "micro_batches=1", *([levers] if levers else [])])
        plan = with_levers(graph, world, f"{plan_name}+{asked}", batch=BATCH, seq=SEQ)
        module = compile_graph(graph, plan=plan)
        opt = module.optimizer(torch.optim.AdamW, lr=1e-3)
        step = functools.partial(_step, module, opt, args, kwargs)
        step()
        opt.zero_grad(set_to_none=True)
        peak = torch.tensor([_peak(step, module, opt)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        opt.zero_grad(set_to_none=True)
        out[f"{model_name} {plan_name} {levers}"] = {
            "measured": int(peak.item()),
            "predicted": plan.predicted.peak_memory_bytes,
            "levers": _describe(plan),
        }
        del module, opt
    return out


def main() -> int:
    from primepar_fx.runtime.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "memory.md"))
    args = parser.parse_args()
    t0 = time.perf_counter()
    report = spawn(measure, WORLD, CASES, timeout=3600)
    rows, within = [], 0
    baseline = {(model, plan): report[f"{model} {plan} "]["measured"] for model, plan, levers in CASES if not levers}
    less = []
    for model, plan, levers in CASES:
        r = report[f"{model} {plan} {levers}"]
        ratio = r["measured"] / r["predicted"]
        if levers:
            within += abs(ratio - 1) <= 0.15
            if r["measured"] < baseline[(model, plan)]:
                less.append((model, plan, levers))
        rows.append([model, plan, r["levers"], r["predicted"] / 2**20, r["measured"] / 2**20, f"{ratio:.2f}"])
    table = tabulate(
        rows,
        ["model", "plan", "levers", "predicted MiB", "measured MiB", "measured / predicted"],
        floatfmt=".2f",
        tablefmt="github",
    )
    with_levers = sum(1 for c in CASES if c[2])
    summary = (
        f"{within} of {with_levers} plans with memory levers measure within 15% of their predicted peak; "
        f"{len(less)} of {with_levers} measure less than the same plan without levers."
    )
    print(table)
    print(summary)
    text = (
        "# Measured peak memory vs the plan's prediction\n\n"
        f"`python bench/memory_check.py` ({time.perf_counter() - t0:.0f} s; {WORLD} gloo ranks, fp32, B={BATCH}, "
        f"S={SEQ}; llama-4 is llama-tiny with 4 layers, hf:bloom the tiny Hugging Face BLOOM with 4 layers and "
        "eager attention).\n\n"
        + __doc__.split("\n\n", 2)[1].strip()
        + "\n\n"
        + table
        + "\n\n"
        + summary
        + "\n\n"
        + READING
        + "\n"
    )
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
