"""Train a model with :func:`primepar_fx.compile` on every rank of a ``torchrun`` job, or in one process.

    torchrun --nproc-per-node 4 -m primepar_fx.examples.train --model gpt2-tiny --steps 20
    python -m primepar_fx.examples.train --steps 2          # one process, no process group

Every rank builds the same model from ``--seed`` and the same batch, compiles it with ``--plan`` (searched by
default) and runs ``--steps`` AdamW steps on its own parameter shards. The data is one fixed batch of random tokens
(``--batch`` x ``--seq``, drawn from ``--seed``, identical on every rank), so the loss falls as the model memorises
it: an end-to-end check that training works, not a measure of learning.

Rank 0 prints one line per step (loss, step time, bytes this rank sent during the step), with a tqdm progress bar
on stderr when it is a terminal, then a summary: the plan's partitions by kind, the predicted and measured bytes per
rank per step, and the mean step time without the first (warm-up) step. ``PRIMEPAR_LOG=INFO`` logs the planning.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import primepar_fx
from primepar_fx.partition import PartitionSeq, Split
from primepar_fx.runtime.process import release
from primepar_fx.runtime.stats import COMM_KINDS
from primepar_fx.utils.cliargs import parse_bytes

log = logging.getLogger("primepar_fx.examples.train")

PLAN_NAMES = ("searched", "megatron", "megatron-sp", "data_parallel", "prime")
#: errors that mean "this configuration cannot be planned or run", reported without a traceback
USER_ERRORS = (ValueError, NotImplementedError, RuntimeError)


# ------------------------------------------------------------------------------------------------ arguments
def _plan_arg(text: str) -> str:
    if text in PLAN_NAMES or re.fullmatch(r"random:\d+", text):
        return text
    if text.endswith(".json") or os.path.exists(text):
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"no plan file {text!r}")
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(PLAN_NAMES)}, random:SEED or a .json plan")


def _model_arg(text: str) -> str:
    from primepar_fx.models import HF_FAMILIES, ZOO

    if text in ZOO or (text.startswith("hf:") and text[3:] in HF_FAMILIES):
        return text
    families = ", ".join(f"hf:{f}" for f in HF_FAMILIES)
    raise argparse.ArgumentTypeError(f"unknown model {text!r}; use a zoo name ({', '.join(ZOO)}) or one of {families}")


def _cluster_arg(text: str) -> str:
    from primepar_fx.planning.options import resolve_cluster

    try:
        resolve_cluster(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive(kind: type) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _output_arg(text: str) -> str:
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent!r} to write {text!r} into")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m primepar_fx.examples.train",
        description="Train a model with primepar_fx.compile on every rank of a torchrun job, or in one process.",
        epilog="example: torchrun --nproc-per-node 4 -m primepar_fx.examples.train --model gpt2-tiny --steps 20",
        allow_abbrev=False,
    )
    p.add_argument("--model", type=_model_arg, default="gpt2-tiny", help="zoo name or hf:FAMILY (default gpt2-tiny)")
    p.add_argument("--steps", type=_positive(int), default=20, help="AdamW steps (default 20)")
    p.add_argument("--batch", type=_positive(int), default=8, help="global batch size (default 8)")
    p.add_argument("--seq", type=_positive(int), default=32, help="sequence length (default 32)")
    p.add_argument("--lr", type=_positive(float), default=1e-2, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default 0)")
    p.add_argument(
        "--plan",
        type=_plan_arg,
        default="searched",
        help="searched (default), megatron, megatron-sp, data_parallel, prime, random:SEED, or a plan .json file",
    )
    p.add_argument(
        "--cluster",
        type=_cluster_arg,
        help="cluster preset or spec file to plan for (default: $PRIMEPAR_CLUSTER, else this machine's: cpu-gloo "
        "without CUDA)",
    )
    p.add_argument("--memory-budget", type=parse_bytes, help="per-device memory budget of the search, e.g. 2GiB")
    p.add_argument("--save-plan", type=_output_arg, metavar="PATH", help="write the plan JSON here (rank 0)")
    return p


# ------------------------------------------------------------------------------------------------ set-up
@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this process runs: its rank, the world size, its device, and whether it started a process group."""

    rank: int
    world: int
    device: torch.device
    grouped: bool


def init_distributed() -> Ranks:
    """A process group from the ``torchrun`` environment (nccl on GPU, else gloo), or one rank without one."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Ranks(0, 1, device, grouped=False)
    dist.init_process_group("nccl" if cuda else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), device, grouped=True)


def build_model(name: str, batch: int, seq: int, seed: int, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """The model and its fixed batch ``(args, kwargs)``, the same on every rank (module docstring)."""
    from primepar_fx.models import build, build_hf_tiny, example_inputs, hf_example_inputs

    if name.startswith("hf:"):
        model = build_hf_tiny(name[3:], seed=seed).to(device)
        args, kwargs = hf_example_inputs(model, batch, seq, seed=seed)
    else:
        model = build(name, seed=seed).to(device)  # weights drawn on the CPU: the same numbers on any device
        args, kwargs = example_inputs(model.config, batch, seq, device=device, seed=seed)
    kwargs["labels"] = kwargs["labels"].clone()  # its own tensor, not an alias of the input ids
    return model, args, kwargs


# ------------------------------------------------------------------------------------------------ training
@dataclass
class History:
    """Per step: the loss, the wall time and the bytes this rank sent, by kind."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    sent: list[dict[str, int]] = field(default_factory=list)


def train(module: primepar_fx.PrimeParModule, args: tuple, kwargs: dict, opts: argparse.Namespace, ranks: Ranks):
    """``opts.steps`` AdamW steps on the fixed batch; rank 0 prints a line per step."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=opts.lr)
    history = History()
    bar = tqdm(
        range(1, opts.steps + 1),
        desc="train",
        unit="step",
        disable=ranks.rank != 0 or not sys.stderr.isatty(),
        file=sys.stderr,
    )
    for step in bar:
        module.comm_stats.reset()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if getattr(module.plan, "pipeline", None) is not None:  # a pipelined plan: Forward and Backward in one call
            loss = module.step(*args, **kwargs)
        else:
            out = module(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
        optimizer.step()
        value = float(loss.detach())
        if ranks.device.type == "cuda":
            torch.cuda.synchronize(ranks.device)
        seconds = time.perf_counter() - t0
        history.losses.append(value)
        history.seconds.append(seconds)
        history.sent.append(module.comm_stats.snapshot())
        if ranks.rank == 0:
            sent = module.comm_stats.total
            tqdm.write(f"step {step:3d}/{opts.steps}  loss {value:.4f}  time {seconds * 1e3:8.1f} ms  sent {sent:,} B")
            bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    return history


# ------------------------------------------------------------------------------------------------ summary
def partition_kind(text: str) -> str:
    """``"P(SxS)"`` if the sequence has a P(S x S), ``"split"`` if it splits a dim, else ``"replicated"``."""
    seq = PartitionSeq.parse(text)
    if seq.prime is not None:
        return "P(SxS)"
    return "split" if any(isinstance(e, Split) for e in seq.elements) else "replicated"


def _mean_over_ranks(values: list[float], ranks: Ranks) -> list[float]:
    if not ranks.grouped:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t)
    return [v / ranks.world for v in t.tolist()]


def summary(module: primepar_fx.PrimeParModule, history: History, opts: argparse.Namespace, ranks: Ranks) -> str:
    """The closing report (every rank must call it: it averages the bytes over the ranks)."""
    steps = len(history.losses)
    per_kind = _mean_over_ranks([sum(s[k] for s in history.sent) / steps for k in COMM_KINDS], ranks)
    measured = dict(zip(COMM_KINDS, per_kind))
    plan = module.plan
    kinds = Counter(partition_kind(n.partition) for n in plan.nodes)
    common = Counter(n.partition for n in plan.nodes).most_common(3)
    planned = sum(v for k, v in measured.items() if k != "output")
    split = ", ".join(f"{k} {measured[k]:,.0f}" for k in COMM_KINDS if k != "output")
    later = history.seconds[1:] or history.seconds
    lines = [
        f"{opts.model} on {ranks.world} rank(s), plan {opts.plan} (digits {list(plan.digits)}, {plan.cluster})",
        f"  partitions: {len(plan.nodes)} nodes, " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()),
        "  most used: " + ", ".join(f"{p if p != '-' else 'whole'} x{n}" for p, n in common),
        f"  bytes per rank per step: predicted {plan.predicted.comm_bytes:,}, measured {planned:,.0f} ({split})"
        f" + {measured['output']:,.0f} output",
        f"  step time: {sum(later) / len(later) * 1e3:.1f} ms mean over steps {min(2, steps)}-{steps}"
        f" (first step {history.seconds[0] * 1e3:.1f} ms), predicted {plan.predicted.step_time_s * 1e3:.1f} ms",
        f"  loss: {history.losses[0]:.4f} -> {history.losses[-1]:.4f}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def run(opts: argparse.Namespace, ranks: Ranks, parser: argparse.ArgumentParser) -> int:
    try:
        model, args, kwargs = build_model(opts.model, opts.batch, opts.seq, opts.seed, ranks.device)
    except ValueError as e:
        parser.error(str(e))
    try:
        module = primepar_fx.compile(
            model,
            args,
            kwargs,
            cluster=opts.cluster,
            plan=opts.plan,
            memory_budget=opts.memory_budget,
            world_size=ranks.world,  # 1 without torchrun: one process, no process group
        )
    except USER_ERRORS as e:  # a plan that cannot be made or loaded, or rank 0 failing to make one
        log.debug("compile failed", exc_info=True)
        where = f" (rank {ranks.rank})" if ranks.world > 1 else ""
        print(f"error{where}: {e} (PRIMEPAR_LOG=DEBUG shows the traceback)", file=sys.stderr)
        return 2
    if ranks.rank == 0 and opts.save_plan:
        print(f"wrote the plan to {module.plan.save(opts.save_plan)}")
    history = train(module, args, kwargs, opts, ranks)
    report = summary(module, history, opts, ranks)
    if ranks.rank == 0:
        print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    ranks = init_distributed()
    level = os.environ.get("PRIMEPAR_LOG", "WARNING").upper()
    logging.basicConfig(level=level, format=f"[rank {ranks.rank}] %(levelname)s %(name)s: %(message)s")
    done = False
    try:
        code = run(opts, ranks, parser)
        done = True
        return code
    finally:
        if ranks.grouped:
            if done:  # every rank finished: free the module's groups and let gloo's transfers drain first
                release()
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
