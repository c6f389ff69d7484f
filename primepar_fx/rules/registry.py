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

from primepar_fx.frontend.shapes import source_line as innermost_source_line
from primepar_fx.frontend.symbols import Shape
from primepar_fx.rules.spec import OpDims, TensorMap

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
    """The model source line a node came from (the innermost frame outside torch), or ``"<unknown>"``."""
    return innermost_source_line(node) or "<unknown>"


def op_name(target: object) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", repr(target))


# ------------------------------------------------------------------------------------- helpers for rule authors
def arg(node: fx.Node, name: str, default: object = None) -> object:
    """Argument ``name`` of an ATen node, passed positionally, by keyword or left at its schema default."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        raise RuleError(f"{op_name(node.target)} has no schema to look argument {name!r} up in")
    for i, a in enumerate(schema.arguments):
        if a.name != name:
            continue
        if not a.kwarg_only and i < len(node.args):
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        return a.default_value if a.has_default_value() else default
    raise RuleError(f"{op_name(node.target)} has no argument {name!r}")


def same_size(a: object, b: object) -> bool:
    """Whether two (symbolic) sizes are equal."""
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def is_one(size: object) -> bool:
    return same_size(size, 1)


def symbolic_name(size: sympy.Expr) -> str | None:
    """``"B"`` for the symbol ``B``, ``"BS"`` for ``B*S``; ``None`` for a size that is not a product of symbols."""
    if size.is_Symbol:
        return str(size)
    if size.is_Mul and all(f.is_Symbol for f in size.args):
        return "".join(sorted(str(f) for f in size.args))
    return None


class DimNamer:
    """Hands out unique, readable iteration dim names for one node and records their sizes.

    A dim is named by its role when the rule gives one (``N``, ``K``, ``H``, ``E``, ``V``, ``D``), else after its
    symbolic size (``B``, ``S``; a second ``S``-sized dim is ``T``; ``B*S`` is ``BS``), else by ``hint``, else by
    position (``d0``, ``d1`` ...). A taken name gets a numeric suffix (``H2``, ``d2_2``).
    """

    def __init__(self) -> None:
        self.dims: list[str] = []
        self.sizes: list[sympy.Expr] = []

    def new(self, size: object, *, role: str | None = None, hint: str | None = None, pos: int | None = None) -> str:
        size = sympy.sympify(size)
        name = role or symbolic_name(size) or hint or f"d{len(self.dims) if pos is None else pos}"
        name = self._unique(name)
        self.dims.append(name)
        self.sizes.append(size)
        return name

    def _unique(self, name: str) -> str:
        if name not in self.dims:
            return name
        if name == "S" and "T" not in self.dims:
            return "T"
        sep = "_" if name[-1].isdigit() else ""
        k = 2
        while f"{name}{sep}{k}" in self.dims:
            k += 1
        return f"{name}{sep}{k}"

    def map(self, shape: Shape, *, hints: dict[int, str] | None = None) -> TensorMap:
        """Fresh dims for every dim of ``shape`` (positional names), ``()`` for size-1 dims."""
        hints = hints or {}
        return tuple(
            () if is_one(size) else (self.new(size, hint=hints.get(i), pos=i),) for i, size in enumerate(shape)
        )

    def build(
        self, kind: str, inputs: Iterable[TensorMap | None], outputs: Iterable[TensorMap], **kw: object
    ) -> OpDims:
        return OpDims(
            kind=kind,
            dims=tuple(self.dims),
            sizes=tuple(self.sizes),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            **kw,  # type: ignore[arg-type]
        )


def broadcast_map(shape: Shape, onto: TensorMap, onto_shape: Shape) -> TensorMap:
    """Right-aligned numpy broadcasting: the map of a tensor of ``shape`` read by a result laid out as ``onto``.

    A size-1 dim maps to ``()`` (broadcast); every other dim must equal the result's dim it aligns with.
    """
    off = len(onto_shape) - len(shape)
    if off < 0:
        raise RuleError(f"cannot broadcast shape {shape} onto the smaller {onto_shape}")
    out: list[tuple[str, ...]] = []
    for i, size in enumerate(shape):
        if is_one(size):
            out.append(())
        elif same_size(size, onto_shape[off + i]):
            out.append(onto[off + i])
        else:
            raise RuleError(f"cannot broadcast shape {shape} onto {onto_shape} (dim {i})")
    return tuple(out)


def align_inputs(node: fx.Node, maps: dict[fx.Node, TensorMap | None]) -> tuple[TensorMap | None, ...]:
    """Order per-input maps as ``node.all_input_nodes`` (``None`` for inputs without one)."""
    return tuple(maps.get(n) for n in node.all_input_nodes)


def tensor_arg(node: fx.Node, name: str) -> fx.Node:
    """The tensor argument ``name`` (positional or keyword) of ``node``; a :class:`RuleError` if it is not one."""
    x = arg(node, name)
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor {name}, got {x!r}")
    return x
