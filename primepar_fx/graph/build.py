"""The operator graph: captured ATen nodes with symbolic shapes and their dimension rules.

:func:`build_graph` turns a :class:`~primepar_fx.frontend.capture.Captured` program into an :class:`OpGraph`: one
:class:`OpNode` per compute node (nodes without tensor outputs, such as shape asserts, are left out), with its
:class:`~primepar_fx.rules.spec.OpDims` (knowing which inputs are parameters and which take no gradient), FLOPs and
bytes moved, and a networkx ``DiGraph`` whose edges carry the producer's output index and the consumer's input index.
This is what the cost model and the search read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import networkx as nx
import sympy
import torch
from torch import fx

from primepar_fx.frontend.capture import Captured
from primepar_fx.frontend.shapes import annotate, node_bytes, shape_of, shapes_of
from primepar_fx.frontend.specialize import warn_static_seq
from primepar_fx.frontend.symbols import META_DTYPES, META_SHAPES, S, Shape
from primepar_fx.rules.apply import op_dims
from primepar_fx.rules.registry import RuleContext, RuleError, op_name, source_line
from primepar_fx.rules.spec import OpDims

log = logging.getLogger(__name__)

#: node.meta key holding a node's OpDims.
META_OPDIMS = "primepar_opdims"


@dataclass(frozen=True)
class OpNode:
    """One compute node of the captured graph."""

    name: str
    target: object
    dims: OpDims
    out_shapes: tuple[Shape, ...]
    flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    source: str
    params: tuple[str, ...] = ()
    requires_grad: bool = True  # False for constant subgraphs (masks, position tables, label shifts)

    @property
    def op(self) -> str:
        return op_name(self.target)


@dataclass(frozen=True)
class LayerStack:
    """How a replicated graph was made: the stack ``fqn`` of ``count`` layers, of which ``captured`` were."""

    fqn: str
    count: int
    captured: int


@dataclass
class OpGraph:
    """Compute nodes in topological order plus their data-flow edges."""

    captured: Captured
    nodes: dict[str, OpNode]
    graph: nx.DiGraph
    param_shapes: dict[str, Shape] = field(default_factory=dict)
    param_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    #: tied parameters: FQN -> the FQN of the parameter it shares storage with (first in graph order)
    tied: dict[str, str] = field(default_factory=dict)
    #: set when the nodes were replicated from a short capture (:mod:`primepar_fx.graph.replicate`): plan, not compile
    replicated: LayerStack | None = None
    #: replicated graphs: node -> the captured node it repeats, whose facts (dtypes, users, arguments) it shares
    origin: dict[str, str] | None = None
    #: replicated graphs: node -> the name of each of its FX inputs (``None`` where it is not a compute node)
    inputs: dict[str, tuple[str | None, ...]] | None = None

    @property
    def name(self) -> str:
        return self.captured.model_name

    def require_captured(self, what: str) -> None:
        """Raise a ValueError when the nodes were replicated from a short capture: ``what`` needs every FX node."""
        if self.replicated is not None:
            r = self.replicated
            raise ValueError(
                f"{what} needs the whole captured graph, but {self.name}'s was replicated from {r.captured} of the "
                f"{r.count} layers of {r.fqn} (planning only); capture it with primepar_fx.analyze(model, ...)"
            )

    @functools.cached_property
    def _fx_by_name(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.captured.gm.graph.nodes}

    def fx_node(self, name: str) -> fx.Node:
        """The captured FX node of compute node ``name`` (of a replicated graph: the node it repeats).

        Read its facts (dtypes, user count, arguments), not its inputs' names: :meth:`input_names` has those.
        """
        return self._fx_by_name[self.origin[name] if self.origin is not None else name]

    def input_names(self, name: str) -> tuple[str | None, ...]:
        """The name of each FX input of compute node ``name``, in order (an input read twice appears twice);
        ``None`` for inputs that are not compute nodes (parameters, user inputs, size nodes)."""
        if self.inputs is not None:
            return self.inputs[name]
        return tuple(a.name if a.name in self.nodes else None for a in self._fx_by_name[name].all_input_nodes)

    def total_flops(self) -> sympy.Expr:
        return sympy.expand(sum((n.flops for n in self.nodes.values()), sympy.Integer(0)))

    def param_count(self) -> int:
        total = 0
        for fqn, shape in self.param_shapes.items():
            if fqn in self.tied:
                continue
            n = 1
            for s in shape:
                n *= int(s)
            total += n
        return total


def _requires_grad(gm: fx.GraphModule, captured: Captured) -> set[str]:
    """Nodes whose value depends on a parameter through floating-point ops."""
    live: set[str] = set(captured.params)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        dtypes = node.meta.get(META_DTYPES) or ()
        floating = any(dt is not None and dt.is_floating_point for dt in dtypes)
        if node.target is torch.ops.aten.detach.default:  # (a no_grad region's result: no gradient past it)
            continue
        if floating and any(a.name in live for a in node.all_input_nodes):
            live.add(node.name)
    return live


def _gradient_reaches(gm: fx.GraphModule, grad_live: set[str]) -> set[str]:
    """Nodes whose result a gradient reaches in Backward: an input of an output, or of a node a gradient reaches
    whose own result carries one (not through ``topk``'s indices, a comparison, a ``detach``)."""
    reached: set[str] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output" or (node.name in reached and node.name in grad_live):
            reached.update(a.name for a in node.all_input_nodes)
    return reached


#: the most nodes :func:`input_chain` follows back (the targets of a loss come from the inputs in a few ops)
MAX_INPUT_CHAIN = 64


def pure_target(target: object) -> bool:
    """Whether a ``call_function`` node of ``target`` is a function of its inputs only (no mutation, no random
    numbers); anything that is not an ATen op (``getitem``, symbolic size arithmetic) is."""
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
    return True


def upstream(node: fx.Node, admit: Callable[[fx.Node], bool], limit: int | None = None) -> set[fx.Node] | None:
    """``node`` and every node it depends on, when ``admit`` admits them all and they are at most ``limit``;
    else ``None``."""
    chain: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in chain:
            continue
        if not admit(n):
            return None
        chain.add(n)
        if limit is not None and len(chain) > limit:
            return None
        todo.extend(n.all_input_nodes)
    return chain


def input_chain(node: fx.Node, user_inputs: Collection[str]) -> list[fx.Node] | None:
    """The nodes ``node``'s value is computed from, in graph order, when they are all user inputs and pure ops
    (no parameter, buffer, mutation or random numbers) and at most :data:`MAX_INPUT_CHAIN` of them; else ``None``.

    Every rank gets the whole inputs, so every rank can compute such a value whole, without a message: the count of
    a mean loss's targets (``count_local`` in the loss's ``OpDims.extra``) is counted so on every rank."""

    def admit(n: fx.Node) -> bool:
        if n.op == "placeholder":
            return n.name in user_inputs
        return n.op == "call_function" and pure_target(n.target)

    chain = upstream(node, admit, MAX_INPUT_CHAIN)
    return None if chain is None else [n for n in node.graph.nodes if n in chain]


def _count_local(node: fx.Node, dims: OpDims, captured: Captured) -> OpDims:
    """A mean cross-entropy whose targets every rank can compute whole counts them without a message."""
    if node.target is not torch.ops.aten.cross_entropy_loss.default or dims.extra.get("reduction") != "mean":
        return dims
    target = node.args[1]
    if not isinstance(target, fx.Node) or input_chain(target, captured.user_inputs) is None:
        return dims
    return dataclasses.replace(dims, extra={**dims.extra, "count_local": True})


def check_fallback(fallback: object) -> None:
    """``fallback`` must be ``None`` or ``"replicate"`` (what to do with an op that has no rule)."""
    if fallback not in (None, "replicate"):
        raise ValueError(f"unknown fallback {fallback!r}; the only one is 'replicate' (or None)")


def graph_of(capture_fn: Callable[[bool], Captured], *, fallback: str | None = None) -> OpGraph:
    """:func:`build_graph` of ``capture_fn(False)``, a capture with a symbolic ``S``; when a rule fails on it,
    ``capture_fn(True)`` (the sequence at the example's length) is tried, and its graph kept with a
    :class:`~primepar_fx.frontend.capture.StaticSeqWarning` that quotes the rule's error.

    A model that slices a fixed buffer by the sequence length can give shapes such as ``2048 - Max(0, 2048 - S)``,
    which no rule can match with ``S`` free; at one integer ``S`` they are plain numbers. When the static capture
    fails as well, the first error is raised.
    """
    captured = capture_fn(False)
    try:
        return build_graph(captured, fallback=fallback)
    except RuleError as e:
        if captured.static_seq or S not in set(captured.symbol_map.values()):
            raise
        first = e
    try:
        static = capture_fn(True)
        graph = build_graph(static, fallback=fallback)
    except Exception:
        raise first from None
    why = str(first).splitlines()[0]
    warn_static_seq(static.model_name, static.example_seq, f"with it symbolic, {why[:400]}")
    return graph


def build_graph(captured: Captured, *, fallback: str | None = None) -> OpGraph:
    """Annotate shapes, apply the op rules and collect the compute nodes and edges."""
    check_fallback(fallback)
    annotate(captured)
    gm = captured.gm
    grad_live = _requires_grad(gm, captured)
    needed = _gradient_reaches(gm, grad_live)
    nodes: dict[str, OpNode] = {}
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ctx = RuleContext(shape_of=shape_of, out_shapes=shapes_of(node))
        dims = op_dims(node, ctx, fallback=fallback)
        if dims.kind == "meta" and not dims.outputs:
            continue
        inputs = node.all_input_nodes
        weights = frozenset(i for i, a in enumerate(inputs) if a.name in captured.params)
        # no gradient reaches an input that does not carry one, nor any input of a node whose result carries none
        # (``topk``'s indices, a comparison) or receives none (``topk``'s values, unused or read only on the way to
        # integer indices): the cost model then prices no Backward traffic for it
        dead = node.name not in grad_live or node.name not in needed
        no_grad = frozenset(
            i for i, a in enumerate(inputs) if dims.inputs[i] is not None and (dead or a.name not in grad_live)
        )
        dims = _count_local(node, dims.with_roles(weights, no_grad), captured)
        node.meta[META_OPDIMS] = dims
        read, written = node_bytes(node)
        nodes[node.name] = OpNode(
            name=node.name,
            target=node.target,
            dims=dims,
            out_shapes=tuple(node.meta.get(META_SHAPES) or ()),
            flops=sympy.sympify(dims.flops),
            bytes_read=read,
            bytes_written=written,
            source=source_line(node),
            params=tuple(captured.params[inputs[i].name] for i in sorted(weights)),
            requires_grad=node.name in grad_live,
        )
        g.add_node(node.name)
        for i, a in enumerate(inputs):
            if a.name in nodes:
                g.add_edge(a.name, node.name, dst_in=i)
    param_shapes = {}
    param_dtypes = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in captured.params:
            fqn = captured.params[node.name]
            param_shapes[fqn] = shapes_of(node)[0]
            param_dtypes[fqn] = (node.meta.get(META_DTYPES) or (torch.float32,))[0]
    tied: dict[str, str] = {}
    seen: dict[int, str] = {}
    for fqn in param_shapes:
        tensor = captured.program.state_dict.get(fqn)
        if tensor is None:
            continue
        if id(tensor) in seen:
            tied[fqn] = seen[id(tensor)]
        else:
            seen[id(tensor)] = fqn
    log.info("graph %s: %d compute nodes, %d edges", captured.model_name, len(nodes), g.number_of_edges())
    return OpGraph(captured, nodes, g, param_shapes, param_dtypes, tied)
