"""Tests for primepar_fx.frontend.capture: torch.export with a symbolic batch and sequence length."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from primepar_fx.frontend.capture import Captured, capture
from primepar_fx.frontend.shapes import annotate
from primepar_fx.frontend.specialize import ShapeSpecializationError, StaticSeqWarning
from primepar_fx.frontend.symbols import ALLOWED_SYMBOLS, META_SHAPES, B, S
from primepar_fx.rules import MissingRuleError

VOCAB, HIDDEN, HEADS = 64, 32, 4


class TinyBlock(nn.Module):
    """Embedding, pre-norm attention through SDPA and a GELU MLP, with a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        self.register_buffer("scale", torch.ones(HIDDEN), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class HardCodedSeq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x.view(x.shape[0], 16, -1).sum()


class HardCodedBatch(HardCodedSeq):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x.reshape(2, -1).sum()


class BranchOnSeq(HardCodedSeq):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if ids.shape[1] > 8:
            x = x * 2
        return x.sum()


class WithLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = TinyBlock()
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.config = SimpleNamespace(max_seq=64, name="with-labels")

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.block(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def _targets(captured: Captured) -> set[object]:
    return {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}


def _assert_all_shapes_in_b_and_s(captured: Captured) -> None:
    annotate(captured)
    for node in captured.gm.graph.nodes:
        for shape in node.meta[META_SHAPES]:
            for size in shape:
                assert size.free_symbols <= ALLOWED_SYMBOLS, (node.name, shape)


@pytest.fixture(scope="module")
def block() -> Captured:
    return capture(TinyBlock(), (_ids(2, 16),))


# ------------------------------------------------------------------------------------------- the graph
def test_linear_sdpa_layer_norm_and_gelu_stay_undecomposed(block: Captured) -> None:
    targets = _targets(block)
    aten = torch.ops.aten
    for op in (aten.linear.default, aten.scaled_dot_product_attention.default, aten.layer_norm.default):
        assert op in targets
    assert aten.gelu.default in targets
    assert aten.mm.default not in targets and aten.bmm.default not in targets


def test_every_node_shape_is_in_b_and_s_only(block: Captured) -> None:
    _assert_all_shapes_in_b_and_s(block)
    sdpa = next(n for n in block.gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.meta[META_SHAPES] == ((B, HEADS, S, HIDDEN // HEADS),)


def test_input_placeholder_is_batch_by_seq(block: Captured) -> None:
    assert block.user_inputs == ("ids",)
    (placeholder,) = [n for n in block.gm.graph.nodes if n.op == "placeholder" and n.name == "ids"]
    annotate(block)
    assert placeholder.meta[META_SHAPES] == ((B, S),)
    assert sorted(block.symbol_map.values(), key=str) == [B, S]
    assert (block.example_batch, block.example_seq) == (2, 16)


def test_parameters_and_non_persistent_buffers_map_to_their_fqns(block: Captured) -> None:
    assert set(block.params.values()) == {name for name, _ in TinyBlock().named_parameters()}
    assert list(block.buffers.values()) == ["scale"]
    placeholders = {n.name for n in block.gm.graph.nodes if n.op == "placeholder"}
    assert set(block.params) | set(block.buffers) | set(block.user_inputs) == placeholders


def test_model_name_defaults_to_the_class_name(block: Captured) -> None:
    assert block.model_name == "TinyBlock"


def test_keyword_labels_get_the_same_symbols_and_config_sets_seq_max() -> None:
    model = WithLabels()
    ids = _ids(3, 8)
    captured = capture(model, (ids,), {"labels": ids})
    assert captured.user_inputs == ("ids", "labels")
    assert captured.model_name == "with-labels"
    assert torch.ops.aten.cross_entropy_loss.default in _targets(captured)
    _assert_all_shapes_in_b_and_s(captured)
    seq_symbol = next(k for k, v in captured.symbol_map.items() if v == S)
    assert captured.program.range_constraints[seq_symbol].upper == 64


def test_capture_keeps_the_model_in_its_current_mode() -> None:
    model = TinyBlock().train()
    capture(model, (_ids(2, 8),))
    assert model.training
    model.eval()
    capture(model, (_ids(2, 8),))
    assert not model.training


def test_a_model_on_meta_is_captured_with_its_inputs_moved_to_meta() -> None:
    with torch.device("meta"):
        model = TinyBlock()
    captured = capture(model, (_ids(2, 16),))
    _assert_all_shapes_in_b_and_s(captured)
    assert torch.ops.aten.linear.default in _targets(captured)


# -------------------------------------------------------------------------------------------- rejections
def test_batch_of_one_is_rejected_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"example batch size is 1.*B would be specialised"):
        capture(TinyBlock(), (_ids(1, 16),))


def test_sequence_of_one_is_rejected_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"example seq size is 1.*S would be specialised"):
        capture(TinyBlock(), (_ids(2, 1),))


def test_equal_batch_and_seq_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="both 4; use distinct sizes"):
        capture(TinyBlock(), (_ids(4, 4),))


def test_a_model_without_tensor_inputs_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        capture(TinyBlock(), (3,))


def test_inputs_that_disagree_on_the_batch_size_are_rejected() -> None:
    with pytest.raises(ValueError, match="disagree on the batch size"):
        capture(WithLabels(), (_ids(2, 8),), {"labels": _ids(3, 8)})


def test_an_example_longer_than_seq_max_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds seq_max=8"):
        capture(TinyBlock(), (_ids(2, 16),), seq_max=8)


# ------------------------------------------------------------------------------------- specialisation
def test_hard_coded_seq_view_is_reported_as_a_seq_specialization() -> None:
    with pytest.raises(ShapeSpecializationError) as info:
        capture(HardCodedSeq(), (_ids(2, 16),), seq_fallback=False)
    err = info.value
    assert err.dims == ("seq",)
    assert "seq" in str(err) and "constant 16" in str(err)
    assert err.location is not None and "test_capture.py" in err.location
    assert "x.view(x.shape[0], 16, -1)" in err.location
    assert "Python branches" in str(err)


def test_hard_coded_batch_reshape_is_reported_as_a_batch_specialization() -> None:
    with pytest.raises(ShapeSpecializationError) as info:
        capture(HardCodedBatch(), (_ids(2, 16),))
    assert info.value.dims == ("batch",)
    assert "constant 2" in str(info.value)
    assert "x.reshape(2, -1)" in (info.value.location or "")


def test_a_python_branch_on_seq_is_reported_with_its_source_line() -> None:
    with pytest.raises(ShapeSpecializationError) as info:
        capture(BranchOnSeq(), (_ids(2, 16),), seq_fallback=False)
    assert info.value.dims == ("seq",)
    assert "if ids.shape[1] > 8" in (info.value.location or "")
    assert "export suggests" in str(info.value)


def test_a_specialization_error_is_a_value_error_and_leaves_logging_as_it_was() -> None:
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, filters = logger.level, list(logger.filters)
    with pytest.raises(ValueError):
        capture(HardCodedSeq(), (_ids(2, 16),), seq_fallback=False)
    assert (logger.level, logger.filters) == (level, filters)


@pytest.mark.parametrize(
    ("model", "line"), [(HardCodedSeq, "x.view(x.shape[0], 16, -1)"), (BranchOnSeq, "if ids.shape[1] > 8")]
)
def test_a_constrained_seq_falls_back_to_the_examples_with_a_warning_naming_the_line(model, line) -> None:
    with pytest.warns(StaticSeqWarning, match=re.escape(line)) as record:
        captured = capture(model(), (_ids(2, 16),))
    assert "captured at the example's S=16" in str(record[0].message)
    assert captured.static_seq and list(captured.symbol_map.values()) == [B]
    annotate(captured)
    shapes = [n.meta[META_SHAPES] for n in captured.gm.graph.nodes if META_SHAPES in n.meta]
    assert all(S not in sympy.sympify(d).free_symbols for shape in shapes for d in shape if shape)
    assert any(B in sympy.sympify(d).free_symbols for shape in shapes for d in shape if shape), "B stays symbolic"


class _NeedsAnInput(nn.Module):
    """Its forward reads a setting that was never set, as a model built from an incomplete config does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.top_k = nn.Linear(8, 8), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(self.proj(x), k=self.top_k, dim=-1).values


def test_a_forward_that_fails_on_its_example_is_one_error_naming_the_model_line() -> None:
    from primepar_fx.frontend.specialize import CaptureError

    with pytest.raises(CaptureError, match=r"capturing _NeedsAnInput failed: TypeError: topk\(\)") as info:
        capture(_NeedsAnInput(), (torch.randn(2, 6, 8),))
    assert info.value.location and "test_capture.py" in info.value.location
    assert "torch.topk(self.proj(x), k=self.top_k" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, TypeError)
    assert "unset" not in str(info.value)  # no config to read


class _Config:
    """A stand-in for a Hugging Face config read from a default file: one setting left null."""

    def to_dict(self) -> dict:
        return {"hidden_size": 8, "top_k": None, "pad_token_id": None, "architectures": None}


def test_a_capture_error_about_none_names_the_config_fields_left_unset() -> None:
    """The fields a checkpoint's config sets and this one leaves null are named (not those null in most
    checkpoints, such as ``pad_token_id``); an error that is not about ``None`` names none."""
    from primepar_fx.frontend.specialize import CaptureError, capture_error

    model = _NeedsAnInput()
    model.config = _Config()
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 6, 8),))
    assert str(info.value).endswith("; the model's config leaves top_k unset, which a checkpoint's config sets")
    assert "unset" not in str(capture_error("m", TypeError("unsupported operand"), _Config()))


def test_the_line_of_a_model_from_an_installed_package_is_named() -> None:
    """transformers' GPT-Neo slices its causal-mask buffer by the sequence length: the warning quotes that line of
    the installed package (site-packages may lie inside the standard library's folder: it is still the model's)."""
    from primepar_fx.models import build_hf_tiny, hf_example_inputs

    model = build_hf_tiny("gpt_neo")
    with pytest.warns(StaticSeqWarning, match=r"modeling_gpt_neo\.py:\d+ in _attn: causal_mask = self\.bias"):
        capture(model, *hf_example_inputs(model, 2, 16))


class _MaskValue(nn.Module):
    """GPT-Neo's masking: the mask value made a tensor inside forward (export lifts it and detaches it in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        mask_value = torch.tensor(torch.finfo(y.dtype).min, dtype=y.dtype, device=y.device)
        return torch.where(y > 0, y, mask_value)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_in_place_detach_of_a_constant_is_captured_as_a_detach(device: str) -> None:
    """On the meta device (where the planner captures) export detaches the lifted constant itself, a graph input,
    in place; on the CPU it detaches a fresh copy of it."""
    from primepar_fx.api import analyze

    model, x = _MaskValue().to(device), torch.randn(2, 6, 8, device=device)
    captured = capture(model, (x,))
    targets = {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.detach_.default not in targets and torch.ops.aten.detach.default in targets
    if device == "cpu":
        torch.testing.assert_close(captured.program.module()(x), model(x))
    analyze(model, (x,))  # every node has a rule


def test_a_static_seq_can_be_asked_for() -> None:
    captured = capture(TinyBlock(), (_ids(2, 16),), static_seq=True)
    assert captured.static_seq and list(captured.symbol_map.values()) == [B]


# ------------------------------------------------------------------------------------ the model zoo
models = pytest.importorskip("primepar_fx.models")


def test_the_gpt2_tiny_reference_captures_with_labels_in_b_and_s() -> None:
    model = models.build("gpt2-tiny")
    args, kwargs = models.example_inputs(model.config, batch=2, seq=16)
    captured = capture(model, args, kwargs)
    assert "labels" in captured.user_inputs
    assert torch.ops.aten.cross_entropy_loss.default in _targets(captured)
    _assert_all_shapes_in_b_and_s(captured)


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt", "bloom"])
def test_hf_tiny_models_capture_with_labels_in_b_and_s(family: str) -> None:
    pytest.importorskip("transformers")
    model = models.build_hf_tiny(family)
    args, kwargs = models.hf_example_inputs(model, batch=2, seq=16)
    captured = capture(model, args, kwargs)
    assert captured.user_inputs == ("input_ids", "labels")
    targets = _targets(captured)
    assert torch.ops.aten.linear.default in targets
    assert torch.ops.aten.cross_entropy_loss.default in targets
    _assert_all_shapes_in_b_and_s(captured)


def test_llama2_70b_captures_on_meta() -> None:
    """The 80-layer model captures on the meta device; its time is measured in bench/explain_time.py, not here."""
    model = models.build("llama2-70b", device="meta")
    args, kwargs = models.example_inputs(model.config, batch=2, seq=16)
    captured = capture(model, args, kwargs)
    annotate(captured)
    linears = [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 80 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    for node in captured.gm.graph.nodes:
        for shape in node.meta[META_SHAPES]:
            assert all(size.free_symbols <= ALLOWED_SYMBOLS for size in shape), node.name


class _InPlace(nn.Module):
    """``y += z`` on an intermediate (rewritten), and, with ``mode``, an update the caller or a view could see."""

    def __init__(self, mode: str = "") -> None:
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(8, 8), nn.Linear(8, 8), mode
        self.register_buffer("seen", torch.zeros(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.mode == "view":  # a view taken before the update and read after it
            v = y.view(-1)
            y += self.b(x)
            return (y * 2).sum() + v.sum()
        y += self.b(x)
        y /= 3.0
        top, _ = y.topk(2, dim=-1)  # an item of a multi-output op: fresh too (a router's top weights)
        top /= top.sum(dim=-1, keepdim=True)
        y = y + top.sum(dim=-1, keepdim=True)
        if self.mode == "buffer":  # the module's own state: the caller sees this update
            self.seen.add_(1.0)
        return (y * 2).sum()


def _mutable_ops(captured: Captured) -> list[str]:
    return [
        str(n.target)
        for n in captured.gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]


def test_in_place_updates_of_intermediates_are_captured_out_of_place() -> None:
    torch.manual_seed(0)
    model, x = _InPlace(), torch.randn(2, 4, 8)
    captured = capture(model, (x,))
    assert _mutable_ops(captured) == []
    ops = [str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert "aten.add.Tensor" in ops and "aten.div.Tensor" in ops
    assert torch.equal(captured.program.module()(x), model(x))


@pytest.mark.parametrize("mode, kept", [("view", "aten.add_.Tensor"), ("buffer", "aten.add_.Tensor")])
def test_in_place_updates_another_name_could_see_are_left_as_they_are(mode: str, kept: str) -> None:
    captured = capture(_InPlace(mode), (torch.randn(2, 4, 8),))
    assert kept in _mutable_ops(captured)


def _assert_compiles_like_the_model(model: torch.nn.Module, x: torch.Tensor) -> None:
    """``model`` compiled on one rank gives the loss and the parameter gradients of an untouched copy of it."""
    import copy

    import primepar_fx

    ref = copy.deepcopy(model)
    module = primepar_fx.compile(model, (x,), plan="data_parallel", world_size=1)
    loss = module(x)
    loss.backward()
    want = ref(x)
    want.backward()
    torch.testing.assert_close(loss, want)
    grads = module.gather_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


class _MaskedUnderNoGrad(torch.nn.Module):
    """A forward with a ``torch.no_grad()`` block (export keeps it as ``wrap_with_set_grad_enabled``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            mask = (h.abs() > h.abs().mean(-1, keepdim=True)).to(h.dtype)
            scale = h.abs().amax(-1, keepdim=True) + 1.0
        return (h * mask / scale).sum()


def test_a_no_grad_block_is_inlined_with_its_results_detached():
    from primepar_fx.graph.build import build_graph

    torch.manual_seed(0)
    model, x = _MaskedUnderNoGrad(), torch.randn(2, 4, 8)
    captured = capture(model, (x,))
    targets = [n.target for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert not any("wrap_with_set_grad_enabled" in str(t) for t in targets)
    assert targets.count(torch.ops.aten.detach.default) == 2  # the mask (cast inside the block) and the scale
    graph = build_graph(captured)
    detached = [n.name for n in graph.nodes.values() if n.target is torch.ops.aten.detach.default]
    edges = [(v, d["dst_in"]) for u in detached for _, v, d in graph.graph.out_edges(u, data=True)]
    assert len(edges) == 2 and all(k in graph.nodes[v].dims.no_grad for v, k in edges)  # no gradient priced back
    _assert_compiles_like_the_model(model, x)


class _FilledBySlices(torch.nn.Module):
    """Keys built as DeepSeek-V3 builds them: a fresh tensor whose last dim is filled slice by slice."""

    def __init__(self, cover: bool = True) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 6), torch.nn.Linear(8, 2)
        self.cover = cover

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        out = a.new_empty(*a.shape[:-1], 8 if self.cover else 9)
        out[..., :6].copy_(a)
        out[..., 6:8].copy_(b)
        return (out[..., :8] * x).sum()


def test_a_tensor_filled_slice_by_slice_is_captured_as_a_concatenation():
    torch.manual_seed(0)
    model, x = _FilledBySlices(), torch.randn(2, 4, 8)
    targets = [n.target for n in capture(model, (x,)).gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cat.default in targets
    assert torch.ops.aten.copy_.default not in targets and torch.ops.aten.new_empty.default not in targets
    _assert_compiles_like_the_model(model, x)
    # a fill that leaves part of the tensor unwritten is not a concatenation: left as it is
    partial = [n.target for n in capture(_FilledBySlices(cover=False), (x,)).gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.copy_.default in partial and torch.ops.aten.cat.default not in partial


class _ComplexRotary(nn.Module):
    """Attention queries rotated in complex arithmetic, as Meta's Llama code and DeepSeek-V2 do it."""

    def __init__(self, mode: str = "rotary") -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 8)
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        freqs = torch.arange(s, device=x.device).float()[:, None] * self.inv_freq  # (S, 4)
        cis = torch.polar(torch.ones_like(freqs), freqs) * 0.5  # complex times a real number
        q = torch.view_as_complex(self.q(x).float().reshape(b, s, 2, 4, 2))  # (B, S, 2 heads, 4)
        k = torch.view_as_complex(self.k(x).reshape(b, s, 1, 4, 2))  # one key head
        cis = cis[None, :, None, :]  # views of a complex tensor
        q, k = q * cis, (k * cis) * torch.sigmoid(x[..., :1, None])  # complex times complex, times a real tensor
        if self.mode == "abs":
            return (q.abs() * 1.0).sum()  # no real form here: left complex
        out = torch.view_as_real(q + k.expand(b, s, 2, 4)).flatten(3)  # (B, S, 2, 8)
        return (out * x[..., None, :8]).sum()


def _complex_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [
        n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()
    ]


def test_complex_rotary_is_captured_as_real_pairs_and_trains_like_the_model() -> None:
    torch.manual_seed(0)
    model, x = _ComplexRotary(), torch.randn(2, 6, 16)
    captured = capture(model, (x,))
    assert _complex_nodes(captured.gm) == []
    targets = {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert not targets & {torch.ops.aten.polar.default, torch.ops.aten.view_as_complex.default}
    assert {torch.ops.aten.cos.default, torch.ops.aten.sin.default, torch.ops.aten.stack.default} <= targets
    torch.testing.assert_close(captured.program.module()(x), model(x))
    _assert_compiles_like_the_model(model, x)


def test_a_complex_op_without_a_real_form_leaves_the_graph_complex_and_is_named() -> None:
    from primepar_fx.api import analyze

    model, x = _ComplexRotary("abs"), torch.randn(2, 6, 16)
    captured = capture(model, (x,))
    assert "polar" in _complex_nodes(captured.gm)  # all or nothing: nothing rewritten
    with pytest.raises(MissingRuleError, match="polar"):
        analyze(model, (x,))
