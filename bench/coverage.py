"""Coverage: which Hugging Face decoder families capture, plan and train on 2 gloo ranks equal to one device.

For each family a tiny random-weight config (:func:`primepar_fx.models.build_hf_tiny`: the curated configs of
``HF_FAMILIES``, else the family's own defaults with hidden 64, 2 layers, 4 heads, vocab 128), offline. One spawn
of 2 gloo ranks per family runs ``tests/distributed_checks.check_plans`` with a random plan (``random:3``): the
loss, every gathered gradient and the parameters after 3 AdamW steps against one device, and the bytes sent
against the plan's prediction. A family that stops before training shows the first line of its error.

    python bench/coverage.py [--families gpt2 llama ...] [--out docs/coverage.md]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from primepar_fx.models.hf import COVERED_FAMILIES  # noqa: E402

#: decoder families checked by default: those known to pass, then those that do not yet
FAMILIES = tuple(dict.fromkeys((*COVERED_FAMILIES, "phimoe", "jamba")))
PLAN = "random:3"
#: seeds tried for a mixture-of-experts family, for a random plan that splits the experts
EXPERT_SEEDS = range(3, 64)


def plan_for(family: str) -> str:
    """:data:`PLAN`, or for a mixture-of-experts family the first ``random:SEED`` (:data:`EXPERT_SEEDS`) that splits
    the experts (``E``) of some MoE layer over a digit: a uniformly random legal plan, picked for that."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.frontend.moe import MOE_EXPERTS
    from primepar_fx.graph.build import graph_of
    from primepar_fx.models import build_hf_tiny, hf_example_inputs
    from primepar_fx.partition import PartitionSeq
    from primepar_fx.partition.seq import Split
    from primepar_fx.planning.forced import forced_plan

    model = build_hf_tiny(family)
    args, kwargs = hf_example_inputs(model, 2, 8)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    experts = [n for n, node in graph.nodes.items() if "E" in node.dims.dims and node.target is MOE_EXPERTS]
    if not experts:
        return PLAN
    for seed in EXPERT_SEEDS:
        plan = forced_plan(graph, f"random:{seed}", world_size=2)
        seqs = [PartitionSeq.parse(n.partition) for n in plan.nodes if n.name in experts]
        if any(isinstance(e, Split) and e.dim == "E" for seq in seqs for e in seq.elements):
            return f"random:{seed}"
    raise RuntimeError(f"no random plan of seeds {EXPERT_SEEDS} splits the experts of {family}")


RTOL, ATOL = 1e-4, 1e-5


def check(family: str, timeout: float) -> dict:
    """One family's row: ``{"family", "model", "result", "note"}``."""
    from distributed_checks import check_plans

    from primepar_fx.models import build_hf_tiny
    from primepar_fx.runtime.testing import spawn

    try:
        model = type(build_hf_tiny(family)).__name__
    except Exception as e:  # noqa: BLE001 - any failure is a row of the table
        return {"family": family, "model": "-", "plan": "-", "result": "no tiny config", "note": _first_line(e)}
    try:
        plan = plan_for(family)
        report = spawn(check_plans, 2, f"hf:{family}", [plan], timeout=timeout)
    except Exception as e:  # noqa: BLE001
        return {"family": family, "model": model, "plan": "-", "result": "fails", "note": _first_line(e)}
    r = report[plan]
    same = (
        abs(r["loss"] - report["reference_loss"]) <= ATOL + RTOL * abs(report["reference_loss"])
        and not r["bad_grads"]
        and not r["bad_params"]
    )
    exact_bytes = abs(r["sent_planned_total"] - r["predicted_total"]) <= 0.01 * max(1.0, r["predicted_total"])
    result = "equal to one device" if same and exact_bytes else "differs" if not same else "bytes differ"
    prime = sum(p.startswith("P") for p in r["partitions"].values())
    sent, predicted = int(r["sent_planned_total"]), int(r["predicted_total"])
    experts = sorted({p for n, p in r["partitions"].items() if n.startswith("moe_experts")})
    note = f"{len(r['partitions'])} nodes, {prime} P(SxS); " + (
        "bytes sent = predicted" if exact_bytes else f"{sent:,} bytes sent, {predicted:,} predicted"
    )
    if experts:
        note += f"; experts split {', '.join(experts)}"
    return {"family": family, "model": model, "plan": plan, "result": result, "note": note}


def _first_line(e: BaseException) -> str:
    """The error a rank raised (the last ``SomethingError: message`` line), without its module path."""
    found = re.findall(r"(\w+(?:Error|Exception)): (.*)", str(e))
    kind, text = found[-1] if found else (type(e).__name__, str(e).strip().split("\n")[0])
    text = re.sub(r"\S*/site-packages/", "", text)
    return f"{kind}: {text}"[:240].replace("|", "/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--out", default=str(ROOT / "docs" / "coverage.md"))
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    rows, t0 = [], time.perf_counter()
    for family in args.families:
        t = time.perf_counter()
        row = check(family, args.timeout)
        rows.append(row)
        print(f"{family:14s} {row['result']:20s} {time.perf_counter() - t:5.1f} s  {row['note']}", flush=True)
    passed = sum(r["result"] == "equal to one device" for r in rows)
    table = tabulate([list(r.values()) for r in rows], ["family", "class", "plan", "result", "note"], tablefmt="github")
    page = "\n".join(
        [
            "# Hugging Face decoder coverage",
            "",
            f"transformers {transformers.__version__}; each family from a tiny random-weight config, offline, "
            f"trained on 2 gloo ranks under a random plan (`{PLAN}`; for a mixture-of-experts family the first seed "
            "whose plan splits the experts) and compared with one device (loss, every gradient, "
            "the parameters after 3 AdamW steps) and with the plan's predicted bytes. "
            f"**{passed} of {len(rows)}** train equal to one device. Generated by `python bench/coverage.py` "
            f"in {(time.perf_counter() - t0) / 60:.1f} minutes.",
            "",
            table,
            "",
            "A family that fails names the op, node or model line that stopped it. Mixture-of-experts layers are "
            "captured as one op (`primepar::moe_experts`, docs/rules.md); *experts split* lists the partitions "
            "their nodes took (`E`: expert parallelism, `I`: each expert's intermediate, `k`: the routing choices, "
            "`BS`: the tokens, `R`: replicated). GPT-Neo (its causal-mask buffer) and MPT (its position bias) "
            "cannot keep S symbolic; they are captured at the example's S with a warning (docs/troubleshooting.md) "
            "and train equal to one device there. DeepSeek-V2's complex rotary embedding is captured on real "
            "pairs (docs/rules.md). gpt-oss's experts run as the one op with their interleaved gate rows and "
            "clamped gate; their down bias keeps `I` whole. PhiMoE captures, plans and trains, but its router "
            "samples its experts with Gumbel noise in training (`exponential_`, `rand_like`), which, like dropout, "
            "each device draws for its own slice, so a step differs from one device's single draw; Jamba's Mamba "
            "layers need a causal `conv1d` "
            "and a selective scan, which have no rules.",
            "",
        ]
    )
    Path(args.out).write_text(page, encoding="utf-8")
    print(f"{passed} of {len(rows)} equal to one device; wrote {args.out}")


if __name__ == "__main__":
    main()
