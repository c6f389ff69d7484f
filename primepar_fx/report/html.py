"""``report.html``: one self-contained page about a plan, to open in any browser (no network, no script, no file
beside it).

What it shows, in order:

* the plan in one paragraph (model, devices, sizes, training state) and its predicted step, peak memory and bytes;
* the plan against its baselines (Megatron, data parallelism, FSDP, the split-only search): a table and two bar
  charts, step time and peak memory, the memory budget marked;
* where the step time goes, per layer (compute of each phase, collectives, redistribution; consecutive layers that
  are partitioned and priced alike drawn once), and where the memory goes, the same way;
* the partition of every node of a layer, and the DSI picture of each distinct matrix-product partition (which block
  of ``I``, ``W`` and ``O`` every device holds at every step, from :mod:`primepar_fx.report.picture`);
* the searched space (legal partition sequences per node) and the search: method, optimality, time spent;
* for ``primepar-fx dump``: the graph picture (:func:`~primepar_fx.report.dump.graph_svg`) and each rank's code.

Pictures are inline SVG (:mod:`primepar_fx.report.svg`); tables are HTML with every text escaped.
"""

from __future__ import annotations

import colorsys
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from tabulate import tabulate

from primepar_fx.graph import OpGraph
from primepar_fx.graph.layers import layer_units
from primepar_fx.partition import DeviceMesh
from primepar_fx.partition.dsi import OpPartition
from primepar_fx.partition.seq import PartitionSeq, Prime, Replicate, Split
from primepar_fx.record.plan import PHASES, MiB, Plan
from primepar_fx.report.explain import explain_rows, fmt_count
from primepar_fx.report.picture import linear_op, render_svg
from primepar_fx.report.svg import bar_chart
from primepar_fx.utils.units import format_bytes

#: at most this many DSI pictures (the matrix-product partitions with the most compute first)
MAX_PICTURES = 6
#: the graph picture is embedded up to this many nodes (a bigger one is left to ``graph.svg``)
MAX_GRAPH_NODES = 600

#: one fill colour per distinct partition, in order of first use (then generated)
PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f", "#a6cee3", "#fbb4ae", "#decbe4", "#fed9a6",
)  # fmt: skip


def partition_colours(graph: OpGraph, plan: Plan) -> dict[str, str]:
    """Partition -> fill colour (``#rrggbb``), in order of first use in ``graph``: :data:`PALETTE`, then hues spread
    by the golden ratio."""
    parts = {n.name: n.partition for n in plan.nodes}
    order = list(dict.fromkeys(parts[n] for n in graph.nodes))
    out = {}
    for i, p in enumerate(order):
        if i < len(PALETTE):
            out[p] = PALETTE[i]
        else:
            r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1, 0.35, 0.95)
            out[p] = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
    return out


STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.facts td { text-align: left; } .chip { display: inline-block; width: 11px; height: 11px; border: 1px solid #555;
  margin-right: 5px; vertical-align: middle; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; }
.picture { overflow-x: auto; margin: 8px 0; } .note { color: #555; font-size: 13px; }
details { margin: 6px 0; } summary { cursor: pointer; }
"""


@dataclass(frozen=True)
class Group:
    """Nodes shown as one row: outside the layer stack, one layer, or consecutive layers alike (``copies``)."""

    label: str
    nodes: tuple[str, ...]
    copies: int = 1


def node_groups(graph: OpGraph, plan: Plan) -> list[Group]:
    """The rows of the per-layer charts: nodes before the stack, each layer (runs of layers with the same
    partitions and costs folded into one row, valued per layer), nodes after it."""
    order = list(graph.nodes)
    units = layer_units(graph)
    if units is None:
        return [Group("all nodes", tuple(order))]
    by_name = {n.name: n for n in plan.nodes}

    def signature(unit: tuple[str, ...]) -> tuple:
        return tuple((by_name[n].op, by_name[n].partition, by_name[n].cost) for n in unit)

    inside = set(units.layer_of)
    first = min(order.index(u[0]) for u in units.units)
    out = [Group("before the layers", tuple(n for n in order[:first] if n not in inside))]
    i = 0
    while i < len(units.units):
        j = i + 1
        while j < len(units.units) and signature(units.units[j]) == signature(units.units[i]):
            j += 1
        label = f"layer {i}" if j == i + 1 else f"layers {i}-{j - 1} (each)"
        out.append(Group(label, units.units[i], j - i))
        i = j
    out.append(Group("after the layers", tuple(n for n in order[first:] if n not in inside)))
    return [g for g in out if g.nodes]


def time_chart(plan: Plan, groups: Sequence[Group]) -> str:
    """Per group, milliseconds of each phase's compute (with its ring shifts), collectives and redistribution."""
    by_name = {n.name: n for n in plan.nodes}
    series: dict[str, list[float]] = {f"{p} compute": [] for p in PHASES}
    series.update({"collectives": [], "redistribution": []})
    for g in groups:
        costs = [by_name[n].cost for n in g.nodes if by_name[n].cost is not None]
        for p in PHASES:
            series[f"{p} compute"].append(sum(c.phase_s.get(p, 0.0) for c in costs) * 1e3)
        series["collectives"].append(max(0.0, sum(c.collective_s for c in costs)) * 1e3)
        series["redistribution"].append(max(0.0, sum(c.redistribution_s for c in costs)) * 1e3)
    series = {k: v for k, v in series.items() if any(v)}
    return bar_chart("Predicted step time per layer", [g.label for g in groups], series, "ms per step")


def memory_chart(plan: Plan, groups: Sequence[Group]) -> str:
    """Per group, MiB of its nodes' parameters with gradients and optimizer state, stashed activations and ring
    buffers (the plan's per-node memory)."""
    by_name = {n.name: n for n in plan.nodes}
    values = [sum(by_name[n].cost.memory_bytes for n in g.nodes if by_name[n].cost is not None) / MiB for g in groups]
    return bar_chart("Memory per layer (per device)", [g.label for g in groups], {"memory": values}, "MiB")


def baselines_section(plan: Plan) -> str:
    ours = plan.predicted
    budget = plan.search.memory_budget
    rows = [("primepar (this plan)", "", ours, True)]
    for key, b in plan.baselines.items():
        rows.append((b.config.get("name", key), key, b.predicted, b.config.get("fits_budget", True) is not False))
    table = [
        [
            name,
            _ms(p.step_time_s),
            f"{p.step_time_s / ours.step_time_s:.2f}x" if ours.step_time_s > 0 else "-",
            format_bytes(p.peak_memory_bytes),
            f"{p.peak_memory_bytes / ours.peak_memory_bytes:.2f}x" if ours.peak_memory_bytes else "-",
            fmt_count(p.comm_bytes) + " B",
            "yes" if fits else "no (not compared)",
        ]
        for name, _, p, fits in rows
    ]
    head = ["system", "step", "its time / ours", "peak memory", "its memory / ours", "sent per device", "fits"]
    names = [name for name, *_ in rows]
    marker = ("budget", budget / MiB) if isinstance(budget, int | float) and budget > 0 else None
    peak = [p.peak_memory_bytes / MiB for _, _, p, _ in rows]
    if marker is not None and marker[1] > 20 * max(peak):
        marker = None  # a budget far above every plan would squash the bars
    seconds = max(p.step_time_s for _, _, p, _ in rows) >= 10
    steps = [p.step_time_s * (1 if seconds else 1e3) for _, _, p, _ in rows]
    charts = bar_chart("Predicted step time", names, {"step": steps}, "s" if seconds else "ms")
    gib = max(peak + [marker[1] if marker else 0.0]) >= 10 * 1024
    if gib:
        peak = [v / 1024 for v in peak]
        marker = (marker[0], marker[1] / 1024) if marker else None
    unit = "GiB" if gib else "MiB"
    charts += bar_chart("Predicted peak memory per device", names, {"peak": peak}, unit, marker=marker)
    return (
        "<h2>Against the baselines</h2>"
        '<p class="note">Every row is priced by the same cost model on the same cluster; a baseline is the best '
        "configuration of its kind (Megatron: data x model parallel, with and without sequence parallelism).</p>"
        + _table(table, head)
        + f'<div class="picture">{charts}</div>'
    )


def partitions_section(graph: OpGraph, plan: Plan, groups: Sequence[Group], colours: Mapping[str, str]) -> str:
    by_name = {n.name: n for n in plan.nodes}
    parts = []
    for g in groups:
        rows = []
        for n in g.nodes:
            node = by_name[n]
            chip = f'<span class="chip" style="background:{colours[node.partition]}"></span>'
            ms = f"{node.cost.step_s * 1e3:.4g}" if node.cost is not None else ""
            rows.append(
                f"<tr><td>{escape(n)}</td><td>{escape(node.op)}</td><td>{chip}{escape(node.partition)}</td>"
                f"<td>{ms}</td></tr>"
            )
        counts: dict[str, int] = {}
        for n in g.nodes:
            counts[by_name[n].partition] = counts.get(by_name[n].partition, 0) + 1
        summary = ", ".join(f"{p} x{c}" for p, c in sorted(counts.items(), key=lambda kv: -kv[1]))
        parts.append(
            f"<details><summary>{escape(g.label)}: {len(g.nodes)} nodes ({escape(summary)})</summary>"
            "<table><tr><th>node</th><th>op</th><th>partition</th><th>step ms</th></tr>" + "".join(rows) + "</table>"
            "</details>"
        )
    return "<h2>Partitions, layer by layer</h2>" + "".join(parts)


def linear_seq(seq: PartitionSeq, roles: tuple[str, str, str]) -> PartitionSeq:
    """``seq`` of a matrix product with roles ``(M, N, K)`` read on the paper's linear ``O[M,K] = I[M,N] . W[N,K]``:
    a split of ``N`` or ``K`` keeps its letter, every other split (M and the batch dims) splits M."""
    _, n, k = roles
    out = []
    for e in seq.elements:
        if isinstance(e, Split):
            out.append(Split("N" if e.dim == n else "K" if e.dim == k else "M"))
        else:
            out.append(e)
    return PartitionSeq(tuple(out))


def pictures_section(graph: OpGraph, plan: Plan) -> str:
    """The DSI picture of each distinct matrix-product partition, the ones with the most compute first."""
    mesh = DeviceMesh(tuple(plan.digits))
    weight: dict[str, float] = {}
    for node in plan.nodes:
        roles = graph.nodes[node.name].dims.matmul
        if roles is None or node.cost is None:
            continue
        text = str(linear_seq(node.seq, roles))
        weight[text] = weight.get(text, 0.0) + node.cost.compute_s
    chosen = sorted(weight, key=lambda t: -weight[t])[:MAX_PICTURES]
    parts = []
    for text in chosen:
        seq = PartitionSeq.parse(text)
        try:  # every dim of the linear divisible by any product of digit radices, and by P(S x S)'s S
            part = OpPartition(linear_op(math.lcm(4, mesh.size)), seq, mesh)
        except ValueError as e:
            parts.append(f'<p class="note">{escape(text)}: not drawn ({escape(str(e))})</p>')
            continue
        share = weight[text] / max(sum(weight.values()), 1e-30)
        what = "P(S x S): the blocks rotate over steps" if any(isinstance(e, Prime) for e in seq.elements) else ""
        what = what or ("replicated" if all(isinstance(e, Replicate) for e in seq.elements) else "")
        parts.append(
            f"<details{' open' if not parts else ''}><summary>{escape(text)}: {share:.0%} of the matrix products' "
            f"compute{(' (' + what + ')') if what else ''}</summary>"
            f'<div class="picture">{render_svg(part)}</div></details>'
        )
    left = len(weight) - len(chosen)
    more = f" ({left} more partitions not drawn)" if left > 0 else ""
    return (
        "<h2>How the matrix products are partitioned</h2>"
        '<p class="note">Each matrix product read as the paper\'s linear O[M,K] = I[M,N] · W[N,K] (batch and '
        "sequence dims are M): which block of each tensor every device holds at every step, drawn from the DSIs"
        f"{more}.</p>" + "".join(parts)
        if parts
        else ""
    )


def search_section(graph: OpGraph, plan: Plan) -> str:
    s = plan.search
    mesh = DeviceMesh(tuple(plan.digits))
    t0 = time.perf_counter()
    counts = [r.sequences for r in explain_rows(graph, mesh, batch=plan.batch, seq=plan.seq)]
    log10 = sum(math.log10(c) for c in counts if c > 0)
    facts = [
        ("method", _or_dash(s.method)),
        ("proven optimal", _or_dash(s.proven_optimal)),
        ("legal partition sequences per node", f"{min(counts)} to {max(counts)}, mean {sum(counts) / len(counts):.1f}"),
        ("plans in the space (product over nodes)", f"10^{log10:.1f}"),
        ("allow P(S x S)", _or_dash(s.allow_prime)),
        ("pricing", _seconds(s.pricing_s)),
        ("search", _seconds(s.search_s)),
        ("baselines", _seconds(s.baselines_s)),
    ]
    if s.groupings:
        facts.append(("digit groupings priced and searched", f"{len(s.groupings)} in {_seconds(s.groupings_s)}"))
    if s.memory_budget:
        facts.append(("memory budget", format_bytes(s.memory_budget)))
    if s.split_only_kept:  # the budgeted search landed above the split-only search's plan (planning.md)
        facts.append(("plan from", "the split-only search, cheaper than what the whole space's search found"))
    facts.append(("counting the space for this page", _seconds(time.perf_counter() - t0)))
    return "<h2>The searched space and the search</h2>" + _facts([(k, v) for k, v in facts if v != "-"])


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _ms(seconds: float) -> str:
    return f"{seconds:.4g} s" if seconds >= 10 else f"{seconds * 1e3:.4g} ms"


def _seconds(x: Any) -> str:
    return f"{x:.2f} s" if isinstance(x, int | float) else "-"


def _facts(items: Sequence[tuple[str, Any]]) -> str:
    return (
        '<table class="facts">'
        + "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(str(v))}</td></tr>" for k, v in items)
        + "</table>"
    )


def _table(rows: list[list[Any]], head: list[str]) -> str:
    return tabulate(rows, head, tablefmt="html", disable_numparse=True)


def report_html(
    graph: OpGraph,
    plan: Plan,
    *,
    colours: Mapping[str, str] | None = None,
    graph_picture: str | None = None,
    rank_codes: Mapping[int, str] | None = None,
) -> str:
    """The page (module docstring). ``graph_picture`` (SVG text) and ``rank_codes`` (rank -> code) come from a dump."""
    plan.check_model((n.name, n.op) for n in graph.nodes.values())
    colours = colours or partition_colours(graph, plan)
    p = plan.predicted
    groups = node_groups(graph, plan)
    extra = [f"{plan.micro_batches} micro-batches"] if plan.micro_batches > 1 else []
    if plan.recompute and plan.recompute.active:
        extra.append(f"recompute {plan.recompute.describe()}")
    title = f"{plan.model} on {plan.world_size} devices"
    if plan.pipeline is not None:
        title += f" in {plan.pipeline.stages} pipeline stages"
    intro = _facts(
        [
            ("model", plan.model),
            ("devices", f"{plan.world_size}, digits {list(plan.digits)} of {plan.cluster}"),
            *([("pipeline", _pipeline_fact(plan))] if plan.pipeline is not None else []),
            ("batch, sequence, dtype", f"B={plan.batch}, S={plan.seq}, {plan.dtype}"),
            ("training state", plan.cost_options().describe_state() + "".join(f"; {e}" for e in extra)),
            ("predicted step", _ms(p.step_time_s)),
            ("predicted peak memory per device", format_bytes(p.peak_memory_bytes)),
            ("sent per device per step", f"{fmt_count(p.comm_bytes)} B"),
            ("nodes", f"{len(plan.nodes)}, {sum(1 for n in plan.nodes if 'P' in n.partition)} with P(S x S)"),
        ]
    )
    body = [f"<h1>{escape(title)}</h1>", intro]
    if plan.baselines:
        body.append(baselines_section(plan))
    body.append(
        "<h2>Where the step time and the memory go</h2>"
        '<p class="note">Per node, the cost model\'s time per phase (compute, and ring shifts where they are '
        "slower), collectives and incoming re-layouts, summed per layer; memory is the nodes' parameters with "
        "their gradients and optimizer state, stashed activations and ring buffers (the peak counts only the "
        "largest ring buffer, so the bars may add up to more than the peak).</p>"
        f'<div class="picture">{time_chart(plan, groups)}</div><div class="picture">{memory_chart(plan, groups)}</div>'
    )
    legend = "".join(
        f'<span style="margin-right:14px"><span class="chip" style="background:{c}"></span>{escape(p_)}</span>'
        for p_, c in colours.items()
    )
    body.append(f'<p class="note">{legend}</p>')
    body.append(partitions_section(graph, plan, groups, colours))
    body.append(pictures_section(graph, plan))
    body.append(search_section(graph, plan))
    if graph_picture is not None:
        body.append(f'<h2>The graph</h2><div class="picture">{graph_picture}</div>')
    if rank_codes:
        codes = "".join(
            f"<details><summary>rank {r}</summary><pre>{escape(code)}</pre></details>"
            for r, code in sorted(rank_codes.items())
        )
        body.append("<h2>Each rank's code</h2>" + codes)
    body.append(
        "<details><summary>Every node (the plan's table)</summary>"
        + plan.summary_table(tablefmt="html", fold=True).split("\n", 1)[1].replace("\n\n", "<br>")
        + "</details>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(path: str | Path, graph: OpGraph, plan: Plan, **kwargs: Any) -> Path:
    """:func:`report_html` written to ``path`` (parent folders created); returns the path."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"cannot write the report to {out}: it is a folder; give a file name, e.g. {out}/report.html")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report_html(graph, plan, **kwargs), encoding="utf-8")
    return out


def _pipeline_fact(plan: Plan) -> str:
    """The pipeline's line: its stages, schedule and bubble, each stage's devices and peak."""
    pipe = plan.pipeline
    assert pipe is not None
    peaks = ", ".join(format_bytes(b) for b in pipe.stage_peak_bytes)
    text = f"{pipe.describe()}; each stage on {plan.stage_devices} devices (digits {list(plan.digits)})"
    return f"{text}; peak per stage {peaks}" if peaks else text
