"""The per-rank rewrite: a captured ATen graph and a plan become the GraphModule one rank runs.

:func:`localize` walks the captured graph once, in order, and emits a new graph in which

* every placeholder stays (parameters arrive as this rank's shards, see :mod:`primepar_fx.passes.shard`);
* every edge whose producer layout differs from the consumer's gets a :class:`~primepar_fx.runtime.Redistribute`
  node (forward: activation; backward: gradient), user inputs are sliced to the first consumer's layout, and user
  outputs are gathered whole on every rank;
* every ``Backward``/``Gradient`` collective of a node's partition becomes a ``"backward"``
  :class:`~primepar_fx.runtime.AllReduce` on the input, every ``Forward`` one a ``"forward"`` all-reduce on the
  output (:func:`primepar_fx.partition.collectives`);
* every node runs its local block: the same ATen op with its size arguments rewritten to the local sizes, an
  ``arange`` offset to the rank's slice, a bias added after the all-reduce of the product it follows, a ``mean``
  rescaled to the global count; a split vocabulary or normalised dim uses the modules of
  :mod:`primepar_fx.runtime.lowered`; a P(S x S) matrix product becomes one :class:`~primepar_fx.runtime.RingMatmul`.

An op whose local form is not known for its partition (say ``amax`` over a split dim) is not guessed at: the node
gathers its inputs, runs whole and keeps its planned output slice (logged as a *fallback*; its traffic is then
more than the plan's).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from math import prod
from typing import Any

import sympy
import torch
from torch import fx, nn

from primepar_fx.cost.redistribute import Layout
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Phase, collectives
from primepar_fx.passes.layouts import NodeLayouts, local_shape, replicated, vkey_of
from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.runtime.exchange import Exchange, Redistribute, full_layout
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.lowered import ShardedCrossEntropy, ShardedLayerNorm, VocabEmbedding
from primepar_fx.runtime.ring import RingMatmul
from primepar_fx.runtime.stats import CommStats

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: ops whose argument ``index`` is the output shape
_SIZE_ARG = {
    aten.view.default: 1,
    aten.reshape.default: 1,
    aten._unsafe_view.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
    aten.rand.default: 0,
    aten.randn.default: 0,
}
_ARANGE = {aten.arange.default: (None, 0, None), aten.arange.start: (0, 1, None), aten.arange.start_step: (0, 1, 2)}
_MEANS = {aten.mean.dim, aten.mean.default}
_SUMS = {aten.sum.dim_IntList, aten.sum.default} | _MEANS
_BIASED = {aten.linear.default: 2, aten.addmm.default: 0, aten.baddbmm.default: 0}
_NEVER_LOCAL = {aten.as_strided.default, aten.unflatten.int, aten.native_layer_norm.default}


@dataclass
class RankGraph:
    """The rewritten graph of one rank and what it needs at run time."""

    gm: fx.GraphModule
    param_layouts: dict[str, Layout]  # placeholder name -> storage layout
    fallbacks: list[str] = field(default_factory=list)
    stats: CommStats = field(default_factory=CommStats)


class _Builder:
    def __init__(
        self,
        graph: OpGraph,
        partitions: dict[str, PartitionSeq],
        mesh: DeviceMesh,
        rank: int,
        values: dict[sympy.Symbol, int],
        groups: ProcessGroups,
    ) -> None:
        self.opgraph, self.captured = graph, graph.captured
        self.mesh, self.rank, self.values, self.groups = mesh, rank, values, groups
        self.vkey = vkey_of(values)
        self.stats = CommStats()
        self.parts: dict[str, OpPartition] = {}
        for name, node in graph.nodes.items():
            if name not in partitions:
                raise ValueError(f"the plan has no partition for node {name} ({node.op})")
            part = OpPartition(node.dims, partitions[name], mesh)
            part.check_divisible(values)
            self.parts[name] = part
        self.g = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, Any] = {}
        self.counter = 0
        self.fallbacks: list[str] = []
        self.param_layouts: dict[str, Layout] = {}
        self._subst = {sym: values[ours] for sym, ours in self.captured.symbol_map.items()}

    # ----------------------------------------------------------------------------------------- helpers
    def module(self, prefix: str, mod: nn.Module) -> str:
        self.counter += 1
        name = f"{prefix}_{self.counter}"
        self.root.add_module(name, mod)
        return name

    def call_module(self, prefix: str, mod: nn.Module, *args: Any) -> fx.Node:
        return self.g.call_module(self.module(prefix, mod), args)

    def concrete(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out = sympy.sympify(val.node.expr).xreplace({k: sympy.Integer(v) for k, v in self._subst.items()})
            kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(val)]
            return kind(out)
        if isinstance(val, (int, float, bool)):
            return val
        raise ValueError(f"node {node.name} ({node.target}) is used as a constant but its value {val!r} is not one")

    def node_layouts(self, name: str, fallback: bool = False) -> NodeLayouts:
        part = self.parts[name]
        if fallback:
            part = OpPartition(part.op, replicated(self.mesh), self.mesh)
        return NodeLayouts(part, self.vkey, self.opgraph.nodes[name].requires_grad)

    def group(self, digits: tuple[int, ...]):
        return self.groups.get(digits)

    def redistribute(
        self,
        value: fx.Node,
        held: Layout,
        needed: Layout,
        grad_held: Layout | None,
        grad_needed: Layout | None,
        what: str,
        node: str = "",
        kind: str = "redistribution",
    ) -> fx.Node:
        fwd = Exchange.plan(held, needed, self.mesh, self.rank)
        bwd = None
        if grad_held is not None and grad_needed is not None:
            bwd = Exchange.plan(grad_held, grad_needed, self.mesh, self.rank)
        if fwd.identity and (bwd is None or bwd.identity):
            return value
        return self.call_module("redistribute", Redistribute(fwd, bwd, self.stats, what, node, kind), value)

    def all_reduce(self, value: fx.Node, digits: tuple[int, ...], mode: str, why: str, node: str = "") -> fx.Node:
        group, ranks = self.group(digits)
        if len(ranks) < 2:
            return value
        return self.call_module("all_reduce", AllReduce(group, ranks, digits, mode, self.stats, why, node), value)

    # ---------------------------------------------------------------------------------------- sources
    def source(self, producer: fx.Node, j: int | None) -> tuple[fx.Node, Layout, Layout | None]:
        """The local value of output ``j`` of ``producer``, its held layout and the gradient layout it needs."""
        value = self.env[producer.name]
        if producer.op == "placeholder":
            shape = tuple(int(s) for s in producer.meta["val"].shape)
            if producer.name in self.captured.params:
                lay = self.param_layouts[producer.name]
                return value, lay, lay
            return value, full_layout(shape, self.mesh.size), None
        lay = self.node_layouts(producer.name)
        index = 0 if j is None else j
        if j is not None:
            value = self.g.call_function(operator.getitem, (value, j))
        return value, lay.out_held(index), lay.out_grad_needed(index)

    # ------------------------------------------------------------------------------------------ nodes
    def placeholder(self, node: fx.Node) -> None:
        self.env[node.name] = self.g.placeholder(node.name)
        if node.name in self.captured.params:
            for user in node.users:  # storage layout: the first consumer's Forward-start layout
                if user.name in self.parts:
                    k = user.all_input_nodes.index(node)
                    self.param_layouts[node.name] = self.node_layouts(user.name, self.is_fallback(user)).in_needed(k)
                    break
            else:
                shape = tuple(int(s) for s in node.meta["val"].shape)
                self.param_layouts[node.name] = full_layout(shape, self.mesh.size)

    def is_fallback(self, node: fx.Node) -> bool:
        part = self.parts[node.name]
        split = {d for d, p in part.parts.items() if p > 1}
        if not split:
            return False
        op, target = part.op, node.target
        if target in _NEVER_LOCAL:
            return True
        if part.steps > 1:
            return False
        if op.kind == "reduce":
            summed = op.summed_dims(op.outputs[0]) if op.outputs else frozenset()
            return bool(summed & split) and target not in _SUMS
        if op.kind == "norm":
            return bool(op.stats & split) and target is not aten.layer_norm.default
        if op.kind == "loss":
            if target is aten.cross_entropy_loss.default:
                return not (node.args[2:3] in ((), (None,)) and float(_arg(node, 5, "label_smoothing", 0.0)) == 0.0)
            summed = op.summed_dims(op.outputs[0])
            return bool(summed & split)
        return False

    def call(self, node: fx.Node) -> None:
        name = node.name
        if name not in self.parts:
            return  # shape arithmetic and asserts: their values are substituted where used
        fallback = self.is_fallback(node)
        if fallback and len(self.parts[name].op.outputs) != 1:
            raise NotImplementedError(
                f"node {name} ({node.target}) has no local form for partition {self.parts[name].seq} and "
                "several outputs; choose another partition for it"
            )
        if fallback:
            self.fallbacks.append(name)
            log.info(
                "node %s (%s, %s) runs whole: no local form for this partition", name, node.target, self.parts[name].seq
            )
        lay = self.node_layouts(name, fallback)
        part = lay.part
        op = part.op
        opnode = self.opgraph.nodes[name]
        colls = [] if fallback else collectives(part)
        # inputs: redistribute into this node's Forward-start layout, then the backward all-reduces
        locals_: dict[fx.Node, fx.Node] = {}
        for k, a in enumerate(node.all_input_nodes):
            if op.inputs[k] is None:
                if isinstance(a.meta.get("val"), torch.Tensor) and (a.op == "placeholder" or a.name in self.parts):
                    # a tensor the rule does not partition (an index list entry): every rank gets all of it
                    value, held, _ = self.source(a, None)
                    full = full_layout(tuple(int(x) for x in a.meta["val"].shape), self.mesh.size)
                    locals_[a] = self.redistribute(value, held, full, None, None, f"{a.name} -> {name}", name)
                continue
            j = None
            if a.name in self.parts and len(self.parts[a.name].op.outputs) > 1:
                j = node.args[1] if node.target is operator.getitem else 0
            value, held, grad_needed = self.source(a, j)
            grad_held = lay.in_grad_held(k) if opnode.requires_grad else None
            value = self.redistribute(
                value, held, lay.in_needed(k), grad_held, grad_needed, f"{a.name} -> {name}", name
            )
            for c in colls:
                if c.tensor == f"d_in{k}" and not self._internal(node, part, c):
                    value = self.all_reduce(value, c.digits, "backward", f"d {a.name} in {name}", name)
            locals_[a] = value
        if node.target is operator.getitem:
            self.env[name] = locals_[node.all_input_nodes[0]]
            return
        out = self.compute(node, part, locals_, lay)
        for c in colls:
            if c.phase is Phase.FORWARD and c.tensor == "out0" and not self._internal(node, part, c):
                if len(op.outputs) != 1:
                    raise NotImplementedError(f"node {name}: a forward all-reduce on a multi-output op")
                if node.target not in _BIASED or part.steps > 1 or not self._has_bias(node):
                    out = self.all_reduce(out, c.digits, "forward", f"partial sums of {name}", name)
        if fallback:
            planned = self.node_layouts(name)
            out = self.redistribute(
                out,
                lay.out_held(0),
                planned.out_held(0),
                planned.out_grad_needed(0),
                lay.out_grad_needed(0),
                f"{name} whole -> planned",
                name,
            )
        self.env[name] = out

    def _internal(self, node: fx.Node, part: OpPartition, c) -> bool:
        """Collectives a special local form performs itself (statistics, loss reductions)."""
        if node.target is aten.cross_entropy_loss.default:
            return c.tensor in ("out0", "d_in0")
        if node.target is aten.layer_norm.default and (part.op.stats & c.dims):
            return c.tensor in ("out0", "d_in0")
        return False

    def _has_bias(self, node: fx.Node) -> bool:
        pos = _BIASED.get(node.target)
        return pos is not None and len(node.args) > pos and isinstance(node.args[pos], fx.Node)

    # --------------------------------------------------------------------------------- local compute
    def compute(self, node: fx.Node, part: OpPartition, locals_: dict[fx.Node, fx.Node], lay: NodeLayouts) -> fx.Node:
        target, op = node.target, part.op
        me = self.rank

        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return locals_[a] if a in locals_ else self.concrete(a)
            return a

        args = list(fx.node.map_aggregate(node.args, arg))
        kwargs = dict(fx.node.map_aggregate(node.kwargs, arg))
        outs = [local_shape(lay.out_held(j), me) for j in range(len(op.outputs))]
        parts_split = {d for d, p in part.parts.items() if p > 1}

        if part.steps > 1:
            return self.ring(node, part, locals_)
        if target in _SIZE_ARG:
            args[_SIZE_ARG[target]] = list(outs[0])
            if target is aten.view.default:
                target = aten.reshape.default
        elif target in _ARANGE and parts_split:
            ((lo, hi),) = lay.out_held(0)[me][0]
            start_i, end_i, step_i = _ARANGE[target]
            start = args[start_i] if start_i is not None else kwargs.get("start", 0)
            step = args[step_i] if step_i is not None and len(args) > step_i else kwargs.get("step", 1)
            args = [start + lo * step, start + hi * step, step]
            kwargs.pop("start", None), kwargs.pop("step", None)
            target = aten.arange.start_step
        elif target is aten.layer_norm.default:
            args[1] = list(outs[0][-len(node.args[1]) :])
            if op.stats & parts_split:
                digits = tuple(
                    p
                    for e, pos in zip(part.seq.elements, part.positions)
                    if getattr(e, "dim", None) in op.stats
                    for p in pos
                )
                size = int(prod(int(sympy.sympify(op.size(d)).xreplace(self.values)) for d in op.stats))
                eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
                mod = ShardedLayerNorm(size, float(eps), self.group(digits), self.stats)
                mod.node = node.name
                w = args[2] if len(args) > 2 else kwargs.get("weight")
                b = args[3] if len(args) > 3 else kwargs.get("bias")
                return self.call_module("layer_norm", mod, args[0], w, b)
        elif target is aten.embedding.default and op.inputs[0][0][0] in parts_split:  # type: ignore[index]
            weight_layout = lay.in_needed(0)[me][0]
            ((lo, hi),) = weight_layout
            return self.call_module("vocab_embedding", VocabEmbedding(lo, hi - lo), args[0], args[1])
        elif target is aten.cross_entropy_loss.default and parts_split:
            return self.cross_entropy(node, part, args, kwargs, lay)
        elif target in _MEANS and parts_split:
            summed = op.summed_dims(op.outputs[0])
            scale = 1.0 / prod(part.parts[d] for d in summed)
            if scale != 1.0:
                out = self.g.call_function(target, tuple(args), kwargs)
                return self.g.call_function(aten.mul.Tensor, (out, scale))
        elif (
            target in _BIASED
            and self._has_bias(node)
            and any(c.phase is Phase.FORWARD and c.tensor == "out0" for c in collectives(part))
        ):
            return self.biased_product(node, part, args, kwargs)
        return self.g.call_function(target, tuple(args), kwargs)

    def biased_product(
        self, node: fx.Node, part: OpPartition, args: list, kwargs: dict, product: fx.Node | None = None
    ) -> fx.Node:
        """``product`` (or the op without its bias), its forward all-reduce, then the bias once."""
        target = node.target
        digits = next((c.digits for c in collectives(part) if c.phase is Phase.FORWARD and c.tensor == "out0"), ())
        if target is aten.linear.default:
            bias = args[2]
            if product is None:
                product = self.g.call_function(aten.linear.default, (args[0], args[1]))
            scale_bias = 1
        else:
            bias = args[0]
            beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
            alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
            if product is None:
                mm = aten.mm.default if target is aten.addmm.default else aten.bmm.default
                product = self.g.call_function(mm, (args[1], args[2]))
            if alpha != 1:
                product = self.g.call_function(aten.mul.Tensor, (product, alpha))
            scale_bias = beta
        product = (
            self.all_reduce(product, digits, "forward", f"partial sums of {node.name}", node.name)
            if digits
            else product
        )
        if scale_bias != 1:
            bias = self.g.call_function(aten.mul.Tensor, (bias, scale_bias))
        return self.g.call_function(aten.add.Tensor, (product, bias))

    def ring(self, node: fx.Node, part: OpPartition, locals_: dict[fx.Node, fx.Node]) -> fx.Node:
        op = part.op
        i_idx, w_idx = op.matmul_operands  # type: ignore[misc]
        inputs = node.all_input_nodes
        mod = RingMatmul(part, node.target, self.rank, self.stats, node.name)
        out = self.call_module("ring", mod, locals_[inputs[i_idx]], locals_[inputs[w_idx]])
        if node.target in (aten.addmm.default, aten.baddbmm.default):
            alpha = node.kwargs.get("alpha", 1)
            if alpha != 1:
                out = self.g.call_function(aten.mul.Tensor, (out, alpha))
        digits = next((c.digits for c in collectives(part) if c.phase is Phase.FORWARD and c.tensor == "out0"), ())
        if digits:
            out = self.all_reduce(out, digits, "forward", f"partial sums of {node.name}", node.name)
        if self._has_bias(node):
            pos = _BIASED[node.target]
            bias = locals_[node.args[pos]]
            beta = node.kwargs.get("beta", 1)
            if beta != 1:
                bias = self.g.call_function(aten.mul.Tensor, (bias, beta))
            out = self.g.call_function(aten.add.Tensor, (out, bias))
        return out

    def cross_entropy(self, node: fx.Node, part: OpPartition, args: list, kwargs: dict, lay: NodeLayouts) -> fx.Node:
        op = part.op
        n_dim, v_dim = op.dims[0], op.dims[1]
        reduction = {0: "none", 1: "mean", 2: "sum"}[int(_arg(node, 3, "reduction", 1))]
        ignore = int(_arg(node, 4, "ignore_index", -100))

        def digits_of(dims: set[str]) -> tuple[int, ...]:
            return tuple(
                p for e, pos in zip(part.seq.elements, part.positions) if getattr(e, "dim", None) in dims for p in pos
            )

        summed = set(op.summed_dims(op.outputs[0]))
        v_layout = lay.in_needed(0)[self.rank][-1]
        v_lo = v_layout[0][0]
        mod = ShardedCrossEntropy(
            reduction, ignore, v_lo, self.group(digits_of({v_dim})), self.group(digits_of(summed - {v_dim})), self.stats
        )
        mod.node = node.name
        if n_dim in summed and reduction == "none":
            raise AssertionError("unreachable: rows are kept with reduction='none'")
        return self.call_module("cross_entropy", mod, args[0], args[1])

    def output(self, node: fx.Node) -> None:
        outs = []
        for a in node.args[0]:
            if not isinstance(a, fx.Node):
                outs.append(a)
                continue
            if a.op != "placeholder" and a.name not in self.parts:
                outs.append(self.concrete(a))
                continue
            j = None
            if a.name in self.parts and len(self.parts[a.name].op.outputs) > 1:
                j = 0
            value, held, grad_needed = self.source(a, j)
            shape = tuple(int(s) for s in a.meta["val"].shape)
            full = full_layout(shape, self.mesh.size)
            outs.append(
                self.redistribute(
                    value,
                    held,
                    full,
                    full if grad_needed is not None else None,
                    grad_needed,
                    f"{a.name} -> output",
                    kind="output",
                )
            )
        self.g.output(tuple(outs))


def _arg(node: fx.Node, pos: int, name: str, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def localize(
    graph: OpGraph,
    partitions: dict[str, PartitionSeq],
    mesh: DeviceMesh,
    rank: int,
    values: dict[sympy.Symbol, int],
    groups: ProcessGroups,
) -> RankGraph:
    """Rewrite ``graph`` (its captured GraphModule) into the GraphModule rank ``rank`` runs (module docstring)."""
    specs = graph.captured.program.graph_signature.output_specs
    bad = [s for s in specs if s.kind.name != "USER_OUTPUT"]
    if bad:
        raise NotImplementedError(
            f"outputs other than user outputs ({bad[0].kind.name}: {bad[0].target}) "
            "are not supported: the model mutates a buffer in forward"
        )
    b = _Builder(graph, partitions, mesh, rank, values, groups)
    for node in graph.captured.gm.graph.nodes:
        if node.op == "placeholder":
            b.placeholder(node)
        elif node.op == "call_function":
            b.call(node)
        elif node.op == "output":
            b.output(node)
        else:
            raise NotImplementedError(f"node {node.name}: {node.op} nodes are not supported")
    gm = fx.GraphModule(b.root, b.g, class_name=f"PrimeParRank{rank}")
    return RankGraph(gm, b.param_layouts, b.fallbacks, b.stats)
