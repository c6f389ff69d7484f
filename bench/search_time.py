"""Benchmark: planning time for OPT-175B, Llama2-70B and BLOOM-176B against the paper's Table 2.

For each model (captured once on the meta device) and world size on ``v100-paper`` (4 GPUs per node; past its 32
GPUs, the same nodes, more of them): the time
to price the partition space (Eq. 7-9, cached per distinct layer shape) and the time of the segmented DP
(Eq. 11-14), with the largest per-node strategy count P. Up to three device digits (8 GPUs) the full space is
searched; past that, as the planner does by default, every grouping of the digits into three
(:func:`primepar_fx.planning.planner.search_meshes`) is priced and searched and the cheapest plan kept: the times
are summed over the groupings, P is the kept one's, and the full space's P is shown for comparison.

The ILP cross-check runs on a two-layer model of the same shapes (the whole 80-layer graph is millions of ILP
variables): DP and ILP time and the relative objective gap. The paper's Table 2 reports its optimisation time
on one Xeon Gold 5218 thread. Targets (issue 3): the whole plan for llama2-70b at 32 devices under 0.5 s; 64 and
128 devices under 5 s.

    python bench/search_time.py [--worlds 4 8 16 32 64 128] [--models OPT Llama2 BLOOM]
        [--out docs/benchmarks/search_time.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import time

from primepar_fx import analyze
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.model import CostOptions, clear_caches
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import enumerate_sequences
from primepar_fx.planning.planner import search_meshes
from primepar_fx.planning.pricing import price_graph
from primepar_fx.search import SearchError, solve
from primepar_fx.search.ilp import ilp_size

MODELS = {"OPT": "opt-175b", "Llama2": "llama2-70b", "BLOOM": "bloom-176b"}
PAPER_MS = {
    "OPT": [85.3, 86.5, 170.9, 5357.3],
    "Llama2": [86.5, 88.8, 185.9, 6070.3],
    "BLOOM": [85.4, 80.2, 165.8, 4153.0],
}
PAPER_WORLDS = [4, 8, 16, 32]
CLUSTER = "v100-paper"
VALUES = {B: 16, S: 2048}
ILP_MAX_VARIABLES = 400_000
ILP_TIME_LIMIT = 120.0


READING = """## Reading the results

* **The DP takes 0.05-0.2 s at every size and for every model.** On the planner's default space, llama2-70b takes
  0.18 s at 32 GPUs (paper 6.07 s) and 0.14-0.20 s at 4-128 GPUs. OPT-175B and BLOOM-176B take 0.05-0.12 s. At
  4 GPUs OPT and BLOOM are faster than the paper (60 and 46 ms against 85 ms). llama2-70b at 4 and 8 GPUs
  (0.18-0.20 s) and OPT and BLOOM at 8 (97-109 ms) are slower than its 80-89 ms, because our graph is the whole
  ATen graph (1,400-4,300 nodes) where the paper's has 13 operators per layer.
  * OPT and BLOOM tie the word embedding to the LM head. That edge goes through a proxy node that the DP
    conditions on (`search/proxy.py`): 27 states, one per layout the embedding stores its weight in. So the layers
    stay separable and are merged by squaring.
* **Capture takes 0.5-0.7 s instead of 6-14 s.** The planner exports two layers and replicates them
  (`primepar_fx/graph/replicate.py`, [planning.md](../planning.md#0-capture-two-layers-replicate-the-rest)). The bench
  checks that the replicated graph has the full capture's nodes and names. `tests/graph/test_replicate.py` also checks
  its edges, parameters and prices.
  * The two-layer export runs without FakeTensor's dispatch cache, which nearly every op of a short symbolic
    trace misses (0.7-0.9 s in the last run). A full capture keeps it: its 80 identical layers hit it, and
    without it llama2-70b's full capture takes 21 s instead of 14.
* **Pricing is 5-20% faster than in the last run, with bit-identical costs** (4,032 cost and byte arrays of four
  models at 8, 32 and 128 GPUs, compared with the tree before).
  * llama2-70b: 1.7 s at 32 GPUs (was 2.2), 2.2 s at 64 (was 2.4), 3.4 s at 128 (was 3.2: within this machine's
    run-to-run spread).
  * OpDims, PartitionSeq and DeviceMesh key the planner's memos a few hundred thousand times per plan; they now
    compute their hash once (an OpDims hash took 1.2 us).
  * Each world size is priced from empty caches, as a plan in a new process would be, and every timing starts
    after a garbage collection.
* **The 64- and 128-GPU targets are met; the 32-GPU target is not.**
  * The issue asked for the whole llama2-70b plan under 0.5 s at 32 GPUs and under 5 s at 64 and 128.
  * llama2-70b now takes 2.6 s, 3.0 s and 4.3 s (last run 3.4, 3.6 and 4.2 s; before replication 23-30 s).
  * OPT-175B takes 1.8/2.1/2.5 s at 32/64/128, and BLOOM-176B 1.8/2.5/3.6 s.
  * 0.5 s at 32 GPUs is out of reach with `torch.export` as the capture: exporting one decoder layer alone, on the
    meta device with symbolic B and S, takes 0.41 s when torch has exported before in the process and 0.74 s in a
    fresh one. Pricing the 193 strategies per node and their re-layouts takes 1.7 s more. The search itself,
    which is what the paper's 6.07 s measures, takes 0.18 s.
  * Timings on this machine vary by 10-20% from run to run (a shared 2-core VM).
* **What `primepar-fx plan` adds.** The command also prices the baselines: every Megatron configuration and data
  parallelism in one pass, and split-only read off the searched pricing. For llama2-70b at 32 GPUs that is 1.2 s
  (9.5 s before this run); the command prints where its time went.
* **Grouped space from 16 GPUs.** Past three device digits, the full space has 700-7,700 sequences per node,
  and its DP tables pass 10^8 entries. The planner therefore merges the leading (node) digits into one:
  `8x2x2` for 32 GPUs.
  * That keeps P near 100-200 sequences per node, so P(S×S) stays possible inside a node and every split stays
    possible across nodes.
  * `tests/planning/test_planner.py` checks that a grouped plan, written out on the full mesh, is priced identically.
  * `tests/search/test_search_real.py` checks that DP = ILP on the grouped 16-GPU mesh.
* **DP vs ILP.** On two-layer models of the same shapes, the ILP (PuLP/CBC) reaches the DP's optimum exactly
  where it fits: gap 0 at 4 and 128 GPUs for all three models. Elsewhere the edge matrices make the ILP
  millions of variables, and it is not run.
"""


def max_strategies(graph, mesh) -> int:
    seen, p_max = set(), 0
    for node in graph.nodes.values():
        if (node.dims, node.target) not in seen:
            seen.add((node.dims, node.target))
            p_max = max(p_max, len(enumerate_sequences(node.dims, mesh, values=VALUES)))
    return p_max


def one(graph, small, world: int) -> dict:
    """Price and search ``graph`` as the planner does (every grouping past three digits, the cheapest kept); DP
    against ILP on the two-layer ``small`` on the kept mesh."""
    cluster = load_cluster(CLUSTER)
    if world > cluster.num_devices:  # the same nodes (4 GPUs, NVLink inside, InfiniBand between), more of them
        cluster = dataclasses.replace(cluster, num_devices=world)
    full = cluster.mesh(world)
    meshes = search_meshes(full, None, cluster)
    row = {"world": world, "groupings": len(meshes), "pricing_s": 0.0, "search_s": 0.0}
    row["P_full"] = max_strategies(graph, full) if len(full.digits) <= 5 else None
    opts = CostOptions(dtype="fp16")
    best = None
    for mesh in meshes:
        clear_caches()  # as the planner does: each mesh is priced afresh, its layouts numbered anew
        gc.collect()  # start each timing without the garbage of the one before, as a new process would
        t0 = time.perf_counter()
        priced = price_graph(graph, mesh, cluster, VALUES, opts)
        row["pricing_s"] += time.perf_counter() - t0
        try:
            sol = solve(priced.search_graph, method="dp")
        except SearchError as e:
            row["error"] = f"{type(e).__name__} on {mesh.digits}: {str(e)[:100]}"
            return row
        row["search_s"] += sol.seconds
        if best is None or sol.cost < best[1]:
            best = (mesh, sol.cost)
    mesh = best[0]
    row.update(digits=mesh.digits, grouped=mesh != full, P=max_strategies(graph, mesh))
    clear_caches()
    cross = price_graph(small, mesh, cluster, VALUES, opts).search_graph
    dp = solve(cross, method="dp")
    row["small_dp_s"] = dp.seconds
    size = ilp_size(cross)
    row["ilp_variables"] = size
    if size <= ILP_MAX_VARIABLES:
        ilp = solve(cross, method="ilp", time_limit=ILP_TIME_LIMIT)
        row["ilp_s"], row["ilp_proven"] = ilp.seconds, ilp.proven_optimal
        row["gap"] = (dp.cost - ilp.cost) / ilp.cost
    return row


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", nargs="+", type=int, default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="model families to run")
    p.add_argument("--out", default="docs/benchmarks/search_time.md")
    args = p.parse_args()
    rows = []
    for family, name in MODELS.items():
        if family not in args.models:
            continue
        graphs, capture_s = {}, {}
        for key, layers, replicate in (("whole", None, False), ("replicated", None, True), (2, 2, False)):
            config = get_config(name) if layers is None else dataclasses.replace(get_config(name), layers=layers)
            model = build(config, device="meta")
            ex_args, ex_kwargs = example_inputs(config, 2, 16, device="meta")
            gc.collect()
            t0 = time.perf_counter()
            graphs[key] = analyze(model, ex_args, ex_kwargs, name=name, replicate_layers=replicate)
            capture_s[key] = time.perf_counter() - t0
        whole, fast = graphs["whole"], graphs["replicated"]
        assert list(fast.nodes) == list(whole.nodes) and fast.nodes == whole.nodes  # the same graph, faster
        for world in args.worlds:
            row = {"family": family, "model": name, "nodes": len(fast.nodes), "capture_s": capture_s["replicated"]}
            row["full_capture_s"] = capture_s["whole"]
            row.update(one(fast, graphs[2], world))
            row["paper_ms"] = PAPER_MS[family][PAPER_WORLDS.index(world)] if world in PAPER_WORLDS else None
            rows.append(row)
            what = row.get("error") or (
                f"{row['groupings']} mesh(es), {row['digits']} kept, P={row['P']}: pricing {row['pricing_s']:.1f} s, "
                f"DP {_ms(row['search_s'])} ms"
            )
            if "gap" in row:
                what += f"; 2 layers: DP {_ms(row['small_dp_s'])} ms, ILP {row['ilp_s']:.1f} s, gap {row['gap']:.1e}"
            print(f"{name:11s} N={world:3d}: {what} (paper {row['paper_ms']} ms)", flush=True)
    lines = [
        "# Planning time: segmented DP against the paper's Table 2",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (one process; the re-layouts priced on two threads). "
        f"Cluster `{CLUSTER}` (4 GPUs per "
        "node), B = 16, S = 2048, fp16. *Capture* is `torch.export` on the meta device of two layers, replicated to "
        "the whole model (`primepar_fx.graph.replicate`, the planner's default; the same nodes, names and edges as a "
        "capture of every layer, which is *full capture*); *pricing* evaluates Eq. 7-9 for every distinct layer "
        "shape, its layouts computed afresh for each "
        "world size; *DP* is the search (Eq. 11-14), which is what the paper's Table 2 times; *whole plan* is the "
        "three together. *meshes* is how many meshes were searched: up to 8 GPUs the full one; past that, as the "
        "planner does by default, every grouping of the digits into three (relabelings once), pricing and DP "
        "summed over them; *digits* is the mesh of the cheapest plan and *P* its per-node strategy count. *P full* "
        "is the per-node strategy count of the full mesh, for comparison. The last "
        "columns cross-check the DP against the ILP (PuLP) on a two-layer model of the same shapes.",
        "",
        "| model | nodes | GPUs | meshes | digits | P | P full | full capture s | capture s | pricing s | DP ms "
        "| whole plan s | paper ms "
        "| 2 layers: DP ms | ILP s | DP - ILP gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        digits = "x".join(map(str, r.get("digits", ())))
        p_full = f"{r['P_full']:,}" if r["P_full"] is not None else "-"
        if "error" in r:
            cells = f"{r['pricing_s']:.1f} | not run: {r['error']} | - | - | - | -"
        else:
            if "gap" in r:
                ilp = f"{r['ilp_s']:.1f}{'' if r['ilp_proven'] else ' (time limit)'} | {r['gap']:.1e}"
            else:
                ilp = f"not run ({r['ilp_variables']:,} variables) | -"
            paper = r["paper_ms"] or "-"
            whole = r["capture_s"] + r["pricing_s"] + r["search_s"]
            cells = (
                f"{r['pricing_s']:.1f} | {_ms(r['search_s'])} | {whole:.1f} | {paper} | {_ms(r['small_dp_s'])} | {ilp}"
            )
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['world']} | {r['groupings']} | {digits} | {r.get('P', '-')} "
            f"| {p_full} "
            f"| {r['full_capture_s']:.1f} | {r['capture_s']:.1f} "
            f"| {cells} |"
        )
    lines += ["", READING]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
