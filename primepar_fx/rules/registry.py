"""The single op-rule registry, keyed by ATen ``OpOverload`` objects (never by strings).

Rules are registered with :func:`register_rule`, which accepts one op, an ``OpOverloadPacket`` (all of its
overloads) or a list of either. A rule is ``rule(node, ctx) -> OpDims``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from primepar_fx.rules.spec import OpDims, Shape, TensorMap

log = logging.getLogger(__name__)

RuleFn = Callable[[fx.Node, "RuleContext"], OpDims]
_RULES: dict[object, RuleFn] = {}


class MissingRuleError(NotImplementedError):
    """No dimension rule is registered for a node's op."""


class RuleError(ValueError):
    """A rule could not describe a node (unexpected arguments or shapes)."""


@dataclass(frozen=True, slots=True)
class RuleContext:
    """What a rule may look at besides the node: symbolic shapes of tensors.

    ``shape_of`` maps an fx node (a tensor-valued input) to its symbolic shape; ``out_shapes`` are the node's
    own tensor outputs, flattened.
    """

    shape_of: Callable[[fx.Node], Shape | None]
    out_shapes: tuple[Shape, ...]

    def shape(self, node: object) -> Shape:
        if not isinstance(node, fx.Node):
            raise RuleError(f"expected a tensor input, got {node!r}")
        shp = self.shape_of(node)
        if shp is None:
            raise RuleError(f"input {node.name} has no tensor shape")
        return shp

    def input_shapes(self, node: fx.Node) -> tuple[Shape | None, ...]:
        return tuple(self.shape_of(n) for n in node.all_input_nodes)


def _expand(ops: object) -> list[object]:
    if isinstance(ops, torch._ops.OpOverloadPacket):
        return [getattr(ops, name) for name in ops.overloads()]
    if isinstance(ops, (list, tuple)):
        return [o for op in ops for o in _expand(op)]
    if isinstance(ops, str):
        raise TypeError(f"rules are keyed by op objects, not strings: {ops!r}")
    return [ops]


def register_rule(ops: object) -> Callable[[RuleFn], RuleFn]:
    """Decorator: register ``fn`` as the rule of one op, a packet's overloads, or a list of them."""

    targets = _expand(ops)

    def deco(fn: RuleFn) -> RuleFn:
        for op in targets:
            if op in _RULES and _RULES[op] is not fn:
                raise ValueError(f"a rule for {op} is already registered ({_RULES[op].__qualname__})")
            _RULES[op] = fn
        return fn

    return deco


def get_rule(target: object) -> RuleFn | None:
    return _RULES.get(target)


def registered_ops() -> tuple[object, ...]:
    return tuple(_RULES)


def source_line(node: fx.Node) -> str:
    """The model source line a node came from (the last frame of its stack trace), or ``"<unknown>"``."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}".strip()
    return "<unknown>"


def op_name(target: object) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", repr(target))


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
    import primepar_fx.rules  # noqa: F401  (fills the registry)

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
