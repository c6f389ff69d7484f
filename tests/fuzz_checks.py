"""Differential fuzzing: random small decoders x world sizes x random legal plans, each against one device.

A :class:`Case` is a small :class:`~primepar_fx.models.DecoderConfig` (1-3 layers; hidden, heads, kv heads and MLP
width drawn from choices that 2 and 3 divide; LayerNorm or RMSNorm; GELU, ReLU or SwiGLU; learned, rotary or ALiBi
positions; fused or separate QKV; tied or untied embeddings; with or without biases), a world size in
{1, 2, 3, 4, 6, 8}, a batch and sequence length, and a plan: mostly ``"random:SEED"`` (a uniformly random legal
partition sequence per node, not only the optimal one), sometimes ``"prime"`` (on 4 or 8), ``"megatron"``,
``"data_parallel"`` or the searched plan, and on 6 ranks sometimes the other digit order (2, 3). Every memory
lever is drawn too (issues 18 and 60): a model of two or more layers is sometimes run with every layer recomputed
in full or selectively (the reference decoder's attention is one fused op, which keeps no scores, so selective
recomputes nothing there: it checks that such a plan compiles and runs), a plan on two or more ranks sometimes
with ZeRO stage 1, 2 or 3, and about half the plans run the batch as 2, 3 or 4 micro-batches where the count
divides it (:data:`MICRO_BATCHES`; the plan is priced at the micro-batch, so its splits of the batch divide
that). About a quarter of the cases whose world and layers allow it run as a pipeline (issue 62): 2 or 3 stages,
1F1B or GPipe, the plan our search makes for those stages on :data:`PIPELINE_CLUSTER`, trained by
``module.step``. One training step of the compiled per-rank module must give the single-device loss and, gathered, every
single-device gradient (``RTOL``, ``ATOL``); with ZeRO the step is taken by ``module.optimizer(AdamW)`` and the
parameters after it must be one device's too (stages 2 and 3 leave no gradients to gather). The bytes every rank
sends in that step (forward, backward and ZeRO's optimizer step), summed, must be the plan's predicted bytes times
the ranks (to two bytes per node, rank and micro-batch: rounding, ``BYTES_SLACK_PER_NODE``).

How examples are drawn, and why. One definition, :func:`draw_case`, draws a case through a ``choose(options)``
callable, so the same generator serves two drivers:

* a seeded ``random.Random`` (:func:`draw_cases`) for the bounded CI run and the long mode. Its cases are bucketed
  by world size and every bucket runs in **one** process-group start (:func:`run_bucket` on every rank; one rank
  runs in this process, without a group). That is what makes a dozen examples affordable: on 2 cores, starting
  8 gloo ranks takes about half a minute (each imports torch), a case a few seconds. Hypothesis cannot drive
  this: it calls the test once per example, and shrinks by calling it again, while a bucket has to be known before
  its ranks start.
* hypothesis (``st.composite`` over the same :func:`draw_case`, see ``tests/compiler/test_fuzz.py``) for two examples on
  2 ranks, one process-group start each, and for cheap single-process properties of the generator. Hypothesis
  only draws there; the ranks run in fresh ``spawn`` processes, never forked from the hypothesis engine.

A failing case (wrong numbers, an exception, or a bucket past its deadline) is written to a folder with the plan
JSON rank 0 compiled, which ``case.json`` then names instead of the drawn plan (so the rerun does not depend on
the planner); the message prints the config and the one-line command that reruns it alone::

    PYTHONPATH=. python tests/fuzz_checks.py /tmp/.../case-3/case.json

``python tests/fuzz_checks.py --examples N [--seed S]`` runs N fresh examples the same way as the tests.

``--simulated`` (issue 61) draws every case on 16 to 64 ranks (:data:`SIM_WORLDS`) of a preset of nodes of eight
(:data:`SIM_CLUSTER`: meshes of up to six digits, searched as groupings), run as threads of this process
(:mod:`primepar_fx.runtime.simulated`): the model captured, the plan made and one device's step taken once per case,
every rank compiling the plan and training one step (:func:`check_simulated`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from distributed_checks import ATOL, RTOL, _mismatch

WORLDS = (1, 2, 3, 4, 6, 8)
CI_WORLDS = (2, 4, 1, 3, 8, 6, 2, 1, 4, 3, 2, 1)  # world sizes of the first cases (draw_cases)
TIMEOUT_PER_CASE = 120.0  # seconds a bucket may take per case before every rank is killed
MICRO_BATCHES = (1, 1, 1, 2, 3, 4)  # drawn among those that divide the batch: 1 about half the time
SIM_WORLDS = (16, 24, 32, 48, 64)  # simulated ranks (runtime.simulated): nodes of eight of SIM_CLUSTER
SIM_CLUSTER = "h100-dgx"  # a preset of nodes of eight devices: meshes of three to six digits, across nodes
#: the bytes every rank sends in the step, summed, against the prediction x ranks: rounding only, at most this
#: many bytes per node, rank and micro-batch (each node's bytes of a kind are rounded to whole bytes once a
#: micro-batch, each message's too: 2/3 of a block on 3 ranks)
BYTES_SLACK_PER_NODE = 2
#: the preset a pipelined case's stage plans are searched for (one that splits tiny layers: cpu-gloo replicates them)
PIPELINE_CLUSTER = "h100-dgx"

Choose = Callable[[Sequence[Any]], Any]


@dataclass(frozen=True)
class Case:
    """One fuzz example: the model, where it runs and how it is partitioned (all JSON data)."""

    config: dict[str, Any]
    world: int
    plan: str  # "random:SEED", "prime", "megatron", "data_parallel", "searched" or a path to a plan JSON
    batch: int
    seq: int
    seed: int = 0  # weights and token ids
    digits: tuple[int, ...] | None = None  # device digits other than the cluster's default (forced plans only)
    index: int = 0
    note: dict[str, Any] = field(default_factory=dict)
    recompute: str = "none"  # activation recomputation of every layer: "none", "selective" or "full" (issue 18)
    zero: int = 0  # ZeRO stage of the plan (issue 18)
    micro_batches: int = 1  # micro-batches a step runs the batch as (gradient accumulation, issue 18)
    simulated: bool = False  # ranks simulated as threads of one process, planned for SIM_CLUSTER (issue 61)
    stages: int = 1  # pipeline stages the plan runs as (issue 62): the search asked for them, on PIPELINE_CLUSTER
    schedule: str = "1F1B"  # their schedule

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["digits"] = list(self.digits) if self.digits else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        data = dict(data)
        data["digits"] = tuple(data["digits"]) if data.get("digits") else None
        return cls(**data)

    def label(self) -> str:
        c = self.config
        parts = [
            f"L{c['layers']} h{c['hidden']} heads{c['heads']}/{c['kv_heads']} ffn{c['ffn_hidden']}",
            f"{c['norm']} {c['mlp']} {c['position']}",
            "fused" if c["fused_qkv"] else "qkv",
            "tied" if c["tied_embeddings"] else "untied",
            "bias" if c["bias"] else "nobias",
            f"V{c['vocab_size']} B{self.batch} S{self.seq} world {self.world} plan {self.plan}",
        ]
        if self.digits:
            parts.append(f"digits {self.digits}")
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute}")
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        if self.simulated:
            parts.append(f"simulated on {SIM_CLUSTER}")
        if self.stages > 1:
            parts.append(f"{self.stages} stages {self.schedule} (searched on {PIPELINE_CLUSTER})")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------ drawing


def draw_config(choose: Choose) -> dict[str, Any]:
    """A small decoder whose dims 2 and 3 divide (as ``DecoderConfig`` keyword arguments)."""
    hidden = choose((24, 48, 96))
    heads = choose([h for h in (2, 3, 4, 6) if hidden % h == 0])
    kv_heads = choose([k for k in (1, 2, 3, heads) if heads % k == 0])
    fused = kv_heads == heads and choose((False, True))
    return {
        "name": "fuzz",
        "vocab_size": choose((96, 192)),
        "hidden": hidden,
        "layers": choose((1, 2, 3)),
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn_hidden": hidden * choose((2, 4)),
        "fused_qkv": fused,
        "norm": choose(("layernorm", "rmsnorm")),
        "mlp": choose(("gelu", "relu", "swiglu")),
        "position": choose(("learned", "rotary", "alibi")),
        "bias": choose((True, False)),
        "tied_embeddings": choose((True, False)),
        "embed_norm": choose((False, False, True)),
        "max_seq": 24,
    }


def draw_case(
    choose: Choose, *, world: int | None = None, index: int = 0, simulated: bool = False, pipelined: bool = False
) -> Case:
    """A :class:`Case`; ``choose(options)`` returns one of ``options`` (``random.Random.choice``, hypothesis).
    ``simulated``: a world size of :data:`SIM_WORLDS` (unless given), run on simulated ranks. ``pipelined``: a
    case that runs as a pipeline wherever its world and layers allow one (:func:`_maybe_pipelined`)."""
    config = draw_config(choose)
    world = world if world is not None else choose(SIM_WORLDS if simulated else WORLDS)
    prime = simulated or world in (4, 8)  # a mesh with two equal digits (past three digits, in a grouping)
    plans = ["random"] * 6 + ["megatron", "data_parallel", "searched"] + (["prime"] * 2 if prime else [])
    plan = choose(plans)
    if plan == "random":
        plan = f"random:{choose(range(10_000))}"
    digits = None
    if world == 6 and plan.startswith("random") and choose((False, True)):
        digits = (2, 3)  # the cluster's default is (3, 2)
    batch, seq = choose(((6, 12), (6, 24), (12, 24)))  # B != S: capture tells the two apart by size
    seed = choose(range(1000))
    # recomputation needs a layer stack: two layers or more
    recompute = choose(("none", "none", "full", "selective")) if config["layers"] >= 2 else "none"
    zero = choose((0, 0, 1, 2, 3)) if world > 1 else 0
    micro_batches = choose([m for m in MICRO_BATCHES if batch % m == 0])
    case = Case(
        config=config,
        world=world,
        plan=plan,
        batch=batch,
        seq=seq,
        seed=seed,
        digits=digits,
        index=index,
        recompute=recompute,
        zero=zero,
        micro_batches=micro_batches,
        simulated=simulated,
    )
    return case if simulated else _maybe_pipelined(case, choose, always=pipelined)


def _maybe_pipelined(case: Case, choose: Choose, always: bool = False) -> Case:
    """About a quarter of the cases whose world and layers allow stages run as a pipeline (issue 62): 2 or 3 stages
    (dividing the world, a layer each at least), the searched plan, 1F1B or GPipe over at least as many
    micro-batches as stages, ZeRO at most 1 (the pipelined runtime runs no ZeRO-2 or 3 yet). Drawn last, so
    the cases drawn before pipelines existed keep their draws."""
    counts = [p for p in (2, 3) if case.world % p == 0 and p <= case.config["layers"]]
    if not counts or not (choose((False, False, False, True)) or always):
        return case
    stages = choose(counts)
    micro = choose([m for m in (2, 3, 4, 6) if case.batch % m == 0 and m >= stages])
    schedule = choose(("1F1B", "GPipe"))
    return replace(
        case, stages=stages, schedule=schedule, plan="searched", micro_batches=micro, zero=min(case.zero, 1),
        digits=None,
    )  # fmt: skip


def draw_cases(
    n: int, seed: int, *, simulated: bool = False, worlds: Sequence[int] | None = None, pipelined: bool = False
) -> list[Case]:
    """``n`` cases from a ``random.Random(seed)``.

    The first cases take their world sizes from :data:`CI_WORLDS` (every size present, the cheap ones more
    often: 8 ranks on 2 cores take a minute to start); later ones cycle through :data:`WORLDS` evenly.
    ``simulated``: every case on simulated ranks, the world sizes cycling through :data:`SIM_WORLDS`. ``worlds``:
    cycle through these world sizes instead. ``pipelined``: every case a pipeline (drawn again until its world and
    layers allow one).
    """
    import random

    rng = random.Random(seed)
    if worlds:
        sizes = [worlds[i % len(worlds)] for i in range(n)]
    elif simulated:
        sizes = [SIM_WORLDS[i % len(SIM_WORLDS)] for i in range(n)]
    else:
        sizes = [CI_WORLDS[i] if i < len(CI_WORLDS) else WORLDS[i % len(WORLDS)] for i in range(n)]
    out = []
    for i, w in enumerate(sizes):
        case = draw_case(rng.choice, world=w, index=i, simulated=simulated, pipelined=pipelined)
        while pipelined and case.stages == 1:
            case = draw_case(rng.choice, world=w, index=i, pipelined=True)
        out.append(case)
    return out


def by_world(cases: Sequence[Case], most: int = 20) -> list[tuple[int, list[Case]]]:
    """Buckets of at most ``most`` cases of one world size, smallest world first (a hang loses one bucket)."""
    worlds: dict[tuple[bool, int], list[Case]] = {}
    for case in cases:
        worlds.setdefault((case.simulated, case.world), []).append(case)
    return [(w, group[i : i + most]) for (_, w), group in sorted(worlds.items()) for i in range(0, len(group), most)]


# ------------------------------------------------------------------------------------------------ on every rank


def _model_and_inputs(case: Case):
    from primepar_fx.models import DecoderConfig, build, example_inputs

    config = DecoderConfig(**case.config)
    model = build(config, seed=case.seed)
    (ids,), kwargs = example_inputs(config, case.batch, case.seq, seed=case.seed)
    return model, (ids,), {"labels": kwargs["labels"].clone()}


def _plan_for(case: Case, graph, world: int):
    """What ``compile_graph`` gets: the name, a plan path, or (other digits, a lever, simulated ranks) a Plan.
    Every real rank makes it (compile runs rank 0's): a plan that cannot be made fails on every rank alike, where
    one rank failing alone would leave the others waiting in a collective. Simulated ranks share one."""
    plain = case.digits is None and case.recompute == "none" and not case.zero and case.micro_batches == 1
    plain = plain and case.stages == 1
    if plain and not case.simulated:
        return case.plan
    from primepar_fx.planning.forced import forced_plan
    from primepar_fx.planning.planner import plan_graph

    cap = graph.captured
    sizes = {"world_size": world, "batch": cap.example_batch, "seq": cap.example_seq, "recompute": case.recompute}
    cluster = SIM_CLUSTER if case.simulated else PIPELINE_CLUSTER if case.stages > 1 else "cpu-gloo"
    sizes.update(cluster=cluster, memory_budget=None, zero=case.zero, micro_batches=case.micro_batches)
    if case.stages > 1:
        return plan_graph(graph, baselines=False, method="dp", stages=case.stages, schedule=case.schedule, **sizes)
    if case.plan == "searched":
        return plan_graph(graph, baselines=False, stages=1, **sizes)
    if case.plan.endswith(".json"):  # a pinned plan records its own levers
        return case.plan
    return forced_plan(graph, case.plan, digits=case.digits, **sizes)


def reference_of(case: Case) -> dict[str, Any]:
    """One device: the step's loss, the gradients, and the parameters after one AdamW step (eps as
    ``distributed_checks`` explains)."""
    ref, args, kwargs = _model_and_inputs(case)
    ref_loss = ref(*args, **kwargs)
    ref_loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3).step()
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return {"loss": float(ref_loss.detach()), "grads": grads, "params": params}


def check_case(case: Case, rank: int, world: int, out_dir: str | None = None) -> dict[str, Any]:
    """One training step compiled over the ranks vs one device (:func:`check_rank`), the graph captured here."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph

    ref = reference_of(case)
    model, args, kwargs = _model_and_inputs(case)
    graph = build_graph(capture(model, args, kwargs))
    return check_rank(rank, world, case, graph, _plan_for(case, graph, world), args, kwargs, ref, out_dir)


def check_rank(
    rank: int, world: int, case: Case, graph, plan, args, kwargs, ref: dict[str, Any], out_dir: str | None = None
) -> dict[str, Any]:
    """One training step of ``plan`` on this rank vs one device (``ref``): every rank's loss, the gradients that
    differ (and with ZeRO, the parameters after an AdamW step).

    Rank 0 writes the plan it compiled to ``out_dir/plan-I.json`` before the step, so a case that raises or hangs
    later still has its plan.
    """
    import torch.distributed as dist

    from primepar_fx.compiler.module import compile_graph

    cluster = {"cluster": SIM_CLUSTER} if case.simulated else {}  # only prices: the plan is made already
    module = compile_graph(graph, plan=plan, world_size=world, **cluster)
    if rank == 0 and out_dir is not None:
        Path(out_dir, f"plan-{case.index}.json").write_text(module.plan.to_json())
    opt = module.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-3) if module.plan.zero else None
    piped = module.plan.pipeline is not None
    if piped:  # the first step runs each stage once more (the shapes that cross are inferred from it): not counted
        module.step(*args, **kwargs)
        module.zero_grad()
    module.comm_stats.reset()
    if piped:
        loss = module.step(*args, **kwargs)
    else:
        loss = module(*args, **kwargs)
        loss.backward()
    sent = module.comm_stats.planned  # the step's bytes: gathering for the checks below is not the plan's traffic
    bad = _mismatch(module.gather_grads(), ref["grads"]) if module.plan.zero < 2 else []
    if opt is not None:  # one AdamW step: the parameters after it
        module.comm_stats.reset()
        opt.step()
        sent += module.comm_stats.planned  # (ZeRO's all-gather after the step)
        bad += _mismatch(module.gather_state_dict(), ref["params"])
    losses = torch.zeros(2, world, dtype=torch.float64)  # every rank must return the same loss; and its bytes
    losses[0, rank], losses[1, rank] = float(loss.detach()), sent
    if world > 1:
        dist.all_reduce(losses)
    asked = {"zero": case.zero, "micro_batches": case.micro_batches}
    predicted = module.plan.predicted.comm_bytes
    report = {
        "loss": [float(x) for x in losses[0]],
        "ref_loss": ref["loss"],
        "bad_grads": bad,
        "fallbacks": list(module.fallbacks),
        "levers": {k: getattr(module.plan, k) for k in asked if getattr(module.plan, k) != asked[k]},
        "sent": [int(x) for x in losses[1]],
        "predicted": predicted,
    }
    # the prediction is per device, the mean over ranks (an uneven re-layout sends different amounts): in total
    report["bytes_ratio"] = float(losses[1].sum()) / (predicted * world) if predicted else float(not losses[1].any())
    slack = BYTES_SLACK_PER_NODE * len(module.plan.nodes) * world * module.plan.micro_batches
    report["bytes_off"] = int(losses[1].sum()) - predicted * world
    report["ok"] = (
        not bad
        and not report["levers"]
        and all(abs(x - report["ref_loss"]) <= ATOL + RTOL * abs(report["ref_loss"]) for x in report["loss"])
        and abs(report["bytes_off"]) <= slack
    )
    return report


def check_simulated(case: Case, out_dir: str) -> dict[str, Any]:
    """:func:`check_rank` on ``case.world`` simulated ranks; the model captured, the plan made and the reference
    trained once, here. An exception on a rank is written to ``error-I-rankR.txt`` like a real rank's."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph
    from primepar_fx.runtime.simulated import simulate

    t0 = time.perf_counter()
    ref = reference_of(case)
    model, args, kwargs = _model_and_inputs(case)
    graph = build_graph(capture(model, args, kwargs))
    try:
        plan = _plan_for(case, graph, case.world)
        report = simulate(check_rank, case.world, case, graph, plan, args, kwargs, ref, out_dir)[0]
        error_ranks = []
    except Exception as e:
        rank = getattr(e, "rank", 0)
        Path(out_dir, f"error-{case.index}-rank{rank}.txt").write_text(traceback.format_exc())
        report, error_ranks = {"ok": False}, [rank]
    report.update(index=case.index, seconds=round(time.perf_counter() - t0, 2), error_ranks=error_ranks)
    report["ok"] = report["ok"] and not error_ranks
    return report


def run_bucket(rank: int, world: int, cases: list[dict[str, Any]], out_dir: str) -> list[dict[str, Any]]:
    """Every case of one world size in one process group (``spawn`` target); rank 0 returns the reports.

    Before each case rank 0 writes ``progress-WORLD.json`` (so a bucket killed at its deadline names the case that
    hung). An exception on a rank is recorded, and every rank agrees
    on whether any rank failed before the next case starts.
    """
    import torch.distributed as dist

    reports = []
    for data in cases:
        case = Case.from_dict(data)
        if rank == 0:
            Path(out_dir, f"progress-{world}.json").write_text(json.dumps(case.to_dict()))
        t0 = time.perf_counter()
        try:
            report = check_case(case, rank, world, out_dir)
            error = None
        except Exception:
            report, error = {"ok": False}, traceback.format_exc()
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        if world > 1:
            errors = torch.zeros(world, dtype=torch.int64)
            errors[rank] = failed[0]
            dist.all_reduce(errors)
        else:
            errors = failed
        if error is not None:
            Path(out_dir, f"error-{case.index}-rank{rank}.txt").write_text(error)
        if rank == 0:
            report.update(
                index=case.index,
                seconds=round(time.perf_counter() - t0, 2),
                error_ranks=[r for r in range(world) if errors[r]],
            )
            report["ok"] = report["ok"] and not report["error_ranks"]
            reports.append(report)
    return reports


# ------------------------------------------------------------------------------------------------ driver


def save_failure(case: Case, report: dict[str, Any], out_dir: str) -> Path:
    """``case-I/case.json`` (+ ``plan.json`` pinning the exact plan, + error texts); returns the case file."""
    folder = Path(out_dir, f"case-{case.index}")
    folder.mkdir(parents=True, exist_ok=True)
    plan_src = Path(out_dir, f"plan-{case.index}.json")
    pinned = case
    if plan_src.exists():
        (folder / "plan.json").write_text(plan_src.read_text())
        pinned = replace(case, plan=str(folder / "plan.json"), digits=None, note={"drawn_plan": case.plan})
    for err in sorted(Path(out_dir).glob(f"error-{case.index}-rank*.txt")):
        (folder / err.name).write_text(err.read_text())
    (folder / "case.json").write_text(json.dumps({**pinned.to_dict(), "report": report}, indent=2))
    return folder / "case.json"


def repro_command(case_file: Path) -> str:
    return f"PYTHONPATH=. python tests/fuzz_checks.py {case_file}"


def describe(case: Case, report: dict[str, Any], case_file: Path) -> str:
    lines = [f"case {case.index}: {case.label()}", f"  config: {case.config}"]
    if report.get("error_ranks"):
        first = next(iter(sorted(case_file.parent.glob("error-*.txt"))), None)
        tail = first.read_text().strip().splitlines()[-1] if first else "?"
        lines.append(f"  raised on ranks {report['error_ranks']}: {tail}")
    if "loss" in report:
        lines.append(f"  loss {report['loss'][:2]} vs one device {report['ref_loss']}")
    if report.get("bad_grads"):
        lines.append(f"  gradients differ: {report['bad_grads'][:4]}")
    if report.get("levers"):
        lines.append(f"  the compiled plan's levers are not the case's: {report['levers']}")
    if report.get("bytes_off"):
        ratio = report["bytes_ratio"]
        lines.append(
            f"  bytes sent {sorted(set(report['sent']))} per rank, predicted {report['predicted']}: {ratio:.9f}"
        )
    if report.get("timeout"):
        lines.append(f"  {report['timeout']}")
    lines.append(f"  repro: {repro_command(case_file)}")
    return "\n".join(lines)


def run_cases(cases: Sequence[Case], out_dir: str, *, log: Callable[[str], None] = lambda s: None) -> list[str]:
    """Run ``cases`` (one process-group start per world size); a description of each failure (empty: all pass)."""
    from primepar_fx.runtime.testing import spawn

    os.makedirs(out_dir, exist_ok=True)
    failures = []
    for world, bucket in by_world(cases):
        t0 = time.perf_counter()
        try:
            if bucket[0].simulated:  # in this process, one case at a time (by_world keeps the kinds apart)
                reports = [check_simulated(case, out_dir) for case in bucket]
            elif world == 1:  # one rank needs no process group (compile's documented single-rank path)
                reports = run_bucket(0, 1, [c.to_dict() for c in bucket], out_dir)
            else:
                reports = spawn(
                    run_bucket,
                    world,
                    [c.to_dict() for c in bucket],
                    out_dir,
                    timeout=60.0 + TIMEOUT_PER_CASE * len(bucket),
                )
        except TimeoutError as e:  # the case in progress hung; the rest of the bucket is unknown
            stuck = Case.from_dict(json.loads(Path(out_dir, f"progress-{world}.json").read_text()))
            report = {"ok": False, "timeout": f"{e}; case {stuck.index} was running"}
            failures.append(describe(stuck, report, save_failure(stuck, report, out_dir)))
            continue
        for case, report in zip(bucket, reports):
            if not report["ok"]:
                failures.append(describe(case, report, save_failure(case, report, out_dir)))
        each = ", ".join(f"{r['seconds']:.1f}" for r in reports)
        whole = sum(len(r.get("fallbacks", ())) for r in reports)
        log(
            f"world {world}: {len(bucket)} cases in {time.perf_counter() - t0:.1f} s ({each}); {whole} nodes ran "
            f"whole; {len(failures)} failures so far"
        )
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", nargs="?", help="a case.json to rerun alone")
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--simulated", action="store_true", help=f"simulated ranks, world sizes {SIM_WORLDS}")
    parser.add_argument("--worlds", help="comma-separated world sizes to cycle through instead (e.g. 48,64)")
    parser.add_argument("--out", default=None, help="folder for failing cases (default: a new temporary one)")
    opts = parser.parse_args(argv)
    out = opts.out or tempfile.mkdtemp(prefix="primepar-fuzz-")
    os.makedirs(out, exist_ok=True)
    if opts.case:
        data = json.loads(Path(opts.case).read_text())
        data.pop("report", None)
        cases = [Case.from_dict(data)]
    else:
        worlds = [int(w) for w in opts.worlds.split(",")] if opts.worlds else None
        cases = draw_cases(opts.examples, opts.seed, simulated=opts.simulated, worlds=worlds)
    for case in cases:
        print(f"case {case.index}: {case.label()}", flush=True)
    failures = run_cases(cases, out, log=lambda s: print(s, flush=True))
    print("\n\n".join(failures) if failures else f"all {len(cases)} cases match one device")
    print(f"{len(cases)} examples, {len(failures)} failures (cases under {out})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fuzz_checks  # the ranks unpickle run_bucket from the module, not from __main__

    sys.exit(fuzz_checks.main())
