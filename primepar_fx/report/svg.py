"""Pictures as inline SVG text, drawn here with no outside program: bar charts and a layered graph drawing.

* :func:`bar_chart`: horizontal bars, one row per category, stacked by series, with a legend and an axis in the
  chart's unit; an optional vertical marker line (a memory budget).
* :func:`layered_graph`: a directed acyclic graph drawn top to bottom. Each node sits on the row of its longest
  path from a source; the order within a row comes from a few sweeps of the barycentre heuristic (each node moved
  to the mean position of its neighbours on the row before, then after), which removes most crossings of a
  transformer's mostly chain-like graph. Edges are curves from a node's bottom to its reader's top, labelled when
  the caller gives a label.

Every text is escaped, so node names and labels may hold any character.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

import networkx as nx

FONT = 'font-family="Helvetica, Arial, sans-serif"'
CHAR_W = 6.2  # mean advance of an 11 px sans-serif character, for sizing boxes around text
#: series colours of the charts (colour-blind safe, Okabe-Ito), cycled
SERIES = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#999999")
#: the gaps between the boxes of :func:`layered_graph`, across and down, and the margin around its picture
GAP_X, GAP_Y, MARGIN = 18, 34, 16


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def fmt_value(x: float) -> str:
    """A chart number: thousands grouped from 10,000 on, else four significant digits."""
    return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def _text_w(text: str, size: float = 11) -> float:
    return len(text) * CHAR_W * size / 11


def nice_ticks(top: float, n: int = 5) -> list[float]:
    """Round axis ticks from 0 that reach at least ``top`` (``top`` <= 0 gives ``[0, 1]``)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks = [0.0]
    while ticks[-1] < top * (1 - 1e-9):
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def bar_chart(
    title: str,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    unit: str,
    *,
    marker: tuple[str, float] | None = None,
    width: int = 760,
) -> str:
    """Horizontal bars: a row per category, the series stacked left to right; ``marker`` is ``(label, value)``."""
    names = list(series)
    for name in names:
        if len(series[name]) != len(categories):
            raise ValueError(f"series {name!r} has {len(series[name])} values for {len(categories)} categories")
        if any(v < 0 for v in series[name]):
            raise ValueError(f"series {name!r} has a negative value: bars stack from 0")
    totals = [sum(series[n][i] for n in names) for i in range(len(categories))]
    top = max(totals + [marker[1] if marker else 0.0, 0.0])
    ticks = nice_ticks(top)
    left = min(max((_text_w(c) for c in categories), default=0) + 16, width * 0.45)
    right = 70
    plot_w = width - left - right
    bar_h, row_h, head = 14, 20, 30
    legend_h = 22 * (1 + int(sum(_text_w(n) + 34 for n in names) // (width - 20))) if len(names) > 1 else 0
    height = head + legend_h + row_h * len(categories) + 34

    def x_of(v: float) -> float:
        return left + plot_w * v / ticks[-1]

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'{FONT} font-size="11" role="img"><title>{escape(title)}</title>',
        f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    x, y = 8.0, head + 4
    for i, name in enumerate(names if len(names) > 1 else []):
        if x + _text_w(name) + 34 > width - 8:
            x, y = 8.0, y + 22
        out.append(f'<rect x="{_num(x)}" y="{y}" width="12" height="12" fill="{SERIES[i % len(SERIES)]}"/>')
        out.append(f'<text x="{_num(x + 16)}" y="{y + 10}">{escape(name)}</text>')
        x += _text_w(name) + 34
    top_y = head + legend_h
    bottom = top_y + row_h * len(categories)
    for t in ticks:
        tx = _num(x_of(t))
        out.append(f'<line x1="{tx}" y1="{top_y}" x2="{tx}" y2="{bottom}" stroke="#e3e3e3"/>')
        out.append(f'<text x="{tx}" y="{bottom + 14}" text-anchor="middle" fill="#555">{fmt_value(t)}</text>')
    out.append(f'<text x="{_num(left + plot_w / 2)}" y="{bottom + 29}" text-anchor="middle" fill="#555">'
               f"{escape(unit)}</text>")  # fmt: skip
    for r, cat in enumerate(categories):
        y0 = top_y + r * row_h + (row_h - bar_h) / 2
        out.append(f'<text x="{_num(left - 6)}" y="{_num(y0 + 11)}" text-anchor="end">{escape(cat)}</text>')
        acc = 0.0
        for i, name in enumerate(names):
            v = series[name][r]
            if v > 0:
                tip = escape(f"{cat}: {name} {v:.4g} {unit}")
                out.append(
                    f'<rect x="{_num(x_of(acc))}" y="{_num(y0)}" width="{max(0.5, x_of(acc + v) - x_of(acc)):.1f}" '
                    f'height="{bar_h}" fill="{SERIES[i % len(SERIES)]}"><title>{tip}</title></rect>'
                )
            acc += v
        out.append(f'<text x="{_num(x_of(acc) + 4)}" y="{_num(y0 + 11)}" fill="#333">{fmt_value(totals[r])}</text>')
    if marker is not None:
        mx = _num(x_of(marker[1]))
        out.append(
            f'<line x1="{mx}" y1="{top_y - 4}" x2="{mx}" y2="{bottom}" stroke="#c0392b" stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{mx}" y="{top_y - 6}" text-anchor="middle" fill="#c0392b">{escape(marker[0])}</text>')
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- graph drawing
@dataclass(frozen=True)
class Box:
    """A node of :func:`layered_graph`: text lines (the first bold) and a fill colour."""

    lines: tuple[str, ...]
    fill: str = "#ffffff"
    tooltip: str = ""


def layer_rows(g: nx.DiGraph, sweeps: int = 4) -> list[list[str]]:
    """Rows of ``g``'s nodes: row = the longest path from a source; each row ordered by barycentre sweeps."""
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("a layered drawing needs an acyclic graph")
    depth: dict[str, int] = {}
    for v in nx.topological_sort(g):
        depth[v] = max((depth[u] + 1 for u in g.predecessors(v)), default=0)
    rows: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for v in g.nodes:  # the graph's own order first: a chain stays in program order
        rows[depth[v]].append(v)
    for sweep in range(sweeps):
        down = sweep % 2 == 0
        order = range(1, len(rows)) if down else range(len(rows) - 2, -1, -1)
        for r in order:
            ref = {v: i for i, v in enumerate(rows[r - 1 if down else r + 1])}
            key = {}
            for i, v in enumerate(rows[r]):
                near = [ref[u] for u in (g.predecessors(v) if down else g.successors(v)) if u in ref]
                key[v] = (sum(near) / len(near) if near else i, i)
            rows[r].sort(key=key.__getitem__)
    return rows


def layered_graph(
    g: nx.DiGraph,
    boxes: Mapping[str, Box],
    *,
    title: str = "",
    edge_labels: Mapping[tuple[str, str], str] | None = None,
    extra_edges: Mapping[tuple[str, str], str] | None = None,
    legend: Sequence[tuple[str, str]] = (),
) -> str:
    """``g`` drawn top to bottom as SVG; ``extra_edges`` (label per edge) are drawn dashed and do not set rows.

    The nodes are placed first (:func:`_place`), then drawn: the title and legend (:func:`_head`), the edges
    (:func:`_edges`) and the boxes over them (:func:`_boxes`)."""
    at = _place(g, boxes, title, legend)
    out = _head(at, title)
    out += _edges(g, at, edge_labels or {}, extra_edges or {})
    out += _boxes(g, boxes, at)
    out.append("</svg>")
    return "\n".join(s for s in out if s) + "\n"


@dataclass(frozen=True)
class _Placed:
    """Where :func:`layered_graph` draws: each node's box size and position, the legend's rows, the picture's size."""

    box_w: dict[str, float]
    box_h: dict[str, int]
    where: dict[str, tuple[float, float]]  # node -> (centre x, top y)
    legend_rows: list[list[tuple[str, str]]]
    width: float
    height: float


def _place(g: nx.DiGraph, boxes: Mapping[str, Box], title: str, legend: Sequence[tuple[str, str]]) -> _Placed:
    """Each node on its row (:func:`layer_rows`), the rows centred under the title and the legend."""
    rows = layer_rows(g)
    box_w = {v: max(_text_w(t, 11 if i else 12) for i, t in enumerate(boxes[v].lines)) + 14 for v in g.nodes}
    box_h = {v: 15 * len(boxes[v].lines) + 8 for v in g.nodes}
    row_h = [max(box_h[v] for v in row) for row in rows]
    row_w = [sum(box_w[v] for v in row) + GAP_X * (len(row) - 1) for row in rows]
    legend_rows = _legend_rows(legend, max(row_w, default=0))
    legend_h = 20 * len(legend_rows)
    width = max(row_w + [max((sum(_text_w(t) + 34 for t, _ in lr) for lr in legend_rows), default=0), _text_w(title)])
    width += 2 * MARGIN
    top = MARGIN + (24 if title else 0) + legend_h + (10 if legend else 0)
    where: dict[str, tuple[float, float]] = {}
    y = float(top)
    for r, row in enumerate(rows):
        x = (width - row_w[r]) / 2
        for v in row:
            where[v] = (x + box_w[v] / 2, y + (row_h[r] - box_h[v]) / 2)
            x += box_w[v] + GAP_X
        y += row_h[r] + GAP_Y
    return _Placed(box_w, box_h, where, legend_rows, width, y - GAP_Y + MARGIN)


def _head(at: _Placed, title: str) -> list[str]:
    """The ``<svg>`` element's opening, the arrow head, the title and the legend."""
    width, height = _num(at.width), _num(at.height)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT} font-size="11" role="img">',
        f"<title>{escape(title)}</title>" if title else "",
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" fill="#666"/></marker></defs>',
    ]
    if title:
        out.append(f'<text x="{MARGIN}" y="{MARGIN + 12}" font-size="13" font-weight="bold">{escape(title)}</text>')
    ly = MARGIN + (24 if title else 0)
    for lr in at.legend_rows:
        lx = float(MARGIN)
        for text, fill in lr:
            out.append(f'<rect x="{_num(lx)}" y="{ly}" width="12" height="12" rx="2" fill="{fill}" stroke="#555"/>')
            out.append(f'<text x="{_num(lx + 16)}" y="{ly + 10}">{escape(text)}</text>')
            lx += _text_w(text) + 34
        ly += 20
    return out


def _edges(
    g: nx.DiGraph,
    at: _Placed,
    edge_labels: Mapping[tuple[str, str], str],
    extra_edges: Mapping[tuple[str, str], str],
) -> list[str]:
    """Each edge a curve from its source's bottom to its reader's top (an extra one dashed), with its label."""
    where, box_h, out = at.where, at.box_h, []
    drawn = [(u, v, edge_labels.get((u, v), ""), False) for u, v in g.edges]
    drawn += [(u, v, text, True) for (u, v), text in extra_edges.items() if u in where and v in where]
    for u, v, text, dashed in drawn:
        (x1, y1), (x2, y2) = where[u], where[v]
        y1 += box_h[u]
        if y2 <= y1:  # an extra edge upwards or within a row: leave from the side
            y1 -= box_h[u] / 2
        bend = max(GAP_Y * 0.8, abs(y2 - y1) / 3)
        colour = "#c0392b" if text and not dashed else "#777"
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(
            f'<path d="M{_num(x1)},{_num(y1)} C{_num(x1)},{_num(y1 + bend)} {_num(x2)},{_num(y2 - bend)} '
            f'{_num(x2)},{_num(y2)}" fill="none" stroke="{colour}" stroke-width="1"{dash} marker-end="url(#arrow)"/>'
        )
        if text:
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2
            out.append(f'<text x="{_num(mx + 3)}" y="{_num(my)}" font-size="9" fill="{colour}">{escape(text)}</text>')
    return out


def _boxes(g: nx.DiGraph, boxes: Mapping[str, Box], at: _Placed) -> list[str]:
    """Each node's box, its first line bold, with its tooltip."""
    out = []
    for v in g.nodes:
        cx, y0 = at.where[v]
        b, w = boxes[v], at.box_w[v]
        x0 = cx - w / 2
        out.append(f"<g><title>{escape(b.tooltip or chr(10).join(b.lines))}</title>")
        out.append(
            f'<rect x="{_num(x0)}" y="{_num(y0)}" width="{_num(w)}" height="{at.box_h[v]}" rx="5" '
            f'fill="{b.fill}" stroke="#444"/>'
        )
        for i, line in enumerate(b.lines):
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(
                f'<text x="{_num(cx)}" y="{_num(y0 + 15 + 15 * i)}" text-anchor="middle"{weight}>{escape(line)}</text>'
            )
        out.append("</g>")
    return out


def _legend_rows(legend: Sequence[tuple[str, str]], width: float) -> list[list[tuple[str, str]]]:
    rows: list[list[tuple[str, str]]] = []
    x = width + 1
    limit = max(width, 600)
    for item in legend:
        w = _text_w(item[0]) + 34
        if not rows or x + w > limit:
            rows.append([])
            x = 0.0
        rows[-1].append(item)
        x += w
    return rows
