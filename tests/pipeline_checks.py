"""Checks of pipelined plans that run on every rank of a gloo process group (started by
``primepar_fx.runtime.testing.spawn``): a plan with stages trains like one device.

A plan is named ``"NAME:stages=P,schedule=S,mb=M[,virtual=V][,recompute=MODE]"``. ``NAME`` ``searched`` is our
search asked for ``P`` stages (``plan_graph(stages=P)``); any other name is the forced plan of that name on one
stage's ``world / P`` devices at ``M`` micro-batches, run as a pipeline of ``P`` (x ``V``) stages of balanced layers
(what a pipelined plan is: one stage's plan, every stage running it on its layers).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import torch
import torch.distributed as dist
from distributed_checks import _mismatch, loss_of

from primepar_fx.compiler.module import compile_graph
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import graph_of
from primepar_fx.models import build, build_hf_tiny, example_inputs, get_config, hf_example_inputs
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.pricing.pipelined import stage_pieces
from primepar_fx.record.pipeline import Pipeline
from primepar_fx.record.plan import Plan

BATCH, SEQ = 4, 16


def make(name: str):
    """``name`` a zoo model or ``hf:FAMILY``, ``@L`` for ``L`` layers; labels with a third of each sequence ignored,
    at a different place in each (ranks that split the sequence count different numbers of targets, every
    micro-batch as many a sequence: the mean of the micro-batches' means is the batch's)."""
    name, _, layers = name.partition("@")
    if name.startswith("hf:"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        model = build_hf_tiny(name[3:], layers=int(layers or 2))
        args, kwargs = hf_example_inputs(model, BATCH, SEQ)
    else:
        config = get_config(name)
        config = dataclasses.replace(config, layers=int(layers)) if layers else config
        model = build(config)
        args, kwargs = example_inputs(config, BATCH, SEQ)
        kwargs = {"labels": kwargs["labels"].clone()}
    kwargs["labels"] = kwargs["labels"].clone()
    for row in range(BATCH):  # as many targets ignored in every row, at different places
        kwargs["labels"][row, 1 + row : 1 + row + SEQ // 3] = -100  # (the first label is never read: shifted)
    return model, args, kwargs


def pipelined_plan(graph, world: int, spec: str) -> Plan:
    """The plan ``spec`` names (module docstring)."""
    name, _, levers = spec.partition(":")
    asked = dict(lever.split("=") for lever in levers.split(","))
    p, m, v = int(asked["stages"]), int(asked["mb"]), int(asked.get("virtual", 1))
    extra: dict = {"recompute": asked["recompute"]} if "recompute" in asked else {}
    extra |= {"zero": int(asked["zero"])} if "zero" in asked else {}
    sizes = {"cluster": asked.get("cluster", "cpu-gloo"), "batch": BATCH, "seq": SEQ, "memory_budget": None}
    if name == "searched":
        return plan_graph(
            graph, world_size=world, baselines=False, method="dp", stages=p, schedule=asked["schedule"],
            micro_batches=m, **extra, **sizes,
        )  # fmt: skip
    stage = forced_plan(graph, name, world_size=world // p, micro_batches=m, **extra, **sizes)
    count, total = p * v, _layers(graph)
    split = tuple(total // count + (k < total % count) for k in range(count))
    pipeline = Pipeline(stages=p, schedule=asked["schedule"], virtual_stages=v, micro_batches=m, layers_per_stage=split)
    return dataclasses.replace(stage, world_size=world, pipeline=pipeline)


def _layers(graph) -> int:
    pieces = stage_pieces(graph)
    assert pieces is not None
    return len(pieces)


def _steps(step, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(step()))
        opt.step()
    return losses


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def check_pipelines(rank: int, world: int, model_name: str, specs: list[str], steps: int = 3) -> dict:
    """For each pipelined plan: the loss and gradients of one step and the losses and parameters of ``steps`` AdamW
    steps vs one device, and the bytes a rank sends (its stages' collectives, the pipeline's transfers) against
    the plan's prediction, as means over the ranks."""
    ref, args, kwargs = make(model_name)
    ref_loss = loss_of(ref(*args, **kwargs))
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    ref_losses = _steps(lambda: _backward(loss_of(ref(*args, **kwargs))), opt, steps)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model, _, _ = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    report: dict = {"reference_loss": float(ref_loss.detach())}
    for spec in specs:
        plan = pipelined_plan(graph, world, spec)
        module = compile_graph(graph, plan=plan)
        loss = module.step(*args, **kwargs)
        grads = module.gather_grads()
        opt = module.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-3)
        # the bytes of a whole step (its micro-batches, Backward and the optimizer's step) after the first, which
        # runs each stage once more (torch.distributed.pipelining infers the shapes that cross from it)
        module.comm_stats.reset()
        losses = _steps(partial(module.step, *args, **kwargs), opt, 1)
        sent = dict(module.comm_stats.bytes)
        losses += _steps(partial(module.step, *args, **kwargs), opt, steps - 1)
        report[spec] = {
            "pipeline": plan.pipeline.describe(),
            "loss": float(loss),
            "bad_grads": _mismatch(grads, ref_grads),
            "losses": losses,
            "ref_losses": ref_losses,
            "bad_params": _mismatch(module.gather_state_dict(), ref_params),
            "stage_bytes": _mean_over_ranks(sum(v for k, v in sent.items() if k not in ("pipeline", "output"))),
            "pipeline_bytes": _mean_over_ranks(sent["pipeline"]),
            "predicted_stage_bytes": plan.predicted.comm_bytes,
            "predicted_pipeline_bytes": plan.pipeline.p2p_bytes,
            "stages_held": len(module.stage_modules),
        }
    return report


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def check_checkpoint_across_stages(rank: int, world: int, model_name: str, spec: str, folder: str) -> dict:
    """A pipelined plan's DCP checkpoint loads into a plan without stages and back, bit-exact: train the pipelined
    module a step, save, load into a flat plan of the same world (its gathered parameters must equal the
    pipeline's), train that a step, save, load into a fresh pipelined module (equal again)."""
    from primepar_fx.compiler import checkpoint

    model, args, kwargs = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    piped = compile_graph(graph, plan=pipelined_plan(graph, world, spec))
    opt = piped.optimizer(torch.optim.AdamW, lr=1e-2)
    _steps(partial(piped.step, *args, **kwargs), opt, 1)
    checkpoint.save(piped, f"{folder}/piped")
    before = piped.gather_state_dict()
    flat = compile_graph(graph, plan=forced_plan(graph, "prime", world_size=world, batch=BATCH, seq=SEQ))
    checkpoint.load(flat, f"{folder}/piped")
    into_flat = flat.gather_state_dict()
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    _steps(lambda: _backward(loss_of(flat(*args, **kwargs))), flat_opt, 1)
    checkpoint.save(flat, f"{folder}/flat")
    trained = flat.gather_state_dict()
    again = compile_graph(graph, plan=pipelined_plan(graph, world, spec))
    checkpoint.load(again, f"{folder}/flat")
    back = again.gather_state_dict()
    return {
        "into_flat": [n for n, t in before.items() if not torch.equal(t, into_flat[n])],
        "back": [n for n, t in trained.items() if not torch.equal(t, back[n])],
        "changed": [n for n, t in before.items() if not torch.equal(t, trained[n])],
        "names": sorted(before) == sorted(trained) == sorted(back),
    }
