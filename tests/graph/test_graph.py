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
import torch.nn.functional as F

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
    """Two layers captured and replicated to 80 (the planner's default; tests/frontend captures all 80): the whole
    model's FLOPs and parameters."""
    cfg = get_config("llama2-70b")
    args, kwargs = example_inputs(cfg, 2, 16, device="meta")
    graph = analyze(build("llama2-70b", device="meta"), args, kwargs, name="llama2-70b", replicate_layers=True)
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


class _Distilled(torch.nn.Module):
    """A loss whose targets come from a parameter (a teacher's argmax): no rank can count them from the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        own = F.cross_entropy(self.student(x).flatten(0, 1), labels.roll(-1, 1).flatten())
        taught = F.cross_entropy(self.student(x).flatten(0, 1), self.teacher(x).argmax(-1).flatten())
        return own + taught


def test_a_mean_loss_counts_targets_from_the_inputs_without_a_message() -> None:
    """Targets computed from the inputs by pure ops are counted whole on every rank (``count_local``): the row
    split's all-reduce carries the loss sum alone. Targets that read a parameter keep the count in the message."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph import build_graph
    from primepar_fx.partition import PartitionSeq
    from primepar_fx.partition.comm import collectives
    from primepar_fx.partition.dsi import OpPartition

    graph = reference_graph("gpt2-tiny")
    (loss,) = [n for n in graph.nodes.values() if n.target is torch.ops.aten.cross_entropy_loss.default]
    assert loss.dims.extra["count_local"] is True
    x, labels = torch.randn(2, 4, 8), torch.randint(0, 5, (2, 4))
    distilled = build_graph(capture(_Distilled(), (x, labels)))
    losses = [n for n in distilled.nodes.values() if n.target is torch.ops.aten.cross_entropy_loss.default]
    assert [bool(n.dims.extra.get("count_local")) for n in losses] == [True, False]
    mesh = DeviceMesh.for_world_size(2)
    for node, count in zip(losses, (1, 2)):
        rows = PartitionSeq.parse(node.dims.dims[0])  # the rows split over both ranks
        (c,) = [c for c in collectives(OpPartition(node.dims, rows, mesh)) if c.tensor == "out0"]
        assert c.count == count


def test_explain_counts_are_the_enumerated_partition_space() -> None:
    graph = reference_graph("gpt2-tiny")
    mesh = DeviceMesh.for_world_size(4)
    rows = {r.name: r for r in explain_rows(graph, mesh, batch=8, seq=32)}
    for node in graph.nodes.values():
        want = len(enumerate_sequences(node.dims, mesh, values={B: 8, S: 32}))
        assert rows[node.name].sequences == want
    lin = next(n for n in graph.nodes.values() if n.target is torch.ops.aten.linear.default)
    assert rows[lin.name].sequences == 5 * 5 + 1  # {B, S, N, K, R} on each of 2 digits, plus P2x2


# ------------------------------------------------------------------------------------- a static S as fallback
class _SeqBranch(torch.nn.Module):
    """A model whose Python branch on the sequence length keeps S from staying symbolic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 7:
            return self.lin(x).sum() * 2
        return self.lin(x).sum()


def test_a_rule_failure_with_a_symbolic_seq_is_retried_at_the_examples(monkeypatch) -> None:
    """A shape that only an integer S makes plain (MPT's ``1 - Max(0, 1 - S)``) fails a rule; graph_of captures
    again with a static S and warns, quoting the rule's error. When that fails too, the first error is raised."""
    from primepar_fx.frontend.capture import capture
    from primepar_fx.frontend.specialize import StaticSeqWarning
    from primepar_fx.graph import build as build_mod
    from primepar_fx.graph import graph_of
    from primepar_fx.rules.registry import RuleError

    real = build_mod.build_graph

    def fussy(captured, **kwargs):
        if not captured.static_seq:
            raise RuleError("rule for aten.add.Tensor failed at node 'add': cannot broadcast 1 - Max(0, 1 - S)")
        return real(captured, **kwargs)

    monkeypatch.setattr(build_mod, "build_graph", fussy)
    model, x = torch.nn.Linear(8, 8), torch.randn(2, 4, 8)
    with pytest.warns(StaticSeqWarning, match=r"cannot broadcast 1 - Max\(0, 1 - S\)\); captured at the example.s S=4"):
        graph = graph_of(lambda static: capture(model, (x,), static_seq=static))
    assert graph.captured.static_seq and graph.nodes["linear"].out_shapes[0] == (B, 4, 8)

    def broken(captured, **kwargs):
        raise RuleError(f"static={captured.static_seq}")

    monkeypatch.setattr(build_mod, "build_graph", broken)
    with pytest.raises(RuleError, match="static=False"):
        graph_of(lambda static: capture(model, (x,), static_seq=static))


def test_a_static_seq_graph_plans_and_compiles_at_its_seq_only() -> None:
    import primepar_fx
    from primepar_fx.frontend.specialize import StaticSeqWarning
    from primepar_fx.planning.planner import plan_graph

    with pytest.warns(StaticSeqWarning, match=r"if x.shape\[1\] == 7"):
        graph = analyze(_SeqBranch(), (torch.randn(2, 4, 8),))
    assert graph.nodes["linear"].out_shapes[0] == (B, 4, 8)
    with pytest.raises(ValueError, match="captured at S=4 .* cannot be planned at S=8"):
        plan_graph(graph, world_size=2, cluster="cpu-gloo", seq=8)
    assert plan_graph(graph, world_size=2, cluster="cpu-gloo", batch=6, method="dp").seq == 4
    with pytest.warns(StaticSeqWarning):
        module = primepar_fx.compile(_SeqBranch(), (torch.randn(2, 4, 8),), world_size=1)
    module(torch.randn(3, 4, 8)).backward()
    with pytest.raises(ValueError, match="dim 1 has size 5 but the compiled model .* fixes it at 4"):
        module(torch.randn(3, 5, 8))
