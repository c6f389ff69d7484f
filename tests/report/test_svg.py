"""The SVG pictures drawn without graphviz: bar charts and the layered graph drawing."""

from __future__ import annotations

import re
from xml.etree import ElementTree

import networkx as nx
import pytest

from primepar_fx.report.svg import Box, bar_chart, layer_rows, layered_graph, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


def _widths(svg: str) -> dict[str, float]:
    """Bar tooltip -> bar width."""
    root = ElementTree.fromstring(svg)
    return {
        r.find(f"{NS}title").text: float(r.get("width"))
        for r in root.iter(f"{NS}rect")
        if r.find(f"{NS}title") is not None
    }


@pytest.mark.parametrize(("top", "want"), [(0.37, 0.4), (7.3, 8.0), (123, 125.0), (1.0, 1.0), (0.0, 1.0)])
def test_ticks_are_round_and_reach_the_top(top, want):
    ticks = nice_ticks(top)
    assert ticks[0] == 0 and ticks[-1] == pytest.approx(want) and ticks[-1] >= top
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1


def test_stacked_bars_are_proportional_to_their_values():
    svg = bar_chart("t <&>", ["a", "b"], {"x": [1.0, 3.0], "y": [2.0, 0.0]}, "ms", marker=("budget", 4.0))
    w = _widths(svg)
    assert w["a: x 1 ms"] * 2 == pytest.approx(w["a: y 2 ms"], abs=0.1)
    assert w["b: x 3 ms"] == pytest.approx(w["a: x 1 ms"] * 3, abs=0.1)
    assert "b: y 0 ms" not in w, "a zero value draws no bar"
    assert "t &lt;&amp;&gt;" in svg and ">budget<" in svg


def test_bad_series_are_refused():
    with pytest.raises(ValueError, match="series 'x' has 1 values for 2 categories"):
        bar_chart("t", ["a", "b"], {"x": [1.0]}, "ms")
    with pytest.raises(ValueError, match="negative"):
        bar_chart("t", ["a"], {"x": [-1.0]}, "ms")


def test_rows_follow_the_longest_path_and_sweeps_untangle_crossings():
    g = nx.DiGraph([("a", "c"), ("b", "d"), ("c", "e"), ("a", "e"), ("d", "f")])
    rows = layer_rows(g)
    assert [set(r) for r in rows] == [{"a", "b"}, {"c", "d"}, {"e", "f"}]
    # crossing: a->y, b->x with x before y in program order
    g = nx.DiGraph()
    g.add_nodes_from(["a", "b", "x", "y"])
    g.add_edges_from([("a", "y"), ("b", "x")])
    assert layer_rows(g) == [["a", "b"], ["y", "x"]]
    with pytest.raises(ValueError, match="acyclic"):
        layer_rows(nx.DiGraph([("a", "b"), ("b", "a")]))


def test_the_graph_drawing_has_every_node_and_labelled_edge_and_escapes_names():
    g = nx.DiGraph([("x<1>", "mm"), ("mm", "out")])
    boxes = {v: Box((v, "op", "B,R"), "#abcdef") for v in g.nodes}
    svg = layered_graph(g, boxes, title="t", edge_labels={("x<1>", "mm"): "1k B"}, legend=[("B,R (3 nodes)", "#abc")])
    root = ElementTree.fromstring(svg)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert {"x<1>", "mm", "out", "1k B", "B,R (3 nodes)"} <= set(texts)
    assert len(re.findall(r"<path d=\"M[^\"]* C", svg)) == 2
    ys = {t.text: float(t.get("y")) for t in root.iter(f"{NS}text") if t.get("font-weight") == "bold"}
    assert ys["x<1>"] < ys["mm"] < ys["out"], "drawn top to bottom"
