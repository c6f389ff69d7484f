"""ZeRO-1/2's all-gathers after the step, left in flight for the next Forward: the rank graph waits for each
bucket's right before its first reader (:func:`primepar_fx.runtime.zero.await_before_uses`), and Forward reads the
stepped values. Training with it is checked on gloo ranks in ``tests/compiler/test_distributed.py``."""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.runtime.zero import AwaitGather, PendingGathers, await_before_uses

aten = torch.ops.aten


class _Landing:
    """An all-gather in flight: writes ``value`` into ``param`` when waited for, and logs that it did."""

    def __init__(self, param: torch.Tensor, value: torch.Tensor, log: list[str], name: str) -> None:
        self.param, self.value, self.log, self.name = param, value, log, name

    def wait(self) -> None:
        self.param.copy_(self.value)
        self.log.append(self.name)


def _graph() -> fx.GraphModule:
    """``relu(x @ w1.T + b1) @ w2.T``: buckets 0 (``w2``, read last) and 1 (``w1``, ``b1``)."""
    g = fx.Graph()
    w1, b1, w2, x = (g.placeholder(n) for n in ("w1", "b1", "w2", "x"))
    h = g.call_function(
        aten.relu.default, (g.call_function(aten.addmm.default, (b1, x, g.call_function(aten.t.default, (w1,)))),)
    )
    g.output(g.call_function(aten.mm.default, (h, g.call_function(aten.t.default, (w2,)))))
    return fx.GraphModule(torch.nn.Module(), g)


def _where(gm: fx.GraphModule) -> list[str]:
    return [
        f"await{n.args[0]}" if n.op == "call_module" else str(n.target).split(".")[1]
        for n in gm.graph.nodes
        if n.op in ("call_module", "call_function")
    ]


def test_each_bucket_is_waited_for_right_before_its_first_reader():
    gm, gathers = _graph(), PendingGathers()
    assert await_before_uses(gm, {"w1": 1, "b1": 1, "w2": 0}, gathers) == 2
    assert gathers.order == [1, 0]  # the order Forward first reads them: the order the step issues them in
    assert _where(gm) == ["await1", "t", "addmm", "relu", "await0", "t", "mm"]
    assert all(isinstance(gm.get_submodule(n.target), AwaitGather) for n in gm.graph.nodes if n.op == "call_module")


def test_forward_reads_the_stepped_values_and_leaves_nothing_in_flight():
    gm, gathers = _graph(), PendingGathers()
    await_before_uses(gm, {"w1": 1, "b1": 1, "w2": 0}, gathers)
    torch.manual_seed(0)
    old = [torch.randn(4, 3), torch.randn(4), torch.randn(2, 4)]
    new = [torch.randn(4, 3), torch.randn(4), torch.randn(2, 4)]
    x = torch.randn(5, 3)
    params = [t.clone() for t in old]  # what the ranks hold before the step's all-gathers land
    log: list[str] = []
    gathers.add(1, _Landing(params[0], new[0], log, "w1"))
    gathers.add(0, _Landing(params[2], new[2], log, "w2"))
    params[1].copy_(new[1])  # b1's bucket 1 lands with w1's: the fake writes w1 only
    assert gathers.in_flight == 2
    out = gm(*params, x)
    expected = torch.relu(x @ new[0].T + new[1]) @ new[2].T
    torch.testing.assert_close(out, expected)
    assert log == ["w1", "w2"] and gathers.in_flight == 0
    gathers.wait(0)  # nothing in flight: a no-op
    gathers.add(0, _Landing(params[2], old[2], log, "again"))
    gathers.settle()
    assert log[-1] == "again" and gathers.in_flight == 0
