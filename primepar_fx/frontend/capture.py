"""Capture a model as one ATen graph with a symbolic batch and sequence length.

:func:`capture` runs ``torch.export.export`` (non-strict) with ``Dim("batch")`` on dim ``batch_dim`` and
``Dim("seq", max=...)`` on dim ``seq_dim`` of every tensor input. The graph is left at the ATen level export
produces, *not* decomposed, so ``aten.linear``, ``aten.scaled_dot_product_attention`` and ``aten.layer_norm``
stay single nodes; its op nodes are then renamed densely in graph order (:func:`renumber`). Export names its size
symbols by hash (``s72`` ...); :class:`Captured` maps them onto :data:`~primepar_fx.frontend.shapes.B` and
:data:`~primepar_fx.frontend.shapes.S` through the first tensor user input's shape.

When the model's code pins the batch or sequence length (a hard-coded ``.view(B, 32, ...)``, a Python branch on
the length), export fails with a constraint violation; :func:`capture` re-raises it as
:class:`ShapeSpecializationError`, naming the dim and the model source line that caused it.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from primepar_fx.frontend.complexes import complex_as_real
from primepar_fx.frontend.inplace import fills_to_cat, functionalize_inplace
from primepar_fx.frontend.moe import experts_as_one_op
from primepar_fx.frontend.regions import inline_grad_regions
from primepar_fx.frontend.specialize import (
    DIM_NAMES,
    ShapeSpecializationError,
    capture_error,
    is_constraint_violation,
    record_shape_events,
    specialization_error,
    warn_static_seq,
    why_specialised,
)
from primepar_fx.frontend.symbols import B, S
from primepar_fx.utils.gcpause import gc_paused

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Captured:
    """An exported model, its ATen graph and how its symbols and placeholders map to ours.

    Attributes:
        program: the ``torch.export.ExportedProgram``.
        gm: ``program.graph_module``, ATen-level and not decomposed.
        symbol_map: export's size symbols -> :data:`~primepar_fx.frontend.symbols.B` / :data:`~.symbols.S`.
        params: placeholder name -> parameter FQN.
        buffers: placeholder name -> buffer FQN (persistent, non-persistent and lifted tensor constants).
        user_inputs: placeholder names of the user inputs, in graph order.
        example_batch: the batch size of the example inputs.
        example_seq: the sequence length of the example inputs.
        model_name: a name for logs and reports.
        call: how the example called ``model.forward``: the signature, and the names of the parameters given
            positionally and by keyword; ``None`` when the signature takes ``*args`` or ``**kwargs``.
        static_seq: the sequence length is the example's, an integer in every shape (the model's code would not
            let it stay symbolic); ``symbol_map`` then has no ``S``.
    """

    program: ExportedProgram
    gm: torch.fx.GraphModule
    symbol_map: dict[sympy.Symbol, sympy.Symbol]
    params: dict[str, str]
    buffers: dict[str, str]
    user_inputs: tuple[str, ...]
    example_batch: int
    example_seq: int
    model_name: str
    call: tuple[inspect.Signature, tuple[str, ...], tuple[str, ...]] | None = None
    static_seq: bool = False


# ------------------------------------------------------------------------------------------------ capture
def _unalias(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of example tensors passed twice (``labels=input_ids``).

    Export deduplicates an input passed under two names into one placeholder, which would bake the aliasing into
    the graph: a later call with different ``labels`` would be read from ``input_ids``.
    """
    seen: set[int] = set()

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, fresh, (args, kwargs))


@gc_paused
def capture(
    model: nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    batch_dim: int = 0,
    seq_dim: int = 1,
    seq_max: int | None = None,
    name: str | None = None,
    dynamic: bool = True,
    static_seq: bool = False,
    seq_fallback: bool = True,
    fake_cache: bool = True,
) -> Captured:
    """Export ``model`` with a symbolic batch (dim ``batch_dim``) and sequence length (dim ``seq_dim``).

    The model keeps its current train/eval mode. ``seq_max`` defaults to ``model.config.max_position_embeddings``
    or ``model.config.max_seq`` when the model has one. A model on the ``meta`` device is captured with its
    example inputs moved to ``meta``.

    ``dynamic=False`` captures at the example's sizes (no ``B``/``S`` symbols: every size is an integer), for
    graphs that are already specialised, such as the first graph ``torch.compile`` hands a backend.

    ``static_seq=True`` keeps the batch symbolic and captures the sequence at the example's length (``S`` an
    integer everywhere). ``capture`` falls back to that by itself, with a :class:`StaticSeqWarning` naming the
    model line, when export cannot keep ``S`` symbolic; ``seq_fallback=False`` raises the
    :class:`ShapeSpecializationError` instead.

    ``fake_cache=False`` traces without FakeTensor's dispatch cache. The cache pays when many layers repeat the
    same ops (a whole deep model) and costs when few do (filling it costs more than its few hits return), so the
    two-layer capture of :mod:`primepar_fx.graph.replicate` turns it off. The graph is the same either way.

    The steps: check the arguments (:func:`_check_call`), check and prepare the example inputs
    (:func:`_example_inputs`, :func:`_example_sizes`, :func:`_checked_seq_max`), mark their batch and sequence dims
    dynamic (:func:`_dynamic_shapes`), export (:func:`_export`), rewrite the graph into the ops the rules describe,
    its op nodes renamed densely (:func:`_normalise_graph`), and map the symbols and placeholders
    (:func:`_captured`).

    Raises:
        ValueError: unusable example inputs (no tensor, a batch or sequence of 1, equal batch and sequence sizes).
        ShapeSpecializationError: the model's code pinned or constrained the batch (or, with
            ``seq_fallback=False``, the sequence) length.
    """
    _check_call(model, batch_dim, seq_dim)
    model_name = name or _model_name(model)
    args, kwargs = _example_inputs(model, example_args, example_kwargs)
    batch, seq = _example_sizes(args, kwargs, batch_dim, seq_dim)
    seq_max = _checked_seq_max(model, seq, seq_max)
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs).arguments
    call = _call_of(signature, args, kwargs)
    dynamic_shapes = _dynamic_shapes(bound, batch_dim, seq_dim, seq_max)
    log.info("exporting %s (batch=%d, seq=%d, seq_max=%s)", model_name, batch, seq, seq_max)
    if static_seq and dynamic:
        dynamic_shapes = _dynamic_shapes(bound, batch_dim, None, seq_max)
    try:
        program = _export(
            model, args, kwargs, dynamic_shapes if dynamic else None, fake_cache, (batch, seq), model_name
        )
    except ShapeSpecializationError as e:
        if not dynamic or static_seq or not seq_fallback or e.dims != ("seq",):
            raise
        warn_static_seq(model_name, seq, why_specialised(model, e))
        static_seq = True
        dynamic_shapes = _dynamic_shapes(bound, batch_dim, None, seq_max)
        program = _export(model, args, kwargs, dynamic_shapes, fake_cache, (batch, seq), model_name)
    _normalise_graph(program)
    captured = _captured(
        program,
        symbol_map=_symbol_map(program, batch_dim, None if static_seq else seq_dim) if dynamic else {},
        sizes=(batch, seq),
        model_name=model_name,
        call=call,
        static_seq=static_seq,
    )
    log.info("captured %s: %d nodes", model_name, len(captured.gm.graph.nodes))
    return captured


def _check_call(model: object, batch_dim: int, seq_dim: int) -> None:
    """:func:`capture` takes a module, and two distinct non-negative dims."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"capture() expects a torch.nn.Module, got {type(model).__name__}")
    if batch_dim == seq_dim or batch_dim < 0 or seq_dim < 0:
        raise ValueError(f"batch_dim ({batch_dim}) and seq_dim ({seq_dim}) must be distinct non-negative dims")


def _normalise_graph(program: ExportedProgram) -> None:
    """Rewrite the exported graph in place into the ops the rules describe: grad-mode regions inlined
    (:func:`inline_grad_regions`), fresh tensors filled slice by slice as ``cat`` (:func:`fills_to_cat`), the safe
    in-place ops functional (:func:`functionalize_inplace`), complex intermediates as real pairs
    (:func:`complex_as_real`); then its op nodes renamed densely (:func:`_renumber_program`)."""
    inline_grad_regions(program.graph_module)
    fills_to_cat(program.graph_module)
    functionalize_inplace(program.graph_module)
    complex_as_real(program.graph_module)
    _renumber_program(program)


def _example_inputs(
    model: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example inputs as export takes them: moved to ``meta`` for a model there, tensors passed twice copied
    (:func:`_unalias`)."""
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    if _on_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    return _unalias(args, kwargs)


def _checked_seq_max(model: nn.Module, seq: int, seq_max: int | None) -> int | None:
    """``seq_max``, by default the model's (:func:`config_seq_max`); the example sequence must fit it."""
    if seq_max is None:
        seq_max = config_seq_max(model)
    if seq_max is not None and seq > seq_max:
        raise ValueError(f"the example sequence length {seq} exceeds seq_max={seq_max}")
    return seq_max


def _dynamic_shapes(bound: dict[str, Any], batch_dim: int, seq_dim: int | None, seq_max: int | None) -> dict[str, Any]:
    """Export's ``dynamic_shapes`` for the bound arguments of ``forward``: ``Dim("batch")`` on dim ``batch_dim``
    and ``Dim("seq", max=seq_max)`` on dim ``seq_dim`` (``None``: the sequence stays static) of every tensor that
    has them."""
    batch_d = Dim("batch")
    seq_d = Dim("seq", max=seq_max) if seq_max is not None else Dim("seq")
    marks = ((batch_dim, batch_d),) if seq_dim is None else ((batch_dim, batch_d), (seq_dim, seq_d))

    def spec(t: torch.Tensor) -> dict[int, Any] | None:
        dims = {d: v for d, v in marks if t.dim() > d}
        return dims or None

    return {
        key: pytree.tree_map(lambda v: spec(v) if isinstance(v, torch.Tensor) else None, value)
        for key, value in bound.items()
    }


def _call_of(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[inspect.Signature, tuple[str, ...], tuple[str, ...]] | None:
    """:attr:`Captured.call`: the signature and the parameters given positionally and by keyword, or ``None``
    when the signature takes ``*args`` or ``**kwargs``."""
    variadic = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values())
    return None if variadic else (signature, tuple(list(signature.parameters)[: len(args)]), tuple(kwargs))


def _export(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: dict[str, Any] | None,
    fake_cache: bool,
    sizes: tuple[int, int],
    model_name: str,
) -> ExportedProgram:
    """``torch.export.export`` (non-strict), a constraint violation re-raised as :class:`ShapeSpecializationError`
    naming the model line that caused it (``sizes``: the example batch and seq, to find the symbols concerned), any
    other failure as a :class:`~primepar_fx.frontend.specialize.CaptureError` that quotes it with its model line."""
    with (
        record_shape_events() as events,
        torch._dynamo.config.patch(fake_tensor_cache_enabled=fake_cache),
        experts_as_one_op(model),
    ):
        try:
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:
            if is_constraint_violation(exc):
                raise specialization_error(str(exc), events, {"batch": sizes[0], "seq": sizes[1]}) from exc
            if type(exc).__module__.startswith("primepar_fx."):  # ours, raised through export: as it is
                raise
            raise capture_error(model_name, exc, getattr(model, "config", None)) from exc


def _renumber_program(program: ExportedProgram) -> None:
    """:func:`renumber` the program's graph and rename the output nodes its signature names to match."""
    renamed = renumber(program.graph_module)
    for spec in program.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) in renamed:
            spec.arg.name = renamed[spec.arg.name]


def _captured(
    program: ExportedProgram,
    *,
    symbol_map: dict[sympy.Symbol, sympy.Symbol],
    sizes: tuple[int, int],
    model_name: str,
    call: tuple[inspect.Signature, tuple[str, ...], tuple[str, ...]] | None,
    static_seq: bool = False,
) -> Captured:
    """The :class:`Captured` of an exported and renumbered ``program``; ``sizes``: the example batch and seq."""
    sig = program.graph_signature
    buffers = dict(sig.inputs_to_buffers)
    buffers.update(sig.inputs_to_lifted_tensor_constants)
    return Captured(
        program=program,
        gm=program.graph_module,
        symbol_map=symbol_map,
        params=dict(sig.inputs_to_parameters),
        buffers=buffers,
        user_inputs=tuple(sig.user_inputs),
        example_batch=sizes[0],
        example_seq=sizes[1],
        static_seq=static_seq,
        model_name=model_name,
        call=call,
    )


_NUMBERED = re.compile(r"^(.*)_(\d+)$")
#: names FX never gives a node (keywords and builtins such as ``pow``, ``and``, ``slice``): their first node is ``_1``
_FX_ILLEGAL = frozenset(torch.fx.graph._illegal_names)


def split_name(name: str) -> tuple[str, int]:
    """``"add_3"`` -> ``("add", 3)``; ``"add"`` -> ``("add", 0)``."""
    m = _NUMBERED.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def renumber(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Name the op nodes densely in graph order: the ``k``-th node named ``add...`` becomes ``add_k`` (``add``;
    ``pow_1`` for the first ``pow``, since FX keeps Python's keywords and builtins for themselves).

    ``torch.export`` numbers names in the order it created nodes, including nodes it later removed (size
    arithmetic, dead mask code), so its numbering has gaps that depend on the whole trace. Dense names depend
    only on the graph: a model's ``k``-th layer's nodes are numbered ``first + k * per_layer``, which is what
    lets :mod:`primepar_fx.graph.replicate` name the nodes of layers it never captured. Placeholders and the output
    keep their names. Returns the names changed, old -> new.
    """
    graph = gm.graph
    taken = {n.name for n in graph.nodes if n.op != "call_function"}
    count: dict[str, int] = {}
    names = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        base, _ = split_name(node.name)
        k = count.get(base, 0)
        while (name := f"{base}_{k}" if k else base) in taken or name in _FX_ILLEGAL:
            k += 1
        count[base] = k + 1
        names.append((node, name))
    renamed = {node.name: name for node, name in names if node.name != name}
    for node, name in names:
        node.name = name
    graph._graph_namespace._used_names.update(name for _, name in names)
    gm.recompile()
    return renamed


def _model_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    for attr in ("name", "model_type"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(model).__name__


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def config_seq_max(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes, from its config's ``max_position_embeddings`` (Hugging Face) or
    ``max_seq`` (the zoo); ``None`` when it has neither."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "max_seq"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _example_sizes(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int, seq_dim: int) -> tuple[int, int]:
    """The example batch and sequence sizes, validated: every tensor agrees, both >= 2, and distinct."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError("capture() needs at least one tensor among the example inputs; none was given")
    sizes = {}
    for label, dim in (("batch", batch_dim), ("seq", seq_dim)):
        found = {int(t.shape[dim]) for t in tensors if t.dim() > dim}
        if not found:
            raise ValueError(f"no example input tensor has a {label} dim (dim {dim}); shapes: {_shapes(tensors)}")
        if len(found) > 1:
            raise ValueError(
                f"example inputs disagree on the {label} size (dim {dim}): {sorted(found)}; shapes: {_shapes(tensors)}"
            )
        sizes[label] = found.pop()
    batch, seq = sizes["batch"], sizes["seq"]
    for label, size, sym in (("batch", batch, "B"), ("seq", seq, "S")):
        if size < 2:
            raise ValueError(
                f"example {label} size is {size}: torch.export treats size-1 dims as static, so {sym} would be "
                f"specialised to {size}. Use an example {label} size >= 2 (e.g. batch=2, seq=16)."
            )
    if batch == seq:
        raise ValueError(
            f"example batch and seq sizes are both {batch}; use distinct sizes (e.g. batch=2, seq=16) so that "
            "B and S can be told apart in the captured shapes"
        )
    return batch, seq


def _shapes(tensors: list[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


def _symbol_map(program: ExportedProgram, batch_dim: int, seq_dim: int | None) -> dict[sympy.Symbol, sympy.Symbol]:
    """Map export's symbols to B and S through the first user input with both a batch and a sequence dim
    (``seq_dim=None``: the sequence is static, B only, through the first input with a batch dim)."""
    if seq_dim is None:
        return _batch_symbol(program, batch_dim)
    user_inputs = set(program.graph_signature.user_inputs)
    for node in program.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user_inputs or not isinstance(val, torch.Tensor):
            continue
        if val.dim() <= max(batch_dim, seq_dim):
            continue
        mapping: dict[sympy.Symbol, sympy.Symbol] = {}
        for label, dim, ours in (("batch", batch_dim, B), ("seq", seq_dim, S)):
            size = val.shape[dim]
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if not isinstance(expr, sympy.Symbol):
                raise ShapeSpecializationError(
                    f"the {label} dim of input {node.name} came out of export as {size}, not a plain symbol; "
                    "the model's code fixed or derived it while tracing",
                    dims=(label,),
                )
            mapping[expr] = ours
        if len(mapping) != 2:
            raise ShapeSpecializationError(
                f"the batch and seq dims of input {node.name} share the symbol {next(iter(mapping))}: "
                "the model's code made them equal",
                dims=DIM_NAMES,
            )
        return mapping
    raise ValueError(f"no user input has both a batch dim ({batch_dim}) and a seq dim ({seq_dim}) after export")


def _batch_symbol(program: ExportedProgram, batch_dim: int) -> dict[sympy.Symbol, sympy.Symbol]:
    user_inputs = set(program.graph_signature.user_inputs)
    for node in program.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in user_inputs and isinstance(val, torch.Tensor):
            if val.dim() > batch_dim:
                expr = val.shape[batch_dim].node.expr if isinstance(val.shape[batch_dim], torch.SymInt) else None
                if not isinstance(expr, sympy.Symbol):
                    raise ShapeSpecializationError(
                        f"the batch dim of input {node.name} came out of export as {val.shape[batch_dim]}, not a "
                        "plain symbol; the model's code fixed or derived it while tracing",
                        dims=("batch",),
                    )
                return {expr: B}
    raise ValueError(f"no user input has a batch dim ({batch_dim}) after export")
