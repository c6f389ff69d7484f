"""Benchmark: planning time for OPT-175B, Llama2-70B and BLOOM-176B against the paper's Table 2.

For each model (captured once on the meta device) and world size: the time to price the partition space (Eq. 7-9,
cached per distinct layer shape) and the time of the segmented DP (Eq. 11-14), with the largest per-node
strategy count P. The paper's Table 2 reports its optimisation time on one Xeon Gold 5218 thread.
Targets (issue 3): the whole plan for llama2-70b at 32 devices under 0.5 s; 64 and 128 devices under 5 s.

    python bench/search_time.py [--worlds 4 8 16 32] [--out docs/benchmarks/search_time.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from primepar_fx import analyze
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.costgraph import price_graph
from primepar_fx.cost.model import CostOptions
from primepar_fx.models import build, example_inputs
from primepar_fx.partition import enumerate_sequences
from primepar_fx.search import SearchError, solve
from primepar_fx.shapes import B, S

MODELS = {"OPT": "opt-175b", "Llama2": "llama2-70b", "BLOOM": "bloom-176b"}
PAPER_MS = {
    "OPT": [85.3, 86.5, 170.9, 5357.3],
    "Llama2": [86.5, 88.8, 185.9, 6070.3],
    "BLOOM": [85.4, 80.2, 165.8, 4153.0],
}
PAPER_WORLDS = [4, 8, 16, 32]
MAX_P = 1500  # beyond this the pricing of one layer shape takes minutes: reported, not run


READING = """## Reading the results

* **4 and 8 GPUs:** the DP takes 0.04-0.37 s on a 2-core machine, in the range of the paper's 80-90 ms on one
  Xeon thread. Our graphs are the whole ATen graph (1,400-4,300 nodes, every view and element-wise op), where
  the paper's has 13 operators per layer.
* **16 GPUs:** only the canonical subspace is searched; the full space's DP tables pass 10^8 entries. It
  takes 0.2-0.8 s, against the paper's 166-186 ms.
* **32 GPUs: not reached.** The issue's target was the whole llama2-70b plan in under 0.5 s. Even the
  canonical space has up to 1,900 sequences per node: pricing takes about a minute, and the DP tables are too
  large. Closing this needs a smaller space, not a faster DP. Two ways to get there: coarsen view and
  element-wise chains into their producers, and plan intra-node and inter-node digits hierarchically.
* **Capture** (`torch.export` of 80-96 layers) dominates the wall time of a first plan.
  Pricing is cached per distinct layer shape, so it does not grow with depth.
"""


def one(graph, world: int, canonical: bool) -> dict:
    cluster = load_cluster("v100-paper")
    mesh = cluster.mesh(world)
    values = {B: 16, S: 2048}
    levels = tuple(cluster.group_level(mesh, (p,)) for p in range(len(mesh.digits))) if canonical else None
    seen, p_max = set(), 0
    for node in graph.nodes.values():
        if (node.dims, node.target) not in seen:
            seen.add((node.dims, node.target))
            p_max = max(p_max, len(enumerate_sequences(node.dims, mesh, values=values, levels=levels)))
    row = {"world": world, "P": p_max, "canonical": canonical}
    if p_max > MAX_P:
        row["error"] = f"P = {p_max} strategies: pricing not attempted"
        return row
    t0 = time.perf_counter()
    priced = price_graph(graph, mesh, cluster, values, CostOptions(dtype="fp16"), canonical=canonical)
    row["pricing_s"] = time.perf_counter() - t0
    try:
        sol = solve(priced.cost_graph, method="dp")
        row["search_s"] = sol.seconds
    except SearchError as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--out", default="docs/benchmarks/search_time.md")
    args = p.parse_args()
    rows = []
    for family, name in MODELS.items():
        model = build(name, device="meta")
        ex_args, ex_kwargs = example_inputs(model.config, 2, 16, device="meta")
        t0 = time.perf_counter()
        graph = analyze(model, ex_args, ex_kwargs, name=name)
        capture_s = time.perf_counter() - t0
        for world in args.worlds:
            for canonical in (False, True) if world >= 16 else (False,):
                row = {"family": family, "model": name, "nodes": len(graph.nodes), "capture_s": capture_s}
                row.update(one(graph, world, canonical))
                paper = PAPER_MS[family][PAPER_WORLDS.index(world)] if world in PAPER_WORLDS else None
                row["paper_ms"] = paper
                rows.append(row)
                what = row.get("error") or f"pricing {row['pricing_s']:.1f} s, DP {1000 * row['search_s']:.1f} ms"
                print(
                    f"{name:11s} N={world:3d} {'canonical ' if canonical else ''}P={row['P']:5d}: {what}"
                    f" (paper {paper} ms)"
                )
    lines = [
        "# Planning time: segmented DP against the paper's Table 2",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (one process). Cluster `v100-paper`, B = 16, "
        "S = 2048, fp16. *Capture* is `torch.export` of the whole model on the meta device (once per model); "
        "*pricing* evaluates Eq. 7-9 for every distinct layer shape; *DP* is the search (Eq. 11-14), which is what "
        "the paper's Table 2 times. *canonical* searches one split order per network level.",
        "",
        "| model | nodes | GPUs | space | P (max per node) | capture s | pricing s | DP ms | paper ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        space = "canonical" if r["canonical"] else "full"
        if "error" in r:
            pricing = f"{r['pricing_s']:.1f}" if "pricing_s" in r else "-"
            cells = f"{pricing} | not run: {r['error']}"
        else:
            cells = f"{r['pricing_s']:.1f} | {1000 * r['search_s']:.1f}"
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['world']} | {space} | {r['P']} | {r['capture_s']:.1f} | {cells} | "
            f"{r['paper_ms'] if r['paper_ms'] is not None else '-'} |"
        )
    lines += ["", READING]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
