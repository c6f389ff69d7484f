"""Factories: tensors made from sizes and scalars (``arange``, ``full``, ``zeros`` ...), declared as tables.

The output's dims are iteration dims named after their sizes (``arange(S)`` has the dim ``S``). They are
splittable: a device makes its own slice (the lowering offsets ``arange`` and the like by the slice start).
Tensor inputs: the ``*_like`` ops map ``self`` 1:1 onto the output (same shape, no data read, so any layout
works without a collective); ``new_*`` ops read only ``self``'s dtype and device, so it maps to ``None``; a
0-d tensor argument (``linspace``'s tensor ends) maps to ``()``.
"""

from __future__ import annotations

from torch import fx

from primepar_fx.rules.pointwise import resolve
from primepar_fx.rules.registry import DimNamer, RuleContext, RuleError, align_inputs, register_rule
from primepar_fx.rules.spec import OpDims, TensorMap

#: Ops whose output shape comes from size arguments alone.
FACTORIES: dict[str, tuple[str, ...]] = {
    "arange": ("default", "start", "start_step"),
    "full": ("default",),
    "ones": ("default",),
    "zeros": ("default",),
    "empty": ("memory_format",),
    "empty_strided": ("default",),
    "scalar_tensor": ("default",),
    "rand": ("default", "generator"),
    "randn": ("default", "generator"),
    "randint": ("default", "generator", "low", "low_generator"),
    "linspace": ("default", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor"),
    "eye": ("default", "m"),
    "new_ones": ("default",),
    "new_zeros": ("default",),
    "new_empty": ("default",),
    "new_full": ("default",),
    "new_empty_strided": ("default",),
}

#: Ops whose output has the shape of ``self`` (which they do not read).
LIKE: dict[str, tuple[str, ...]] = {
    "zeros_like": ("default",),
    "ones_like": ("default",),
    "empty_like": ("default",),
    "full_like": ("default",),
    "rand_like": ("default", "generator"),
    "randn_like": ("default", "generator"),
    "randint_like": ("default", "Tensor", "low_dtype"),
}

_FACTORY_OPS, _MISSING = resolve(FACTORIES)
_LIKE_OPS, _MISSING_LIKE = resolve(LIKE)
#: Table entries this torch build does not have.
UNRESOLVED: tuple[str, ...] = tuple(_MISSING + _MISSING_LIKE)


def _factory(node: fx.Node, ctx: RuleContext, *, like: bool) -> OpDims:
    if len(ctx.out_shapes) != 1:
        raise RuleError(f"expected one tensor output, got {len(ctx.out_shapes)}")
    nm = DimNamer()
    omap = nm.map(ctx.out_shapes[0])
    maps: dict[fx.Node, TensorMap | None] = {}
    for n in node.all_input_nodes:
        shp = ctx.shape_of(n)
        if shp is not None and len(shp) == 0:
            maps[n] = ()
    if like:
        first = node.args[0]
        if not isinstance(first, fx.Node):
            raise RuleError(f"expected a tensor self, got {first!r}")
        maps[first] = omap
    return nm.build("factory", align_inputs(node, maps), (omap,))


@register_rule(_FACTORY_OPS)
def factory_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return _factory(node, ctx, like=False)


@register_rule(_LIKE_OPS)
def like_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    return _factory(node, ctx, like=True)
