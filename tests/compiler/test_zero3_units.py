"""ZeRO-3's units (:func:`primepar_fx.compiler.zero3.zero3_units`): a whole layer each, as FSDP2 wraps each block,
the parameters Backward reads apart from those it does not, and those kept whole from Forward to Backward apart."""

from __future__ import annotations

from primepar_fx.compiler.zero3 import UnitKey, zero3_units
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import build_graph
from primepar_fx.graph.layers import layer_units
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.record.levers import Recompute


def _graph(name: str):
    config = get_config(name)
    args, kwargs = example_inputs(config, 2, 8)
    return build_graph(capture(build(config), args, kwargs))


def _by_unit(units: dict[str, UnitKey]) -> dict[UnitKey, set[str]]:
    out: dict[UnitKey, set[str]] = {}
    for fqn, key in units.items():
        out.setdefault(key, set()).add(fqn)
    return out


def test_llama_has_one_unit_a_layer_and_the_head_kept_whole():
    units = _by_unit(zero3_units(_graph("llama-tiny"), None))
    layer = {"attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp_norm"}
    layer |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert units == {
        UnitKey("before", False, False): {"embed_tokens.weight"},
        **{UnitKey(f"layer {i}", True, False): {f"blocks.{i}.{m}.weight" for m in layer} for i in (0, 1)},
        UnitKey("after", True, True): {"final_norm.weight", "lm_head.weight"},
    }


def test_gpt2_keeps_the_biases_apart_and_the_tied_embedding_whole():
    units = _by_unit(zero3_units(_graph("gpt2-tiny"), None))
    projections = ("attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    for i in (0, 1):
        norms = {f"blocks.{i}.{n}.{w}" for n in ("attn_norm", "mlp_norm") for w in ("weight", "bias")}
        assert units[UnitKey(f"layer {i}", True, False)] == norms | {f"blocks.{i}.{p}.weight" for p in projections}
        assert units[UnitKey(f"layer {i}", False, False)] == {f"blocks.{i}.{p}.bias" for p in projections}
    assert units[UnitKey("before", True, True)] == {"lm_head.weight"}  # tied: first read by the embedding
    assert units[UnitKey("before", False, False)] == {"embed_positions.weight"}
    assert units[UnitKey("after", True, True)] == {"final_norm.weight", "final_norm.bias"}
    assert len(units) == 7


def test_a_recomputed_layer_gathers_its_biases_again_too():
    graph = _graph("gpt2-tiny")
    stack = layer_units(graph)
    recompute = Recompute(stack=stack.stack, layers=("full", "none"))
    units = zero3_units(graph, recompute)
    assert units["blocks.0.attn.o_proj.bias"] == UnitKey("layer 0", True, False)
    assert units["blocks.1.attn.o_proj.bias"] == UnitKey("layer 1", False, False)
