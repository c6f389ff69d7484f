"""``primepar_fx.cost.matmul_overlap``: what overlapping a re-layout with the linears beside it hides, and its rules.

That the pass fuses exactly the edges priced here is ``tests/passes/test_overlap.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.cost.matmul_overlap import LINEAR, feeds_linears, linear_into, rows_only
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.baselines import megatron_assignment
from primepar_fx.pricing import price as pricing
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.summary import summarize

MODEL, WORLD, BATCH, SEQ = "llama-tiny", 4, 4, 16
VALUES, OPTS = {B: BATCH, S: SEQ}, CostOptions()
aten = torch.ops.aten


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config(MODEL), BATCH, SEQ)
    return analyze(build(MODEL, device="meta"), args, kwargs, name=MODEL)


def priced(sp: bool = True, overlap: bool = True, share: float = 1.0):
    spec = dataclasses.replace(load_cluster("cpu-gloo"), matmul_overlap=share)
    mesh = spec.mesh(WORLD)
    assignment = megatron_assignment(graph(), mesh, dp=1, sequence_parallel=sp, values=VALUES)
    if overlap:
        return price_graph(graph(), mesh, spec, VALUES, OPTS, fixed=assignment)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pricing, "overlap_saving", lambda *a, **k: None)
        return price_graph(graph(), mesh, spec, VALUES, OPTS, fixed=assignment)


def step_s(p) -> float:
    return summarize(graph(), p, dict.fromkeys(p.strategies, 0), OPTS).predicted.step_time_s


# ------------------------------------------------------------------------------------------------ the rules
def test_rows_only_asks_every_device_for_the_whole_last_dim() -> None:
    by_rows = tuple((((0, 4),), ((r * 4, r * 4 + 4),), ((0, 8),)) for r in range(4))
    by_columns = tuple((((0, 4),), ((0, 16),), ((r * 2, r * 2 + 2),)) for r in range(4))
    assert rows_only(by_rows, None) and not rows_only(by_rows, by_columns)


def test_a_gather_needs_every_reader_to_be_a_linear_reading_it_as_its_input() -> None:
    qkv = [(LINEAR, ("norm", None)), (LINEAR, ("norm", None, None))]
    assert feeds_linears("norm", qkv)
    assert not feeds_linears("norm", [*qkv, (aten.add.Tensor, ("norm", "x"))])  # a residual reads it too
    assert not feeds_linears("norm", [(LINEAR, ("x", "norm"))])  # as a weight
    assert not feeds_linears("norm", [])


def test_a_scatter_needs_a_linear_with_one_reader() -> None:
    assert linear_into("o", LINEAR, [(aten.add.Tensor, ("x", "o"))])
    assert not linear_into("o", LINEAR, [(aten.add.Tensor, ("x", "o")), (aten.mul.Tensor, ("o", "o"))])
    assert not linear_into("o", aten.mm.default, [(aten.add.Tensor, ("x", "o"))])


# ------------------------------------------------------------------------------------------------ the prices
def _layer_edges(p) -> dict[str, tuple[str, str]]:
    """The first layer's priced edges by role: q's gather, o's scatter."""
    nodes = graph().nodes
    linears = [n for n in nodes if nodes[n].target is LINEAR]
    q, o = linears[0], linears[3]
    (gather,) = [e for e in p.overlap if e[1] == q]
    (scatter,) = [e for e in p.overlap if e[0] == o]
    return {"gather": gather, "scatter": scatter}


def test_a_gather_hides_its_re_layout_under_the_rows_held_and_its_reduce_scatter_under_the_weight_gradient() -> None:
    p, plain = priced(), priced(overlap=False)
    u, v = _layer_edges(p)["gather"]
    cost, saving = p.node_costs[v][0], p.overlap[(u, v)]
    forward_s, backward_s, gradient_s = cost.phase_s
    relayout = float(plain.flows[(u, v)].forward_s[0, 0])  # the all-gather of the sequence-split norm output
    rs = float(p.scatter[(u, v)].backward_rs_s[0, 0])
    assert saving.forward_relayout_s[0, 0] == pytest.approx(min(relayout, forward_s / WORLD))  # its quarter of the rows
    assert saving.consumer_s[0, 0] == pytest.approx(min(rs, backward_s / WORLD + gradient_s))
    assert saving.producer_s[0, 0] == saving.backward_relayout_s[0, 0] == 0


def test_a_scatter_hides_its_reduce_scatter_under_its_own_rows_and_the_gradient_s_gather_under_its_backward() -> None:
    p, plain = priced(), priced(overlap=False)
    u, v = _layer_edges(p)["scatter"]
    cost, saving = p.node_costs[u][0], p.overlap[(u, v)]
    forward_s, backward_s, gradient_s = cost.phase_s
    edge = float(plain.cost_graph.edge_cost[(u, v)][0, 0] + plain.scatter[(u, v)].forward_s[0, 0])
    gather = edge - float(plain.flows[(u, v)].forward_s[0, 0])  # the gradient's way back
    rs = float(p.scatter[(u, v)].forward_rs_s[0, 0])
    assert saving.producer_s[0, 0] == pytest.approx(min(rs, forward_s / WORLD))
    assert saving.backward_relayout_s[0, 0] == pytest.approx(min(gather, (backward_s + gradient_s) / WORLD))
    assert saving.consumer_s[0, 0] == saving.forward_relayout_s[0, 0] == 0


def test_the_prediction_is_the_plain_one_less_what_the_overlap_hides() -> None:
    p, plain = priced(), priced(overlap=False)
    run = {
        e for e in p.overlap if not any(s.v == e[1] and s.u == e[0] for s in p.not_run(dict.fromkeys(p.strategies, 0)))
    }
    hidden = sum(float(p.overlap[e].seconds[0, 0]) for e in run)
    assert hidden > 0
    assert step_s(p) == pytest.approx(step_s(plain) - hidden, rel=1e-12)
    nodes = {n.name: n.cost for n in summarize(graph(), p, dict.fromkeys(p.strategies, 0), OPTS).nodes}
    assert all(c.collective_s >= 0 and c.redistribution_s >= 0 for c in nodes.values())


def test_without_sequence_parallelism_nothing_is_hidden() -> None:
    p = priced(sp=False)
    assert not p.overlap and np.isclose(step_s(p), step_s(priced(sp=False, overlap=False)))


def test_a_recomputed_forward_hides_its_transfers_again() -> None:
    """``megatron-sp`` recomputing every layer: the fused pairs run again in Backward and hide the same; every node's
    seconds stay non-negative (the plan validates them) and the bytes are the plain prediction's."""
    from primepar_fx.planning.forced import forced_plan

    def plans(recompute: str):
        sizes = {"world_size": WORLD, "cluster": "cpu-gloo", "batch": BATCH, "seq": SEQ, "recompute": recompute}
        with_overlap = forced_plan(graph(), "megatron-sp", **sizes)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(pricing, "overlap_saving", lambda *a, **k: None)
            plain = forced_plan(graph(), "megatron-sp", **sizes)
        assert with_overlap.search.config == plain.search.config
        assert with_overlap.predicted.comm_bytes == plain.predicted.comm_bytes
        return plain.predicted.step_time_s - with_overlap.predicted.step_time_s

    once, again = plans("none"), plans("full")
    assert once < again < 2 * once  # the Forward's part of it again, not all of it


def test_the_spec_says_how_much_of_it_the_compute_beside_a_transfer_hides() -> None:
    full, half = priced(), priced(share=0.5)
    for edge, saving in full.overlap.items():
        np.testing.assert_allclose(half.overlap[edge].seconds, saving.seconds / 2)
    assert not priced(share=0.0).overlap
    spec = dataclasses.replace(load_cluster("cpu-gloo"), matmul_overlap=0.25)
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert "matmul_overlap" not in load_cluster("cpu-gloo").to_json()  # the default: preset files unchanged
    with pytest.raises(ValueError, match="matmul_overlap must be a fraction"):
        dataclasses.replace(spec, matmul_overlap=1.5)
