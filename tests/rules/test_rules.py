"""Tests for primepar_fx.rules: coverage of real graphs, exact rules on hand examples, errors, the registry."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import sympy
import torch
from torch import fx

from primepar_fx.frontend.symbols import Shape
from primepar_fx.rules import MissingRuleError, OpDims, RuleContext, op_dims, register_rule, registered_ops
from primepar_fx.rules import factory as factory_rules
from primepar_fx.rules import pointwise as pointwise_rules
from primepar_fx.rules.registry import same_size
from primepar_fx.rules.spec import TensorMap, tensor_shape
from primepar_fx.rules.view import group_dims

aten = torch.ops.aten
B = sympy.Symbol("B", integer=True, positive=True)
S = sympy.Symbol("S", integer=True, positive=True)
MAX_SEQ = 64
HF_TINY = ("gpt2", "llama", "opt", "bloom")
REFERENCE_TINY = ("gpt2-tiny", "llama-tiny", "opt-tiny", "bloom-tiny")

#: Ops that may leave a tensor input unmapped (``None``): they read only its dtype, or they compute no tensor.
DTYPE_ONLY_READERS = {aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default, aten.new_full.default}


# ---------------------------------------------------------------------------------------------- helpers
def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _symbol_map(gm: fx.GraphModule) -> dict[sympy.Symbol, sympy.Symbol]:
    """export's hashed symbols -> B, S, through the ``input_ids`` placeholder."""
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    batch, seq = (sympy.sympify(s.node.expr) for s in ids.meta["val"].shape)
    assert batch.is_Symbol and seq.is_Symbol, "batch and seq must stay symbolic"
    return {batch: B, seq: S}


def _shape(t: torch.Tensor, smap: dict) -> Shape:
    return tuple(
        sympy.sympify(s.node.expr).xreplace(smap) if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in t.shape
    )


def _context(node: fx.Node, smap: dict) -> RuleContext:
    def shape_of(n: fx.Node) -> Shape | None:
        val = n.meta.get("val")
        return _shape(val, smap) if isinstance(val, torch.Tensor) else None

    return RuleContext(shape_of=shape_of, out_shapes=tuple(_shape(t, smap) for t in _tensors(node.meta.get("val"))))


def _reproduces(op: OpDims, tmap: TensorMap, shape: Shape) -> bool:
    """The map rebuilds ``shape`` exactly, and ``()`` only stands for size-1 dims."""
    if len(tmap) != len(shape):
        return False
    rebuilt = tensor_shape(op, tmap)
    return all(same_size(r, s) for r, s in zip(rebuilt, shape, strict=True)) and all(
        group or same_size(s, 1) for group, s in zip(tmap, shape, strict=True)
    )


def check_node(node: fx.Node, ctx: RuleContext, op: OpDims) -> list[str]:
    """Problems with ``op`` as the description of ``node`` (empty when it is consistent)."""
    problems = []
    if len(op.inputs) != len(node.all_input_nodes):
        return [f"{node.name}: {len(op.inputs)} input maps for {len(node.all_input_nodes)} inputs"]
    for n, tmap in zip(node.all_input_nodes, op.inputs, strict=True):
        shape = ctx.shape_of(n)
        if node.target is operator.getitem and shape is None:  # the map is that of the selected output of n
            shape = ctx.out_shapes[0] if ctx.out_shapes else None
        if tmap is None:
            if shape is not None and op.kind != "meta" and node.target not in DTYPE_ONLY_READERS:
                problems.append(f"{node.name}: tensor input {n.name} left unmapped")
        elif shape is None or not _reproduces(op, tmap, shape):
            problems.append(f"{node.name}: input {n.name} map {tmap} does not rebuild {shape}")
    if len(op.outputs) != len(ctx.out_shapes):
        problems.append(f"{node.name}: {len(op.outputs)} output maps for {len(ctx.out_shapes)} outputs")
    for tmap, shape in zip(op.outputs, ctx.out_shapes, strict=False):
        if not _reproduces(op, tmap, shape):
            problems.append(f"{node.name}: output map {tmap} does not rebuild {shape}")
    return problems


def check_graph(gm: fx.GraphModule) -> dict[str, OpDims]:
    smap = _symbol_map(gm)
    problems: list[str] = []
    described: dict[str, OpDims] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ctx = _context(node, smap)
        op = op_dims(node, ctx)
        problems += check_node(node, ctx, op)
        described[node.name] = op
    assert not problems, "\n".join(problems)
    return described


# ------------------------------------------------------------------------------------------ real graphs
def _hf_model(family: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 128, "max_position_embeddings": 128}
    configs = {
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128),
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            **small,
        ),
        "opt": lambda: transformers.OPTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64, **small
        ),
        "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128),
    }
    config = configs[family]()
    config.use_cache = False
    config._attn_implementation = "eager" if family == "bloom" else "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.fixture(scope="module")
def hf_graphs() -> Callable[[str], fx.GraphModule]:
    cache: dict[str, fx.GraphModule] = {}

    def get(family: str) -> fx.GraphModule:
        if family not in cache:
            ids = torch.randint(0, 128, (2, 16))
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=MAX_SEQ)
            dyn = {"input_ids": {0: batch, 1: seq}, "labels": {0: batch, 1: seq}}
            kwargs = {"input_ids": ids, "labels": ids.clone()}
            cache[family] = torch.export.export(_hf_model(family), (), kwargs, dynamic_shapes=dyn).graph_module
        return cache[family]

    return get


@pytest.mark.parametrize("family", HF_TINY)
def test_every_node_of_the_hf_tiny_graphs_has_a_rule_that_rebuilds_its_shapes(hf_graphs, family):
    described = check_graph(hf_graphs(family))
    kinds = {op.kind for op in described.values()}
    assert {"matmul", "embedding", "loss", "view", "pointwise"} <= kinds
    assert "attention" in kinds or family == "bloom"


@pytest.mark.parametrize("name", REFERENCE_TINY)
def test_every_node_of_the_reference_tiny_graphs_has_a_rule_that_rebuilds_its_shapes(name):
    models = pytest.importorskip("primepar_fx.models")
    model = models.build(name).train()
    args, kwargs = models.example_inputs(model.config, batch=2, seq=16)
    kwargs = {k: v.clone() for k, v in kwargs.items()}
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=models.dynamic_shapes(MAX_SEQ))
    described = check_graph(ep.graph_module)
    assert any(op.kind == "matmul" for op in described.values())


def test_matmul_flops_of_the_bloom_graph_match_torch_flop_counter(hf_graphs):
    # BLOOM's eager attention is made of baddbmm / bmm, which FlopCounterMode counts on every CPU kernel path.
    from torch.utils.flop_counter import FlopCounterMode

    described = check_graph(hf_graphs("bloom"))
    total = sum((op.flops for op in described.values()), sympy.Integer(0)).subs({B: 2, S: 16})
    ids = torch.randint(0, 128, (2, 16))
    with FlopCounterMode(display=False) as counter:
        _hf_model("bloom")(input_ids=ids, labels=ids.clone())
    assert total == counter.get_total_flops()


def test_linears_in_the_llama_graph_are_b_s_n_k_and_attention_splits_kv_heads(hf_graphs):
    described = check_graph(hf_graphs("llama"))
    q_proj = described["linear"]
    assert q_proj.dims == ("B", "S", "N", "K") and q_proj.matmul == ("S", "N", "K")
    sdpa = described["scaled_dot_product_attention"]
    # HF's repeat_kv expands k/v to all heads before SDPA, so the kernel itself sees H == Hk.
    assert sdpa.dims == ("B", "H", "S", "T", "E", "Ev")
    assert sdpa.no_split == {"T", "E", "Ev"}


# ------------------------------------------------------------------------------------ hand-made nodes
class T:
    """A tensor argument of the given (symbolic) shape, for :func:`describe`."""

    def __init__(self, *shape: object) -> None:
        self.shape: Shape = tuple(sympy.sympify(s) for s in shape)


def describe(target: object, *args: object, out: list[tuple] | tuple, **kwargs: object) -> tuple[fx.Node, OpDims]:
    """Apply the rule of ``target`` to one node whose :class:`T` arguments become placeholders."""
    g = fx.Graph()
    shapes: dict[fx.Node, Shape] = {}

    def lift(a: object) -> object:
        if isinstance(a, T):
            n = g.placeholder(f"x{len(shapes)}")
            shapes[n] = a.shape
            return n
        if isinstance(a, (list, tuple)):
            return type(a)(lift(x) for x in a)
        return a

    node = g.call_function(target, lift(args), {k: lift(v) for k, v in kwargs.items()})
    outs = out if isinstance(out, list) else [out]
    ctx = RuleContext(shape_of=shapes.get, out_shapes=tuple(tuple(sympy.sympify(s) for s in o) for o in outs))
    op = op_dims(node, ctx)
    assert not check_node(node, ctx, op), check_node(node, ctx, op)
    return node, op


def test_linear_is_b_s_n_k_with_the_sequence_as_m_and_exact_flops():
    _, op = describe(aten.linear.default, T(B, S, 64), T(32, 64), T(32), out=(B, S, 32))
    assert op.kind == "matmul"
    assert op.dims == ("B", "S", "N", "K") and op.sizes == (B, S, 64, 32)
    assert op.matmul == ("S", "N", "K") and op.matmul_operands == (0, 1)
    assert op.inputs == ((("B",), ("S",), ("N",)), (("K",), ("N",)), (("K",),))
    assert op.outputs == ((("B",), ("S",), ("K",)),)
    assert op.summed_dims(op.outputs[0]) == {"N"}
    assert sympy.expand(op.flops - 2 * B * S * 64 * 32) == 0


def test_addmm_on_merged_rows_names_the_row_dim_bs():
    _, op = describe(aten.addmm.default, T(192), T(B * S, 64), T(64, 192), out=(B * S, 192))
    assert op.dims == ("BS", "N", "K") and op.matmul == ("BS", "N", "K") and op.matmul_operands == (1, 2)
    assert op.inputs[0] == (("K",),)
    assert sympy.expand(op.flops - 2 * B * S * 64 * 192) == 0


def test_bmm_of_scores_names_key_sequence_t():
    _, op = describe(aten.bmm.default, T(4 * B, S, 16), T(4 * B, 16, S), out=(4 * B, S, S))
    assert op.dims == ("d0", "S", "N", "T") and op.matmul == ("S", "N", "T")
    assert sympy.expand(op.flops - 2 * 4 * B * S * S * 16) == 0


def test_view_merge_maps_the_merged_output_dim_onto_both_input_dims():
    _, op = describe(aten.view.default, T(B, S, 64), [-1, 64], out=(B * S, 64))
    assert op.kind == "view" and not op.no_split
    assert op.inputs == ((("B",), ("S",), ("d1",)),)
    assert op.outputs == ((("B", "S"), ("d1",)),)


def test_view_split_maps_the_input_dim_onto_heads_and_head_embed():
    _, op = describe(aten.view.default, T(B, S, 64), [B, S, -1, 16], out=(B, S, 4, 16))
    assert op.inputs == ((("B",), ("S",), ("d2", "d3")),)
    assert op.outputs == ((("B",), ("S",), ("d2",), ("d3",)),)
    _, op = describe(aten.reshape.default, T(B * S, 64), [B, S, 64], out=(B, S, 64))
    assert op.inputs == ((("B", "S"), ("d2",)),)


def test_many_to_many_reshape_is_unsplittable_and_size_one_dims_map_to_nothing():
    assert group_dims((6, 4), (4, 6)) == [((0, 1), (0, 1))]
    _, op = describe(aten.view.default, T(B, 6, 4), [B, 4, 6], out=(B, 4, 6))
    assert op.no_split == set(op.dims) - {"B"}
    _, op = describe(aten.unsqueeze.default, T(B, S), 1, out=(B, 1, S))
    assert op.outputs == ((("B",), (), ("S",)),)


def test_expand_maps_broadcast_dims_to_nothing():
    _, op = describe(aten.expand.default, T(1, S, 1, 16), [B, -1, 4, 16], out=(B, S, 4, 16))
    assert op.inputs == (((), ("S",), (), ("d3",)),)
    assert op.outputs == ((("B",), ("S",), ("d2",), ("d3",)),)


def test_transpose_permutes_the_input_dims():
    _, op = describe(aten.transpose.int, T(B, S, 4, 16), 1, 2, out=(B, 4, S, 16))
    assert op.outputs == ((("B",), ("d2",), ("S",), ("d3",)),)


def test_slicing_part_of_a_dim_makes_it_unsplittable_but_a_full_slice_is_an_identity():
    _, op = describe(aten.slice.Tensor, T(B, S, 16), 2, 0, 8, out=(B, S, 8))
    assert op.no_split == {"d2", "d2_2"} and op.outputs == ((("B",), ("S",), ("d2_2",)),)
    _, op = describe(aten.slice.Tensor, T(B, S, 16), 0, 0, 2**63 - 1, out=(B, S, 16))
    assert not op.no_split and op.inputs == op.outputs


def test_split_and_getitem_select_one_output():
    node, op = describe(aten.split.Tensor, T(B, S, 192), 64, 2, out=[(B, S, 64)] * 3)
    assert op.no_split >= {"d2"} and len(op.outputs) == 3
    g = node.graph
    item = g.call_function(operator.getitem, (node, 1))
    ctx = RuleContext(shape_of=lambda n: None, out_shapes=((B, S, 64),))
    got = op_dims(item, ctx)
    assert got.kind == "view" and got.inputs == got.outputs and got.extra["selects"] == 1
    one_chunk = RuleContext(shape_of=lambda n: (B, S, 64), out_shapes=((B, S, 64),))  # a split into one chunk
    assert op_dims(item, one_chunk).extra["selects"] == 1


def test_cat_joins_along_an_unsplittable_dim():
    _, op = describe(aten.cat.default, [T(B, 4, S, 8), T(B, 4, S, 8)], -1, out=(B, 4, S, 16))
    assert "d3" in op.no_split and op.outputs == ((("B",), ("d1",), ("S",), ("d3",)),)


def test_elementwise_broadcasting_maps_size_one_and_missing_dims_to_nothing():
    _, op = describe(aten.mul.Tensor, T(B, 4, S, 16), T(1, 1, S, 16), out=(B, 4, S, 16))
    assert op.kind == "pointwise" and op.inputs[1] == ((), (), ("S",), ("d3",))
    _, op = describe(aten.mul.Tensor, T(64), T(B, S, 64), out=(B, S, 64))
    assert op.inputs[0] == (("d2",),)
    _, op = describe(aten.where.self, T(B, 1, S, S), T(), T(B, 4, S, S), out=(B, 4, S, S))
    assert op.dims == ("B", "d1", "S", "T") and op.inputs[1] == ()


def test_native_dropout_maps_output_and_mask_alike():
    _, op = describe(aten.native_dropout.default, T(B, S, 64), 0.1, True, out=[(B, S, 64), (B, S, 64)])
    assert op.outputs[0] == op.outputs[1] == op.inputs[0]


def test_random_fills_are_elementwise_like_dropout():
    """``exponential`` and ``uniform`` (what ``exponential_()`` and ``rand_like`` capture as: PhiMoE's Gumbel
    routing) fill their input's shape element by element: a split draws each slice on its own device."""
    for target in (aten.exponential.default, aten.uniform.default):
        _, op = describe(target, T(B, S, 4), out=(B, S, 4))
        assert op.kind == "pointwise" and op.outputs[0] == op.inputs[0] == (("B",), ("S",), ("d2",))


def test_sdpa_dims_flops_and_mask():
    _, op = describe(
        aten.scaled_dot_product_attention.default,
        T(B, 4, S, 16),
        T(B, 4, S, 16),
        T(B, 4, S, 8),
        T(B, 1, S, S),
        out=(B, 4, S, 8),
    )
    assert op.kind == "attention" and op.dims == ("B", "H", "S", "T", "E", "Ev")
    assert op.no_split == {"T", "E", "Ev"}
    assert op.inputs[3] == (("B",), (), ("S",), ("T",))
    assert op.summed_dims(op.outputs[0]) == {"T", "E"}
    assert sympy.expand(op.flops - 2 * B * 4 * S * S * (16 + 8)) == 0
    _, causal = describe(
        aten.scaled_dot_product_attention.default,
        T(B, 4, S, 16),
        T(B, 4, S, 16),
        T(B, 4, S, 16),
        is_causal=True,
        out=(B, 4, S, 16),
    )
    assert "S" in causal.no_split and sympy.expand(causal.flops - 2 * B * 4 * S * (S + 1) * 16) == 0  # S(S+1)/2 scores


def test_sdpa_with_grouped_kv_heads_maps_query_heads_onto_kv_heads_and_groups():
    _, op = describe(
        aten.scaled_dot_product_attention.default,
        T(B, 8, S, 16),
        T(B, 2, S, 16),
        T(B, 2, S, 16),
        enable_gqa=True,
        out=(B, 8, S, 16),
    )
    assert op.dims == ("B", "Hk", "G", "S", "T", "E", "Ev") and op.size("G") == 4
    assert op.inputs[0][1] == ("Hk", "G") and op.inputs[1][1] == ("Hk",)
    assert sympy.expand(op.flops - 4 * B * 8 * S * S * 16) == 0


def test_embedding_sums_over_the_vocabulary():
    _, op = describe(aten.embedding.default, T(128, 64), T(B, S), out=(B, S, 64))
    assert op.kind == "embedding" and op.dims == ("B", "S", "V", "D")
    assert op.inputs == ((("V",), ("D",)), (("B",), ("S",)))
    assert op.summed_dims(op.outputs[0]) == {"V"} and op.flops == 0


def test_cross_entropy_sums_rows_and_keeps_class_statistics():
    _, op = describe(aten.cross_entropy_loss.default, T(B * S, 128), T(B * S), out=())
    assert op.kind == "loss" and op.dims == ("N", "V") and op.stats == {"V"}
    assert op.outputs == ((),) and "N" in op.summed_dims(op.outputs[0])
    _, op = describe(aten.cross_entropy_loss.default, T(B * S, 128), T(B * S), None, 0, out=(B * S,))
    assert op.outputs == ((("N",),),)
    _, op = describe(aten.nll_loss_forward.default, T(B, 128), T(B), None, 1, -100, out=[(), ()])
    assert not op.stats and op.summed_dims(op.outputs[0]) == {"N", "V"}


def test_softmax_axis_is_unsplittable_and_layer_norm_dim_is_a_statistic():
    _, op = describe(aten.softmax.int, T(B, 4, S, S), -1, out=(B, 4, S, S))
    assert op.no_split == {"T"} and op.inputs == op.outputs
    _, op = describe(aten.layer_norm.default, T(B, S, 64), [64], T(64), T(64), 1e-5, out=(B, S, 64))
    assert op.kind == "norm" and op.dims == ("B", "S", "D") and op.stats == {"D"}
    assert op.inputs[1] == op.inputs[2] == (("D",),)
    _, op = describe(
        aten.native_layer_norm.default, T(B, S, 64), [64], T(64), T(64), 1e-5, out=[(B, S, 64)] + [(B, S, 1)] * 2
    )
    assert op.outputs[1] == (("B",), ("S",), ())


def test_reductions_drop_their_dims_and_only_sums_may_be_split():
    _, op = describe(aten.mean.dim, T(B, S, 64), [-1], True, out=(B, S, 1))
    assert op.kind == "reduce" and op.outputs == ((("B",), ("S",), ()),) and not op.no_split
    assert op.summed_dims(op.outputs[0]) == {"d2"}
    _, op = describe(aten.amax.default, T(B, S, 64), [-1], out=(B, S))
    assert op.no_split == {"d2"}


def test_data_dependent_ops_run_replicated():
    _, op = describe(aten.index.Tensor, T(B, S), [T(B, 1), T(1, S)], out=(B, S))
    assert op.no_split == set(op.dims)


def test_factories_name_their_dims_by_size():
    _, op = describe(aten.arange.default, S, out=(S,))
    assert op.kind == "factory" and op.dims == ("S",) and not op.no_split
    _, op = describe(aten.zeros_like.default, T(B, S), out=(B, S))
    assert op.inputs == op.outputs


def test_meta_nodes_have_no_dims():
    _, op = describe(aten.sym_size.int, T(B, S), 0, out=[])
    assert op.kind == "meta" and op.dims == () and op.inputs == (None,) and op.outputs == ()


# ------------------------------------------------------------------------------------ errors, registry
class _Special(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.bessel_j0(x)  # an op no rule covers


def test_a_missing_rule_names_the_op_the_node_and_the_source_line():
    gm = torch.export.export(_Special(), (torch.randn(4, 8),)).graph_module
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    ctx = _context(node, {})
    with pytest.raises(MissingRuleError) as err:
        op_dims(node, ctx)
    message = str(err.value)
    assert "special_bessel_j0" in message and node.name in message
    assert "test_rules.py" in message and "bessel_j0(x)" in message
    op = op_dims(node, ctx, fallback="replicate")
    assert op.no_split == set(op.dims) and not check_node(node, ctx, op)


def test_registering_a_rule_under_a_string_raises_type_error():
    with pytest.raises(TypeError):
        register_rule("aten::add.Tensor")


def test_the_registry_is_keyed_by_op_objects_and_the_tables_resolve():
    assert not any(isinstance(op, str) for op in registered_ops())
    assert all(isinstance(op, torch._ops.OpOverload) or callable(op) for op in registered_ops())
    assert not pointwise_rules.UNRESOLVED and not factory_rules.UNRESOLVED
    must = [aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default]
    must += [aten._softmax.default, aten.log_softmax.int, aten.split_with_sizes.default, aten.squeeze.dims]
    must += [aten.flatten.using_ints, aten.t.default, aten.where.ScalarSelf, aten.nll_loss.default]
    assert set(must) <= set(registered_ops())
