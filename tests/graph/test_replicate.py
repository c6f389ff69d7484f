"""Two captured layers replicated into the whole graph equal the whole model's capture, node for node."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

from primepar_fx import analyze
from primepar_fx import plan as make_plan
from primepar_fx.compiler.module import compile_graph
from primepar_fx.frontend.capture import capture, split_name
from primepar_fx.graph.replicate import find_layer_stack, layer_period
from primepar_fx.models import build, example_inputs, get_config

LAYERS = 4


def assert_same_graph(full, rep) -> None:
    assert list(rep.nodes) == list(full.nodes)  # names, in graph order
    for name, node in full.nodes.items():
        assert rep.nodes[name] == node, name
    edges = lambda g: sorted((u, v, d["dst_in"]) for u, v, d in g.graph.edges(data=True))  # noqa: E731
    assert edges(rep) == edges(full)
    assert list(rep.param_shapes.items()) == list(full.param_shapes.items())
    assert rep.param_dtypes == full.param_dtypes
    assert rep.tied == full.tied


def both(model, args, kwargs):
    return analyze(model, args, kwargs), analyze(model, args, kwargs, replicate_layers=True)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "opt-tiny", "bloom-tiny", "llama2-70b"])
def test_zoo_models_replicate_exactly(name):
    config = dataclasses.replace(get_config(name), layers=LAYERS)
    model = build(config, device="meta")
    stack = model.blocks
    full, rep = both(model, *example_inputs(config, 2, 16, device="meta"))
    assert rep.replicated is not None and (rep.replicated.fqn, rep.replicated.count) == ("blocks", LAYERS)
    assert full.replicated is None
    assert len(rep.captured.gm.graph.nodes) < len(full.captured.gm.graph.nodes)  # really two layers captured
    assert model.blocks is stack and len(model.blocks) == LAYERS  # the model is restored
    assert_same_graph(full, rep)


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt", "bloom"])
def test_hugging_face_models_replicate_exactly(family):
    from primepar_fx.models.hf import build_hf_tiny, hf_example_inputs

    model = build_hf_tiny(family, layers=LAYERS)
    full, rep = both(model, *hf_example_inputs(model, 2, 16))
    assert rep.replicated is not None and rep.replicated.count == LAYERS
    assert_same_graph(full, rep)


def test_capture_numbers_op_nodes_densely():
    """Export leaves gaps (``pow_1`` first, dead size arithmetic); capture renames ``base, base_1, ...``."""
    from primepar_fx.models.hf import build_hf_tiny, hf_example_inputs

    model = build_hf_tiny("llama", layers=3)
    captured = capture(model, *hf_example_inputs(model, 2, 16))
    numbers: dict[str, list[int]] = {}
    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            base, num = split_name(node.name)
            numbers.setdefault(base, []).append(num)
    first = {"pow": 1, "and": 1, "slice": 1}  # FX never names a node after a builtin or keyword
    assert all(nums == list(range(first.get(b, 0), first.get(b, 0) + len(nums))) for b, nums in numbers.items())
    assert {"linear", "pow", "sym_size_int"} <= numbers.keys()
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(captured.gm.graph, {}))
    assert [n.name for n in copy.nodes] == [n.name for n in captured.gm.graph.nodes]  # FX keeps every name
    out = captured.program.graph_signature.output_specs[0].arg.name
    assert out in {n.name for n in captured.gm.graph.nodes}  # the signature follows the renaming
    ids = hf_example_inputs(model, 2, 16)[1]["input_ids"]
    torch.testing.assert_close(captured.gm(*_inputs(captured, model, ids))[0], model(input_ids=ids, labels=ids).loss)


def _inputs(captured, model, ids):
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    out = []
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        fqn = captured.params.get(node.name) or captured.buffers.get(node.name)
        out.append(state[fqn] if fqn in state else ids)
    return out


class _Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return torch.relu(y) if self.index == 1 else torch.tanh(y)  # layer 1 differs from layer 0


class _Stack(nn.Module):
    def __init__(self, layers: int, same_layers: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(0 if same_layers else i) for i in range(layers))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return self.head(x).sum()


def test_layers_that_do_not_repeat_are_captured_whole():
    model, x = _Stack(4, same_layers=False), torch.randn(2, 5, 8)
    full, rep = both(model, (x,), {})
    assert rep.replicated is None
    assert_same_graph(full, rep)
    same, x = _Stack(4), torch.randn(2, 5, 8)
    full, rep = both(same, (x,), {})
    assert rep.replicated is not None and rep.replicated.fqn == "layers"
    assert_same_graph(full, rep)


def test_units_after_a_layer_that_differs_and_a_tail_that_does_not_repeat(caplog):
    x = torch.randn(2, 5, 8)
    model = _Stack(9, same_layers=False)  # layer 1 differs: units 1 to 3 of two layers and the tail repeat
    model.config = type("Config", (), {"layer_types": ["a", "b"] * 4 + ["a"]})()
    full, rep = both(model, (x,), {})
    assert rep.replicated is not None and (rep.replicated.count, rep.replicated.captured) == (9, 7)
    assert_same_graph(full, rep)
    model = _Stack(9)
    model.config = type("Config", (), {"layer_types": ["a", "b"] * 4 + ["a"]})()
    model.layers[6].index = 1  # the short capture's tail (units 1 and 2 from layer 2 on, then 6) is not a unit's start
    with caplog.at_level(logging.INFO, logger="primepar_fx.graph.replicate"):
        full, rep = both(model, (x,), {})
    assert "the tail's" in caplog.text  # units 1 and 2 repeat; the tail does not
    assert rep.replicated is None
    assert_same_graph(full, rep)


def test_no_layer_stack():
    assert find_layer_stack(_Stack(2)) is None  # two layers: nothing to save
    assert find_layer_stack(nn.Sequential(nn.Linear(4, 4))) is None
    model = _Stack(3)
    model.layers[2].proj = nn.Linear(8, 8, bias=False)  # another parameter signature
    assert find_layer_stack(model) is None
    model = _Stack(3)
    model.config = type("Config", (), {"layer_types": ["full", "sliding", "full"]})()
    assert find_layer_stack(model) is None


def test_replicated_graph_plans_like_the_full_one_and_is_not_compiled():
    config = dataclasses.replace(get_config("gpt2-tiny"), layers=LAYERS)
    model = build(config, device="meta")
    ex = example_inputs(config, 2, 16, device="meta")
    full = analyze(model, *ex)
    kw = dict(world_size=4, cluster="cpu-gloo", batch=8, seq=32, baselines=False)
    fast, slow = make_plan(model, ex, **kw), make_plan(model, ex, replicate_layers=False, **kw)
    assert fast.model_fingerprint == slow.model_fingerprint
    assert fast.nodes == slow.nodes
    fast.check_model((n.name, n.op) for n in full.nodes.values())
    rep = analyze(model, *ex, replicate_layers=True)
    with pytest.raises(ValueError, match="replicated from 2 of the 4 layers of blocks"):
        compile_graph(rep, plan=fast, world_size=1)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_replicated_graph_prices_like_the_full_one(name):
    """Every node and edge cost, scatter saving and shared (tied) parameter edge is the full graph's."""
    from primepar_fx.cost.blocks import CostOptions
    from primepar_fx.cost.cluster import load_cluster
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.pricing.price import price_graph

    config = dataclasses.replace(get_config(name), layers=LAYERS)
    model = build(config, device="meta")
    full, rep = both(model, *example_inputs(config, 2, 16, device="meta"))
    cluster = load_cluster("v100-paper")
    priced = [price_graph(g, cluster.mesh(8), cluster, {B: 8, S: 64}, CostOptions()) for g in (full, rep)]
    a, b = (p.cost_graph for p in priced)
    assert a.nodes == b.nodes and a.edge_cost.keys() == b.edge_cost.keys()
    for n in a.nodes:
        np.testing.assert_array_equal(a.node_cost[n], b.node_cost[n])
        np.testing.assert_array_equal(a.node_memory[n], b.node_memory[n])
    for e in a.edge_cost:
        np.testing.assert_array_equal(a.edge_cost[e], b.edge_cost[e], err_msg=str(e))
    assert priced[0].scatter.keys() == priced[1].scatter.keys() and priced[0].scatter


def _hf_causal_lm(family: str, **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, use_cache=False, **extra,
    )  # fmt: skip
    model = getattr(transformers, f"{family}ForCausalLM")(config).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, ((), {"input_ids": ids, "labels": ids.clone()})


@pytest.mark.parametrize("family", ["Qwen2", "Mistral"])
def test_more_hugging_face_families_replicate_exactly(family):
    model, ex = _hf_causal_lm(family)
    full, rep = both(model, *ex)
    assert rep.replicated is not None
    assert_same_graph(full, rep)


def test_the_period_of_layer_types():
    assert layer_period(None, 6) == layer_period(["full"] * 6, 6) == 1
    assert layer_period(["sliding", "full"] * 3, 6) == 2
    assert layer_period(["sliding"] * 3 + ["full"], 4) is None  # four layers hold no three units of two or more
    assert layer_period((["sliding"] * 3 + ["full"]) * 3, 12) == 4
    assert layer_period((["sliding"] * 5 + ["full"]) * 3 + ["sliding"] * 2, 20) == 6  # and a tail of two
    assert layer_period(["sliding", "full"] * 2, 4) is None  # two units: nothing to save
    assert layer_period(["sliding", "full", "full"] * 2, 6) is None
    assert layer_period(["sliding", "full"] * 3, 8) is None  # not one type per layer


@pytest.mark.parametrize(("family", "layers"), [("gemma2", 6), ("gpt_oss", 7)])
def test_layers_whose_types_alternate_replicate_in_units(family, layers):
    """Sliding-window and full attention in turn: two units of two layers captured (and the tail of one layer
    where the depth is odd), the graph the full capture's."""
    from primepar_fx.models.hf import build_hf_tiny, hf_example_inputs

    model = build_hf_tiny(family, layers=layers)
    assert model.config.layer_types == (["sliding_attention", "full_attention"] * 4)[:layers]
    full, rep = both(model, *hf_example_inputs(model, 2, 16))
    assert rep.replicated is not None and (rep.replicated.count, rep.replicated.captured) == (layers, 4 + layers % 2)
    assert_same_graph(full, rep)


def test_layers_of_different_types_are_captured_whole():
    """Qwen2 with a sliding window on its last layers: ``config.layer_types`` differ, so every layer is exported."""
    model, ex = _hf_causal_lm("Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert len(set(model.config.layer_types)) == 2
    full, rep = both(model, *ex)
    assert rep.replicated is None
    assert_same_graph(full, rep)
