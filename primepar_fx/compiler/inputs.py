"""The inputs a compiled module is called with: their ``B`` and ``S``, checked, and the graph at other sizes.

:func:`sizes_of` reads the batch and sequence length of a call's inputs from the captured (symbolic) shapes of its
user inputs and raises, naming the input and the dim, on a dtype, rank or size the compiled model cannot take.
:func:`at_sizes` gives a copy of the captured graph whose tensor metadata is that of other sizes, so the per-rank
passes can rebuild a graph for them (:class:`~primepar_fx.compiler.module.PrimeParModule` does, reusing its plan).
:func:`no_specialisation` keeps reading a ``SymInt`` as an ``int`` from pinning ``B`` or ``S`` in the program.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph


class InputSpec(NamedTuple):
    """A user input as compiled: its name, its shape in ``B``, ``S`` and integers, its dtype (``None``: not a
    tensor)."""

    name: str
    shape: tuple[sympy.Expr, ...] | None
    dtype: torch.dtype | None


def input_spec(node: fx.Node, symbol_map: Mapping[sympy.Symbol, sympy.Symbol]) -> InputSpec:
    """The :class:`InputSpec` of a user-input placeholder of the captured graph."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return InputSpec(node.name, None, None)

    def dim(size: Any) -> sympy.Expr:
        if isinstance(size, torch.SymInt):
            return sympy.sympify(size.node.expr).xreplace(dict(symbol_map))
        return sympy.Integer(int(size))

    return InputSpec(node.name, tuple(dim(s) for s in val.shape), val.dtype)


def size_ranges(captured: Any) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """``B`` and ``S`` -> the ``[low, high]`` export captured them for (``high`` ``None`` when unbounded)."""
    out = {}
    for sym, ours in captured.symbol_map.items():
        vr = captured.program.range_constraints.get(sym)
        if vr is None:
            continue
        lo, hi = vr.lower, vr.upper
        out[ours] = (
            int(lo) if isinstance(lo, sympy.Integer) else 1,
            int(hi) if isinstance(hi, sympy.Integer) else None,
        )
    return out


def sizes_of(
    specs: list[InputSpec],
    flat: list[Any],
    ranges: Mapping[sympy.Symbol, tuple[int, int | None]],
    default: tuple[int, int],
) -> tuple[int, int]:
    """The ``(B, S)`` of the inputs ``flat``; raises naming the input and dim whose dtype or size cannot be run.

    ``B`` and ``S`` are read from the first input dim that is exactly that symbol; every other dim must then equal
    its compiled expression. A symbol no input carries keeps its ``default``.
    """
    bound: dict[sympy.Symbol, int] = {}
    pairs = list(zip(specs, flat))
    for (name, shape, dtype), x in pairs:
        if shape is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor (it was one at compile time), got {type(x).__name__}")
        if x.dtype != dtype:
            raise TypeError(
                f"input {name!r} has dtype {x.dtype} but the module was compiled for {dtype}; cast it to "
                f"{dtype}, or compile again with example inputs of dtype {x.dtype}"
            )
        if x.dim() != len(shape):
            raise ValueError(f"input {name!r} has {x.dim()} dims but the module was compiled for {len(shape)}")
        for expr, n in zip(shape, x.shape):
            if expr in (B, S):
                bound.setdefault(expr, int(n))
    for (name, shape, _), x in pairs:
        for d, (expr, n) in enumerate(zip(shape or (), x.shape if shape else ())):
            want = expr.xreplace({k: sympy.Integer(v) for k, v in bound.items()})
            if not (want.is_Integer and int(want) == int(n)):
                compiled = tuple(str(e) for e in shape)  # type: ignore[union-attr]
                why = f"fixes it at {expr}" if expr.is_Integer else f"makes it {expr} = {want} here"
                raise ValueError(
                    f"input {name!r} dim {d} has size {int(n)} but the compiled model (shape {compiled}) {why}"
                )
    sizes = (bound.get(B, default[0]), bound.get(S, default[1]))
    for sym, value in zip((B, S), sizes):
        lo, hi = ranges.get(sym, (1, None))
        if value < lo or (hi is not None and value > hi):
            raise ValueError(
                f"{sym}={value} is outside the range [{lo}, {hi if hi is not None else 'inf'}] the model was "
                "captured for; compile again with example inputs of this size"
            )
    return sizes


def at_sizes(graph: OpGraph, values: Mapping[sympy.Symbol, int]) -> OpGraph:
    """``graph`` whose captured GraphModule carries the tensor metadata of sizes ``values`` (a copy).

    The passes read a few sizes from ``node.meta["val"]`` as integers, which gives the example's; a fake run of a
    copy of the graph at the new sizes gives them the new ones. The plan and the rules are symbolic and are shared.
    """
    captured = graph.captured
    subs = {sym: sympy.Integer(values[ours]) for sym, ours in captured.symbol_map.items()}
    copy = fx.Graph()
    copy.output(copy.graph_copy(captured.gm.graph, {}))
    gm = fx.GraphModule(captured.gm, copy)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs: list[Any] = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                inputs.append(val)
                continue
            shape = [
                int(sympy.sympify(d.node.expr).xreplace(subs)) if isinstance(d, torch.SymInt) else int(d)
                for d in val.shape
            ]
            inputs.append(torch.empty(shape, dtype=val.dtype, device=val.device).requires_grad_(val.requires_grad))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return dataclasses.replace(graph, captured=dataclasses.replace(captured, gm=gm))


def no_specialisation(captured: Any) -> Any:
    """A context in which reading a ``SymInt`` as an ``int`` does not pin ``B`` or ``S`` in the captured program.

    ``int()`` of an export ``SymInt`` adds a guard that replaces the symbol by its example value for good; the
    passes do that, which would leave every later rebuild (a new ``B`` or ``S``) at the example's sizes.
    """
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        for size in val.shape if isinstance(val, torch.Tensor) else ():
            if isinstance(size, torch.SymInt):
                return size.node.shape_env.suppress_guards()
    return contextlib.nullcontext()


def bind_call(captured: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call as the example made it: the model's arguments bound to its signature, then given positionally and by
    keyword as in the capture, so ``m(ids, labels)`` and ``m(input_ids=ids, labels=labels)`` both work."""
    call = captured.call
    if call is None:
        return args, kwargs
    signature, positional, keyword = call
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise TypeError(f"the compiled module takes the model's arguments {signature}: {e}") from None
    missing = [n for n in (*positional, *keyword) if n not in bound]
    extra = [n for n in bound if n not in positional and n not in keyword]
    if missing or extra:
        what = [f"without {', '.join(map(repr, missing))}"] if missing else []
        what += [f"with {', '.join(map(repr, extra))}"] if extra else []
        raise TypeError(
            f"called {' and '.join(what)}, but the module was compiled with the inputs {[*positional, *keyword]}: "
            "call it with the inputs it was compiled with, or compile with these"
        )
    return tuple(bound[n] for n in positional), {n: bound[n] for n in keyword}


def unused_tied(graph: OpGraph) -> dict[str, str]:
    """Each tied parameter name the captured graph never reads -> the name sharing its storage that it reads."""
    program = graph.captured.program
    placeholders = [n for n in graph.captured.gm.graph.nodes if n.op == "placeholder"]
    used = {s.target for n, s in zip(placeholders, program.graph_signature.input_specs) if n.users}
    tied_used = {}
    for alias, canon in graph.tied.items():
        if alias in used and canon not in used:
            tied_used[canon] = alias
        elif canon in used and alias not in used:
            tied_used[alias] = canon
    return tied_used
