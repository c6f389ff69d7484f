"""Complex intermediates rewritten as real pairs, so that every rule, cost and collective sees real tensors.

Some models compute rotary embeddings in complex arithmetic (Meta's original Llama code, DeepSeek-V2):
``torch.polar`` builds the rotations, ``view_as_complex`` reads a query's last dim as pairs, a complex ``mul``
rotates it and ``view_as_real`` reads the result back. The dimension rules, the cost model's byte counts and the
runtime's collectives are written for real tensors, so :func:`complex_as_real` rewrites such a graph before
analysis: each complex tensor of shape ``s`` becomes the real tensor of shape ``s + (2,)`` that
``view_as_real`` would give (real part at index 0, imaginary at 1), and each op on complex tensors the ops that
compute the same numbers on those pairs:

* ``polar(r, theta)`` -> ``stack([r * cos(theta), r * sin(theta)], -1)``;
* ``view_as_complex(x)`` -> ``x``; ``view_as_real(z)`` -> ``z``'s pair;
* ``mul(z, w)`` of two complex tensors -> ``z * c + [-b, a] * d`` for ``z = [a, b]``, ``w = [c, d]`` (slices of the
  pairs: ``(a c - b d, b c + a d)``, laid out as a real rotary embedding's ``rotate_half``); of a complex tensor and
  a real one or a real number -> the pair times it (a real tensor unsqueezed at the end);
* ``add`` / ``sub`` of two complex tensors -> the same op on the pairs;
* views and copies (``unsqueeze``, ``view``/``reshape``, ``slice``, ``select``, ``expand``, ``clone``, ``to``)
  -> the same op on the pair, a negative dim moved one further left and a shape given one more size ``2``,
  a complex dtype mapped to its real one; ``_assert_tensor_metadata`` of a complex tensor is dropped.

Autograd differentiates the rewritten ops to the same gradients. The rewrite is all or nothing: when a complex
tensor is a graph input or output, or meets an op not listed above, the graph is left as it was, and analysis
names that op (:class:`~primepar_fx.rules.MissingRuleError`).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from primepar_fx.frontend.inplace import finish

log = logging.getLogger(__name__)

aten = torch.ops.aten

#: a complex dtype's real one (of each part)
REAL_OF = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _is_complex(value: object) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_complex()


def _touches_complex(node: fx.Node) -> bool:
    return _is_complex(node) or any(_is_complex(a) for a in node.all_input_nodes)


class _Rewriter:
    """One pass over ``gm``'s graph: ``pair[z]`` is the node of complex node ``z``'s real pair."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.graph = gm, gm.graph
        self.pair: dict[fx.Node, fx.Node] = {}
        self.fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta])
        self.at: fx.Node | None = None  # the node being rewritten: new nodes take its source and module stack

    def emit(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        """A new node ``target(*args, **kwargs)`` before :attr:`at`, its ``val`` computed on the fake inputs."""
        node = self.graph.call_function(target, args, kwargs)
        fakes = fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.fake:
            node.meta["val"] = target(*fakes, **kwargs)
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.at.meta:  # type: ignore[union-attr]
                node.meta[key] = self.at.meta[key]  # type: ignore[union-attr]
        return node

    def product(self, z: fx.Node, w: fx.Node) -> fx.Node:
        """The pair of the complex product of pairs ``z = [a, b]`` and ``w = [c, d]``: ``z * c + [-b, a] * d``, the
        shape of a real rotary embedding's ``rotate_half`` (two slices, a negation and a concatenation), which the
        search handles as it does Llama's; written with ``select``, the four products and their ``stack`` would
        entangle the pair's two halves in one table too large for the search on a real model."""

        def half(x: fx.Node, i: int) -> fx.Node:  # the real (0) or imaginary (1) part, kept as a last dim of 1
            return self.emit(aten.slice.Tensor, x, x.meta["val"].dim() - 1, i, i + 1)

        turned = self.emit(aten.cat.default, [self.emit(aten.neg.default, half(z, 1)), half(z, 0)], -1)
        return self.emit(
            aten.add.Tensor, self.emit(aten.mul.Tensor, z, half(w, 0)), self.emit(aten.mul.Tensor, turned, half(w, 1))
        )

    def rewrite(self, node: fx.Node) -> fx.Node | None:
        """The pair of ``node``'s complex result (or, for ``view_as_real``, the real node that replaces it)."""
        op, args, kw = node.target, node.args, node.kwargs
        pair = self.pair.get
        if op is aten.polar.default and not kw:
            r, theta = args
            re = self.emit(aten.mul.Tensor, r, self.emit(aten.cos.default, theta))
            im = self.emit(aten.mul.Tensor, r, self.emit(aten.sin.default, theta))
            return self.emit(aten.stack.default, [re, im], -1)
        if op is aten.view_as_complex.default and not kw:
            return args[0]
        if op is aten.view_as_real.default and not kw:
            return pair(args[0])
        if op in (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor) and not kw:
            a, b = args
            if _is_complex(a) and _is_complex(b):
                if op is not aten.mul.Tensor:
                    return self.emit(op, pair(a), pair(b))
                return self.product(pair(a), pair(b))
            if op is not aten.mul.Tensor:
                return None  # a real added to a complex changes only its real part: not rewritten
            z, x = (a, b) if _is_complex(a) else (b, a)
            if isinstance(x, fx.Node):
                return self.emit(op, pair(z), self.emit(aten.unsqueeze.default, x, -1))
            if isinstance(x, numbers.Real):
                return self.emit(op, pair(z), x)
            return None
        return self._view(node, op, args, kw)

    def _view(self, node: fx.Node, op: object, args: tuple, kw: dict) -> fx.Node | None:
        z = args[0] if args else None
        if not _is_complex(z) or any(_is_complex(a) for a in args[1:]):
            return None
        rank = z.meta["val"].dim()  # type: ignore[union-attr]
        rest = args[1:]
        if op is aten.unsqueeze.default and not kw:
            (d,) = rest
            return self.emit(op, self.pair[z], d - 1 if d < 0 else d)
        if op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default) and not kw:
            shape, *more = rest
            return self.emit(op, self.pair[z], [*shape, 2], *more)
        if op in (aten.slice.Tensor, aten.select.int) and not kw and rest:
            d = rest[0] if rest[0] >= 0 else rest[0] + rank
            return self.emit(op, self.pair[z], d, *rest[1:])
        if op is aten.clone.default and not args[1:]:
            return self.emit(op, self.pair[z])
        if op in (aten.to.dtype_layout, aten.to.dtype, aten._to_copy.default):
            out = node.meta["val"]
            if not out.is_complex() or any(not isinstance(a, (torch.dtype, bool)) for a in rest):
                return None  # complex to real drops the imaginary part: not rewritten
            kwargs = {k: v for k, v in kw.items() if k not in ("dtype", "memory_format", "copy")}
            return self.emit(aten._to_copy.default, self.pair[z], **kwargs, dtype=REAL_OF[out.dtype])
        return None


def complex_as_real(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm``'s complex intermediates as real pairs (module docstring), in place, all or nothing; the names
    of the complex nodes replaced."""
    touched = [n for n in gm.graph.nodes if _touches_complex(n)]
    if not touched:
        return []
    where = next((n for n in touched if n.op != "call_function"), None)
    if where is not None:
        log.info("complex tensor at %s %s: complex arithmetic left as it is", where.op, where.name)
        return []
    rewriter = _Rewriter(gm)
    if rewriter.fake is None:
        return []
    done: list[tuple[fx.Node, fx.Node | None]] = []
    before = set(gm.graph.nodes)
    for node in touched:
        rewriter.at = node
        with gm.graph.inserting_before(node):
            if node.target is aten._assert_tensor_metadata.default:
                done.append((node, None))
                continue
            try:
                new = rewriter.rewrite(node)
            except Exception as exc:  # noqa: BLE001 -- e.g. a shape the fake op rejects: the graph is left as it was
                log.info("complex op %s at %s could not be rewritten (%s)", node.target, node, exc)
                new = None
        if new is None:
            log.info("complex op %s at %s has no real form here: complex arithmetic left as it is", node.target, node)
            for n in reversed(list(gm.graph.nodes)):  # the nodes added so far: none is read by an original node yet
                if n not in before:
                    gm.graph.erase_node(n)
            return []
        if _is_complex(node):
            rewriter.pair[node] = new
        done.append((node, new))
    for node, new in done:
        if new is not None and not _is_complex(node):  # view_as_real: its readers read the pair
            node.replace_all_uses_with(new)
    for node, _ in reversed(done):
        if not node.users:
            gm.graph.erase_node(node)
    return finish(gm, [n.name for n, _ in done], "complex op(s) rewritten on real pairs", log)
