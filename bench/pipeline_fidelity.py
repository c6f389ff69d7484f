"""A pipeline priced against the same pipeline measured: Megatron-style data parallelism on each of 2 stages x 2
replicas (4 gloo ranks), written by hand on ``torch.distributed.pipelining`` (``PipelineStage``, ``Schedule1F1B`` or
``ScheduleGPipe``), against ``pricing.pipelined.price_pipeline``'s prediction of that split on a cluster spec.

What runs: a zoo decoder (gpt2-style, untied embeddings, so no parameter is shared between stages) cut where the
pricing cuts it (``layers_per_stage``), each stage an ``nn.Module`` of its layers (the embeddings with the first, the
final norm, head and loss with the last); per step the schedule's Forwards and Backwards over ``m`` micro-batches,
then each stage's gradients summed over its 2 replicas in one flat all-reduce. Measured: that step (no optimizer
step), the median over ``--steps`` steps after two, the ranks' slowest. Predicted: the same split priced as a pipeline
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
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.models.reference import next_token_loss
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.enumerate import values_key
from primepar_fx.planning.baselines import data_parallel_assignment
from primepar_fx.pricing.fixed import price_assignments
from primepar_fx.pricing.pipelined import plan_pieces, price_pipeline
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


def bench_rank(rank: int, world: int, config_args: list, batch: int, seq: int, runs: list, steps: int) -> list:
    """Each run ``[m, schedule, layers in stage 0]`` timed, interleaved step by step; rank 0 gets the medians."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    config = model_config(*config_args)
    stage, replica = divmod(rank, REPLICAS)
    pp_groups = [dist.new_group([s * REPLICAS + r for s in range(STAGES)]) for r in range(REPLICAS)]
    dp_groups = [dist.new_group([s * REPLICAS + r for r in range(REPLICAS)]) for s in range(STAGES)]
    pp, dp = pp_groups[replica], dp_groups[stage]
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch // REPLICAS, seq))
    schedules = []
    for m, name, first in runs:
        model = build(config)
        module = First(model, first) if stage == 0 else Last(model, first)
        piece = PipelineStage(module, stage, STAGES, torch.device("cpu"), group=pp)
        kind = Schedule1F1B if name == "1F1B" else ScheduleGPipe
        schedules.append((kind(piece, n_microbatches=m, loss_fn=next_token_loss), module))
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps + 2):
        for k, (schedule, module) in enumerate(schedules):
            dist.barrier()
            t0 = time.perf_counter()
            if stage == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=[])
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            module.zero_grad(set_to_none=True)
            if i >= 2:
                times[k].append(float(dt))
    return [statistics.median(t) for t in times]


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
        bench_rank, STAGES * REPLICAS, [args.layers, args.hidden], args.batch, args.seq, runs, args.steps, timeout=1800
    )
    rows = []
    for (m, name, first), pp, seconds in zip(runs, predicted, measured):
        rows.append((m, name, f"{first}+{args.layers - first}", seconds * 1e3, pp.step_s * 1e3, pp.bubble))
        print(f"m={m:2d} {name:5s}: measured {seconds * 1e3:8.2f} ms, predicted {pp.step_s * 1e3:8.2f} ms")
    write(args, rows)


def write(args: argparse.Namespace, rows: list[tuple]) -> None:
    lines = [
        "# A pipeline priced against the same pipeline run by torch.distributed.pipelining",
        "",
        f"`python bench/pipeline_fidelity.py --spec {args.spec}` (torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores): a gpt2-style decoder of {args.layers} layers, hidden {args.hidden}, untied "
        f"embeddings; batch {args.batch}, sequence {args.seq}, fp32; 4 gloo ranks as 2 stages x 2 data-parallel "
        "replicas, written by hand on `PipelineStage` and torch's schedule, cut where the pricing cuts it. Measured: "
        "the schedule's step plus each stage's flat gradient all-reduce over its replicas (no optimizer step), median "
        f"of {args.steps} steps after two, the slowest rank, runs interleaved step by step. Predicted: "
        "`pricing.pipelined.price_pipeline` of data parallelism on a stage's 2 devices at one of `m` micro-batches, "
        "on the spec.",
        "",
        "| micro-batches | schedule | layers per stage | measured ms | predicted ms | predicted / measured | "
        "predicted bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, name, split, measured, predicted, bubble in rows:
        lines.append(
            f"| {m} | {name} | {split} | {measured:.2f} | {predicted:.2f} | {predicted / measured:.2f} | {bubble:.0%} |"
        )
    lines += ["", READING]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


READING = """## Reading the results (the run above)

* **The prediction misses, and in the wrong direction as the micro-batches grow.** Measured, the step grows with the
  micro-batch count (629 ms at 2, 666 at 4, 787 at 8: about 26 ms a micro-batch more); predicted, it falls (470, 401,
  378 ms) as the bubble shrinks (37% to 15%). At 2 micro-batches the prediction is 0.75x the measurement, at 8
  0.48x.
* **Why, as far as this machine shows:** the step-fitted spec (`bench/cost_fidelity.py`) prices bytes only, 0 s a
  message, fitted to plans that send few large messages; a pipeline sends two per micro-batch and stage boundary,
  and `torch.distributed.pipelining` adds its own work per action (shape checks, buffers, the loss per
  micro-batch). And 4 ranks share 2 cores here, so the two stages never compute at once, which is the whole point
  the replay prices: what the bubble saves, this machine cannot show. GPipe and 1F1B measure within 3% of each other
  (the same work; only the memory differs), as predicted.
* **Not measured here:** a pipeline on devices that run their stages at once (the GPU check, no device lent to this
  session); the memory each rank holds (1F1B against GPipe).
"""


if __name__ == "__main__":
    main()
