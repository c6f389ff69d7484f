"""Benchmark: the same plans from two versions of the code, and their planning times, measured interleaved.

For a change that must not change any plan (a refactor of the planner, say), each ``primepar-fx plan`` command of
:data:`COMMANDS` runs with the old tree's package and with the new one's, in the order old, new, new, old (so a
drift of the machine's speed weighs on both alike), each in a fresh process from a temporary folder (so the current
folder's package is not imported instead). The plan JSONs are compared with their timings stripped (every
``*_s`` and ``seconds`` field); the planning times (the command's ``planned in`` line) are tabulated.

    python bench/same_plans.py OLD_TREE NEW_TREE [--only l32 g4 ...] [--rounds 1] [--out docs/benchmarks/same_plans.md]

``OLD_TREE``, ``NEW_TREE``: folders holding a ``primepar_fx`` package, e.g. a ``git worktree`` of the commit before
the change. A budgeted search can stop its ILP cross-check at a time limit
(:data:`~primepar_fx.search.solve.GAP_ILP_SECONDS`), so on a loaded machine a plan's ``method`` and
``proven_optimal`` (and, rarely, the plan) may differ between two runs of the same code: run it on a quiet machine,
and where a pair differs, read the old-old pair (``--rounds 2``) before blaming the change.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: name -> the ``plan`` command's arguments: issue 59's acceptance set
COMMANDS = {
    "l32": "llama2-70b -n 32 --cluster v100-paper --batch 16 --seq 2048 --dtype fp16 --memory-budget none",
    "l64": "llama2-70b -n 64 --cluster v100-paper --batch 16 --seq 2048 --dtype fp16 --memory-budget none",
    "l128": "llama2-70b -n 128 --cluster v100-paper --batch 16 --seq 2048 --dtype fp16 --memory-budget none",
    "h32": "llama2-70b -n 32 --cluster h100-dgx --batch 16 --seq 4096 --dtype bf16",
    "moe": "{mixtral} -n 16 --cluster h100-dgx --batch 32 --seq 2048 --dtype bf16",
    "moe-tiny": "hf:mixtral -n 8 --batch 8 --seq 32 --memory-budget 1MiB",
    "g4": "gpt2-tiny -n 4 --batch 8 --seq 32 --memory-budget 1MiB",
    "t8": "llama-tiny -n 8 --batch 8 --seq 32 --memory-budget 1MiB",
    "g16": "gpt2-tiny -n 16 --batch 16 --seq 32 --memory-budget 1MiB",
}
PLANNED = re.compile(r"planned in ([\d.]+) s")


def stripped(plan: Any) -> Any:
    """A plan's JSON without its timings: every ``*_s`` and ``seconds`` field left out, at any depth."""
    if isinstance(plan, dict):
        return {k: stripped(v) for k, v in plan.items() if not (k.endswith("_s") or k == "seconds")}
    if isinstance(plan, list):
        return [stripped(v) for v in plan]
    return plan


def mixtral_config(folder: Path) -> Path:
    """``transformers``' default Mixtral config (8x7B: 32 layers, 8 experts) as a config file, random weights."""
    from transformers import MixtralConfig

    path = folder / "mixtral.json"
    MixtralConfig().to_json_file(str(path))
    return path


def run(tree: Path, name: str, folder: Path, out: Path) -> float:
    """``primepar-fx plan`` of command ``name`` with ``tree``'s package; the plan to ``out``, its planning time."""
    args = COMMANDS[name].format(mixtral=folder / "mixtral.json").split()
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "primepar_fx", "plan", *args, "-o", str(out)]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} with {tree} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return float(PLANNED.findall(done.stderr)[-1])


def compare(old: Path, new: Path, names: list[str], rounds: int) -> list[dict[str, Any]]:
    """Per command: the plans' differences (old against every run) and each version's planning times."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        mixtral_config(folder)
        for name in names:
            times: dict[str, list[float]] = {"old": [], "new": []}
            plans: list[tuple[str, Any]] = []
            for r in range(rounds):
                for k, (label, tree) in enumerate((("old", old), ("new", new), ("new", new), ("old", old))):
                    out = folder / f"{name}-{label}-{r}-{k}.json"
                    times[label].append(run(tree, name, folder, out))
                    plans.append((label, stripped(json.loads(out.read_text()))))
                    print(f"{name} {label}: {times[label][-1]:.1f} s", file=sys.stderr)
            first = plans[0][1]
            diffs = [diff(first, plan, f"{label} run {i}") for i, (label, plan) in enumerate(plans) if plan != first]
            rows.append({"name": name, "times": times, "diffs": diffs})
    return rows


def diff(a: Any, b: Any, label: str) -> str:
    lines = difflib.unified_diff(
        json.dumps(a, indent=1, sort_keys=True).splitlines(),
        json.dumps(b, indent=1, sort_keys=True).splitlines(),
        "old run 0",
        label,
        lineterm="",
    )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| command | same plans | old planning s | new planning s | new / old (means) |\n|---|---|---|---|---|"
    lines = [head]
    for row in rows:
        old, new = row["times"]["old"], row["times"]["new"]
        ratio = statistics.mean(new) / statistics.mean(old)
        same = "yes" if not row["diffs"] else f"**no** ({len(row['diffs'])} runs differ)"
        fmt = ", ".join
        lines.append(
            f"| `{row['name']}` | {same} | {fmt(f'{t:.1f}' for t in old)} | {fmt(f'{t:.1f}' for t in new)} | "
            f"{ratio:.3f} |"
        )
    commands = "\n".join(f"* `{n}`: `primepar-fx plan {COMMANDS[n]}`" for n in (r["name"] for r in rows))
    return "\n".join(lines) + "\n\n" + commands.replace("{mixtral}", "mixtral.json") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a folder holding the old primepar_fx package")
    parser.add_argument("new", type=Path, help="a folder holding the new primepar_fx package")
    parser.add_argument("--only", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--rounds", type=int, default=1, help="old, new, new, old this many times per command")
    parser.add_argument("--out", type=Path, help="also write the table (and any differences) here")
    args = parser.parse_args()
    rows = compare(args.old.resolve(), args.new.resolve(), args.only, args.rounds)
    text = table(rows)
    for row in rows:
        for d in row["diffs"]:
            text += f"\n`{row['name']}`:\n```diff\n{d}\n```\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(1 if any(row["diffs"] for row in rows) else 0)


if __name__ == "__main__":
    main()
