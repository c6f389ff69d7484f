"""Benchmark: the segmented DP on a transformer-shaped cost graph, and the DP against the ILP where the ILP fits.

Part 1 builds ``--layers`` identical decoder layers (``--views`` view/transpose nodes per branch; 8 gives 48 nodes
a layer, about 3,850 nodes for 80 layers) with a global mask, random seeded costs and ``P`` drawn per node kind
from ``--strategies LO HI``, then times the DP in each layer-merge mode. Part 2 solves a smaller copy with both
the DP and the ILP (PuLP, HiGHS or CBC) and prints their times and the objective gap, without and with a memory
budget.

    python bench/search_engine.py [--layers 80] [--views 8] [--strategies 16 128] [--mask 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import platform
import time

from primepar_fx.search import DPOptions, DPSolver, evaluate, smallest_memory, solve
from primepar_fx.search.synthetic import transformer_graph


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def part1(args: argparse.Namespace) -> None:
    lo, hi = args.strategies
    graph, t_build = timed(
        lambda: transformer_graph(
            args.layers, strategies=(lo, hi), views=args.views, mask_states=args.mask or None, seed=args.seed
        )
    )
    print(f"graph: {args.layers} layers, {len(graph.nodes)} nodes, {len(graph.edge_cost)} edges, P in [{lo}, {hi}]")
    print(f"  build + validation {t_build:.3f}s")
    values = {}
    for mode in ("auto", "power", "none"):
        if mode == "none" and not args.slow:
            continue
        solver, t_analyse = timed(lambda mode=mode: DPSolver(graph, DPOptions(layer_merge=mode)))
        res, t_min = timed(solver.minimise)
        values[mode] = evaluate(graph, res.choice)
        kinds = {k: sum(i.kind == k for i in solver.items) for k in ("fold", "table", "stack")}
        st = solver.structure
        print(
            f"  DP layer_merge={mode:5s}: analyse {t_analyse:.3f}s + minimise {t_min:.3f}s = {t_analyse + t_min:.3f}s"
            f"  objective {values[mode]:.6f}  globals {list(st.globals)}  segments {len(st.segments)}"
            f" in {len(st.class_sizes)} classes  chain {kinds}"
        )
    sol, t_solve = timed(lambda: solve(graph, method="dp"))
    print(f"  solve(method='dp') end to end (reduce + analyse + minimise + evaluate): {t_solve:.3f}s")
    spread = max(values.values()) - min(values.values())
    print(f"  modes agree: max objective difference {spread:.3g}")


def part2(args: argparse.Namespace) -> None:
    graph = transformer_graph(args.ilp_layers, strategies=tuple(args.ilp_strategies), views=1, mask_states=3, seed=1)
    print(f"\nDP vs ILP: {args.ilp_layers} layers, {len(graph.nodes)} nodes, P in {args.ilp_strategies}")
    least = smallest_memory(graph)
    free = solve(graph, method="dp").memory
    for label, budget in (("no budget", None), ("budget", least + 0.5 * (free - least))):
        dp = solve(graph, method="dp", memory_budget=budget)
        ilp = solve(graph, method="ilp", memory_budget=budget, time_limit=args.ilp_time_limit)
        gap = (dp.cost - ilp.cost) / abs(ilp.cost)
        print(
            f"  {label:9s}: DP {dp.seconds:.3f}s cost {dp.cost:.6f} (proven {dp.proven_optimal}, bound {dp.bound:.6f})"
            f" | ILP {ilp.seconds:.3f}s cost {ilp.cost:.6f} (proven {ilp.proven_optimal}) | gap {gap:+.2e}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--views", type=int, default=8)
    p.add_argument("--strategies", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    p.add_argument("--mask", type=int, default=4, help="strategies of the global mask (0: no mask)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow", action="store_true", help="also time layer_merge='none' (no sharing: slow)")
    p.add_argument("--ilp-layers", type=int, default=4)
    p.add_argument("--ilp-strategies", type=int, nargs=2, default=[4, 12])
    p.add_argument("--ilp-time-limit", type=float, default=120.0)
    args = p.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, one process")
    part1(args)
    part2(args)


if __name__ == "__main__":
    main()
