"""Checks for bad input, rank failures and checkpoints that run on the ranks of a gloo process group.

Started by ``primepar_fx.runtime.testing.spawn`` / ``spawn_each`` from ``test_errors.py``, ``test_faults.py`` and
``test_checkpoint.py``. Each returns a JSON-serialisable report; bit-exact comparisons happen here, on the ranks,
against files in ``tmp``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from distributed_checks import ATOL, RTOL, make, with_levers

import primepar_fx
from primepar_fx.compiler import checkpoint
from primepar_fx.compiler.module import compile_graph
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import build_graph
from primepar_fx.models import example_inputs, get_config
from primepar_fx.partition import PartitionError
from primepar_fx.planning.forced import forced_plan


def inputs(name: str, batch: int, seq: int) -> tuple[tuple, dict]:
    args, kwargs = example_inputs(get_config(name), batch, seq)
    return args, {"labels": kwargs["labels"].clone()}


def step(module, opt, args, kwargs) -> float:
    opt.zero_grad()
    loss = module(*args, **kwargs)
    loss.backward()
    opt.step()
    return float(loss.detach())


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)


def _compiled(graph, plan: str):
    """``plan`` a forced name, or ``"NAME+zero=STAGE"`` and the like (:func:`distributed_checks.with_levers`)."""
    if "+" not in plan:
        return compile_graph(graph, plan=plan)
    return compile_graph(graph, plan=with_levers(graph, dist.get_world_size() if dist.is_initialized() else 1, plan))


def _optimizer(module, **kwargs):
    """AdamW as the plan trains it: ``module.optimizer`` (sharded under ZeRO)."""
    return module.optimizer(torch.optim.AdamW, **{"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1, **kwargs})


def _per_param(opt):
    return opt.as_params() if hasattr(opt, "as_params") else opt


def _error(e: BaseException) -> list[str]:
    return [type(e).__name__, str(e)]


# ---------------------------------------------------------------------------------------------------- bad input
def errors_on_ranks(rank: int, world: int, tmp: str) -> None:
    """Run-time sizes and plans a real group cannot use; every rank writes ``tmp/rank{r}.json``."""
    report: dict = {}
    name = "gpt2-tiny"
    ref, args, kwargs = make(name)
    model, _, _ = make(name)
    graph = build_graph(capture(model, args, kwargs))
    for plan in ("megatron-sp", "data_parallel"):  # new B and S: the plan is reused, the numbers are one device's
        module = compile_graph(graph, plan=plan)
        for b, s in ((4, 16), (2, 8), (6, 12)):
            a, k = inputs(name, b, s)
            module.zero_grad()
            ref.zero_grad()
            loss = module(*a, **k)
            loss.backward()
            ref_loss = ref(*a, **k)
            ref_loss.backward()
            grads = module.gather_grads()
            bad = [n for n, p in ref.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=RTOL, atol=ATOL)]
            close = abs(float(loss) - float(ref_loss)) <= ATOL + RTOL * abs(float(ref_loss))
            report[f"{plan} {b}x{s}"] = {"close": close, "bad_grads": bad}
        report[f"{plan} graphs"] = [list(k) for k in module._rank_graphs]
        try:
            module(*inputs(name, 3, 8)[0], **inputs(name, 3, 8)[1])
            report[f"{plan} odd batch"] = None
        except (PartitionError, ValueError) as e:
            report[f"{plan} odd batch"] = _error(e)
        # ranks given different sizes: both already built (4x16 and 2x8), then one new (8x8) against a built one
        for label, sizes in (("built", [(2, 8), (4, 16)]), ("new", [(8, 8), (2, 8)])):
            a, k = inputs(name, *sizes[rank % 2])
            try:
                module(*a, **k)
                report[f"{plan} mismatch {label}"] = None
            except ValueError as e:
                report[f"{plan} mismatch {label}"] = _error(e)
        a, k = inputs(name, 2, 8)  # and the group still works
        report[f"{plan} after mismatch"] = abs(float(module(*a, **k)) - float(ref(*a, **k))) <= ATOL
    if rank == 0:
        cap = graph.captured
        plan4 = forced_plan(graph, "megatron", world_size=2 * world, batch=cap.example_batch, seq=cap.example_seq)
        plan4.save(Path(tmp, "plan4.json"))
        bad = json.loads(plan4.to_json())
        bad["world_size"], bad["digits"] = world, [world]
        bad["nodes"][0]["bogus"] = 1
        Path(tmp, "tampered.json").write_text(json.dumps(bad))
    dist.barrier()
    for label, plan in (("other world", Path(tmp, "plan4.json")), ("tampered", Path(tmp, "tampered.json"))):
        try:
            compile_graph(graph, plan=plan)
            report[label] = None
        except Exception as e:  # noqa: BLE001  (the report names the type)
            report[label] = _error(e)
    try:
        compile_graph(graph, plan="megatron", world_size=2 * world)
        report["world_size"] = None
    except ValueError as e:
        report["world_size"] = _error(e)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(report))


# ---------------------------------------------------------------------------------------------------- faults
def rank_fails_mid_step(rank: int, world: int, how: str, at: str, timeout: float, plan: str) -> dict:
    """Rank 1 fails in the second step, before its ``at`` (forward or backward); the others report what they raised.

    ``how="kill"``: rank 1's process is killed (SIGKILL). ``how="raise"``: rank 1 raises, catches it and stays
    alive without taking part, so the others can only notice through the timeout.
    """
    name = "gpt2-tiny"
    model, _, _ = make(name)
    args, kwargs = inputs(name, 2 * world, 8)
    module = primepar_fx.compile(model, args, kwargs, plan=plan, timeout=timeout)
    opt = adamw(module.parameters())
    step(module, opt, args, kwargs)
    start = time.monotonic()

    def fail_here(where: str) -> None:
        if rank == 1 and where == at:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank 1 before the {at}")

    try:
        opt.zero_grad()
        fail_here("forward")
        loss = module(*args, **kwargs)
        fail_here("backward")
        loss.backward()
        return {"rank": rank, "error": None, "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001  (the report names the type)
        if rank == 1:
            time.sleep(timeout + 5)  # alive and silent: the others must time out
            return {"rank": rank, "injected": str(e)}
        return {"rank": rank, "error": _error(e), "seconds": time.monotonic() - start}


# ---------------------------------------------------------------------------------------------------- checkpoints
def _full_optimizer_state(module, opt) -> dict[str, torch.Tensor]:
    params, opt = module.local_parameters(), _per_param(opt)
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        for fqn, full in module.gather_tensors({f: opt.state[p][key] for f, p in params.items()}).items():
            out[f"{fqn}/{key}"] = full
    return out


def _compare_to_file(module, opt, path: Path) -> list[str]:
    """Names whose gathered parameter or optimizer state is not bit-identical to the consolidated file's."""
    saved = torch.load(path, weights_only=True)
    params = module.gather_state_dict()
    bad = [n for n, t in saved["model"].items() if not torch.equal(params[n], t)]
    state = _full_optimizer_state(module, opt)
    opt = _per_param(opt)
    for fqn, keys in saved["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(state[f"{fqn}/{key}"], keys[key]):
                bad.append(f"{fqn}/{key}")
        if float(keys["step"]) != float(opt.state[module.local_parameters()[fqn]]["step"]):
            bad.append(f"{fqn}/step")
    return bad


def checkpoint_save(rank: int, world: int, name: str, plan: str, tmp: str, before: int, after: int) -> dict:
    """Train ``before`` steps, save both ways, train ``after`` more; resume from each and train the same steps."""
    model, args, kwargs = make(name)
    graph = build_graph(capture(model, args, kwargs))
    module = _compiled(graph, plan)
    opt = _optimizer(module)
    first = [step(module, opt, args, kwargs) for _ in range(before)]
    t0 = time.monotonic()
    checkpoint.save(module, Path(tmp, "dcp"), opt)
    t1 = time.monotonic()
    checkpoint.save_consolidated(module, Path(tmp, "full.pt"), opt)
    t2 = time.monotonic()
    report = {
        "first": first,
        "save_s": t1 - t0,
        "save_consolidated_s": t2 - t1,
        "file_differs": _compare_to_file(module, opt, Path(tmp, "full.pt")),
        "uninterrupted": [step(module, opt, args, kwargs) for _ in range(after)],
        "partitions": sorted({n.partition for n in module.plan.nodes}),
    }
    ref, _, _ = make(name)  # the trained weights at other sizes: the module rebuilds its graph, reusing its plan
    ref.load_state_dict(module.gather_state_dict())
    a, k = inputs(name, 2, 8)
    with torch.no_grad():
        try:
            report["other sizes"] = [float(module(*a, **k)), float(ref(*a, **k))]
        except PartitionError:  # (a plan that splits B four ways cannot run B=2)
            report["other sizes"] = None
    for how in ("dcp", "consolidated"):
        fresh = _compiled(graph, plan)
        fresh_opt = _optimizer(fresh, lr=1.0)  # the checkpoint's hyperparameters win
        if how == "dcp":
            checkpoint.load(fresh, Path(tmp, "dcp"), fresh_opt)
        else:
            checkpoint.load_consolidated(fresh, Path(tmp, "full.pt"), fresh_opt)
        report[f"{how} lr"] = fresh_opt.param_groups[0]["lr"]
        report[f"{how} resumed"] = [step(fresh, fresh_opt, args, kwargs) for _ in range(after)]
    return report


def checkpoint_load(rank: int, world: int, name: str, plan: str, tmp: str, after: int) -> dict:
    """Load a checkpoint written under another plan or world size; compare with the consolidated file; resume."""
    model, args, kwargs = make(name)
    graph = build_graph(capture(model, args, kwargs))
    report: dict = {}
    for how in ("dcp", "consolidated"):
        module = _compiled(graph, plan)
        opt = _optimizer(module, lr=1.0)
        t0 = time.monotonic()
        if how == "dcp":
            checkpoint.load(module, Path(tmp, "dcp"), opt)
        else:
            checkpoint.load_consolidated(module, Path(tmp, "full.pt"), opt)
        report[f"{how} load_s"] = time.monotonic() - t0
        report[f"{how} differs"] = _compare_to_file(module, opt, Path(tmp, "full.pt"))
        report[f"{how} resumed"] = [step(module, opt, args, kwargs) for _ in range(after)]
    report["partitions"] = sorted({n.partition for n in module.plan.nodes})
    return report
