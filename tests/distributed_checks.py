"""Checks that run on every rank of a gloo process group (started by ``primepar_fx.runtime.testing.spawn``).

Each function returns a JSON-serialisable report from rank 0; the tests assert on it. Every rank builds the same
single-device reference (deterministic seeds), so no reference data has to travel between processes.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from primepar_fx.compiler.module import compile_graph
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import graph_of
from primepar_fx.models import build, build_hf_tiny, example_inputs, get_config, hf_example_inputs
from primepar_fx.partition import PartitionSeq
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.record.plan import Plan
from primepar_fx.runtime.collectives import ReduceScatter

BATCH, SEQ = 4, 16
RTOL, ATOL = 1e-4, 1e-5


def make(name: str):
    if name.startswith("hf:"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        model = build_hf_tiny(name[3:])
        args, kwargs = hf_example_inputs(model, BATCH, SEQ)
    else:
        model = build(name)
        args, kwargs = example_inputs(get_config(name), BATCH, SEQ)
        kwargs = {"labels": kwargs["labels"].clone()}
    if "labels" in kwargs:
        # the first and third sequences ignore a third of their targets: the ranks of a row split count different
        # numbers of targets, and each half of the batch (a micro-batch of two) as many (``compiler.microbatch``)
        kwargs["labels"] = kwargs["labels"].clone()
        kwargs["labels"][::2, : SEQ // 3] = -100
    return model, args, kwargs


def loss_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _steps(model, params, args, kwargs, steps: int) -> list[float]:
    # Adam's first steps are nearly sign(g) * lr, so the float32 rounding differences of a sharded sum (~1e-7)
    # flip the update of any element whose gradient is that close to zero. An eps above those gradients keeps such
    # elements' updates proportional to g, so the check still follows every step of the optimizer.
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _grads_of(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Each parameter's gradient (none for a parameter the loss does not reach), and every name, tied ones under each
    of theirs, that has one."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def _mismatch(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], graded: set[str] | None = None) -> list[str]:
    """What of ``full`` differs from ``ref``; ``graded``: the names that may have a non-zero tensor in ``full`` (the
    parameters one device's loss reaches)."""
    stray = [n for n, t in full.items() if graded is not None and n not in graded and t.any()]
    out = [f"{n}: a gradient where one device has none" for n in stray]
    for n, t in ref.items():
        if n not in full:
            out.append(f"{n}: missing")
        elif not torch.allclose(full[n], t, rtol=RTOL, atol=ATOL):
            out.append(f"{n}: max abs diff {float((full[n] - t).abs().max()):.3g}")
    return out


def _summed(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def with_levers(graph, world: int, plan: str, batch: int = BATCH, seq: int = SEQ) -> Plan:
    """``"NAME+recompute=MODE+zero=STAGE+micro_batches=M"`` (any lever may be left out): the searched plan
    (``NAME`` ``searched``) or the forced plan ``NAME``, with ``MODE`` on every layer, ZeRO stage ``STAGE`` and
    ``M`` micro-batches."""
    name, *levers = plan.split("+")
    asked: dict = dict(lever.split("=") for lever in levers)
    for key in ("micro_batches", "zero"):
        if key in asked:
            asked[key] = int(asked[key])
    sizes = {"world_size": world, "cluster": "cpu-gloo", "batch": batch, "seq": seq, "memory_budget": None}
    if name == "searched":
        return plan_graph(graph, baselines=False, method="dp", stages=1, **asked, **sizes)  # run: no stages
    return forced_plan(graph, name, **asked, **sizes)


def check_plans(rank: int, world: int, model_name: str, plans: list[str], steps: int = 3) -> dict:
    """For each plan: loss and gradients vs one device, parameters after ``steps`` AdamW steps, bytes sent."""
    ref, args, kwargs = make(model_name)
    ref_loss = loss_of(ref(*args, **kwargs))
    ref_loss.backward()
    ref_grads, ref_graded = _grads_of(ref)
    ref_losses = _steps(ref, list(ref.parameters()), args, kwargs, steps)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}

    model, _, _ = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    report = {"reference_loss": float(ref_loss.detach())}
    for plan in plans:
        budget = None
        if plan == "searched:budget":  # a budget that replication cannot meet, so the search must shard
            free = plan_graph(
                graph, world_size=world, cluster="cpu-gloo", batch=BATCH, seq=SEQ, baselines=False, stages=1
            )
            budget = 0.6 * free.predicted.peak_memory_bytes
        if "+recompute=" in plan:
            chosen = with_levers(graph, world, plan)
        else:
            chosen = None if plan.startswith("searched") else plan
        module = compile_graph(graph, plan=chosen, memory_budget=budget)
        module.comm_stats.reset()
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        sent = dict(module.comm_stats.bytes)
        planned = _summed([float(module.comm_stats.planned)])[0]
        grads = module.gather_grads()
        local = module.local_parameters()
        prime_weights = sorted(
            {
                fqn
                for n in module.plan.nodes
                if PartitionSeq.parse(n.partition).prime is not None
                for fqn in graph.nodes[n.name].params
            }
        )
        held = _summed([float(local[f].numel()) for f in prime_weights if f in local])
        initial = {n: p.detach().clone() for n, p in make(model_name)[0].named_parameters()}
        losses = _steps(module, list(module.parameters()), args, kwargs, steps)
        params = module.gather_state_dict()
        module.load_full_state_dict(initial)  # back to the start: the first loss again
        with torch.no_grad():
            reloaded = float(loss_of(module(*args, **kwargs)))
        report[plan] = {
            "loss": float(loss.detach()),
            "bad_grads": _mismatch(grads, ref_grads, ref_graded),
            "losses": losses,
            "ref_losses": ref_losses,
            "bad_params": _mismatch(params, ref_params),
            "reloaded_loss": reloaded,
            "sent_planned_total": planned,
            "predicted_total": module.plan.predicted.comm_bytes * world,
            "recomputed_bytes": sum(n.cost.comm_bytes.get("recomputation", 0) for n in module.plan.nodes if n.cost),
            "sent_rank0": sent,
            "fallbacks": list(module.fallbacks),
            "partitions": {n.name: n.partition for n in module.plan.nodes},
            "prime_weights": {
                f: [h, float(graph.captured.program.state_dict[f].numel())]
                for f, h in zip([f for f in prime_weights if f in local], held)
            },
            "sharded_elems": _summed([float(sum(p.numel() for p in local.values()))])[0],
            "reduce_scatters": sum(
                isinstance(getattr(m, d, None), ReduceScatter)
                for m in module.graph_module.modules()
                for d in ("fwd", "bwd")
            ),
            "full_elems": float(sum(p.numel() for p in ref.parameters())),
        }
    return report


def check_levers(rank: int, world: int, model_name: str, plans: list[str], steps: int = 3) -> dict:
    """For each plan with levers (``with_levers``: ZeRO, micro-batches, recomputation): losses and parameters over
    ``steps`` steps of ``module.optimizer(AdamW)`` vs one device, the bytes of the first whole step (every
    micro-batch, backward and optimizer step) and the optimizer state each rank keeps."""
    ref, args, kwargs = make(model_name)
    ref_losses = _steps(ref, list(ref.parameters()), args, kwargs, steps)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model, _, _ = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    report = {}
    for plan in plans:
        module = compile_graph(graph, plan=with_levers(graph, world, plan))
        opt = module.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-3)
        losses, planned, grads_kept, gathers, in_flight, after_forward = [], 0.0, 0.0, 0, [], []
        for step in range(steps):
            opt.zero_grad()
            module.comm_stats.reset()
            loss = loss_of(module(*args, **kwargs))
            if module.zero_gathers is not None:
                after_forward.append(module.zero_gathers.in_flight)
            loss.backward()
            grads_kept = _summed([float(sum(p.grad.numel() for p in module.parameters() if p.grad is not None))])[0]
            # the last step under torch's profiler, which crashes when it stops while a gloo collective is running
            profiled = step == steps - 1 and module.zero_gathers is not None
            with torch.profiler.profile(profile_memory=True) if profiled else contextlib.nullcontext():
                opt.step()
            if module.zero_gathers is not None:  # ZeRO-1/2: the step's all-gathers left for the next Forward
                in_flight.append(module.zero_gathers.in_flight)
            if step == 0:
                planned = _summed([float(module.comm_stats.planned)])[0]
                gathers = module.zero3.gathers if module.zero3 is not None else 0
            losses.append(float(loss.detach()))
        state = sum(t.numel() for st in opt.state.values() for t in st.values() if t.dim() > 0)
        local = sum(p.numel() for p in module.parameters())
        stored, freed = local, True  # ZeRO-3: the parameters a rank keeps between steps, and whether none is whole
        if module.zero3 is not None:
            units = module.zero3.units
            in_units = sum(p.numel() for u in units for p in u.params)
            stored = local - in_units + sum(u.local.numel() for u in units)
            freed = all(u.storage.nbytes() == 0 for u in units)
            try:  # its values are not there between steps: state_dict refuses, and works inside whole_parameters
                module.state_dict()
                freed = False
            except RuntimeError:
                with module.whole_parameters():
                    freed = freed and all(bool(torch.isfinite(t).all()) for t in module.state_dict().values())
        report[plan] = {
            "zero": module.plan.zero,
            "micro_batches": module.plan.micro_batches,
            "losses": losses,
            "ref_losses": ref_losses,
            "bad_params": _mismatch(module.gather_state_dict(), ref_params),
            "sent_planned_total": planned,
            "predicted_total": module.plan.predicted.comm_bytes * world,
            "state_elems": _summed([float(state)])[0],
            "unsharded_state_elems": _summed([2.0 * local])[0],
            "grad_elems": grads_kept,
            "param_elems": _summed([float(local)])[0],
            "stored_param_elems": _summed([float(stored)])[0],
            "freed_between_steps": freed,
            "gathers": gathers,  # ZeRO-3's all-gathers in the first step
            "in_flight_after_step": in_flight,  # ZeRO-1/2: after each step, before the next Forward
            "in_flight_after_forward": after_forward,
            "units": [[u.read, u.kept] for u in module.zero3.units] if module.zero3 is not None else [],
            "sharded_buckets": len(opt.describe()) if hasattr(opt, "describe") else 0,
            "unsharded_elems": _summed([float(sum(p.numel() for p in getattr(opt, "plain", [])))])[0],
        }
    return report


def check_backend(rank: int, world: int, model_name: str, plans: list[str]) -> dict:
    """``torch.compile(model, backend=primepar_fx.backend(plan=...))``: loss and gradients vs one device, also after
    Dynamo recompiles for a second batch and sequence length."""
    import torch._dynamo

    import primepar_fx

    ref, args, kwargs = make(model_name)
    ref_loss = loss_of(ref(*args, **kwargs))
    ref_loss.backward()
    ref_grads, ref_graded = _grads_of(ref)
    other = dict(kwargs)
    for key in ("input_ids", "labels"):
        if key in other:
            other[key] = other[key][: BATCH // 2, : SEQ // 2].clone()
    other_args = tuple(a[: BATCH // 2, : SEQ // 2].clone() for a in args)
    ref.zero_grad()
    ref_other = float(loss_of(ref(*other_args, **other)).detach())
    report: dict = {"reference_loss": float(ref_loss.detach()), "reference_other": ref_other}
    for plan in plans:
        torch._dynamo.reset()
        model, _, _ = make(model_name)
        compiled = torch.compile(model, backend=primepar_fx.backend(plan=None if plan == "searched" else plan))
        loss = loss_of(compiled(*args, **kwargs))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        with torch.no_grad():
            again = float(loss_of(compiled(*other_args, **other)))
        bad = _mismatch(grads, ref_grads, ref_graded)
        report[plan] = {"loss": float(loss.detach()), "bad_grads": bad, "other": again}
    return report
