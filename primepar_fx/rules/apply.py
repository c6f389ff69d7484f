"""Apply the registered rule of a node: the one entry point of the rules stage.

Importing this module imports every rule family, so the registry is full before the first lookup.
"""

from __future__ import annotations

import logging

import sympy
from torch import fx

from primepar_fx.frontend.symbols import Shape
from primepar_fx.rules import (  # noqa: F401  (importing a family registers its rules)
    attention,
    embedding,
    factory,
    loss,
    matmul,
    misc,
    moe,
    norm,
    pointwise,
    view,
)
from primepar_fx.rules.registry import MissingRuleError, RuleContext, RuleError, get_rule, op_name, source_line
from primepar_fx.rules.spec import OpDims, TensorMap

log = logging.getLogger(__name__)


def replicate_dims(node: fx.Node, ctx: RuleContext) -> OpDims:
    """The opt-in fallback: an opaque op whose every dim is unsplittable, so it runs replicated."""
    ins: list[TensorMap | None] = []
    dims: list[str] = []
    sizes: list[sympy.Expr] = []

    def fresh(shape: Shape, tag: str) -> TensorMap:
        out = []
        for i, size in enumerate(shape):
            name = f"{tag}{i}"
            dims.append(name)
            sizes.append(sympy.sympify(size))
            out.append((name,))
        return tuple(out)

    for j, shp in enumerate(ctx.input_shapes(node)):
        ins.append(None if shp is None else fresh(shp, f"i{j}_"))
    outs = tuple(fresh(shp, f"o{j}_") for j, shp in enumerate(ctx.out_shapes))
    return OpDims("meta", tuple(dims), tuple(sizes), tuple(ins), outs, no_split=frozenset(dims))


def op_dims(node: fx.Node, ctx: RuleContext, *, fallback: str | None = None) -> OpDims:
    """Apply the registered rule of ``node.target``.

    Raises :class:`MissingRuleError` naming the op, the node and the model source line when there is no rule,
    unless ``fallback="replicate"`` is given.
    """
    rule = get_rule(node.target)
    if rule is None:
        if fallback == "replicate":
            log.warning("no rule for %s (node %s); replicating it", op_name(node.target), node.name)
            return replicate_dims(node, ctx)
        if fallback is not None:
            raise ValueError(f"unknown fallback {fallback!r}; the only one is 'replicate'")
        raise MissingRuleError(
            f"no dimension rule for op {op_name(node.target)} at node '{node.name}' "
            f"(model source: {source_line(node)}). Register one with "
            f"primepar_fx.rules.register_rule, or pass fallback='replicate' to run it replicated."
        )
    try:
        return rule(node, ctx)
    except RuleError as e:
        raise RuleError(
            f"rule for {op_name(node.target)} failed at node '{node.name}' ({source_line(node)}): {e}"
        ) from e
