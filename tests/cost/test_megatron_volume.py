"""A Megatron plan's predicted communication volume per layer against the closed-form Megatron-LM formula.

Megatron-LM tensor parallelism over ``t`` devices (Shoeybi et al. 2019; Korthikanti et al. 2022) moves, per
transformer layer and per device, with ``B*S*h`` the size of one activation of the residual stream:

* **without sequence parallelism**: 4 all-reduces of ``B*S*h`` elements, 2 in Forward (after the attention output
  projection and the MLP down projection, both row-parallel) and 2 in Backward (the input gradients of the QKV and
  MLP-up projections, both column-parallel). A ring all-reduce sends ``2(t-1)/t`` of its buffer, so the layer sends
  ``4 * 2(t-1)/t * B*S*h * itemsize`` bytes, and nothing is redistributed between operators.
* **with sequence parallelism**: each all-reduce becomes a reduce-scatter plus an all-gather. Forward all-gathers
  the sequence-split input of the QKV and MLP-up projections and reduce-scatters the outputs of the two row-parallel
  projections; Backward mirrors it. That is 4 all-gathers and 4 reduce-scatters of ``B*S*h``, each sending
  ``(t-1)/t`` of it: ``8 * (t-1)/t * B*S*h * itemsize``, the same volume as without SP.

Our side, for the nodes of one layer under ``megatron_assignment`` (dp=1, mp=t): (a) the Forward and Backward
collectives that :func:`~primepar_fx.partition.collectives` derives from the DSIs, each an all-reduce sending
``2(g-1)/g`` of the local result block (g = its group size); (b) the Forward and Backward redistribution traffic
(:func:`~primepar_fx.cost.redistribute.redistribution`, Eq. 9) on every edge into the layer's nodes. Weight-gradient
(Gradient phase) collectives are data-parallel traffic and not part of the formula; with dp=1 there are none inside
the layer except, with SP, the norms' parameter-gradient all-reduce (Megatron has it too), which is left out.

A layer is the run of nodes, in graph (topological) order, from the first node with a ``blocks.0.`` parameter (the
attention norm) up to, not including, the first later node with a parameter outside ``blocks.0`` (the next block's
attention norm). Its edges are those whose consumer is in the run, so the edges that enter a layer from the previous
layer's residual output are counted once, with the layer that reads them. Layer 1 is checked to give the same
volume as layer 0.

Without SP our volume equals the closed form exactly. With SP the all-gathers are priced exactly (as
redistribution traffic). Our IR derives an all-reduce for each row-parallel output and each column-parallel input
gradient, followed by a free slice into (or out of) the sequence-split neighbour; the cost model recognises each
such pair as one reduce-scatter (:mod:`primepar_fx.cost.scatter`, which the graph passes emit), so (c) we take
off what a reduce-scatter saves over the all-reduce, and the volume equals the closed form exactly as well. (The
row-parallel bias is then added to the scattered piece and its gradient all-reduced in the Gradient phase, as in
Megatron-LM; like the norm weights', that is left out of the formula.)
"""

from __future__ import annotations

import functools
from fractions import Fraction
from math import prod

import pytest
import sympy

import primepar_fx
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.redistribute import redistribution
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh, OpPartition, Phase, collectives
from primepar_fx.partition.comm import phase_tensors
from primepar_fx.planning.baselines import classify_linears, megatron_assignment
from primepar_fx.pricing.price import out_index, price_graph

MODEL = "gpt2-tiny"
VALUES = {B: 8, S: 32}
OPTS = CostOptions(dtype="fp32")
ITEMSIZE = OPTS.itemsize
WORLDS = (2, 4)


@functools.cache
def graph() -> OpGraph:
    config = get_config(MODEL)
    assert config.fused_qkv, "the test is about the fused-QKV GPT-2 layout"
    model = build(config)
    args, kwargs = example_inputs(config, 2, 16)
    return primepar_fx.analyze(model, args, kwargs, name=MODEL)


def layer_nodes(g: OpGraph, k: int) -> list[str]:
    """Nodes of transformer layer ``k``: from its first ``blocks.k.`` parameter to the next foreign parameter."""
    prefix = f"blocks.{k}."
    names = list(g.nodes)
    start = next(i for i, n in enumerate(names) if any(p.startswith(prefix) for p in g.nodes[n].params))
    end = next(
        i
        for i in range(start + 1, len(names))
        if g.nodes[names[i]].params and not all(p.startswith(prefix) for p in g.nodes[names[i]].params)
    )
    return names[start:end]


def residual_elems(g: OpGraph) -> int:
    """``B*S*h`` at VALUES, read from the graph: the output of the layer's first norm."""
    config = get_config(MODEL)
    norm = layer_nodes(g, 0)[0]
    (shape,) = g.nodes[norm].out_shapes
    elems = int(sympy.sympify(prod(shape)).subs(VALUES))
    assert elems == VALUES[B] * VALUES[S] * config.hidden
    return elems


def _tmap(op, name: str):
    return next(pt.tmap for tensors in phase_tensors(op).values() for pt in tensors if pt.name == name)


def _block_elems(part: OpPartition, tmap) -> int:
    return int(sympy.sympify(prod(part.local_shape(tmap), start=sympy.Integer(1))).subs(VALUES))


def collective_bytes(g: OpGraph, plan, mesh: DeviceMesh, nodes: list[str], phases) -> list[Fraction]:
    """Per device (rank order): bytes the collectives of ``nodes`` in ``phases`` send (ring all-reduce bus factor)."""
    out = [Fraction(0)] * mesh.size
    for name in nodes:
        part = OpPartition(g.nodes[name].dims, plan[name], mesh)
        for c in collectives(part):
            if c.phase not in phases:
                continue
            assert c.kind == "all-reduce", c
            group = prod(mesh.digits[p] for p in c.digits)
            sent = Fraction(2 * (group - 1), group) * _block_elems(part, _tmap(part.op, c.tensor)) * ITEMSIZE
            out = [v + sent for v in out]  # every device holds a block of the same size and joins one group
    return out


def layer_edges(g: OpGraph, nodes: list[str]):
    """``(producer, out index, consumer, in index)`` of every data edge into ``nodes`` (as price_graph walks them)."""
    inside = set(nodes)
    for u, v, data in g.graph.edges(data=True):
        pu, pv = g.nodes[u], g.nodes[v]
        k_in = data["dst_in"]
        if v in inside and pv.dims.inputs[k_in] is not None and pu.dims.outputs:
            yield u, out_index(pv), v, k_in


def redistribution_bytes(g: OpGraph, plan, mesh: DeviceMesh, nodes: list[str]) -> tuple[list[int], list[int], dict]:
    """Per device: Forward and Backward redistribution bytes on the layer's edges; plus the edges that move data."""
    fwd, bwd, moving = [0] * mesh.size, [0] * mesh.size, {}
    for u, j, v, k in layer_edges(g, nodes):
        r = redistribution(
            OpPartition(g.nodes[u].dims, plan[u], mesh), j, OpPartition(g.nodes[v].dims, plan[v], mesh), k, VALUES
        )
        fwd = [a + b * ITEMSIZE for a, b in zip(fwd, r.per_device_forward)]
        bwd = [a + b * ITEMSIZE for a, b in zip(bwd, r.per_device_backward)]
        if r.total_elems:
            moving[(u, v)] = (r.forward_elems * ITEMSIZE, r.backward_elems * ITEMSIZE)
    return fwd, bwd, moving


def megatron_closed_form(t: int) -> Fraction:
    """Per device and layer: 4 all-reduces of B*S*h (no SP) = 4 all-gathers + 4 reduce-scatters (SP)."""
    bsh = VALUES[B] * VALUES[S] * get_config(MODEL).hidden
    return 4 * Fraction(2 * (t - 1), t) * bsh * ITEMSIZE


def scattered_bytes(g: OpGraph, plan, mesh: DeviceMesh, nodes: list[str]) -> tuple[Fraction, int]:
    """Per device: what the all-reduces of ``nodes`` that became reduce-scatters save (an all-reduce sends twice a
    reduce-scatter's bytes, so the saving is what the reduce-scatter sends), and how many fused."""
    pg = price_graph(g, mesh, load_cluster("v100-paper"), VALUES, OPTS, fixed=plan)
    inside, saved, count = set(nodes), Fraction(0), 0
    for (u, v), sav in pg.scatter.items():
        for owner, rs in ((u, sav.forward_scattered), (v, sav.backward_scattered)):
            if owner in inside and rs[0, 0]:
                saved += int(rs[0, 0])
                count += 1
    return saved, count


@functools.cache
def measured(t: int, sp: bool, layer: int = 0) -> dict:
    g, mesh = graph(), DeviceMesh.for_world_size(t)
    plan = megatron_assignment(g, mesh, dp=1, sequence_parallel=sp, values=VALUES)
    assert not plan.fallbacks, plan.fallbacks
    nodes = layer_nodes(g, layer)
    all_reduced = collective_bytes(g, plan, mesh, nodes, (Phase.FORWARD, Phase.BACKWARD))
    saved, fused = scattered_bytes(g, plan, mesh, nodes)
    coll = [c - saved for c in all_reduced]
    fwd, bwd, moving = redistribution_bytes(g, plan, mesh, nodes)
    per_device = [c + f + b for c, f, b in zip(coll, fwd, bwd)]
    assert len(set(per_device)) == 1, f"devices differ: {per_device}"
    return {
        "plan": plan,
        "nodes": nodes,
        "all_reduced": all_reduced[0],
        "scattered": saved,
        "fused": fused,
        "collective": coll[0],
        "redistribution": fwd[0] + bwd[0],
        "redistribution_fwd": fwd[0],
        "redistribution_bwd": bwd[0],
        "moving": moving,
        "total": per_device[0],
    }


# ------------------------------------------------------------------------------------------------ the layer
def test_a_layer_is_one_block_with_a_fused_qkv_projection():
    g = graph()
    nodes = layer_nodes(g, 0)
    params = {p.rsplit(".", 1)[0] for n in nodes for p in g.nodes[n].params}
    assert params == {
        "blocks.0.attn_norm",
        "blocks.0.attn.qkv_proj",
        "blocks.0.attn.o_proj",
        "blocks.0.mlp_norm",
        "blocks.0.mlp.up_proj",
        "blocks.0.mlp.down_proj",
    }
    styles = classify_linears(g)
    assert len([n for n in nodes if n in styles]) == 4
    # the layer ends with the residual add that feeds the next block's norm
    assert g.nodes[nodes[-1]].dims.kind == "pointwise"
    assert len(layer_nodes(g, 1)) == len(nodes)


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_fused_qkv_heads_are_split_without_fallbacks(t, sp):
    """The fused linear is column-parallel and its view / unbind / transposes / SDPA split the heads."""
    g = graph()
    plan = measured(t, sp)["plan"]
    styles = classify_linears(g)
    qkv = next(n for n in layer_nodes(g, 0) if any(".qkv_proj." in p for p in g.nodes[n].params))
    assert styles[qkv] == "column"
    assert str(plan[qkv]) == ",".join(["K"] * len(DeviceMesh.for_world_size(t).digits))
    # every node between the fused projection and the attention output projection is on the head split
    nodes = layer_nodes(g, 0)
    o_proj = next(n for n in nodes if any(".o_proj." in p for p in g.nodes[n].params))
    region = nodes[nodes.index(qkv) + 1 : nodes.index(o_proj)]
    kinds = {g.nodes[n].dims.kind for n in region}
    assert "attention" in kinds and "view" in kinds
    for n in region:
        assert plan.roles[n] == "tensor-parallel", (n, plan.roles[n])
        assert all(getattr(e, "dim", None) is not None for e in plan[n].elements), (n, str(plan[n]))


# ------------------------------------------------------------------------------------------------ without SP
@pytest.mark.parametrize("t", WORLDS)
def test_megatron_volume_per_layer_equals_the_closed_form(t):
    m = measured(t, False)
    assert m["redistribution"] == 0, m["moving"]
    assert m["collective"] == megatron_closed_form(t)
    assert m["total"] == megatron_closed_form(t)


@pytest.mark.parametrize("t", WORLDS)
def test_megatron_all_reduces_sit_where_megatron_puts_them(t):
    """2 Forward all-reduces at the row-parallel outputs, 2 Backward ones at the column-parallel inputs."""
    g, mesh = graph(), DeviceMesh.for_world_size(t)
    m = measured(t, False)
    styles = classify_linears(g)
    found = []
    for n in m["nodes"]:
        for c in collectives(OpPartition(g.nodes[n].dims, m["plan"][n], mesh)):
            if c.phase is not Phase.GRADIENT:
                found.append((styles.get(n, n), c.phase, c.tensor))
    assert sorted(found, key=str) == sorted(
        [("row", Phase.FORWARD, "out0")] * 2 + [("column", Phase.BACKWARD, "d_in0")] * 2, key=str
    )


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_every_layer_has_the_same_volume(t, sp):
    assert measured(t, sp, 1)["total"] == measured(t, sp, 0)["total"]


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_the_planner_prices_the_same_bytes(t, sp):
    """price_graph(fixed=plan) counts the same collective and edge bytes as this test (over all devices)."""
    g, mesh = graph(), DeviceMesh.for_world_size(t)
    m = measured(t, sp)
    pg = price_graph(g, mesh, load_cluster("v100-paper"), VALUES, OPTS, fixed=m["plan"])
    every_phase = collective_bytes(g, m["plan"], mesh, m["nodes"], tuple(Phase))[0]
    priced = sum(pg.node_costs[n][0].comm_bytes.get("all-reduce", 0) for n in m["nodes"])
    assert priced == pytest.approx(float(every_phase), abs=len(m["nodes"]))  # NodeCost rounds each collective
    edges = {(u, v) for u, _, v, _ in layer_edges(g, m["nodes"])}
    assert sum(int(pg.edge_bytes[e][0, 0]) for e in edges) == m["redistribution"] * mesh.size


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_gradient_phase_collectives_left_out_are_only_the_sp_norm_weights(t, sp):
    """What the formula leaves out: no weight-gradient collective at dp=1, except the norms' parameters under SP."""
    g, mesh = graph(), DeviceMesh.for_world_size(t)
    m = measured(t, sp)
    reduced = {
        n
        for n in m["nodes"]
        for c in collectives(OpPartition(g.nodes[n].dims, m["plan"][n], mesh))
        if c.phase is Phase.GRADIENT
    }
    assert {g.nodes[n].dims.kind for n in reduced} == ({"norm"} if sp else set())


# ------------------------------------------------------------------------------------------------ with SP
@pytest.mark.parametrize("t", WORLDS)
def test_sequence_parallel_all_gathers_are_priced_exactly(t):
    """The 4 all-gathers are redistribution traffic: the sequence-split input of each column-parallel linear in
    Forward, the gradient of each row-parallel linear's output in Backward; each moves (t-1)/t of B*S*h."""
    g = graph()
    m = measured(t, True)
    styles = classify_linears(g)
    bsh = residual_elems(g)
    gather = Fraction(t - 1, t) * bsh * ITEMSIZE
    assert m["redistribution_fwd"] == 2 * gather and m["redistribution_bwd"] == 2 * gather
    assert m["redistribution"] == megatron_closed_form(t) / 2  # the all-gather half of the closed form
    moving = m["moving"]
    assert len(moving) == 4
    fwd_into = sorted(styles[v] for (u, v), (f, b) in moving.items() if f and not b)
    bwd_out_of = sorted(styles[u] for (u, v), (f, b) in moving.items() if b and not f)
    assert fwd_into == ["column", "column"] and bwd_out_of == ["row", "row"]


@pytest.mark.parametrize("t", WORLDS)
def test_sequence_parallel_all_reduces_become_four_reduce_scatters(t):
    """The row-parallel outputs (Forward) and column-parallel input gradients (Backward) are the no-SP all-reduces,
    and under SP all four fuse with the sequence slice after them: each then sends (t-1)/t of B*S*h."""
    bsh = residual_elems(graph())
    with_sp, without = measured(t, True), measured(t, False)
    assert with_sp["all_reduced"] == without["collective"] == megatron_closed_form(t)
    assert without["fused"] == 0 and with_sp["fused"] == 4
    assert with_sp["scattered"] == 4 * Fraction(t - 1, t) * bsh * ITEMSIZE
    assert with_sp["collective"] == megatron_closed_form(t) / 2  # the reduce-scatter half of the closed form


@pytest.mark.parametrize("t", WORLDS)
def test_sequence_parallel_volume_per_layer_equals_the_closed_form(t):
    assert measured(t, True)["total"] == megatron_closed_form(t) == measured(t, False)["total"]
