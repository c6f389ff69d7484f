"""Symbolic shapes of a captured graph, in the two symbols ``B`` (batch) and ``S`` (sequence).

``torch.export`` records a FakeTensor in ``node.meta["val"]`` whose sizes are ``SymInt``s over hashed symbols
(``s72``, ``s95`` ...). :func:`annotate` rewrites them, through the capture's ``symbol_map``, into sympy
expressions over :data:`B` and :data:`S`, stores them under :data:`META_SHAPES` / :data:`META_DTYPES`, and checks
that no other symbol survived (a survivor means a dim got specialised or a data-dependent size appeared).

Byte helpers (:func:`numel`, :func:`nbytes`, :func:`node_bytes`) stay symbolic; :func:`evaluate` turns an
expression into a number for a concrete batch and sequence length.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx

from primepar_fx.frontend.specialize import ShapeSpecializationError
from primepar_fx.frontend.symbols import (
    ALLOWED_SYMBOLS,
    META_DTYPES,
    META_SHAPES,
    META_SYMVALUE,
    B,
    S,
    Shape,
    SymbolMap,
)

if TYPE_CHECKING:
    from primepar_fx.frontend.capture import Captured

log = logging.getLogger(__name__)


_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


# --------------------------------------------------------------------------------------------- conversions
def sym_expr(x: int | torch.SymInt | sympy.Expr, symbol_map: SymbolMap | None = None) -> sympy.Expr:
    """An int or ``SymInt`` as a sympy expression, with export's symbols replaced through ``symbol_map``."""
    if isinstance(x, bool):
        raise ValueError(f"expected an int or SymInt size, got the bool {x!r}")
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, torch.SymInt):
        expr = sympy.sympify(x.node.expr)
    elif isinstance(x, sympy.Expr):
        expr = x
    else:
        raise ValueError(f"expected an int or SymInt size, got {type(x).__name__} {x!r}")
    if symbol_map:
        expr = expr.xreplace(dict(symbol_map))
    return expr


def sym_shape(sizes: Iterable[int | torch.SymInt], symbol_map: SymbolMap | None = None) -> Shape:
    """A tensor's sizes as a :data:`~primepar_fx.rules.spec.Shape`."""
    return tuple(sym_expr(s, symbol_map) for s in sizes)


def _flat_tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _flat_tensors(v)]
    return []


# ----------------------------------------------------------------------------------------------- annotate
def annotate(captured: Captured) -> None:
    """Store :data:`META_SHAPES` and :data:`META_DTYPES` on every node of ``captured.gm`` and check them.

    Raises:
        ShapeSpecializationError: a shape mentions a symbol other than ``B``/``S``, or the ShapeEnv replaced
            the batch or sequence symbol by a constant.
    """
    symbol_map = dict(captured.symbol_map)
    shape_env = None
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val")
        tensors = _flat_tensors(val)
        shapes = tuple(sym_shape(t.shape, symbol_map) for t in tensors)
        node.meta[META_SHAPES] = shapes
        node.meta[META_DTYPES] = tuple(t.dtype for t in tensors)
        exprs: list[sympy.Expr] = [size for shape in shapes for size in shape]
        if isinstance(val, torch.SymInt):
            value = sym_expr(val, symbol_map)
            node.meta[META_SYMVALUE] = value
            exprs.append(value)
        if shape_env is None:
            shape_env = _shape_env_of(val)
        stray = set().union(*(e.free_symbols for e in exprs)) - ALLOWED_SYMBOLS if exprs else set()
        if stray:
            raise ShapeSpecializationError(
                f"node {node.name} ({_op_name(node)}) has a shape in symbols "
                f"{sorted(map(str, stray))} besides B and S: {shapes or node.meta.get(META_SYMVALUE)}. "
                "Its size depends on something other than the batch and sequence lengths (a data-dependent size "
                "such as nonzero()/item(), or an input dim that is neither batch nor seq)."
                f"{_where(node)}",
                location=source_line(node),
            )
    if shape_env is not None:
        _check_replacements(captured, shape_env, ShapeSpecializationError)
    log.debug("annotated %d nodes of %s", len(captured.gm.graph.nodes), captured.model_name)


def _shape_env_of(val: Any) -> Any:
    if isinstance(val, torch.SymInt):
        return val.node.shape_env
    for t in _flat_tensors(val):
        mode = getattr(t, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return None


def _check_replacements(captured: Captured, shape_env: Any, error: type[ShapeSpecializationError]) -> None:
    """Raise if the ShapeEnv pinned an input symbol of the batch or sequence dim to a constant."""
    sizes = {captured.example_batch: "batch", captured.example_seq: "seq"}
    inverse = {v: k for k, v in captured.symbol_map.items()}
    originals = set(captured.symbol_map) | set(shape_env.var_to_sources)
    for sym in originals:
        target = shape_env.replacements.get(sym)
        if target is None or not sympy.sympify(target).is_number:
            continue
        dim = {B: "batch", S: "seq"}.get(captured.symbol_map.get(sym))
        if dim is None:
            dim = sizes.get(int(shape_env.var_to_val.get(sym, -1)), "an input")
        sources = ", ".join(s.name for s in shape_env.var_to_sources.get(sym, ())) or str(inverse.get(sym, sym))
        sloc = shape_env.replacements_slocs.get(sym)
        where = f" (recorded at {sloc})" if sloc is not None else ""
        raise error(
            f"the {dim} dim ({sources}) was specialised to the constant {target}{where}: the model's code fixed "
            f"it while tracing. Compute sizes from the input (x.shape[i] or -1 in view/reshape) instead of "
            "hard-coding them, and avoid Python branches on the batch or sequence length.",
            dims=(dim,) if dim in ("batch", "seq") else (),
            location=str(sloc) if sloc is not None else None,
        )


def _op_name(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method"):
        return str(node.target)
    return node.op


def source_line(node: fx.Node) -> str | None:
    """The model source line a node came from: the innermost frame of ``node.meta["stack_trace"]`` outside torch.

    Falls back to the innermost frame when every frame is inside torch.
    """
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            code = "" if _FRAME.match(lines[i + 1] if i + 1 < len(lines) else "") else following
            frames.append((match.group(1), f"{match.group(1)}:{match.group(2)} in {match.group(3)}", code))
    if not frames:
        return lines[-1].strip()
    outside = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    _, loc, code = (outside or frames)[-1]
    return f"{loc}: {code}" if code else loc


def _where(node: fx.Node) -> str:
    line = source_line(node)
    return f"\n  from the model source line {line}" if line else ""


# ------------------------------------------------------------------------------------------------ helpers
def shapes_of(node: fx.Node) -> tuple[Shape, ...]:
    """The annotated shapes of a node's tensor outputs (run :func:`annotate` first)."""
    try:
        return node.meta[META_SHAPES]
    except KeyError:
        raise ValueError(
            f"node {node.name} has no {META_SHAPES!r}; run primepar_fx.frontend.shapes.annotate first"
        ) from None


def shape_of(node: fx.Node) -> Shape | None:
    """The shape of a node with exactly one tensor output, else ``None``."""
    shapes = shapes_of(node)
    return shapes[0] if len(shapes) == 1 else None


def numel(shape: Shape) -> sympy.Expr:
    """The number of elements of ``shape`` (``1`` for a scalar)."""
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def nbytes(shape: Shape, dtype: torch.dtype) -> sympy.Expr:
    """The size in bytes of a dense tensor of ``shape`` and ``dtype``."""
    return numel(shape) * dtype.itemsize


def output_bytes(node: fx.Node) -> sympy.Expr:
    """Bytes of all tensor outputs of a node."""
    dtypes = node.meta.get(META_DTYPES, ())
    return sympy.Add(*(nbytes(s, d) for s, d in zip(shapes_of(node), dtypes, strict=True)))


def node_bytes(node: fx.Node) -> tuple[sympy.Expr, sympy.Expr]:
    """``(read, written)`` bytes of a node: all tensor outputs of every input node, and its own outputs."""
    read = sympy.Add(*(output_bytes(n) for n in node.all_input_nodes))
    return read, output_bytes(node)


def evaluate(expr: sympy.Expr | int, batch: int, seq: int) -> int | float:
    """``expr`` with ``B = batch`` and ``S = seq``: an int when the result is integral, else a float."""
    value = sympy.sympify(expr).xreplace({B: sympy.Integer(batch), S: sympy.Integer(seq)})
    if value.free_symbols:
        raise ValueError(f"cannot evaluate {expr}: symbols {sorted(map(str, value.free_symbols))} are not B or S")
    if value.is_Integer:
        return int(value)
    return float(value)
