"""In-place ATen ops rewritten to their out-of-place forms where nothing else can see the mutation.

``torch.export`` keeps a model's in-place updates of its own intermediates (``x += y`` becomes
``aten.add_.Tensor``; ``x /= n`` ``aten.div_.Tensor``). Every dimension rule describes an out-of-place op, so
rather than one rule per in-place variant, :func:`functionalize_inplace` rewrites each such node into the op
without the trailing underscore (same overload, same arguments) and points every later reader of the mutated
tensor at the new value. The graph then computes the same numbers, functionally, and the out-of-place rule
partitions it.

The rewrite is safe only when the mutated tensor has no other name. It is made when the tensor written (the
op's first argument, the only one its schema marks written) is

* the fresh result of an earlier op: not a graph input (a parameter, buffer or user input, whose mutation the
  caller would see), and not the output of a view op (whose base would change too);
* not read through a view taken before the in-place op and used after it (that view would go stale).

A tensor allocated and then filled slice by slice (``x = y.new_empty(...); x[..., :n].copy_(a);
x[..., n:].copy_(b)``, DeepSeek's keys) is a concatenation: :func:`fills_to_cat` rewrites it to ``aten.cat``
when the slices of one dim are disjoint, cover it whole, and each is written once, by a source of its shape and
dtype, before anything else reads the tensor.

``detach_`` writes no values, only autograd's flag: on a tensor that takes no gradient (a constant such as
GPT-Neo's mask value, lifted to a graph input) it is ``detach`` whatever else can see the tensor.

Any other in-place op is left as it is; analysis then names it with its model source line
(:class:`~primepar_fx.rules.MissingRuleError`).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

log = logging.getLogger(__name__)


def _writes(op: torch._ops.OpOverload) -> list[int]:
    """Positions of the arguments the op's schema marks written."""
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with an input: a view op, or anything not a known ATen op (an
    item of a multi-output op, such as ``topk``'s values, is fresh when that op's results are)."""
    op = node.target
    if op is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0].op != "call_function" or _aliases_input(node.args[0])
    if not isinstance(op, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in op._schema.returns)


def _requires_grad(node: fx.Node) -> bool:
    """Whether ``node``'s value takes a gradient (``True`` when its traced value is not known)."""
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.requires_grad


def _stale_view(target: fx.Node, node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a view of ``target`` (or a view of one, ...) taken before ``node`` is read after it."""
    stack = [u for u in target.users if u is not node and order[u] < order[node] and _aliases_input(u)]
    seen: set[fx.Node] = set()
    while stack:
        view = stack.pop()
        if view in seen:
            continue
        seen.add(view)
        for reader in view.users:
            if order[reader] > order[node]:
                return True
            if _aliases_input(reader):
                stack.append(reader)
    return False


def finish(gm: fx.GraphModule, changed: list[str], what: str, logger: logging.Logger = log) -> list[str]:
    """After a rewrite of ``gm``'s graph: check and recompile it and log ``what`` changed (when anything did)."""
    if changed:
        gm.graph.lint()
        gm.recompile()
        logger.info("%d %s: %s", len(changed), what, ", ".join(changed))
    return changed


def out_of_place(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an in-place op (``aten.add_.Tensor`` -> ``aten.add.Tensor``), or ``None``."""
    base = op._schema.name.split("::")[-1]
    if not base.endswith("_") or base.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, base[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or twin._schema.is_mutable:
        return None
    if len(twin._schema.arguments) != len(op._schema.arguments):
        return None
    return twin


def functionalize_inplace(gm: fx.GraphModule) -> list[str]:
    """Rewrite the safe in-place nodes of ``gm`` (module docstring) in place; the names of the nodes rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rewritten = []
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        twin = out_of_place(op)
        if twin is None or _writes(op) != [0] or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target = node.args[0]
        if op is torch.ops.aten.detach_.default and not _requires_grad(target):
            pass  # it writes no values, and a tensor that takes no gradient reads the same detached or not
        elif target.op != "call_function" or _aliases_input(target):
            continue
        later = [u for u in target.users if u is not node and order[u] > order[node]]
        if _stale_view(target, node, order):
            continue  # a view taken before the update and read after it would see the old value
        node.target = twin
        node.name = gm.graph._graph_namespace.create_name(twin._schema.name.split("::")[-1], None)  # add_ -> add_<k>
        for user in later:
            user.replace_input_with(target, node)
        rewritten.append(node.name)
    return finish(gm, rewritten, "in-place op(s) rewritten out of place")


#: ops that allocate a tensor whose values are all written before being read where :func:`fills_to_cat` applies
_FRESH = {
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.zeros.default,
}


def _meta_shape(node: object) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _fill(base: fx.Node) -> tuple[int, list[tuple[int, fx.Node, fx.Node, fx.Node]]] | None:
    """``(dim, [(start, slice, copy, source), ...])`` when every use of ``base`` up to its last ``copy_`` is a slice
    of one dim written once by ``copy_`` and the slices cover that dim exactly; else ``None``."""
    shape, val = _meta_shape(base), base.meta.get("val")
    if shape is None:
        return None
    parts, dims = [], set()
    for view in base.users:
        if view.target is not torch.ops.aten.slice.Tensor or len(view.users) != 1:
            continue
        (write,) = view.users
        if write.target is not torch.ops.aten.copy_.default or write.args[0] is not view or write.users:
            continue
        dim, start, end, *step = (*view.args[1:], *([0] if len(view.args) < 3 else []))[:4]
        src = write.args[1]
        if step not in ([], [1]) or not isinstance(src, fx.Node) or write.kwargs:
            return None
        size = shape[dim % len(shape)]
        if not (isinstance(start, int) and isinstance(end, int)) or not isinstance(size, int):
            return None
        sval = src.meta.get("val")
        if _meta_shape(src) != _meta_shape(view) or not isinstance(sval, torch.Tensor) or sval.dtype != val.dtype:
            return None
        dims.add(dim % len(shape))
        parts.append((max(0, start), view, write, src, min(end, size)))
    if len(parts) < 2 or len(dims) != 1:
        return None
    (dim,) = dims
    parts.sort(key=lambda p: p[0])
    edges = [(p[0], p[4]) for p in parts]
    if edges[0][0] != 0 or edges[-1][1] != shape[dim] or any(a[1] != b[0] for a, b in zip(edges, edges[1:])):
        return None
    return dim, [p[:4] for p in parts]


def fills_to_cat(gm: fx.GraphModule) -> list[str]:
    """Rewrite each fresh tensor filled slice by slice into ``aten.cat`` of the slices' sources (module docstring);
    the names of the tensors rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for base in list(gm.graph.nodes):
        if base.op != "call_function" or base.target not in _FRESH:
            continue
        found = _fill(base)
        if found is None:
            continue
        dim, parts = found
        last = max((write for _, _, write, _ in parts), key=order.__getitem__)
        ours = {n for _, view, write, _ in parts for n in (view, write)}
        if any(order[u] < order[last] for u in base.users if u not in ours):
            continue  # read between the writes: not a plain concatenation
        with gm.graph.inserting_after(last):
            cat = gm.graph.call_function(torch.ops.aten.cat.default, ([src for *_, src in parts], dim))
        cat.meta = {k: v for k, v in base.meta.items() if k in ("val", "tensor_meta", "stack_trace", "nn_module_stack")}
        base.replace_all_uses_with(cat, delete_user_cb=lambda u, ours=ours: u not in ours)
        for _, view, write, _ in parts:
            gm.graph.erase_node(write)
            gm.graph.erase_node(view)
        gm.graph.erase_node(base)
        done.append(cat.name)
    return finish(gm, done, "slice-by-slice fill(s) rewritten as concatenations")
