"""Megatron-LM and data-parallel baselines expressed in our IR (primepar_fx.planning.baselines).

Every plan must be legal on the mesh for every node of the reference and Hugging Face tiny models; the
column/row classification must match Megatron's on GPT-2 (by structure, not names); and the collectives our DSIs
derive for the Megatron plan must be Megatron's: a Forward all-reduce after each row-parallel linear, a Backward
all-reduce before each column-parallel one, and data-parallel traffic only for reductions over the batch.
"""

from __future__ import annotations

import functools

import pytest
import sympy
import torch
from torch import nn

import primepar_fx
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, build_hf_tiny, example_inputs, hf_example_inputs
from primepar_fx.partition import (
    DeviceMesh,
    OpPartition,
    PartitionError,
    PartitionSeq,
    collectives,
    enumerate_sequences,
)
from primepar_fx.partition.comm import phase_tensors
from primepar_fx.planning import baselines as bl

VALUES = {B: 8, S: 16}
REFERENCE = ["gpt2-tiny", "llama-tiny", "opt-tiny", "bloom-tiny"]
HF = ["hf-gpt2", "hf-llama", "hf-opt", "hf-bloom"]
MESHES = {4: DeviceMesh((2, 2)), 8: DeviceMesh((2, 2, 2))}


@functools.cache
def graph_of(name: str):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
        model = build_hf_tiny(name[3:])
        args, kwargs = hf_example_inputs(model, 2, 16)
    else:
        model = build(name)
        args, kwargs = example_inputs(model.config, 2, 16)
    return primepar_fx.analyze(model, args, kwargs)


@functools.cache
def legal_seqs(name: str, world: int, node: str) -> frozenset[str]:
    return frozenset(str(s) for s in enumerate_sequences(graph_of(name).nodes[node].dims, MESHES[world], values=VALUES))


def module_of(graph, node: str) -> str:
    """The module path of a linear's weight, e.g. ``blocks.0.attn.q_proj``."""
    return next(p for p in graph.nodes[node].params if p.endswith("weight")).rsplit(".", 1)[0]


# ------------------------------------------------------------------------------------------------ legality
@pytest.mark.parametrize("name", REFERENCE + HF)
@pytest.mark.parametrize("world", [4, 8])
def test_every_plan_is_legal_for_every_node(name, world):
    g, mesh = graph_of(name), MESHES[world]
    plans = [bl.megatron_assignment(g, mesh, values=VALUES, **cfg) for cfg in bl.megatron_configs(mesh)]
    plans.append(bl.data_parallel_assignment(g, mesh, values=VALUES))
    for plan in plans:
        assert set(plan) == set(g.nodes)
        for node, seq in plan.items():
            OpPartition(g.nodes[node].dims, seq, mesh)
            assert str(seq) in legal_seqs(name, world, node), (plan.config, node, str(seq))


def test_configs_cover_every_digit_prefix():
    cfgs = [(c["dp"], c["mp"], c["sequence_parallel"]) for c in bl.megatron_configs(MESHES[4])]
    assert cfgs == [(1, 4, False), (1, 4, True), (2, 2, False), (2, 2, True), (4, 1, False)]
    assert [c["dp"] for c in bl.megatron_configs(MESHES[8])] == [1, 1, 2, 2, 4, 4, 8]
    assert sorted({c["dp"] for c in bl.megatron_configs(DeviceMesh((3, 2, 2)))}) == [1, 3, 6, 12]
    assert bl.config_name(bl.megatron_configs(MESHES[8])[3]) == "megatron dp2 x mp4 +SP"


def test_dp_must_be_a_digit_prefix():
    g = graph_of("gpt2-tiny")
    with pytest.raises(ValueError, match="leading device digits"):
        bl.megatron_assignment(g, DeviceMesh((3, 2, 2)), dp=2)
    with pytest.raises(ValueError, match="world size"):
        bl.megatron_assignment(g, MESHES[4], dp=2, mp=4)
    assert bl.dp_digits(DeviceMesh((3, 2, 2)), 6) == 2


# ------------------------------------------------------------------------------------------------ classification
def test_gpt2_tiny_column_and_row_linears():
    g = graph_of("gpt2-tiny")
    styles = {module_of(g, n).split(".")[-1]: set() for n in bl.classify_linears(g)}
    for n, style in bl.classify_linears(g).items():
        styles[module_of(g, n).split(".")[-1]].add(style)
    assert styles == {
        "qkv_proj": {"column"},
        "up_proj": {"column"},
        "o_proj": {"row"},
        "down_proj": {"row"},
        "lm_head": {"column"},
    }
    assert {lin.how for lin in bl._analyse(g).linears.values()} == {"structure"}


def test_hf_gpt2_conv1d_linears():
    g = graph_of("hf-gpt2")
    by_module = {module_of(g, n).split(".", 3)[-1]: s for n, s in bl.classify_linears(g).items()}
    assert by_module["attn.c_attn"] == "column"
    assert by_module["attn.c_proj"] == "row"
    assert by_module["mlp.c_fc"] == "column"
    assert by_module["mlp.c_proj"] == "row"
    assert by_module["lm_head"] == "column"


@pytest.mark.parametrize("name", ["llama-tiny", "hf-llama", "hf-opt", "hf-bloom"])
def test_classification_matches_megatron_names(name):
    g = graph_of(name)
    row = {"o_proj", "out_proj", "down_proj", "fc2", "dense", "dense_4h_to_h"}
    for n, style in bl.classify_linears(g).items():
        assert style == ("row" if module_of(g, n).split(".")[-1] in row else "column"), n


class _Misnamed(nn.Module):
    """An MLP whose up projection is called ``o_proj`` and down projection ``q_proj``."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16) if norm else nn.Identity()
        self.o_proj = nn.Linear(16, 64)
        self.q_proj = nn.Linear(64, 16)

    def forward(self, x):
        return self.q_proj(torch.relu(self.o_proj(self.norm(x)))).sum()


def test_classification_is_structural_and_names_only_break_ties():
    g = primepar_fx.analyze(_Misnamed(), (torch.randn(2, 8, 16),))
    assert bl.classify_linears(g) == {"linear": "column", "linear_1": "row"}
    # the first linear reads the raw input: the structure says nothing, so the name "o_proj" decides
    g = primepar_fx.analyze(_Misnamed(norm=False), (torch.randn(2, 8, 16),))
    assert bl.classify_linears(g) == {"linear": "row", "linear_1": "row"}
    assert bl._analyse(g).linears["linear"].how == "name hint"


# ------------------------------------------------------------------------------------------------ collectives
def _has_batch(op, name: str, phase) -> bool:
    tmap = next(pt.tmap for pt in phase_tensors(op)[phase] if pt.name == name)
    return any(B in sympy.sympify(op.size(d)).free_symbols for d in op.dims_of(tmap))


@pytest.mark.parametrize("name", REFERENCE + HF)
def test_megatron_collectives_at_mp4(name):
    g, mesh = graph_of(name), MESHES[4]
    plan = bl.megatron_assignment(g, mesh, dp=1, values=VALUES)
    linears = bl._analyse(g).linears
    assert len(linears) >= 5
    for node, seq in plan.items():
        fb = {(c.phase.value, c.tensor, c.digits) for c in collectives(OpPartition(g.nodes[node].dims, seq, mesh))}
        fb = {c for c in fb if c[0] != "G"}
        lin = linears.get(node)
        if lin is not None and lin.style == "row":
            assert fb == {("F", "out0", (0, 1))}, node
        elif lin is not None:
            assert fb == {("B", f"d_in{lin.act_input}", (0, 1))}, node
        elif plan.roles[node] not in ("vocab", "vocab-loss"):
            assert not fb, (node, str(seq), fb)


@pytest.mark.parametrize("name", REFERENCE + HF)
@pytest.mark.parametrize(("world", "dp"), [(4, 2), (8, 2), (8, 4)])
def test_data_parallel_digits_only_reduce_over_the_batch(name, world, dp):
    """A collective over a DP digit is a weight-gradient all-reduce, or reduces a tensor without a batch dim
    (a broadcast position embedding's gradient, the scalar loss); linears have only the weight-gradient kind."""
    g, mesh = graph_of(name), MESHES[world]
    dp_pos = set(range(bl.dp_digits(mesh, dp)))
    for sp in (False, True):
        plan = bl.megatron_assignment(g, mesh, dp=dp, sequence_parallel=sp, values=VALUES)
        for node, seq in plan.items():
            op = g.nodes[node].dims
            for c in collectives(OpPartition(op, seq, mesh)):
                if not dp_pos & set(c.digits):
                    continue
                weight = c.phase.value == "G" and c.tensor in {f"d_in{k}" for k in op.weights}
                if g.nodes[node].dims.matmul is not None and op.weights:
                    assert weight, (node, c)
                else:
                    assert weight or not _has_batch(op, c.tensor, c.phase), (node, str(seq), c)


# ------------------------------------------------------------------------------------------------ plans
def test_gpt2_tiny_plans():
    g, mesh = graph_of("gpt2-tiny"), MESHES[4]
    mega = {n: str(s) for n, s in bl.megatron_assignment(g, mesh, dp=2, values=VALUES).items()}
    assert mega["embedding"] == "B,V" and mega["layer_norm"] == "B,R" and mega["add_1"] == "B,R"
    assert mega["linear"] == "B,K" and mega["linear_3"] == "B,N" and mega["linear_8"] == "B,K"
    assert mega["scaled_dot_product_attention"] == "B,H" and mega["gelu"] == "B,d2" and mega["view"] == "B,d2"
    assert mega["reshape_2"] == "B,d1" and mega["cross_entropy_loss"] == "N,V" and mega["arange"] == "R,R"
    sp = {n: str(s) for n, s in bl.megatron_assignment(g, mesh, dp=1, sequence_parallel=True).items()}
    assert sp["layer_norm"] == "S,S" and sp["add_1"] == "S,S" and sp["linear"] == "K,K" and sp["eq"] == "R,R"
    dp = {n: str(s) for n, s in bl.data_parallel_assignment(g, mesh, values=VALUES).items()}
    assert dp["linear"] == "B,B" and dp["cross_entropy_loss"] == "N,N" and dp["arange"] == "R,R"


def test_opt_mlp_matches_the_paper_example():
    """§7: on 8 GPUs Megatron's OPT MLP is fc1 = {B,K,K}, fc2 = {B,N,N} (dp=2 x mp=4)."""
    g = graph_of("opt-tiny")
    plan = bl.megatron_assignment(g, MESHES[8], dp=2, values=VALUES)
    styles = bl.classify_linears(g)
    mlp = [n for n in styles if module_of(g, n).endswith(("up_proj", "down_proj"))]
    assert {str(plan[n]) for n in mlp if styles[n] == "column"} == {"B,K,K"}
    assert {str(plan[n]) for n in mlp if styles[n] == "row"} == {"B,N,N"}


def test_fallbacks_are_reported():
    g = graph_of("gpt2-tiny")
    plan = bl.megatron_assignment(g, MESHES[8], dp=1, values=VALUES)  # 4 heads on mp=8
    assert str(plan["scaled_dot_product_attention"]) == "H,H,R"
    assert "scaled_dot_product_attention" in plan.fallback_nodes()
    assert not bl.megatron_assignment(g, MESHES[4], dp=1, values=VALUES).fallbacks
    plan = bl.data_parallel_assignment(g, MESHES[4], values={B: 2, S: 16})
    assert str(plan["linear"]) == "B,R" and any(f.node == "linear" and f.digit == 1 for f in plan.fallbacks)
    (why,) = {f.reason for f in plan.fallbacks if f.node == "linear"}
    assert why == "B of size B = 2 does not split into 4"  # the symbol's value said, not only its name
    hf = bl.megatron_assignment(graph_of("hf-gpt2"), MESHES[4], dp=1, values=VALUES)
    assert str(hf["split"]) == "R,R" and "split" in hf.fallback_nodes()


def test_assignment_from_text():
    g, mesh = graph_of("gpt2-tiny"), MESHES[4]
    plan = bl.megatron_assignment(g, mesh, dp=2, values=VALUES)
    again = bl.assignment_from_text(g, {n: str(s) for n, s in plan.items()}, mesh=mesh)
    assert again == plan
    partial = bl.assignment_from_text(g, {"linear": "B,K"}, default="R,R")
    assert partial["linear"] == PartitionSeq.parse("B,K") and partial["add"] == PartitionSeq.parse("R,R")
    with pytest.raises(KeyError):
        bl.assignment_from_text(g, {"nope": "B,K"})
    with pytest.raises(PartitionError):
        bl.assignment_from_text(g, {"layer_norm": "K,K"}, mesh=mesh)


# ------------------------------------------------------------------------------------- Megatron under a budget
def test_megatron_fits_a_budget_with_its_distributed_optimizer() -> None:
    """On one digit of 4 the Megatron splits are dp1 x mp4 (with and without SP) and dp4 x mp1 (data parallel).
    With a budget 6 bytes a parameter under data parallelism's peak, only dp4 x mp1 with the distributed optimizer
    fits: fp32 Adam keeps 8 bytes of moments a parameter, split 4 ways leaves 2, and nothing else moves."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.planning.compare import price_baselines

    graph, params = graph_of("llama-tiny"), sum(p.numel() for p in build("llama-tiny").parameters())
    mesh, cluster, values = DeviceMesh((4,)), load_cluster("cpu-gloo"), {B: 8, S: 64}
    free = price_baselines(graph, mesh, cluster, values, CostOptions(), None)
    assert "distributed_optimizer" not in free["megatron"].config  # no budget: no distributed optimizer
    data = free["data_parallel"].predicted
    budget = data.peak_memory_bytes - 6 * params
    fitted = price_baselines(graph, mesh, cluster, values, CostOptions(), budget)
    mega = fitted["megatron"]
    assert mega.config["name"] == "megatron dp4 x mp1 +distributed optimizer" and mega.config["fits_budget"]
    assert mega.predicted.peak_memory_bytes == budget
    assert mega.predicted.step_time_s == data.step_time_s and mega.predicted.comm_bytes == data.comm_bytes
    assert fitted["data_parallel"].config["fits_budget"] is False
    # a byte less: only Megatron's activation recomputation fits, slower
    tight = price_baselines(graph, mesh, cluster, values, CostOptions(), budget - 1)["megatron"]
    assert tight.config["fits_budget"] and tight.config["recompute"] == "full"
    assert tight.predicted.peak_memory_bytes <= budget - 1 and tight.predicted.step_time_s > data.step_time_s
    assert tight.config["name"].endswith("+full recompute")


def test_megatron_recomputes_to_fit_and_says_when_nothing_does() -> None:
    """Under a budget Megatron may recompute every layer's activations (priced like ours): it then keeps only the
    layers' inputs, so its peak drops by the activations and its step grows by a Forward; below the least peak of
    every configuration nothing fits and the fastest is kept, marked."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.planning.compare import price_baselines
    from primepar_fx.planning.forced import forced_plan

    graph = graph_of("llama-tiny")
    cluster, values = load_cluster("cpu-gloo"), {B: 8, S: 64}
    mesh = cluster.mesh(4)  # forced_plan's mesh, so that both choose among the same configurations
    free = price_baselines(graph, mesh, cluster, values, CostOptions(), None)["megatron"]
    assert "recompute" not in free.config
    sizes = {"world_size": 4, "cluster": "cpu-gloo", "batch": 8, "seq": 64, "memory_budget": None}
    name = free.config["name"].removeprefix("megatron ")
    full = forced_plan(graph, "megatron", recompute="full", **sizes)  # the same split, recomputing every layer
    assert full.search.config["name"] == free.config["name"] and f"megatron {name}" == free.config["name"]
    fitted = price_baselines(graph, mesh, cluster, values, CostOptions(), full.predicted.peak_memory_bytes)
    mega = fitted["megatron"]
    assert mega.config["fits_budget"] and mega.predicted.peak_memory_bytes <= full.predicted.peak_memory_bytes
    assert mega.predicted.step_time_s <= full.predicted.step_time_s
    nothing = price_baselines(graph, mesh, cluster, values, CostOptions(), 1000)["megatron"]
    assert nothing.config["fits_budget"] is False


def test_fsdp_shards_everything_and_gathers_each_layer_twice() -> None:
    """FSDP (ZeRO-3 data parallelism) on 4 devices: a quarter of every parameter, gradient and optimizer state
    (fp32: 4 + 4 + 8 bytes of moments, the fp32 shard stepped in place), two layers' parameters gathered whole; it
    sends data parallelism's all-reduce and one all-gather more (3/2 of its bytes), but for the head and the final
    norm, which are kept whole from Forward to Backward (as FSDP2 keeps its root): gathered once, held at the peak."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.planning.compare import price_baselines

    graph, model = graph_of("llama-tiny"), build("llama-tiny")
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.blocks[0].parameters())
    kept = model.lm_head.weight.numel() + model.final_norm.weight.numel()
    mesh, cluster, values = DeviceMesh((4,)), load_cluster("cpu-gloo"), {B: 8, S: 64}
    free = price_baselines(graph, mesh, cluster, values, CostOptions(), None)
    data, fsdp = free["data_parallel"].predicted, free["fsdp"]
    assert fsdp.config["name"] == "fsdp4 (ZeRO-3)" and fsdp.config["recompute"] == "none"
    gather = 4 * 3 / 4  # an fp32 element's all-gather over 4 devices, bus bytes
    expected_bytes = 1.5 * data.comm_bytes - gather * kept
    assert fsdp.predicted.comm_bytes == pytest.approx(expected_bytes, abs=len(graph.nodes))  # (rounding)
    assert fsdp.predicted.step_time_s > data.step_time_s
    expected = data.peak_memory_bytes - 16 * params + (4 + 4 + 8) * params // 4 + 2 * 4 * layer + gather * kept
    assert fsdp.predicted.peak_memory_bytes == pytest.approx(expected, abs=1024)
    # a budget under that: FSDP recomputes every layer to fit
    tight = price_baselines(graph, mesh, cluster, values, CostOptions(), fsdp.predicted.peak_memory_bytes - 1)
    assert tight["fsdp"].config["fits_budget"] and tight["fsdp"].config["recompute"] in ("full", "selective")


def test_fsdp_accumulates_gradients_over_micro_batches_where_that_is_the_fastest_fit() -> None:
    """FSDP under a budget may run the batch as micro-batches too: the parameters gathered again for each, the
    gradients reduce-scattered once a step. Priced per step as FSDP at half the batch, twice; chosen where it fits
    without recomputation, not where recomputing one whole batch is faster."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.planning.baselines import data_parallel_assignment
    from primepar_fx.planning.compare import fsdp_at, price_baselines

    graph = graph_of("llama-tiny")
    mesh, cluster, values = DeviceMesh((4,)), load_cluster("v100-paper"), {B: 32, S: 1024}
    free = price_baselines(graph, mesh, cluster, values, CostOptions(), None)["fsdp"]
    assert "micro_batches" not in free.config and free.config["recompute"] == "none"
    half = {B: 16, S: 1024}
    config, one = fsdp_at(
        graph,
        mesh,
        cluster,
        half,
        CostOptions(micro_batches=2),
        None,
        data_parallel_assignment(graph, mesh, values=half),
    )
    assert config["recompute"] == "none" and one.peak_memory_bytes < free.predicted.peak_memory_bytes
    roomy = price_baselines(graph, mesh, cluster, values, CostOptions(), one.peak_memory_bytes)["fsdp"]
    assert roomy.config["micro_batches"] == 2 and roomy.config["name"] == "fsdp4 (ZeRO-3) +2 micro-batches"
    assert roomy.config["fits_budget"] and roomy.predicted.peak_memory_bytes == one.peak_memory_bytes
    assert roomy.predicted.step_time_s == pytest.approx(2 * one.step_time_s, rel=1e-12)
    assert roomy.predicted.comm_bytes == 2 * one.comm_bytes
    # the gradients' reduce-scatter once a step, the gathers for every micro-batch: more bytes than one batch
    assert free.predicted.comm_bytes < roomy.predicted.comm_bytes < 2 * free.predicted.comm_bytes
    whole = price_baselines(graph, mesh, cluster, values, CostOptions(), one.peak_memory_bytes - 1)["fsdp"]
    assert whole.config["fits_budget"] and whole.config["recompute"] != "none"
    assert "micro_batches" not in whole.config  # two micro-batches would recompute as well: slower
    both, two = fsdp_at(
        graph,
        mesh,
        cluster,
        half,
        CostOptions(micro_batches=2),
        one.peak_memory_bytes - 1,
        data_parallel_assignment(graph, mesh, values=half),
    )
    assert both["recompute"] != "none" and whole.predicted.step_time_s < 2 * two.step_time_s


def test_megatron_accumulates_gradients_over_micro_batches_where_that_is_the_fastest_fit() -> None:
    """Under a budget Megatron may also run the batch as micro-batches (activations of one held, gradients
    reduced once a step). Where two micro-batches fit without recomputation they beat recomputing every layer;
    where they would need recomputation too, one batch with recomputation stays (more micro-batches only add
    per-step overhead then)."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.planning.compare import best_megatron, price_baselines

    graph = graph_of("llama-tiny")
    mesh, cluster, values = DeviceMesh((4,)), load_cluster("v100-paper"), {B: 32, S: 1024}
    peak = price_baselines(graph, mesh, cluster, values, CostOptions(), None)["megatron"].predicted.peak_memory_bytes

    def by_hand(m: int, budget: float):
        config, summary, _ = best_megatron(
            graph, mesh, cluster, {B: 32 // m, S: 1024}, CostOptions(micro_batches=m), budget
        )[0]
        return config, summary.predicted

    roomy = 0.9 * peak
    got = price_baselines(graph, mesh, cluster, values, CostOptions(), roomy)["megatron"]
    whole, (two, half) = by_hand(1, roomy), by_hand(2, roomy)
    assert whole[0]["recompute"] == "full" and "recompute" not in two and two["fits_budget"]
    assert got.config["micro_batches"] == 2 and got.config["name"] == "megatron dp4 x mp1 +2 micro-batches"
    assert got.config["fits_budget"] and got.predicted.peak_memory_bytes == half.peak_memory_bytes <= roomy
    assert got.predicted.step_time_s == pytest.approx(2 * half.step_time_s, rel=1e-12)
    assert got.predicted.comm_bytes == 2 * half.comm_bytes
    assert got.predicted.step_time_s < whole[1].step_time_s
    tight = 0.5 * peak
    kept = price_baselines(graph, mesh, cluster, values, CostOptions(), tight)["megatron"]
    (config, predicted), (two, half) = by_hand(1, tight), by_hand(2, tight)
    assert config["recompute"] == two["recompute"] == "full" and 2 * half.step_time_s > predicted.step_time_s
    assert "micro_batches" not in kept.config and kept.config["recompute"] == "full"
    assert kept.predicted.step_time_s == predicted.step_time_s
