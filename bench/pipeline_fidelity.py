"""A pipeline priced, compiled by us, and written by hand: data parallelism on each of 2 stages x 2 replicas (4 gloo
ranks), written by hand on ``torch.distributed.pipelining`` (``PipelineStage``, ``Schedule1F1B`` or
``ScheduleGPipe``), the same split compiled as a pipelined plan (``module.step``), and
``pricing.pipelined.price_pipeline``'s prediction of that split on a cluster spec.

What runs: a zoo decoder (gpt2-style, untied embeddings, so no parameter is shared between stages) cut where the
pricing cuts it (``layers_per_stage``), each stage an ``nn.Module`` of its layers (the embeddings with the first, the
final norm, head and loss with the last); per step the schedule's Forwards and Backwards over ``m`` micro-batches,
then each stage's gradients summed over its 2 replicas in one flat all-reduce; ours runs the same split from the
captured graph. Measured: that step (no optimizer step), the median over ``--steps`` steps after two, the ranks'
slowest, the two interleaved step by step. Predicted: the same split priced as a pipeline
of 2 stages on a stage's mesh of 2 devices (data parallelism), at one of ``m`` micro-batches.

    python bench/pipeline_fidelity.py [--spec docs/benchmarks/stepfit-cpu-gloo.json] [--counts 2 4 8] [--steps 10]

The page is ``docs/benchmarks/pipeline_fidelity.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from primepar_fx import analyze
from primepar_fx.compiler.module import compile_graph
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.frontend.capture import capture
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import graph_of
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.models.reference import next_token_loss
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.planning.forced import forced_plan
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import plan_pieces, price_pipeline
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.runtime.testing import spawn

STAGES, REPLICAS = 2, 2


def model_config(layers: int, hidden: int):
    return dataclasses.replace(
        get_config("gpt2-tiny"),
        hidden=hidden,
        layers=layers,
        heads=4,
        ffn_hidden=4 * hidden,
        vocab_size=1024,
        max_seq=256,
        tied_embeddings=False,
    )


class First(nn.Module):
    """The embeddings and the first stage's layers."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.embed_tokens, self.embed_positions = model.embed_tokens, model.embed_positions
        self.blocks = nn.ModuleList(model.blocks[:layers])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x, None, None)
        return x


class Last(nn.Module):
    """The last stage's layers, the final norm and the head (the loss is the schedule's)."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[layers:])
        self.final_norm, self.lm_head = model.final_norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, None, None)
        return self.lm_head(self.final_norm(x))


@functools.cache
def captured(layers: int, hidden: int):
    config = model_config(layers, hidden)
    args, kwargs = example_inputs(config, 2, 16, device="meta")
    return analyze(build(config, device="meta"), args, kwargs, name=config.name)


def predict(config, cluster: ClusterSpec, batch: int, seq: int, m: int, schedule: str):
    """The hand-written split priced: data parallelism on a stage's 2 devices, 2 stages, ``m`` micro-batches."""
    graph = captured(config.layers, config.hidden)
    sub, micro, costs = DeviceMesh((REPLICAS,)), {B: batch // m, S: seq}, CostOptions(micro_batches=m)
    dp = data_parallel_assignment(graph, sub, values=micro)
    priced, (choice,) = price_assignments(graph, [dp], sub, cluster, micro, costs)
    pieces = plan_pieces(graph, priced, choice, costs, values_key(micro))
    return price_pipeline(pieces, cluster, m, stages=STAGES, schedule=schedule)


def ours(graph, config, spec: str, batch: int, seq: int, m: int, schedule: str, first: int):
    """The same split as our plan: data parallelism on a stage's 2 devices (the forced plan at ``m`` micro-batches),
    run as 2 stages of ``first`` and the other layers, compiled by ``primepar_fx.compile_graph``."""
    stage = forced_plan(
        graph, "data_parallel", world_size=REPLICAS, micro_batches=m, cluster=spec, batch=batch, seq=seq,
        memory_budget=None,
    )  # fmt: skip
    pipeline = Pipeline(STAGES, schedule, 1, m, (first, config.layers - first))
    plan = dataclasses.replace(stage, world_size=STAGES * REPLICAS, pipeline=pipeline)
    return compile_graph(graph, plan=plan)


def _timed(step) -> float:
    """``step()``'s seconds on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def bench_rank(
    rank: int, world: int, config_args: list, spec: str, batch: int, seq: int, runs: list, steps: int
) -> list:
    """Each run ``[m, schedule, layers in stage 0]`` timed by hand and compiled, interleaved step by step; rank 0
    gets the medians, ``(hand-written, ours)`` a run."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    config = model_config(*config_args)
    stage, replica = divmod(rank, REPLICAS)
    pp_groups = [dist.new_group([s * REPLICAS + r for s in range(STAGES)]) for r in range(REPLICAS)]
    dp_groups = [dist.new_group([s * REPLICAS + r for r in range(REPLICAS)]) for s in range(STAGES)]
    pp, dp = pp_groups[replica], dp_groups[stage]
    torch.manual_seed(0)
    whole = torch.randint(0, config.vocab_size, (batch, seq))
    ids = whole.chunk(REPLICAS)[replica]  # the hand-written replicas each take half the batch
    graph = graph_of(lambda static: capture(build(config), (whole,), {"labels": whole}, static_seq=static))
    schedules = []
    for m, name, first in runs:
        model = build(config)
        module = First(model, first) if stage == 0 else Last(model, first)
        piece = PipelineStage(module, stage, STAGES, torch.device("cpu"), group=pp)
        kind = Schedule1F1B if name == "1F1B" else ScheduleGPipe
        compiled = ours(graph, config, spec, batch, seq, m, name, first)
        schedules.append((kind(piece, n_microbatches=m, loss_fn=next_token_loss), module, compiled))

    def by_hand(schedule, module) -> None:
        if stage == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])
        flat = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])
        dist.all_reduce(flat, group=dp)

    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    for i in range(steps + 2):
        for k, (schedule, module, compiled) in enumerate(schedules):
            hand = _timed(functools.partial(by_hand, schedule, module))
            module.zero_grad(set_to_none=True)
            mine = _timed(functools.partial(compiled.step, whole, labels=whole))
            compiled.zero_grad(set_to_none=True)
            if i >= 2:
                times[k].append((hand, mine))
    return [tuple(statistics.median(t[j] for t in run) for j in (0, 1)) for run in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="docs/benchmarks/stepfit-cpu-gloo.json", help="cluster spec (file or preset)")
    p.add_argument("--counts", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="docs/benchmarks/pipeline_fidelity.md")
    args = p.parse_args()
    cluster = ClusterSpec.from_file(args.spec) if os.path.exists(args.spec) else load_cluster(args.spec)
    config = model_config(args.layers, args.hidden)
    runs, predicted = [], []
    for m in args.counts:
        for name in args.schedules:
            pp = predict(config, cluster, args.batch, args.seq, m, name)
            runs.append([m, name, pp.layers[0]])
            predicted.append(pp)
    measured = spawn(
        bench_rank, STAGES * REPLICAS, [args.layers, args.hidden], args.spec, args.batch, args.seq, runs, args.steps,
        timeout=3600,
    )  # fmt: skip
    rows = []
    for (m, name, first), pp, (hand, mine) in zip(runs, predicted, measured):
        rows.append((m, name, f"{first}+{args.layers - first}", hand * 1e3, mine * 1e3, pp.step_s * 1e3, pp.bubble))
        print(
            f"m={m:2d} {name:5s}: by hand {hand * 1e3:8.2f} ms, ours {mine * 1e3:8.2f} ms ({mine / hand:.2f}x), "
            f"predicted {pp.step_s * 1e3:8.2f} ms"
        )
    write(args, rows)


def write(args: argparse.Namespace, rows: list[tuple]) -> None:
    lines = [
        "# A pipeline priced, compiled, and written by hand on torch.distributed.pipelining",
        "",
        f"`python bench/pipeline_fidelity.py --spec {args.spec}` (torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores): a gpt2-style decoder of {args.layers} layers, hidden {args.hidden}, untied "
        f"embeddings; batch {args.batch}, sequence {args.seq}, fp32; 4 gloo ranks as 2 stages x 2 data-parallel "
        "replicas, cut where the pricing cuts it. **By hand:** the split written on `PipelineStage` and torch's "
        "schedule, each replica given half the batch, then each stage's flat gradient all-reduce over its replicas. "
        "**Ours:** the same split as a plan (data parallelism on a stage's 2 devices, run as 2 stages of the same "
        "layers) compiled by `primepar_fx.compile_graph`: `module.step(ids, labels=ids)` (the stage graphs cut from "
        "the rank graph, gradient buckets summed in each stage's last Backward). No optimizer step in either. "
        f"Median of {args.steps} steps after two, the slowest rank, the two and every run interleaved step by step. "
        "Predicted: `pricing.pipelined.price_pipeline` of that split at one of `m` micro-batches, on the spec.",
        "",
        "| micro-batches | schedule | layers per stage | by hand ms | ours ms | ours / by hand | predicted ms | "
        "predicted / ours | predicted bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, name, split, hand, mine, predicted, bubble in rows:
        lines.append(
            f"| {m} | {name} | {split} | {hand:.2f} | {mine:.2f} | {mine / hand:.2f} | {predicted:.2f} | "
            f"{predicted / mine:.2f} | {bubble:.0%} |"
        )
    lines += ["", READING]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


READING = """## Reading the results (the run above)

* **Ours against the same split by hand: 1.00x to 1.14x** (1F1B: 1.00, 1.06, 1.12 at 2, 4, 8 micro-batches; GPipe:
  1.05, 1.14, 1.08). The issue's bound, at most 1.05x, holds at 2 micro-batches only. The gap grows with the
  micro-batches, about 11 ms a micro-batch at 8 (875 against 783 ms under 1F1B), so it is a per-micro-batch cost,
  not the compiled graph's compute. A profile of ours at 8 micro-batches (`torch.profiler`, 3 steps, ranks 0 and 2)
  shows the matmuls as by hand and about 9 all-reduces a step on each rank where the hand-written split sends one:
  on the first stage, the learned position table's deferred gradient sum (`DeferredGradients`) runs once a
  micro-batch (inside micro-batches it is sent alone instead of joining the gradient bucket); on the last, the
  loss's count of targets and its sum run once a micro-batch (they make the loss the batch's token mean, as one
  device computes it; by hand each replica averages its own half). With 4 ranks on 2 cores every such message
  waits for a core. Summing the table's local gradient into the bucket instead, once a step, is the next fix.
* **The prediction misses, and in the wrong direction as the micro-batches grow.** Measured, the step grows with the
  micro-batch count (by hand 643, 685, 783 ms under 1F1B); predicted, it falls (470, 401, 378 ms) as the bubble
  shrinks (37% to 15%): 0.73x of ours at 2 micro-batches, 0.43x at 8. The step-fitted spec
  (`bench/cost_fidelity.py`) prices bytes only, 0 s a message, fitted to plans that send few large messages; a
  pipeline sends two per micro-batch and stage boundary, and `torch.distributed.pipelining` adds its own work per
  action (shape checks, buffers, the loss per micro-batch). And 4 ranks share 2 cores here, so the two stages never
  compute at once, which is the whole point the replay prices: what the bubble saves, this machine cannot show.
  GPipe and 1F1B measure within 6% of each other (the same work; only the memory differs), as predicted.
* **Not measured here:** a pipeline on devices that run their stages at once (the GPU check, no device lent to this
  session); the memory each rank holds (1F1B against GPipe).
"""


if __name__ == "__main__":
    main()
