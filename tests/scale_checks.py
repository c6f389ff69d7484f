"""Plans at the sizes users run them (issue 61): 16 real gloo ranks, and 32-128 ranks simulated in one process.

One check, :func:`run_plan`, runs on every rank of either kind: the plan compiled, ``steps`` AdamW steps through
``module.optimizer``, and per rank the losses and the bytes of the first whole step (forward, backward, optimizer
step) against the plan's prediction; rank 0 gathers the gradients of the first step (where ZeRO leaves them) and
the parameters after the last, and holds them against one device's.

* :func:`check_simulated`: every plan of ``specs`` at ``world`` ranks simulated as threads
  (:mod:`primepar_fx.runtime.simulated`): the model captured once, the plans made once, the reference trained once.
* :func:`check_real` (a ``spawn`` target): the same plans, made beforehand and handed over as JSON, on real gloo
  ranks; each rank captures its own graph, as a user's processes do.

A spec is ``NAME[+recompute=MODE][+zero=STAGE][+micro_batches=M]``: ``NAME`` is ``searched`` or a forced plan.

    PYTHONPATH=. python tests/scale_checks.py --world 32 --model hf:llama prime random:3 searched+zero=3
    PYTHONPATH=. python tests/scale_checks.py --real --world 16 --model llama-tiny searched prime megatron
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed_checks import BATCH, SEQ, _grads_of, _mismatch, _steps, loss_of, make

LR, EPS = 1e-2, 1e-3  # as distributed_checks._steps (its comment says why eps is large)
SIM_TIMEOUT = 3600.0  # seconds for one plan on simulated ranks: 128 of them take minutes on a shared 2-core machine
BYTES_RTOL = 1e-6  # measured bytes of all ranks over predicted bytes x ranks: integer rounding only


def make_plan(graph, world: int, spec: str, cluster: str, batch: int = BATCH, seq: int = SEQ):
    """The plan of ``spec`` (module docstring) for ``world`` devices of ``cluster``."""
    from primepar_fx.planning.forced import forced_plan
    from primepar_fx.planning.planner import plan_graph

    name, *levers = spec.split("+")
    asked: dict[str, Any] = dict(lever.split("=") for lever in levers)
    for key in ("micro_batches", "zero"):
        if key in asked:
            asked[key] = int(asked[key])
    sizes = {"world_size": world, "cluster": cluster, "batch": batch, "seq": seq, "memory_budget": None}
    if name == "searched":
        return plan_graph(graph, baselines=False, method="dp", stages=1, **asked, **sizes)  # run: no stages
    return forced_plan(graph, name, **asked, **sizes)


def reference(model_name: str, steps: int) -> dict[str, Any]:
    """One device: the first step's loss and gradients, the losses of ``steps`` AdamW steps and the parameters
    after them."""
    ref, args, kwargs = make(model_name)
    loss_of(ref(*args, **kwargs)).backward()
    grads, graded = _grads_of(ref)
    ref.zero_grad()
    losses = _steps(ref, list(ref.parameters()), args, kwargs, steps)
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return {"grads": grads, "graded": graded, "losses": losses, "params": params}


def run_plan(rank: int, world: int, graph, plan, args, kwargs, ref: dict[str, Any] | None, steps: int) -> dict:
    """The plan trained for ``steps`` steps on this rank (module docstring); rank 0's report has the mismatches."""
    from primepar_fx.compiler.module import compile_graph

    module = compile_graph(graph, plan=plan, cluster="cpu-gloo")  # the cluster only prices; the plan is given
    opt = module.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, sent, bad_grads = [], 0, []
    for step in range(steps):
        opt.zero_grad()
        module.comm_stats.reset()
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        if step == 0 and module.plan.zero < 2:  # ZeRO-2 and -3 keep only their shard of each gradient
            grads = module.gather_grads()
            module.comm_stats.reset()  # gathering for the check is not the plan's traffic: count the step again
            if rank == 0 and ref is not None:
                bad_grads = _mismatch(grads, ref["grads"], ref["graded"])
            opt.zero_grad()
            loss = loss_of(module(*args, **kwargs))
            loss.backward()
        opt.step()
        if step == 0:
            sent = module.comm_stats.planned
        losses.append(float(loss.detach()))
    params = module.gather_state_dict()
    report = {"losses": losses, "sent": sent, "predicted": module.plan.predicted.comm_bytes}
    if rank == 0 and ref is not None:
        report.update(bad_grads=bad_grads, bad_params=_mismatch(params, ref["params"]))
    return report


def judge(spec: str, plan, per_rank: list[dict], ref: dict[str, Any]) -> dict[str, Any]:
    """One plan's verdict from every rank's report: losses equal to one device's on every rank, no gradient or
    parameter off, and every rank's bytes equal to the prediction."""
    first = per_rank[0]
    tol = lambda a, b: abs(a - b) <= 1e-5 + 1e-4 * abs(b)  # noqa: E731 (distributed_checks' RTOL, ATOL)
    losses_ok = all(all(map(tol, r["losses"], ref["losses"])) for r in per_rank)
    sent = [r["sent"] for r in per_rank]
    out = {
        "spec": spec,
        "digits": list(plan.digits),
        "zero": plan.zero,
        "micro_batches": plan.micro_batches,
        "recompute": bool(plan.recompute),
        "prime_nodes": sum(n.seq.prime is not None for n in plan.nodes),
        "losses": first["losses"],
        "ref_losses": ref["losses"],
        "bad_grads": first["bad_grads"],
        "bad_params": first["bad_params"],
        "sent": sent,
        "predicted": first["predicted"],
    }
    # the prediction is per device, the mean over ranks: a plan whose ranks send different amounts (an uneven
    # re-layout) matches it in total, as the real-rank tests hold it
    out["bytes_ratio"] = sum(sent) / (out["predicted"] * len(sent)) if out["predicted"] else float(sum(sent) == 0)
    bytes_ok = abs(out["bytes_ratio"] - 1.0) <= BYTES_RTOL
    out["ok"] = losses_ok and not out["bad_grads"] and not out["bad_params"] and bytes_ok
    return out


def check_simulated(world: int, model_name: str, specs: list[str], cluster: str, steps: int = 2) -> list[dict]:
    """Every spec at ``world`` simulated ranks of ``cluster`` (module docstring); a verdict per spec."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import graph_of
    from primepar_fx.runtime.simulated import simulate

    ref = reference(model_name, steps)
    model, args, kwargs = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    verdicts = []
    for spec in specs:
        plan = make_plan(graph, world, spec, cluster)
        per_rank = simulate(run_plan, world, graph, plan, args, kwargs, ref, steps, timeout=SIM_TIMEOUT)
        verdicts.append(judge(spec, plan, per_rank, ref))
    return verdicts


def check_real(rank: int, world: int, model_name: str, plans: list[str], steps: int = 2) -> list[dict]:
    """``spawn`` target: every plan (JSON text) on this real rank; rank 0 returns every rank's report per plan."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import graph_of
    from primepar_fx.record.plan import Plan

    ref = reference(model_name, steps) if rank == 0 else None
    model, args, kwargs = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    out = []
    for text in plans:
        report = run_plan(rank, world, graph, Plan.from_json(text), args, kwargs, ref, steps)
        mine = json.dumps(report).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(mine)]))
        most = int(max(s.item() for s in sizes))
        bufs = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(bufs, torch.frombuffer(bytearray(mine.ljust(most)), dtype=torch.uint8))
        out.append([json.loads(bytes(b.tolist()).decode()) for b in bufs])
    return out


def real_verdicts(world: int, model_name: str, specs: list[str], cluster: str, steps: int = 2) -> list[dict]:
    """Every spec on ``world`` real gloo ranks, the plans made here once (``cluster``); a verdict per spec."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import graph_of
    from primepar_fx.runtime.testing import spawn

    ref = reference(model_name, steps)
    model, args, kwargs = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    plans = [make_plan(graph, world, spec, cluster) for spec in specs]
    runs = spawn(check_real, world, model_name, [p.to_json() for p in plans], steps, timeout=300.0 + 240.0 * len(plans))
    return [judge(spec, plan, per_rank, ref) for spec, plan, per_rank in zip(specs, plans, runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", help="plans: searched, prime, megatron, random:N, ... with +LEVER=VALUE")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", action="append", help="zoo name or hf:FAMILY (repeatable)")
    parser.add_argument("--cluster", default="h100-dgx", help="preset the plans are made for (default h100-dgx)")
    parser.add_argument("--real", action="store_true", help="real gloo ranks instead of simulated ones")
    parser.add_argument("--steps", type=int, default=2)
    opts = parser.parse_args(argv)
    failed = 0
    for model_name in opts.model or ["llama-tiny"]:
        t0 = time.perf_counter()
        run = real_verdicts if opts.real else check_simulated
        for v in run(opts.world, model_name, opts.specs, opts.cluster, opts.steps):
            failed += not v["ok"]
            sent = sorted(set(v["sent"]))
            print(
                f"{model_name} {opts.world} {'real' if opts.real else 'simulated'} {v['spec']}: "
                f"{'ok' if v['ok'] else 'MISMATCH'}; digits {v['digits']}, P(SxS) on {v['prime_nodes']} nodes, "
                f"ZeRO-{v['zero']}, {v['micro_batches']} micro-batches, recompute {v['recompute']}; losses "
                f"{[round(x, 6) for x in v['losses']]} vs {[round(x, 6) for x in v['ref_losses']]}; bytes/rank "
                f"{sent} predicted {v['predicted']} (all ranks / predicted: {v['bytes_ratio']:.9f}); grads off "
                f"{v['bad_grads'][:2]}, params off {v['bad_params'][:2]}",
                flush=True,
            )
        print(f"{model_name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scale_checks  # the ranks unpickle check_real from the module, not from __main__

    sys.exit(scale_checks.main())
