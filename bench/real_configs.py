"""Real-size configs: every covered Hugging Face family planned from a config file as a user has one.

``docs/coverage.md`` checks training on tiny configs; this checks planning at real widths, where strategy counts
and tables are large. For each family, transformers' default config (the one ``AutoConfig.for_model`` gives, which
mirrors a released checkpoint's widths) is written to a file and planned the way a user plans their own
``config.json``, in a fresh process (imports and all, as the command line runs)::

    primepar-fx plan FAMILY.json -n 8 --batch 8 --seq SEQ --dtype bf16 --layers 2 --cluster v100-paper

``SEQ`` is 2048, or the model's maximum where that is shorter; the default memory budget (90% of a V100's 32 GiB).
The table gives the command's status, its wall time, the planner's own "planned in" line, and for a failure the
error it printed. A default config that leaves a field the model needs unset (transformers' defaults for some
mixture-of-experts families do) fails at the build with that named: a checkpoint's own config sets it.

    python bench/real_configs.py [--families llama mixtral ...] [--merge] [--timeout 600] [--out PAGE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from primepar_fx.models.hf import COVERED_FAMILIES  # noqa: E402

ARGS = ("-n", "8", "--batch", "8", "--dtype", "bf16", "--layers", "2", "--cluster", "v100-paper")
SEQ = 2048


def write_config(family: str, folder: Path) -> tuple[Path, int] | str:
    """transformers' default config of ``family`` as a file, and the sequence length to plan it at; or why not."""
    import transformers

    try:
        config = transformers.AutoConfig.for_model(family).to_dict()
    except Exception as exc:  # noqa: BLE001 -- reported in the table
        return f"no default config: {type(exc).__name__}: {exc}"
    path = folder / f"{family}.json"
    path.write_text(json.dumps(config))
    limit = next((config[k] for k in ("max_position_embeddings", "n_positions", "n_ctx") if config.get(k)), None)
    return path, min(SEQ, limit) if isinstance(limit, int) else SEQ


def plan(path: Path, seq: int, timeout: float) -> tuple[str, float, str]:
    """``(status, wall seconds, the planned-in line or the error)`` of one ``primepar-fx plan`` process."""
    argv = [sys.executable, "-m", "primepar_fx", "plan", str(path), *ARGS, "--seq", str(seq)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, f"over {timeout:.0f} s"
    wall = time.perf_counter() - start
    planned = re.search(r"planned in .*", done.stderr + done.stdout)
    if done.returncode == 0 and planned:
        return "planned", wall, planned.group(0)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    if done.returncode < 0 or done.returncode == 137:
        return "killed", wall, f"signal {-done.returncode if done.returncode < 0 else 9} (out of memory?)"
    last = errors[-1] if errors else (done.stderr.strip().splitlines() or ["no output"])[-1]
    return "error", wall, last.replace(str(path.parent) + os.sep, "")[:300]


def _rows(path: Path) -> dict[str, tuple]:
    """The table rows of an earlier page, by family (empty where there is none)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("family", "") and not cells[0].startswith("-"):
            out[cells[0]] = tuple(cells)
    return out


def _minutes(path: Path) -> str:
    """What an earlier page says of its run's time."""
    found = re.search(r"\(([^()]*minutes[^()]*(?:\([^()]*\)[^()]*)*) on this project", path.read_text())
    return found.group(1) if found else "an earlier run"


#: what a failure's message says, and what it means
KINDS = (
    ("could not build", "transformers' default config leaves a field its model needs unset (named)"),
    ("rejects it", "transformers' default config does not validate"),
    ("capturing", "the model's forward fails on its example inputs (its line named)"),
    ("no plan fits", "no plan fits a V100's memory even with two layers"),
    ("", "other"),
)


def _reading(rows: list[tuple]) -> str:
    """The failures counted by what stopped them."""
    failed = [r for r in rows if r[2] != "planned"]
    if not failed:
        return "Every family plans."
    counts: dict[str, list[str]] = {}
    for family, _, _, _, said in failed:
        kind = next(meaning for text, meaning in KINDS if text in said)
        counts.setdefault(kind, []).append(family)
    parts = [f"{meaning}: {', '.join(families)}" for meaning, families in counts.items()]
    return f"The {len(failed)} that do not plan, by what stopped them: " + "; ".join(parts) + "."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(COVERED_FAMILIES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one plan may take")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "real_configs.md"))
    p.add_argument("--merge", action="store_true", help="keep the other families' rows of --out (rerun a few)")
    args = p.parse_args()
    rows, start = [], time.perf_counter()
    kept = _rows(Path(args.out)) if args.merge else {}
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families:
            made = write_config(family, Path(folder))
            if isinstance(made, str):
                rows.append((family, "-", "no config", "-", made))
                continue
            status, wall, said = plan(*made, args.timeout)
            rows.append((family, made[1], status, f"{wall:.1f}", said))
            print(f"{family:20s} {status:8s} {wall:6.1f} s  {said[:150]}", flush=True)
    minutes = f"{(time.perf_counter() - start) / 60:.1f} minutes"
    if kept:  # the file's order, the rows run now in place of theirs
        minutes = f"{_minutes(Path(args.out))}; {', '.join(args.families)} run again with `--merge` ({minutes})"
        fresh = {r[0]: r for r in rows}
        rows = [fresh.pop(f, row) for f, row in kept.items()] + list(fresh.values())
    planned = [r for r in rows if r[2] == "planned"]
    import torch
    import transformers

    header = (
        "# Real-size configs: every covered family planned from a config file\n\n"
        f"transformers {transformers.__version__}, torch {torch.__version__}; `python bench/real_configs.py` "
        f"({minutes} on this project's 2-core machine). For each family, "
        "transformers' default config (mirroring a released checkpoint's widths) written to a file and planned as "
        f"a user plans their own: `primepar-fx plan FAMILY.json {' '.join(ARGS)} --seq SEQ` (SEQ 2048, or the "
        "model's maximum), the default memory budget, in a fresh process. *wall* is the whole command (Python, "
        "torch and transformers imports included); *planner* is its own account. "
        f"**{len(planned)} of {len(rows)}** plan. A failure shows the one error the command printed.\n\n"
    )
    table = tabulate(rows, headers=["family", "seq", "result", "wall s", "planner"], tablefmt="github")
    Path(args.out).write_text(header + table + "\n\n" + _reading(rows) + "\n")
    print(f"wrote {args.out}: {len(planned)} of {len(rows)} planned")


if __name__ == "__main__":
    main()
