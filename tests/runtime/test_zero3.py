"""ZeRO-3's graph pass: each unit of parameters gathered right before its first use and freed right after its last
use in Forward, a view's uses included (:func:`primepar_fx.runtime.zero3.gather_around_uses`). Training with it
is checked on gloo ranks in ``tests/compiler/test_distributed.py``."""

from __future__ import annotations

import torch
from torch import fx, nn

from primepar_fx.runtime.zero3 import GatherUnit, ReleaseUnit, gather_around_uses

aten = torch.ops.aten


class _Opaque(nn.Module):
    def forward(self, x):
        return x


class _Store:
    """What the pass reads of a store: nothing but what its nodes and recomputed layers call."""

    order: list[int] | None = None
    kept: tuple[int, ...] = ()

    def ensure(self, values):  # pragma: no cover - called only when a recomputed layer runs
        raise AssertionError

    def set_order(self, order):
        self.order = order

    def released_after_forward(self, index):
        return index not in self.kept


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    w, b, x, v = (g.placeholder(n) for n in ("w", "b", "x", "v"))
    t = g.call_function(aten.t.default, (w,))
    y = g.call_function(aten.mm.default, (x, t))
    z = g.call_function(aten.add.Tensor, (y, b))
    h = g.call_function(aten.relu.default, (z,))
    o = g.call_module("opaque", (v,))  # a submodule reading unit 2: what it returns may alias it
    s = g.call_function(aten.mul.Tensor, (h, o))
    g.output(s)
    root = nn.Module()
    root.opaque = _Opaque()
    return fx.GraphModule(root, g)


def _where(gm: fx.GraphModule) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), (GatherUnit, ReleaseUnit)):
            kind = "gather" if isinstance(gm.get_submodule(n.target), GatherUnit) else "release"
            out.append(f"{kind}{n.args[0]}" + ("(" + ",".join(a.name for a in n.args[1:]) + ")" if n.args[1:] else ""))
        elif n.op == "call_function":
            out.append(str(n.target).split(".")[1])  # aten.mm.default -> mm
        elif n.op == "call_module":
            out.append(n.target)
    return out


def test_units_are_gathered_before_first_use_and_freed_after_last_use_of_any_view():
    gm = _graph()
    store = _Store()
    assert gather_around_uses(gm, {"w": 2, "b": 0, "v": 1}, store) == 3
    assert store.order == [2, 0, 1]  # the order of first use: each gather prefetches the next
    assert _where(gm) == [
        "gather2",
        "t",
        "mm",  # the last use of w's view t: w freed after it
        "release2",
        "gather0",
        "add",
        "release0",
        "relu",
        "gather1",
        "opaque",
        "release1(opaque)",  # freed unless what the submodule returned lives in it
        "mul",
    ]


def test_a_unit_returned_as_an_output_is_left_to_the_end_of_forward():
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    view = g.call_function(aten.view.default, (w, [-1]))
    y = g.call_function(aten.mul.Tensor, (x, x))
    g.output((view, y))
    gm = fx.GraphModule(nn.Module(), g)
    assert gather_around_uses(gm, {"w": 0}, _Store()) == 0
    assert _where(gm) == ["view", "mul"]


def test_recomputed_layers_are_told_to_gather_what_they_read():
    gm = _graph()
    layer = _Opaque()
    layer.before_run = None
    gm.add_submodule("layer", layer)
    store = _Store()
    gather_around_uses(gm, {"w": 0}, store)
    assert layer.before_run == store.ensure


def test_a_unit_kept_whole_until_backward_gets_no_release():
    gm = _graph()
    store = _Store()
    store.kept = (1,)
    assert gather_around_uses(gm, {"w": 0, "b": 1}, store) == 2
    assert _where(gm) == ["gather0", "t", "mm", "release0", "gather1", "add", "relu", "opaque", "mul"]
    assert store.order == [0, 1]
