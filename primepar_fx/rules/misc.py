"""Reductions, scans, data-dependent ops, shape/assert (meta) nodes and ``operator.getitem``.

* **Reductions** (``sum``, ``mean``, ``amax``, ``max.dim``, ``var``, ``any`` ...): the reduced dims are absent
  from the output (``keepdim`` leaves ``()`` in their place). For ``sum`` / ``mean`` that is the whole story:
  a split of a reduced dim all-reduces partial sums. Other reductions (max, min, arg-max, var, std, any, all,
  prod, logsumexp, norms) are not sums of partial results, so their reduced dims are ``no_split``.
* **Scans and positional ops** (``cumsum``, ``cumprod``, ``diff``, ``flip``, ``roll``, ``sort``, ``topk``,
  ``tril``, ``triu``): the dims they work along are ``no_split``; the others map 1:1.
* **Data-dependent ops** (``index``, ``index_put``, ``index_select``, ``gather``, ``scatter``, ``repeat``,
  ``repeat_interleave``, ``masked_select``, ``nonzero``, ``as_strided``): which elements they touch depends on
  values (or on strides), so every dim of every tensor is its own ``no_split`` dim: they run replicated.
* **Meta nodes** without tensor outputs (``sym_size``, ``_assert_tensor_metadata``, ``_assert_scalar``, SymInt
  arithmetic through ``operator.mul`` ...): kind ``"meta"``, no dims, every input ``None``.
* **operator.getitem** selecting a tensor from a multi-output node (``split``, ``native_layer_norm``): a
  ``"view"`` whose input map is the selected tensor's (the producer has no single shape), with
  ``extra["selects"]`` the index. The Python arithmetic operators on tensors (torch.compile graphs) are
  element-wise.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from primepar_fx.rules.pointwise import elementwise
from primepar_fx.rules.registry import (
    DimNamer,
    RuleContext,
    RuleError,
    align_inputs,
    arg,
    register_rule,
)
from primepar_fx.rules.spec import OpDims, TensorMap
from primepar_fx.rules.view import along_dims_rule, dims_arg, norm_dim

aten = torch.ops.aten


def _self(node: fx.Node) -> fx.Node:
    x = node.args[0] if node.args else node.kwargs.get("self")
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor first argument, got {x!r}")
    return x


# ---------------------------------------------------------------------------------------------- reductions
_SUMS = [aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default]
_OTHER_REDUCTIONS = [
    aten.amax.default,
    aten.amin.default,
    aten.max.dim,
    aten.min.dim,
    aten.max.default,
    aten.min.default,
    aten.argmax.default,
    aten.argmin.default,
    aten.var.correction,
    aten.var.dim,
    aten.var.default,
    aten.std.correction,
    aten.std.dim,
    aten.std.default,
    aten.var_mean.correction,
    aten.var_mean.dim,
    aten.any.dim,
    aten.any.dims,
    aten.any.default,
    aten.all.dim,
    aten.all.dims,
    aten.all.default,
    aten.prod.dim_int,
    aten.prod.default,
    aten.logsumexp.default,
    aten.linalg_vector_norm.default,
]


@register_rule(_SUMS + _OTHER_REDUCTIONS)
def reduce_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _self(node)
    xs = ctx.shape(x)
    schema_args = {a.name for a in node.target._schema.arguments}  # type: ignore[union-attr]
    reduced = set(dims_arg(arg(node, "dim") if "dim" in schema_args else None, len(xs)))
    keepdim = bool(arg(node, "keepdim", False)) if "keepdim" in schema_args else False
    nm = DimNamer()
    xmap = nm.map(xs)
    omap: TensorMap = tuple(() if i in reduced else g for i, g in enumerate(xmap) if keepdim or i not in reduced)
    for shape in ctx.out_shapes:
        if len(shape) != len(omap):
            raise RuleError(f"output {shape} does not fit {xs} reduced over {sorted(reduced)}")
    no_split = frozenset() if node.target in _SUMS else frozenset(d for i in reduced for d in xmap[i])
    return nm.build("reduce", align_inputs(node, {x: xmap}), (omap,) * len(ctx.out_shapes), no_split=no_split)


# ------------------------------------------------------------------------------------ scans and positions
def _along_dims(node: fx.Node, rank: int) -> list[int]:
    t = node.target
    if t in (aten.tril.default, aten.triu.default):
        return [rank - 2, rank - 1] if rank >= 2 else []
    if t == aten.flip.default:
        return dims_arg(arg(node, "dims"), rank)
    if t == aten.roll.default:
        return dims_arg(arg(node, "dims"), rank)  # no dims: a roll of the flattened tensor touches them all
    return [norm_dim(arg(node, "dim", -1), rank)] if rank else []


_SAME_SIZE_ALONG_DIM = [
    aten.cumsum.default,
    aten.cumprod.default,
    aten.flip.default,
    aten.roll.default,
    aten.tril.default,
    aten.triu.default,
    aten.sort.default,
    aten.sort.stable,
]


@register_rule(_SAME_SIZE_ALONG_DIM)
def scan_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _self(node)
    kind = "reduce" if node.target in (aten.cumsum.default, aten.cumprod.default) else "pointwise"
    return along_dims_rule(node, ctx, [x], _along_dims(node, len(ctx.shape(x))), kind=kind, share=True)


@register_rule([aten.diff.default, aten.topk.default])
def resize_dim_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``diff`` (with ``prepend`` / ``append``) and ``topk`` change the size along their dim."""
    x = _self(node)
    data = [x] + [n for n in node.all_input_nodes if n is not x and ctx.shape_of(n) is not None]
    kind = "reduce" if node.target == aten.topk.default else "pointwise"
    return along_dims_rule(node, ctx, data, _along_dims(node, len(ctx.shape(x))), kind=kind)


# -------------------------------------------------------------------------------------- data-dependent ops
_DATA_DEPENDENT = [
    aten.index.Tensor,
    aten.index.Tensor_hacked_twin,
    aten._unsafe_index.Tensor,
    aten.index_put.default,
    aten._unsafe_index_put.default,
    aten.index_select.default,
    aten.gather.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
    aten.repeat.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten.repeat_interleave.self_int,
    aten.masked_select.default,
    aten.nonzero.default,
    aten.as_strided.default,
]


def opaque(node: fx.Node, ctx: RuleContext, kind: str = "view") -> OpDims:
    """Every tensor dim its own ``no_split`` iteration dim (named by size): the op runs replicated."""
    nm = DimNamer()
    maps: dict[fx.Node, TensorMap | None] = {}
    for n in node.all_input_nodes:
        shp = ctx.shape_of(n)
        if shp is not None:
            maps[n] = nm.map(shp)
    outs = tuple(nm.map(s) for s in ctx.out_shapes)
    return nm.build(kind, align_inputs(node, maps), outs, no_split=frozenset(nm.dims))


@register_rule(_DATA_DEPENDENT)
def data_dependent_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return opaque(node, ctx)


# ------------------------------------------------------------------------------------------------- meta
def meta(node: fx.Node, ctx: RuleContext) -> OpDims:
    """No dims: a node that computes no tensor (sizes, asserts, SymInt arithmetic)."""
    if ctx.out_shapes:
        raise RuleError(f"a meta node has no tensor outputs, got {len(ctx.out_shapes)}")
    return OpDims(kind="meta", dims=(), sizes=(), inputs=(None,) * len(node.all_input_nodes), outputs=())


_META_ATEN = [
    "_assert_tensor_metadata.default",
    "sym_size.int",
    "sym_numel.default",
    "sym_stride.int",
    "sym_storage_offset.default",
    "_assert_scalar.default",
    "_assert_async.default",
    "_assert_async.msg",
    "_functional_assert_async.msg",
    "_functional_assert_scalar.default",
    "sym_constrain_range.default",
    "sym_constrain_range_for_size.default",
    "_functional_sym_constrain_range.default",
    "_functional_sym_constrain_range_for_size.default",
    "_local_scalar_dense.default",
    "_print.default",
]
_META_ATEN_OPS = [
    op
    for packet, _, ov in (name.partition(".") for name in _META_ATEN)
    if isinstance(op := getattr(getattr(aten, packet, None), ov, None), torch._ops.OpOverload)
]

#: Python-level functions that act on SymInts in exported graphs (and, for the operators, on tensors under
#: torch.compile, where they are element-wise).
_PY_OPERATORS = [
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.neg,
    operator.pos,
    operator.abs,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.xor,
    operator.invert,
]
_SYM_FUNCTIONS = [
    operator.not_,
    torch.sym_max,
    torch.sym_min,
    torch.sym_float,
    torch.sym_int,
    torch.sym_not,
    torch.sym_ite,
    torch.sym_sum,
    math.ceil,
    math.floor,
    math.trunc,
    math.sqrt,
]


@register_rule(_META_ATEN_OPS + _SYM_FUNCTIONS)
def meta_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return meta(node, ctx)


@register_rule(_PY_OPERATORS)
def python_operator_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return elementwise(node, ctx) if ctx.out_shapes else meta(node, ctx)


def _returns_many(node: fx.Node) -> bool:
    """Whether an ATen node returns a tuple or a list (a ``split`` into one chunk still returns a list)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return len(schema.returns) != 1 or isinstance(schema.returns[0].type, torch.ListType)


@register_rule(operator.getitem)
def getitem_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``operator.getitem(multi_output, i)``: the selected tensor, mapped 1:1 (``extra["selects"] = i``)."""
    if not ctx.out_shapes:
        return meta(node, ctx)
    src, index = node.args[0], node.args[1]
    if not isinstance(src, fx.Node) or not isinstance(index, int) or len(ctx.out_shapes) != 1:
        raise RuleError(f"unsupported getitem({src!r}, {index!r})")
    if not _returns_many(src) and ctx.shape_of(src) is not None:  # indexing a tensor (torch.compile graphs)
        return opaque(node, ctx)
    nm = DimNamer()
    omap = nm.map(ctx.out_shapes[0])
    return nm.build("view", align_inputs(node, {src: omap}), (omap,), extra={"selects": index})
