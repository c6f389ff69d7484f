"""The operator graph: every node in B and S, FLOPs against an analytic count, parameter roles, explain table.

Analytic forward FLOPs of a decoder-only LM (matrix products only, 2 per multiply-add; the convention of
``torch.utils.flop_counter``), with h = hidden, kv = key/value width (= h without GQA), f = MLP width,
V = vocabulary, L = layers, m = 3 for a gated (SwiGLU) MLP and 2 otherwise:

    FLOPs = L * ( 2*B*S*(2*h*h + 2*h*kv)      # q, o and k, v projections
                + 4*B*S*S*h                   # Q.K^T and P.V (SDPA or the eager bmm pair)
                + m*2*B*S*h*f )               # MLP
          + 2*B*S*h*V                         # LM head
"""

from __future__ import annotations

import functools

import pytest
import sympy
import torch

from primepar_fx import analyze
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.models import build, build_hf_tiny, example_inputs, get_config, hf_example_inputs
from primepar_fx.partition import DeviceMesh, enumerate_sequences
from primepar_fx.report.explain import explain_rows, explain_table


def analytic_flops(h: int, kv: int, f: int, vocab: int, layers: int, gated: bool, causal: bool = True) -> sympy.Expr:
    """Forward FLOPs; ``causal``: attention by ``is_causal`` (S(S+1)/2 scores), else through a mask (all S^2)."""
    m = 3 if gated else 2
    scores = B * S * (S + 1) / 2 if causal else B * S * S
    per_layer = 2 * B * S * (2 * h * h + 2 * h * kv) + 4 * scores * h + m * 2 * B * S * h * f
    return sympy.expand(layers * per_layer + 2 * B * S * h * vocab)


@functools.cache
def reference_graph(name: str) -> OpGraph:
    model = build(name, device="meta" if not name.endswith("tiny") else None)
    args, kwargs = example_inputs(model.config, 2, 16, device="meta" if not name.endswith("tiny") else None)
    return analyze(model, args, kwargs, name=name)


@functools.cache
def hf_graph(family: str) -> tuple[OpGraph, object]:
    model = build_hf_tiny(family)
    args, kwargs = hf_example_inputs(model, 2, 16)
    return analyze(model, args, kwargs, name=f"hf:{family}"), model.config


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "opt-tiny", "bloom-tiny"])
def test_reference_forward_flops_equal_the_analytic_count(name: str) -> None:
    cfg = get_config(name)
    graph = reference_graph(name)
    causal = cfg.position != "alibi"  # ALiBi's bias is an explicit mask
    want = analytic_flops(
        cfg.hidden, cfg.kv_dim, cfg.ffn_hidden, cfg.vocab_size, cfg.layers, cfg.mlp == "swiglu", causal
    )
    assert sympy.expand(graph.total_flops() - want) == 0


def test_llama2_70b_on_meta_has_the_analytic_flops_and_an_explain_table() -> None:
    cfg = get_config("llama2-70b")
    graph = reference_graph("llama2-70b")
    want = analytic_flops(cfg.hidden, cfg.kv_dim, cfg.ffn_hidden, cfg.vocab_size, cfg.layers, True)
    assert sympy.expand(graph.total_flops() - want) == 0
    assert graph.param_count() == cfg.param_count()
    table = explain_table(graph, DeviceMesh.for_world_size(32), batch=8, seq=4096)
    assert "TOTAL" in table and f"{len(graph.nodes)} nodes" in table


HF_DIMS = {
    "gpt2": lambda c: (c.n_embd, c.n_embd, c.n_inner, c.vocab_size, c.n_layer, False),
    "llama": lambda c: (
        c.hidden_size,
        c.num_key_value_heads * c.hidden_size // c.num_attention_heads,
        c.intermediate_size,
        c.vocab_size,
        c.num_hidden_layers,
        True,
    ),
    "opt": lambda c: (c.hidden_size, c.hidden_size, c.ffn_dim, c.vocab_size, c.num_hidden_layers, False),
    "bloom": lambda c: (c.hidden_size, c.hidden_size, 4 * c.hidden_size, c.vocab_size, c.n_layer, False),
}


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt", "bloom"])
def test_hugging_face_graphs_are_in_b_and_s_with_the_analytic_flops(family: str) -> None:
    graph, config = hf_graph(family)
    for node in graph.nodes.values():
        for shape in node.out_shapes:
            for size in shape:
                assert sympy.sympify(size).free_symbols <= {B, S}, f"{node.name}: {shape}"
    # Hugging Face's SDPA path passes its causal mask explicitly: every score is computed
    assert sympy.expand(graph.total_flops() - analytic_flops(*HF_DIMS[family](config), causal=False)) == 0


def test_parameters_and_gradient_free_inputs_are_marked() -> None:
    graph = reference_graph("gpt2-tiny")
    linears = [n for n in graph.nodes.values() if n.target is torch.ops.aten.linear.default]
    assert linears and all(n.dims.weights for n in linears)
    emb = next(n for n in graph.nodes.values() if n.target is torch.ops.aten.embedding.default)
    assert emb.dims.weights == frozenset({0}) and emb.dims.no_grad == frozenset({1})  # the token ids
    loss = next(n for n in graph.nodes.values() if n.target is torch.ops.aten.cross_entropy_loss.default)
    assert 1 in loss.dims.no_grad  # the targets
    assert graph.tied == {"lm_head.weight": "embed_tokens.weight"}
    assert graph.param_count() == get_config("gpt2-tiny").param_count()  # the tied weight counts once


def test_explain_counts_are_the_enumerated_partition_space() -> None:
    graph = reference_graph("gpt2-tiny")
    mesh = DeviceMesh.for_world_size(4)
    rows = {r.name: r for r in explain_rows(graph, mesh, batch=8, seq=32)}
    for node in graph.nodes.values():
        want = len(enumerate_sequences(node.dims, mesh, values={B: 8, S: 32}))
        assert rows[node.name].sequences == want
    lin = next(n for n in graph.nodes.values() if n.target is torch.ops.aten.linear.default)
    assert rows[lin.name].sequences == 5 * 5 + 1  # {B, S, N, K, R} on each of 2 digits, plus P2x2
