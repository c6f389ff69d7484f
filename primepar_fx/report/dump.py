"""The graph dump: everything about one partitioned model, written as files to read or diff.

:func:`dump` writes into a folder:

* ``captured.txt``: the captured ATen graph (``print_readable``);
* ``plan.json``: the plan (:meth:`~primepar_fx.record.plan.Plan.save`);
* ``nodes.md``: one row per node: op, symbolic output shape, partition, predicted time per phase, communication
  bytes per kind and memory (the plan's :class:`~primepar_fx.record.plan.CostBreakdown`);
* ``rank{r}.py``: each rank's rewritten code (``print_readable`` of its GraphModule);
* ``passes.md``: the op counts after each graph pass (rank 0's);
* ``report.html``: all of it on one self-contained page (:mod:`primepar_fx.report.html`);
* ``graph.svg`` (drawn here, :mod:`primepar_fx.report.svg`) and ``graph.dot`` (the same for graphviz): the graph
  coloured by partition, each edge labelled with the redistribution bytes the cost model predicts for it.

Per-rank graphs come from the caller (``rank_graphs``) or are built here for every rank under the "fake" process
group (:func:`fake_rank_graphs`), which creates groups but moves no data: a world of any size on one CPU process.
With ``PRIMEPAR_DUMP_DIR`` set, :func:`primepar_fx.compile` calls :func:`dump_module` on every rank: rank 0 writes
the whole dump with its own code, every other rank its ``rank{r}.py``.
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tabulate import tabulate

from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh
from primepar_fx.planning.options import CPU_CLUSTER, resolve_cluster
from primepar_fx.record.plan import COMM_KINDS, PHASES, MiB, Plan
from primepar_fx.report.explain import fmt_count, fmt_shape, price_plan
from primepar_fx.report.html import MAX_GRAPH_NODES, partition_colours, write_report
from primepar_fx.report.svg import Box, layered_graph

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- per-rank graphs
def fake_rank_graphs(graph: OpGraph, plan: Plan, ranks: list[int] | None = None) -> dict[int, Any]:
    """Each rank's :class:`~primepar_fx.passes.RankGraph`, built in this process under the fake process group.

    Sizes are the plan's ``batch`` and ``seq``. Needs no process group to be initialised (it initialises and
    destroys one per rank).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from primepar_fx.passes import localize
    from primepar_fx.runtime.groups import ProcessGroups

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised: pass each rank's graph as rank_graphs, or set "
            "PRIMEPAR_DUMP_DIR and let primepar_fx.compile dump its own rank"
        )
    plan.check_model((n.name, n.op) for n in graph.nodes.values())
    captured = graph.captured
    if (plan.batch, plan.seq) != (captured.example_batch, captured.example_seq):
        raise ValueError(
            f"the plan is for B={plan.batch}, S={plan.seq} but {graph.name} was captured with example inputs of "
            f"B={captured.example_batch}, S={captured.example_seq}; the per-rank graphs are built at the example "
            "sizes, so capture with inputs of the plan's sizes (primepar-fx dump --batch/--seq does)"
        )
    mesh = DeviceMesh(tuple(plan.digits))
    values = {B: plan.batch, S: plan.seq}
    out = {}
    for rank in range(plan.world_size) if ranks is None else ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
        try:
            out[rank] = localize(
                graph, plan.partitions(), mesh, rank, values, ProcessGroups(mesh, rank), recompute=plan.recompute
            )
        finally:
            dist.destroy_process_group()
    return out


def _gm(rank_graph: Any):
    """The GraphModule of a RankGraph or a PrimeParModule."""
    return rank_graph.gm if hasattr(rank_graph, "gm") else rank_graph.graph_module


def rank_code(rank_graph: Any, rank: int, plan: Plan) -> str:
    """``rank{r}.py``: a comment header, then ``print_readable`` of the rank's GraphModule."""
    coords = DeviceMesh(tuple(plan.digits)).coords(rank)
    head = (
        f"# rank {rank} of {plan.world_size}, device digits {list(plan.digits)}, coordinates {list(coords)}\n"
        f"# {plan.model}, B={plan.batch}, S={plan.seq}: size arguments are this rank's blocks; the type annotations "
        "are the captured graph's (whole tensors at the example sizes)\n"
    )
    gm = _gm(rank_graph)
    modules = [(str(n.target), gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    if modules:
        head += "# what each module of the code below does (which tensor, which ranks, which direction):\n"
    for name, module in modules:
        text = f"{name} = {type(module).__name__}({' '.join(module.extra_repr().split())})"
        head += "".join(f"# {line}\n" for line in textwrap.wrap(text, 116, subsequent_indent="    "))
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for placeholder, reduction in getattr(rank_graph, "grad_reductions", {}).items():
        by_ranks.setdefault(reduction.ranks, []).append(placeholder)
    if by_ranks:
        head += (
            "# parameter gradients summed over their replicas outside the graph, in gradient buckets during backward:\n"
        )
    for ranks, names in by_ranks.items():
        text = f"over ranks {ranks}: {', '.join(names)}"
        head += "".join(f"# {line}\n" for line in textwrap.wrap(text, 116, subsequent_indent="    "))
    return head + gm.print_readable(print_output=False)


_NOISE = re.compile(r"^\s*# (File: |No stacktrace found).*$\n?", re.MULTILINE)


def normalize_code(text: str) -> str:
    """``print_readable`` text without what changes from run to run or checkout to checkout: source-location
    comments (absolute paths, line numbers), memory addresses and runs of blank lines."""
    text = _NOISE.sub("", text)
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0x?", text)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


# ---------------------------------------------------------------------------------------------- tables
def nodes_table(graph: OpGraph, plan: Plan) -> str:
    """``nodes.md``: one row per node of ``graph`` with its partition and predicted cost (markdown)."""
    by_name = {n.name: n for n in plan.nodes}
    costs = [n.cost for n in plan.nodes if n.cost is not None]
    kinds = [k for k in COMM_KINDS if any(c.comm_bytes.get(k) for c in costs)]
    head = ["node", "op", "shape", "partition"] + [f"{p} ms" for p in PHASES]
    head += ["collective ms", "redistr. ms", "step ms"] + [f"{k} B" for k in kinds] + ["memory MiB"]
    rows = []
    for name, node in graph.nodes.items():
        np_ = by_name.get(name)
        shape = "; ".join(fmt_shape(s) for s in node.out_shapes) or "-"
        row: list[Any] = [name, node.op, shape, np_.partition if np_ else ""]
        c = np_.cost if np_ else None
        if c is None:
            row += [""] * (len(head) - len(row))
        else:
            row += [c.phase_s[p] * 1e3 if c.phase_s else "" for p in PHASES]
            row += [c.collective_s * 1e3, c.redistribution_s * 1e3, c.step_s * 1e3]
            row += [c.comm_bytes.get(k, 0) for k in kinds] + [c.memory_bytes / MiB]
        rows.append(row)
    p = plan.predicted
    title = (
        f"# Nodes of {plan.model}\n\n{plan.world_size} devices {list(plan.digits)} of {plan.cluster}, "
        f"B={plan.batch}, S={plan.seq}, {plan.dtype}. Times are per training step: a phase's time is its compute "
        "and ring shifts (Eq. 7: each step the slower of the two), and step = forward + backward + gradient + "
        "collectives + redistribution (the node's incoming re-layouts; a reduce-scatter saving comes off the "
        "collectives of the node that runs it). Bytes are what one device sends per step (redistribution: the mean "
        "per device of the node's incoming edges). Memory is the node's parameters with their gradients and "
        "optimizer state, the activations it stashes and its ring receive buffers; the peak counts only the "
        "largest receive buffer of all nodes, so the column may add up to more than the peak. Shapes are "
        "symbolic.\n\n"
        f"Predicted: step {p.step_time_s * 1e3:.4g} ms, peak memory {p.peak_memory_bytes / MiB:.4g} MiB, "
        f"{p.comm_bytes:,} B sent per device.\n\n"
    )
    return title + tabulate(rows, head, tablefmt="github", floatfmt=".4f", intfmt=",") + "\n"


def passes_table(pass_counts: list[tuple[str, dict[str, int]]], note: str = "") -> str:
    """``passes.md``: op x pass counts, the change over all passes, and a row of totals (markdown)."""
    if not pass_counts:
        return "# Op counts after each pass\n\nNo pass counts were recorded.\n"
    names = [name for name, _ in pass_counts]
    ops = sorted({op for _, counts in pass_counts for op in counts})
    rows: list[list[Any]] = []
    for op in ops:
        row = [counts.get(op, 0) for _, counts in pass_counts]
        change = row[-1] - row[0]
        rows.append([op, *row, f"{change:+d}" if change else ""])
    totals = [sum(counts.values()) for _, counts in pass_counts]
    rows.append(["**total**", *totals, f"{totals[-1] - totals[0]:+d}"])
    table = tabulate(rows, ["op", *names, "change"], tablefmt="github", disable_numparse=True)
    return f"# Op counts after each pass\n\n{note}\n\n{table}\n"


def _passes_note(rank_graphs: Mapping[int, Any], world: int) -> str:
    ranks = sorted(rank_graphs)
    note = f"Counts of rank {ranks[0]}'s graph: ATen ops by overload, inserted modules by class."
    if len(ranks) == 1 and world > 1:
        note += f" The other {world - 1} ranks' graphs were not at hand (each compiled rank writes only its code)."
    elif len(ranks) > 1:
        final = {r: (getattr(rank_graphs[r], "pass_counts", None) or [("", {})])[-1][1] for r in ranks}
        differ = [r for r in ranks[1:] if final[r] != final[ranks[0]]]
        note += f" Of the other {len(ranks) - 1} ranks, " + (
            f"ranks {differ} end with other counts." if differ else "every one ends with the same counts."
        )
    return note


# ---------------------------------------------------------------------------------------------- the picture
def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def edge_redistribution_bytes(graph: OpGraph, plan: Plan, cluster: Any = None) -> dict[tuple[str, str], int]:
    """Per priced edge ``(u, v)``, the plan's redistribution bytes: Forward plus Backward, mean per device.

    Tied parameters appear as edges from their first reader to each later one. An edge whose consumer shares another
    consumer's re-layout (:mod:`primepar_fx.cost.share`) moves nothing of its own.
    """
    if cluster is None:
        try:
            cluster = resolve_cluster(plan.cluster)
        except ValueError as e:  # a spec file not at hand: bytes do not depend on the cluster, seconds do
            log.warning("pricing the edges on %s: %s", CPU_CLUSTER, e)
            cluster = resolve_cluster(CPU_CLUSTER)
    priced = price_plan(graph, plan, cluster=cluster)
    out = {e: int(m[0, 0]) for e, m in priced.edge_bytes.items()}
    for skip in priced.not_run(dict.fromkeys(priced.strategies, 0)):  # it reads another consumer's re-layout
        out[(skip.u, skip.v)] -= skip.relayout_bytes
    return {e: b // plan.world_size for e, b in out.items()}


def graph_dot(graph: OpGraph, plan: Plan, edge_bytes: Mapping[tuple[str, str], int]) -> str:
    """DOT text of the partitioned graph: one colour per distinct partition (with a legend), edge labels in bytes."""
    parts = {n.name: n.partition for n in plan.nodes}
    colour = partition_colours(graph, plan)
    order = list(colour)
    lines = [
        f"digraph {_quote(plan.model)} {{",
        "  rankdir=TB; nodesep=0.25; ranksep=0.35;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8, color="#555555"];',
        f"  label={_quote(f'{plan.model}: {plan.world_size} devices {list(plan.digits)}, B={plan.batch}, S={plan.seq}; edges: redistribution bytes per device')};",  # noqa: E501
        "  labelloc=t;",
    ]
    for name, node in graph.nodes.items():
        op = node.op.removeprefix("aten.").removesuffix(".default")
        label = f"{name}\n{op}\n{parts[name]}"
        lines.append(f"  {_quote(name)} [label={_quote(label)}, fillcolor={_quote(colour[parts[name]])}];")
    data_edges = set(graph.graph.edges)
    for u, v in graph.graph.edges:
        nbytes = edge_bytes.get((u, v), 0)
        attrs = f' [label={_quote(f"{fmt_count(nbytes)} B")}, color="#c0392b", fontcolor="#c0392b"]' if nbytes else ""
        lines.append(f"  {_quote(u)} -> {_quote(v)}{attrs};")
    for (u, v), nbytes in edge_bytes.items():
        if (u, v) not in data_edges:
            text = "tied parameter" + (f" {fmt_count(nbytes)} B" if nbytes else "")
            lines.append(f"  {_quote(u)} -> {_quote(v)} [style=dashed, constraint=false, label={_quote(text)}];")
    lines.append('  subgraph cluster_legend { label="partitions"; fontsize=10; style=dashed;')
    counts = {p: sum(1 for n in graph.nodes if parts[n] == p) for p in order}
    for i, p in enumerate(order):
        text = f"{p} ({counts[p]} node{'s' if counts[p] != 1 else ''})"
        lines.append(f"    legend_{i} [label={_quote(text)}, fillcolor={_quote(colour[p])}];")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def graph_svg(graph: OpGraph, plan: Plan, edge_bytes: Mapping[tuple[str, str], int]) -> str:
    """The picture of :func:`graph_dot`, drawn here (:func:`~primepar_fx.report.svg.layered_graph`): no graphviz."""
    parts = {n.name: n.partition for n in plan.nodes}
    colour = partition_colours(graph, plan)
    boxes = {}
    for name, node in graph.nodes.items():
        op = node.op.removeprefix("aten.").removesuffix(".default")
        boxes[name] = Box((name, op, parts[name]), colour[parts[name]], f"{name}\n{node.op}\n{parts[name]}")
    data_edges = set(graph.graph.edges)
    labels = {e: f"{fmt_count(b)} B" for e, b in edge_bytes.items() if b and e in data_edges}
    tied = {
        e: "tied parameter" + (f" {fmt_count(b)} B" if b else "") for e, b in edge_bytes.items() if e not in data_edges
    }
    counts = {p: sum(1 for n in graph.nodes if parts[n] == p) for p in colour}
    legend = [(f"{p} ({counts[p]} node{'s' if counts[p] != 1 else ''})", c) for p, c in colour.items()]
    title = (
        f"{plan.model}: {plan.world_size} devices {list(plan.digits)}, B={plan.batch}, S={plan.seq}; "
        "red edges: redistribution bytes per device"
    )
    return layered_graph(graph.graph, boxes, title=title, edge_labels=labels, extra_edges=tied, legend=legend)


# ---------------------------------------------------------------------------------------------- entry points
def dump(
    graph: OpGraph,
    plan: Plan,
    out_dir: str | Path,
    *,
    rank_graphs: Mapping[int, Any] | None = None,
    cluster: Any = None,
) -> list[Path]:
    """Write the dump of ``graph`` under ``plan`` into ``out_dir`` (module docstring); return the files written.

    ``rank_graphs`` maps ranks to their :class:`~primepar_fx.passes.RankGraph` or
    :class:`~primepar_fx.compiler.module.PrimeParModule`; by default every rank is built under the fake process group.
    ``cluster`` overrides the plan's cluster for pricing the edges.
    """
    plan.check_model((n.name, n.op) for n in graph.nodes.values())
    for rank, given in (rank_graphs or {}).items():  # a compiled module must run this plan, on one of its ranks
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank_graphs has rank {rank}, but the plan is for {plan.world_size} ranks")
        runs = getattr(given, "plan", None)
        if runs is not None and (runs.digits != plan.digits or runs.partitions() != plan.partitions()):
            raise ValueError(f"rank_graphs[{rank}] is a module compiled for another plan than the one to dump")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rank_graphs is None:
        rank_graphs = fake_rank_graphs(graph, plan)
    written = [out / "captured.txt", plan.save(out / "plan.json"), out / "nodes.md", out / "passes.md"]
    written[0].write_text(graph.captured.gm.print_readable(print_output=False), encoding="utf-8")
    written[2].write_text(nodes_table(graph, plan), encoding="utf-8")
    counts = list(getattr(rank_graphs[min(rank_graphs)], "pass_counts", None) or [])
    written[3].write_text(passes_table(counts, _passes_note(rank_graphs, plan.world_size)), encoding="utf-8")
    codes = {rank: rank_code(rank_graphs[rank], rank, plan) for rank in sorted(rank_graphs)}
    for rank, code in codes.items():
        written.append(out / f"rank{rank}.py")
        written[-1].write_text(code, encoding="utf-8")
    dot = out / "graph.dot"
    edge_bytes = edge_redistribution_bytes(graph, plan, cluster)
    dot.write_text(graph_dot(graph, plan, edge_bytes), encoding="utf-8")
    written.append(dot)
    svg = out / "graph.svg"
    picture = graph_svg(graph, plan, edge_bytes)
    svg.write_text(picture, encoding="utf-8")
    written.append(svg)
    embedded = picture if len(graph.nodes) <= MAX_GRAPH_NODES else None
    written.append(write_report(out / "report.html", graph, plan, graph_picture=embedded, rank_codes=codes))
    log.info("wrote the dump of %s into %s (%d files)", plan.model, out, len(written))
    return written


def _write_rank(out: Path, rank: int, rank_graph: Any, plan: Plan) -> Path:
    path = out / f"rank{rank}.py"
    path.write_text(rank_code(rank_graph, rank, plan), encoding="utf-8")
    return path


def dump_module(graph: OpGraph, module: Any, out_dir: str | Path) -> list[Path]:
    """The ``PRIMEPAR_DUMP_DIR`` hook of :func:`primepar_fx.compile`: rank 0 writes the whole dump with its own code,
    every other rank only its ``rank{r}.py``."""
    if module.rank == 0:
        return dump(graph, module.plan, out_dir, rank_graphs={0: module})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_write_rank(out, module.rank, module, module.plan)]
