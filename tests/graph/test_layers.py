"""The layers of a layer stack (graph.layers): what recomputation prices and checkpoints, layer by layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from primepar_fx import analyze
from primepar_fx.graph.layers import is_score, layer_units, selective_nodes, unit_inputs
from primepar_fx.models import build, build_hf_tiny, example_inputs, get_config, hf_example_inputs

LAYERS = 4


def zoo_graph(name: str, *, replicate: bool = False):
    config = dataclasses.replace(get_config(name), layers=LAYERS)
    args, kwargs = example_inputs(config, 2, 8, device="meta")
    return analyze(build(config, device="meta"), args, kwargs, replicate_layers=replicate)


@pytest.mark.parametrize(("name", "entering"), [("gpt2-tiny", 1), ("llama-tiny", 3), ("opt-tiny", 1)])
def test_each_layer_runs_the_same_ops_on_its_own_parameters(name: str, entering: int) -> None:
    graph = zoo_graph(name)
    units = layer_units(graph)
    assert units is not None and units.stack == "blocks" and len(units) == LAYERS
    ops = [[graph.nodes[n].op for n in unit] for unit in units.units]
    assert all(o == ops[0] for o in ops)
    order = list(graph.nodes)
    for i, unit in enumerate(units.units):
        assert list(unit) == order[order.index(unit[0]) : order.index(unit[-1]) + 1]  # a contiguous run
        params = {p for n in unit for p in graph.nodes[n].params}
        assert params and all(p.startswith(f"blocks.{i}.") for p in params)
        # the residual stream enters (llama: with the rotary tables), not the norm's halfway values
        assert len(unit_inputs(graph, unit)) == entering
    params = {p for n in order for p in graph.nodes[n].params if p.startswith("blocks.")}
    assert params == {p for unit in units.units for n in unit for p in graph.nodes[n].params}


def test_a_replicated_graph_has_the_layers_of_the_whole_capture() -> None:
    assert layer_units(zoo_graph("llama-tiny", replicate=True)) == layer_units(zoo_graph("llama-tiny"))


def test_selective_runs_from_the_scores_to_their_readers() -> None:
    model = build_hf_tiny("bloom")
    args, kwargs = hf_example_inputs(model, 2, 8)
    graph = analyze(model, args, kwargs)
    units = layer_units(graph)
    assert units is not None and units.stack == "transformer.h"
    for unit in units.units:
        run = selective_nodes(graph, unit)
        ops = [graph.nodes[n].op.removeprefix("aten.") for n in run]
        # Q K^T (with ALiBi), the mask, softmax, dropout; then the product of the probabilities with V
        assert ops == ["baddbmm.default", "view.default", "add.Tensor", "softmax.int", "to.dtype", "dropout.default",
                       "view.default", "bmm.default"]  # fmt: skip
        assert [is_score(graph, n) for n in run] == [True] * 7 + [False]
    # a fused attention keeps no scores: nothing to recompute selectively
    llama = zoo_graph("llama-tiny")
    assert all(selective_nodes(llama, u) == () for u in layer_units(llama).units)


class _NoStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum()


def test_a_model_without_a_stack_has_no_layers() -> None:
    graph = analyze(_NoStack(), (torch.randn(2, 4, 8),))
    assert layer_units(graph) is None
