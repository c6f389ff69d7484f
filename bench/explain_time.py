"""Benchmark: wall time and peak resident memory of ``primepar-fx explain`` on large zoo models (meta device).

Each run is a fresh process (``python -m primepar_fx.cli explain ...``); peak RSS is that child's ``ru_maxrss``
(from ``os.wait4``).
Target (issue 2): llama2-70b at 32 devices in under 30 s and under 2 GB on a 2-core machine.

    python bench/explain_time.py [--reps 3] [--out docs/benchmarks/explain.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

CASES = [("llama2-70b", 32, 8, 4096), ("opt-175b", 32, 8, 2048), ("bloom-176b", 32, 8, 2048), ("llama2-7b", 8, 8, 4096)]


def run_once(model: str, world: int, batch: int, seq: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "primepar_fx.cli", "explain", model, "--world-size", str(world)]
    cmd += ["--batch", str(batch), "--seq", str(seq)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return wall, usage.ru_maxrss / 1024**2  # ru_maxrss is in KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="docs/benchmarks/explain.md")
    args = p.parse_args()
    rows = []
    for model, world, batch, seq in CASES:
        walls, peaks = zip(*(run_once(model, world, batch, seq) for _ in range(args.reps)))
        rows.append((model, world, batch, seq, statistics.median(walls), max(peaks)))
        print(f"{model:12s} N={world:3d} B={batch} S={seq}: median {rows[-1][4]:.1f} s, peak RSS {rows[-1][5]:.2f} GiB")
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    lines = [
        "# `primepar-fx explain` on large models",
        "",
        f"Machine: {machine}. Models are built on the meta device; {args.reps} fresh processes per row, median wall "
        "time (capture with torch.export + rules + enumeration of every node's partition space) and the largest peak "
        "RSS of the process.",
        "",
        "| model | devices | B | S | wall (s, median) | peak RSS (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {m} | {w} | {b} | {s} | {t:.1f} | {r:.2f} |" for m, w, b, s, t, r in rows]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
