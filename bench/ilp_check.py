"""Benchmark: the DP's optimum against the ILP's on the full partition space, and against every grouping.

For two layers of each model on ``v100-paper`` (B = 16, S = 2048, fp16) at each world size: price the *full*
mesh (every device digit free: ``cluster.mesh(world)``, as ``--no-grouped``), solve it with the DP and with the ILP
(HiGHS, by column generation from the DP's plan: :mod:`primepar_fx.search.colgen`; the optimality proof is the
LP bound over every pair, so the start plan decides nothing), and report the relative gap. Then price and solve
every grouping of the digits the planner searches by default (:func:`primepar_fx.planning.groupings.search_meshes`)
and check that the full space's optimum is no worse than any of them (each grouping's plans lie in the full space).

Where the DP's default table limit (``DPOptions.max_table_entries``, 2e8) is too small for the full space, the DP
runs again with ``--table-limit`` (default 1e10: the limit bounds the work of one elimination step, which runs in
chunks, so memory stays under 2 GB) and the row says so. Needs ``highspy`` (``pip install -e ".[ilp]"``).

    python bench/ilp_check.py [--models llama2-70b bloom-176b] [--worlds 8 16] [--table-limit 1e10]
        [--out docs/benchmarks/ilp_check.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import time

import numpy as np

from primepar_fx import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.model import clear_caches
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.groupings import Grouped, search_meshes
from primepar_fx.pricing.price import price_graph
from primepar_fx.search import DPOptions, TableTooLarge, evaluate, reduce_graph, solve
from primepar_fx.search.ilp import solve_ilp, solver_name

CLUSTER = "v100-paper"
VALUES = {B: 16, S: 2048}
REL = 1e-6


def _dp(graph, limit: int):
    """The DP with the default table limit, else with ``limit``, else (tables too large even so) the DP on a
    narrower space as ``method="auto"`` runs it (not proven optimal); and which of the three it took."""
    try:
        return solve(graph, method="dp"), None
    except TableTooLarge:
        pass
    try:
        return solve(graph, method="dp", options=DPOptions(max_table_entries=limit)), f"table limit {limit:.0e}"
    except TableTooLarge as err:
        how = f"narrowed, not proven: {str(err).split(' over ')[0]}"
        return solve(graph, method="auto", ilp_max_variables=0, ilp_max_pairs=0), how


def one(model: str, world: int, limit: int) -> dict:
    config = dataclasses.replace(get_config(model), layers=2)
    net = build(config, device="meta")
    args, kwargs = example_inputs(config, 2, 16, device="meta")
    graph = analyze(net, args, kwargs, name=model)
    cluster = load_cluster(CLUSTER)
    full = cluster.mesh(world)
    opts = CostOptions(dtype="fp16")
    row = {"model": model, "world": world, "digits": full.digits}
    clear_caches()
    gc.collect()
    t0 = time.perf_counter()
    searched = price_graph(graph, full, cluster, VALUES, opts).search_graph
    row["pricing_s"] = time.perf_counter() - t0
    row["strategies"] = sum(searched.strategies(n) for n in searched.nodes)
    row["P"] = max(searched.strategies(n) for n in searched.nodes)
    t0 = time.perf_counter()
    dp, raised = _dp(searched, limit)
    row.update(dp_s=time.perf_counter() - t0, dp=dp.cost, dp_proven=dp.proven_optimal, dp_limit=raised)
    red = reduce_graph(searched)
    start = {n: int(np.searchsorted(red.kept[n], dp.choice[n])) for n in red.graph.nodes}
    pairs = sum(int(np.isfinite(e).sum()) for e in red.graph.edge_cost.values())
    t0 = time.perf_counter()
    ilp = solve_ilp(red.graph, start=start)
    row["ilp_s"] = time.perf_counter() - t0
    row.update(ilp=evaluate(searched, red.lift(ilp.choice)), ilp_proven=ilp.proven_optimal)
    row.update(variables=ilp.variables, all_variables=sum(red.graph.strategies(n) for n in red.graph.nodes) + pairs)
    row["gap"] = (row["dp"] - row["ilp"]) / row["ilp"]
    row["groupings"] = []
    for mesh in search_meshes(full, Grouped.ALL, cluster):
        if mesh.digits == full.digits:
            continue
        clear_caches()
        sol = solve(price_graph(graph, mesh, cluster, VALUES, opts).search_graph, method="dp")
        row["groupings"].append((mesh.digits, sol.cost))
    worst = min((cost for _, cost in row["groupings"]), default=None)
    row["no_worse"] = worst is None or row["dp"] <= worst * (1 + REL)
    return row


def _digits(d) -> str:
    return "x".join(map(str, d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama2-70b", "bloom-176b"])
    p.add_argument("--worlds", nargs="+", type=int, default=[8, 16])
    p.add_argument(
        "--table-limit",
        type=float,
        default=1e10,
        help="the DP's table limit where the default is too small (work per elimination step, run in chunks: "
        "memory stays small)",
    )
    p.add_argument("--out", default="docs/benchmarks/ilp_check.md")
    args = p.parse_args()
    if solver_name() != "highs":
        raise SystemExit("bench/ilp_check.py needs HiGHS: pip install -e '.[ilp]'")
    rows = []
    for model in args.models:
        for world in args.worlds:
            row = one(model, world, int(args.table_limit))
            rows.append(row)
            print(
                f"{model:11s} N={world:3d} {_digits(row['digits'])}: DP {row['dp']:.9g} ({row['dp_s']:.1f} s"
                f"{', ' + row['dp_limit'] if row['dp_limit'] else ''}), ILP {row['ilp']:.9g} "
                f"({row['ilp_s']:.1f} s, proven {row['ilp_proven']}, {row['variables']:,} of "
                f"{row['all_variables']:,} variables), gap {row['gap']:.1e}; groupings "
                + ", ".join(f"{_digits(d)} {c:.6g}" for d, c in row["groupings"]),
                flush=True,
            )
    header = (
        "| model | GPUs | full mesh | P (largest) | strategies | pricing s | DP s | DP optimum s | ILP s "
        "| ILP variables (generated of all) | proven | DP - ILP gap | groupings' DP optima s | DP <= every grouping |"
    )
    lines = [
        "# The DP against the ILP on the full partition space",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores. Generated by `python "
        f"bench/ilp_check.py --models {' '.join(args.models)} --worlds {' '.join(map(str, args.worlds))} "
        f"--table-limit {args.table_limit:.0e}` "
        f"({time.strftime('%Y-%m-%d')}). Two layers of each model, `{CLUSTER}`, B = 16, S = 2048, fp16. *Full mesh*: "
        "every device digit free (the paper's space, `--no-grouped`); *P*: the largest per-node strategy count. "
        "The ILP is solved by HiGHS by column generation (`primepar_fx/search/colgen.py`); *variables* counts those "
        "it generated against the whole ILP's. The optimum is the predicted step time in seconds.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for r in rows:
        dp_s = f"{r['dp_s']:.1f}" + (f" ({r['dp_limit']})" if r["dp_limit"] else "")
        groups = "; ".join(f"{_digits(d)}: {c:.6g}" for d, c in r["groupings"]) or "- (the full mesh is the only one)"
        lines.append(
            f"| {r['model']} | {r['world']} | {_digits(r['digits'])} | {r['P']:,} | {r['strategies']:,} | "
            f"{r['pricing_s']:.1f} | {dp_s} | {r['dp']:.9g} | {r['ilp_s']:.1f} | {r['variables']:,} of "
            f"{r['all_variables']:,} | {'yes' if r['ilp_proven'] else 'no'} | {r['gap']:.1e} | {groups} | "
            f"{'yes' if r['no_worse'] else '**no**'} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n\n" + READING)
    print(f"wrote {args.out}")


READING = """## Reading the results

* **The DP reaches the ILP's proven optimum on the full space wherever it can run.** Two llama2-70b layers at 8
  and 16 GPUs and two BLOOM-176B layers at 8: gap 0 (the same plan cost to the last digit). The ILP is exact:
  its column generation stops only when the LP over *every* edge pair (1.5 to 37 million of them) has no pair of
  negative reduced cost, and its plan meets that LP bound; it prices and holds a few percent of the pairs (26,072
  to 207,120 variables). The whole ILP at 16 GPUs (46 million variables for llama2-70b) needed over 21 GB
  before HiGHS started and was stopped; at 8 GPUs the whole ILP (1.9 million variables) solved in 47 s to the
  same optimum.
* **At 16 GPUs llama2-70b's DP needs a larger table limit than its default, and is exact with it.** Its full
  16-GPU space needs one elimination step of 2.4e8 entries (the default limit is 2e8). The limit bounds the work
  of one step, which runs in chunks of 65,536 entries, not its memory: with a limit of 1e10 the DP is exact in
  under 10 s. BLOOM-176B's DP runs within the default limit since nodes of a single strategy are folded into
  their neighbours' costs before the DP (`search.problem.fold_fixed`): 4.3 s, the same optimum, where without the
  fold it needs one step of 8.6e9 entries and 81.5 s (the tied embedding's edge from the first node to the LM
  head made the two layers one cycle through such nodes; measured side by side on this machine, 2026-12-05).
  The planner keeps the default of 2e8 (a table past it takes minutes, not the seconds planning should), and
  without a budget `auto` first runs the DP once more with five times the limit where the failing table fits
  that (`AUTO_TABLE_STRETCH`): exact for llama2-70b's 2.4e8. Past it `auto` narrows the failing table's nodes
  and, where the graph has at most 50 million edge pairs (`ilp_max_pairs`; these two layers have 13 to 37
  million), proves or improves the narrowed plan by column generation (`method="dp-narrowed+ilp"`). A whole
  70-layer model's full 16-GPU space has far more pairs, and its plan stays narrowed; the planner's default mesh
  past 8 GPUs, the groupings, stays under the default limit for every model and world size of search_time.md.
* **The full space is never worse than a grouping, and better at 16 GPUs:** by 1.4% for llama2-70b (best
  grouping `4x2x2`) and 2.3% for BLOOM-176B (`2x2x4`), two layers each. At 8 GPUs the planner's only mesh is the
  full one.
* **The column generation's LP rounds run warm.** Each round re-solves the master from the last basis, without
  presolve (which rebuilt the LP from scratch every round), and where the last LP's node columns are all 0 or 1,
  as on all four rows, that solution is the plan and no MIP runs. Measured 2026-12-06 against the run of
  2026-12-05 (same optima, same proofs), on a machine then about 1.6 times slower (pricing 1.7 s against 0.9 s;
  a 20-million-step Python loop 2.8-3.0 s against about 1.7 s quiet): the ILP 11.1 -> 4.2 s, 60.7 -> 24.5 s,
  10.3 -> 1.0 s and 17.0 -> 6.2 s. The pricing and DP columns are slower than before only because the machine was.
* Times are one process on this 2-core machine, each row from empty caches.
"""


if __name__ == "__main__":
    main()
