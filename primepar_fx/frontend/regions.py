"""Grad-mode regions inlined: ``torch.no_grad()`` blocks of a model's forward become ordinary nodes.

``torch.export`` keeps a ``with torch.no_grad():`` block of a forward (PhiMoE's router masks, for one) as a
higher-order op, ``wrap_with_set_grad_enabled(False, submodule, *inputs)``, whose body is a graph of its own.
No dimension rule can describe an op that runs another graph, so :func:`inline_grad_regions` copies each body into
the graph in its place and passes each floating-point result through ``aten.detach``: the numbers are the same,
and no gradient flows back into the block, as under ``no_grad``. A block with ``True`` (``enable_grad`` inside
``no_grad``) is inlined as it is. A body that reads attributes of its own submodule is left as it was (analysis
then names the op).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from primepar_fx.frontend.inplace import finish

aten = torch.ops.aten


def _grad_region_op() -> object | None:
    return getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def inline_grad_regions(gm: fx.GraphModule) -> list[str]:
    """Inline every ``wrap_with_set_grad_enabled`` node of ``gm`` (module docstring); the names of those inlined."""
    hop = _grad_region_op()
    done: list[str] = []
    for node in list(gm.graph.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        enabled, holder, *inputs = node.args
        body = getattr(gm, holder.target, None) if isinstance(holder, fx.Node) and holder.op == "get_attr" else None
        if not isinstance(body, fx.GraphModule) or node.kwargs:
            continue
        nodes = list(body.graph.nodes)
        if any(n.op not in ("placeholder", "call_function", "output") for n in nodes):
            continue
        env: dict[fx.Node, object] = dict(zip([n for n in nodes if n.op == "placeholder"], inputs))
        outputs: tuple = ()
        with gm.graph.inserting_before(node):
            for n in nodes:
                if n.op == "call_function":
                    env[n] = gm.graph.node_copy(n, env.__getitem__)
                elif n.op == "output":
                    outputs = tuple(fx.node.map_arg(n.args[0], env.__getitem__))
            results = [_detached(gm, r) if not enabled else r for r in outputs]
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise AssertionError(f"{user.format_node()} reads the grad-mode region {node.name} whole")
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not holder.users:
            gm.graph.erase_node(holder)
            delattr(gm, holder.target)
        done.append(node.name)
    return finish(gm, done, "grad-mode region(s) inlined")


def _detached(gm: fx.GraphModule, value: object) -> object:
    """``aten.detach(value)`` for a floating-point tensor result (its metadata copied), else ``value``."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return value
    out = gm.graph.call_function(aten.detach.default, (value,))
    out.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "stack_trace", "nn_module_stack")}
    return out
