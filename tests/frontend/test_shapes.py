"""Tests for primepar_fx.frontend.shapes: symbolic shapes in B and S, and the byte helpers."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

from primepar_fx.frontend.capture import Captured, capture
from primepar_fx.frontend.shapes import (
    annotate,
    evaluate,
    nbytes,
    node_bytes,
    numel,
    shape_of,
    shapes_of,
    source_line,
    sym_expr,
)
from primepar_fx.frontend.specialize import ShapeSpecializationError
from primepar_fx.frontend.symbols import META_DTYPES, META_SHAPES, META_SYMVALUE, B, S

IN, OUT = 8, 4


class LinearSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).split(OUT // 2, dim=-1)
        return (a * b).to(torch.float16).reshape(x.shape[0], -1)


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.nonzero(x > 0)
        return x.sum() + idx.sum()


@pytest.fixture(scope="module")
def linear() -> Captured:
    captured = capture(LinearSplit(), (torch.randn(2, 16, IN),))
    annotate(captured)
    return captured


def _node(captured: Captured, target: object) -> torch.fx.Node:
    return next(n for n in captured.gm.graph.nodes if n.target == target)


# ------------------------------------------------------------------------------------------------- sym_expr
def test_sym_expr_turns_an_int_into_a_sympy_integer() -> None:
    assert sym_expr(7) == sympy.Integer(7)


def test_sym_expr_maps_export_symbols_to_b_and_s(linear: Captured) -> None:
    x = next(n for n in linear.gm.graph.nodes if n.name == "x")
    batch, seq, hidden = x.meta["val"].shape
    assert isinstance(batch, torch.SymInt) and isinstance(seq, torch.SymInt)
    assert sym_expr(batch, linear.symbol_map) == B
    assert sym_expr(seq * 3 + 1, linear.symbol_map) == 3 * S + 1
    assert sym_expr(hidden, linear.symbol_map) == IN


def test_sym_expr_rejects_bools_and_floats() -> None:
    with pytest.raises(ValueError, match="bool"):
        sym_expr(True)
    with pytest.raises(ValueError, match="float"):
        sym_expr(1.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- annotate
def test_annotate_records_shapes_and_dtypes_per_tensor_output(linear: Captured) -> None:
    fc = _node(linear, torch.ops.aten.linear.default)
    assert fc.meta[META_SHAPES] == ((B, S, OUT),)
    assert fc.meta[META_DTYPES] == (torch.float32,)
    split = _node(linear, torch.ops.aten.split.Tensor)
    assert split.meta[META_SHAPES] == ((B, S, OUT // 2), (B, S, OUT // 2))
    assert shape_of(split) is None and len(shapes_of(split)) == 2
    cast = _node(linear, torch.ops.aten.to.dtype)
    assert cast.meta[META_DTYPES] == (torch.float16,)
    reshape = _node(linear, torch.ops.aten.reshape.default)
    assert shape_of(reshape) == (B, S * OUT // 2)


def test_symbolic_integer_nodes_get_no_shape_but_a_value(linear: Captured) -> None:
    sizes = [n for n in linear.gm.graph.nodes if n.target == torch.ops.aten.sym_size.int]
    assert sizes, "the reshape should read the batch size through aten.sym_size.int"
    for node in sizes:
        assert node.meta[META_SHAPES] == ()
        assert node.meta[META_SYMVALUE] in (B, S)


def test_parameters_get_static_shapes(linear: Captured) -> None:
    weight = next(n for n, fqn in linear.params.items() if fqn == "fc.weight")
    node = next(n for n in linear.gm.graph.nodes if n.name == weight)
    assert node.meta[META_SHAPES] == ((OUT, IN),)


def test_shapes_of_an_unannotated_node_says_to_annotate_first() -> None:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    with pytest.raises(ValueError, match="run primepar_fx.frontend.shapes.annotate first"):
        shapes_of(node)


def test_a_data_dependent_size_is_reported_with_its_node_and_source_line() -> None:
    captured = capture(DataDependent(), (torch.randn(2, 16),))
    with pytest.raises(ShapeSpecializationError) as info:
        annotate(captured)
    message = str(info.value)
    assert "nonzero" in message and "aten.nonzero.default" in message
    assert "test_shapes.py" in message and "idx = torch.nonzero(x > 0)" in message


def test_a_seq_symbol_pinned_in_the_shape_env_is_reported() -> None:
    captured = capture(LinearSplit(), (torch.randn(2, 16, IN),))
    x = next(n for n in captured.gm.graph.nodes if n.name == "x")
    shape_env = x.meta["val"].fake_mode.shape_env
    seq_symbol = next(k for k, v in captured.symbol_map.items() if v == S)
    shape_env.replacements[seq_symbol] = sympy.Integer(16)  # what a hard-coded view does under FakeTensorProp
    with pytest.raises(ShapeSpecializationError, match="seq dim .* specialised to the constant 16") as info:
        annotate(captured)
    assert info.value.dims == ("seq",)


def test_source_line_prefers_the_model_frame_over_torch_internals(linear: Captured) -> None:
    line = source_line(_node(linear, torch.ops.aten.linear.default))
    assert line is not None and "test_shapes.py" in line and "self.fc(x)" in line


# ---------------------------------------------------------------------------------------------- bytes
def test_numel_and_nbytes_are_exact() -> None:
    shape = (B, S, sympy.Integer(64))
    assert numel(shape) == 64 * B * S
    assert nbytes(shape, torch.float16) == 128 * B * S
    assert nbytes(shape, torch.float32) == 256 * B * S
    assert numel(()) == 1 and nbytes((), torch.int64) == 8


def test_node_bytes_of_a_linear_counts_input_weight_bias_and_output(linear: Captured) -> None:
    read, written = node_bytes(_node(linear, torch.ops.aten.linear.default))
    assert sympy.expand(read - (B * S * IN * 4 + OUT * IN * 4 + OUT * 4)) == 0
    assert sympy.expand(written - B * S * OUT * 4) == 0
    assert evaluate(read, 2, 16) == 2 * 16 * IN * 4 + OUT * IN * 4 + OUT * 4


def test_node_bytes_of_a_cast_reads_float32_and_writes_float16(linear: Captured) -> None:
    read, written = node_bytes(_node(linear, torch.ops.aten.to.dtype))
    assert sympy.expand(read - B * S * (OUT // 2) * 4) == 0
    assert sympy.expand(written - B * S * (OUT // 2) * 2) == 0


# ------------------------------------------------------------------------------------------- evaluate
def test_evaluate_substitutes_batch_and_seq() -> None:
    assert evaluate(B * S * 64, 4, 128) == 4 * 128 * 64
    assert isinstance(evaluate(B * S, 2, 3), int)
    assert evaluate(S / 4, 2, 6) == 1.5
    assert evaluate(7, 2, 3) == 7


def test_evaluate_rejects_other_symbols() -> None:
    with pytest.raises(ValueError, match="are not B or S"):
        evaluate(sympy.Symbol("s72") * B, 2, 3)
