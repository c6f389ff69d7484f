"""Pass 6, and the pipeline: every planned node computes its own block.

:func:`rewrite_local_ops` turns each remaining planned node into its local computation on this rank's blocks, by
the local form registered for its op (:func:`register_local`, keyed by ``OpOverload`` objects):

* the same ATen op, with its size arguments (``view``/``reshape``/``expand``, factories, ``layer_norm``'s
  ``normalized_shape``) set to the local sizes and every size node replaced by its value at the compiled ``B``, ``S``;
* an ``arange`` over a split dim starts at the rank's offset;
* a ``mean`` over a split dim is rescaled to the global count (its forward all-reduce sums the parts);
* a split vocabulary (``embedding``), normalised dim (``layer_norm``) or class / row dim (``cross_entropy``)
  uses the modules of :mod:`primepar_fx.runtime.lowered`; a mean cross-entropy over rows split across ranks also
  gets a :class:`~primepar_fx.runtime.pending.TargetCount` node, and the computation of its targets moves to the
  start of the graph (:func:`hoist`), so the count is summed while forward runs;
* a fallback node (:mod:`primepar_fx.passes.annotate`) runs whole and then keeps its planned output slice.

:func:`localize` runs the passes in order on a copy of the captured graph, with
:func:`~primepar_fx.passes.runner.run_passes` (each pass checked, ``PRIMEPAR_DISABLE_PASSES``, per-pass dumps)::

    annotate_plan -> shard_parameters -> insert_redistributions -> insert_collectives -> share_relayouts
      -> fuse_reduce_scatters -> defer_parameter_gradients -> replace_ring_products -> rewrite_local_ops
      -> defer_input_gradient_sums -> overlap_collective_matmuls -> recompute_layers
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Any, NamedTuple

import sympy
import torch
from torch import fx, nn

from primepar_fx.frontend.moe import MOE_EXPERTS
from primepar_fx.graph import OpGraph
from primepar_fx.graph.build import input_chain, pure_target, upstream
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq
from primepar_fx.partition.layouts import Layout
from primepar_fx.passes.annotate import annotate_plan
from primepar_fx.passes.collectives import fuse_reduce_scatters, insert_collectives
from primepar_fx.passes.common import META, STORAGE, NodeInfo, RankContext, add_module, arg, digits_of, info, is_getitem
from primepar_fx.passes.gradsync import defer_input_gradient_sums, defer_parameter_gradients
from primepar_fx.passes.layouts import NodeLayouts, local_shape
from primepar_fx.passes.overlap import overlap_collective_matmuls
from primepar_fx.passes.recompute import recompute_layers
from primepar_fx.passes.redistribute import insert_redistributions, redistribute_module
from primepar_fx.passes.ring import replace_ring_products
from primepar_fx.passes.runner import run_passes
from primepar_fx.passes.shard import shard_parameters
from primepar_fx.passes.share import share_relayouts
from primepar_fx.runtime.exchange import Exchange, Redistribute
from primepar_fx.runtime.gradsync import GradReduction
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.lowered import ShardedCrossEntropy, ShardedLayerNorm, VocabEmbedding, loss_message_bytes
from primepar_fx.runtime.pending import TargetCount
from primepar_fx.runtime.stats import CommStats

aten = torch.ops.aten

#: ops whose argument ``index`` is the output shape
SIZE_ARG = {
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


class ArangeArgs(NamedTuple):
    """The positions of an ``arange`` overload's arguments (``None``: the overload has no such argument)."""

    start: int | None
    end: int
    step: int | None


ARANGE = {
    aten.arange.default: ArangeArgs(None, 0, None),
    aten.arange.start: ArangeArgs(0, 1, None),
    aten.arange.start_step: ArangeArgs(0, 1, 2),
}
MEANS = {aten.mean.dim, aten.mean.default}
#: ``aten.layer_norm(input, normalized_shape, weight, bias, eps, cudnn_enable)``
LN_INPUT, LN_SHAPE, LN_WEIGHT, LN_BIAS, LN_EPS = range(5)
#: ``aten.embedding(weight, indices, ...)``: arguments, and inputs of its ``OpDims`` (the weight's first dim is the
#: vocabulary)
EMB_WEIGHT, EMB_INDICES = range(2)
#: ``primepar::moe_experts(hidden, top_k_index, top_k_weights, up, ..., expert_lo, ...)``: the input of the experts'
#: up weights (experts first), and the argument holding the first expert of the block
MOE_UP, MOE_EXPERT_LO = 3, 10
#: ``aten.cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)``
CE_LOGITS, CE_TARGET, CE_REDUCTION, CE_IGNORE_INDEX = 0, 1, 3, 4
#: ``aten.cross_entropy_loss``'s ``reduction`` values
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
#: the passes ``PRIMEPAR_DISABLE_PASSES`` may not skip, and why. Skipping any other pass gives a graph that runs (or
#: fails at run time) to help find a bug, not the plan's computation: docs/runtime.md, "Running the passes", says
#: what each one does then. Skipping ``annotate_plan`` leaves no node planned, so every rank runs the whole graph.
REQUIRED_PASSES = {
    "shard_parameters": "it records which slice of each parameter this rank keeps; later passes and the compiled "
    "module read it",
    "rewrite_local_ops": "it turns every op into its local form; without it the ops of a partitioned graph keep "
    "their whole-tensor sizes and fail on their blocks",
}
_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


@dataclass
class RankGraph:
    """The rewritten graph of one rank and what it needs at run time."""

    gm: fx.GraphModule
    param_layouts: dict[str, Layout]  # placeholder name -> storage layout
    fallbacks: list[str] = field(default_factory=list)
    stats: CommStats = field(default_factory=CommStats)
    #: ``(pass name, op counts after it)``, starting with the captured graph
    pass_counts: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    #: parameter placeholder -> the gradient sum the compiled module's gradient buckets do for it
    grad_reductions: dict[str, GradReduction] = field(default_factory=dict)


def _replace(gm: fx.GraphModule, node: fx.Node, prefix: str, mod: nn.Module, *args: Any) -> fx.Node:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(add_module(gm, prefix, mod), args)
    new.meta[META] = node.meta[META]
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _local_exchange(e: object) -> bool:
    return e is None or (isinstance(e, Exchange) and not e.sends and not e.recvs)


def _pure(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may run earlier than it does on this rank: a function of its inputs only (no mutation, no
    RNG, no message: a re-layout that is a local slice on this rank in both directions keeps every message of this
    rank where it was, so no peer sees a different order)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)  # type: ignore[arg-type]
        return isinstance(mod, Redistribute) and _local_exchange(mod.fwd) and _local_exchange(mod.bwd)
    return node.op == "call_function" and pure_target(node.target)


def hoist(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Move ``node`` and the nodes it depends on to just after the graph's inputs, keeping their order, if all of
    them are :func:`_pure`; returns whether it moved them. The decision may differ between ranks; only this rank's
    computation moves, never its messages."""
    chain = upstream(node, lambda n: _pure(gm, n))
    if chain is None:
        return False
    nodes = list(gm.graph.nodes)
    anchor = [n for n in nodes if n.op == "placeholder"][-1]
    for n in nodes:
        if n in chain and n.op not in ("placeholder", "get_attr"):
            anchor.append(n)
            anchor = n
    return True


def _target_count(gm: fx.GraphModule, ctx: RankContext, node: fx.Node, loss: ShardedCrossEntropy) -> fx.Node | None:
    """A mean cross-entropy over rows split across ranks: the count of its targets is summed from the start of the
    graph, while forward runs (:class:`~primepar_fx.runtime.pending.TargetCount`); or, when the plan prices no
    message for it (``count_local``: the targets come from the inputs), counted whole on every rank."""
    group = loss.n_group  # its own communicator (``rewrite_local_ops``): only the count and the loss use it
    if len(group[1]) < 2:
        return None
    target = node.args[CE_TARGET]
    assert isinstance(target, fx.Node), node.format_node()
    dtype = node.meta["val"].dtype  # the loss's, the logits'
    if loss.count_local:
        whole = next(n for n in ctx.graph.captured.gm.graph.nodes if n.name == node.name)  # the loss, unpartitioned
        chain = input_chain(whole.args[CE_TARGET], ctx.graph.captured.user_inputs)
        assert chain is not None, node.format_node()
        sub, copied = fx.Graph(), {}
        sources = [n for n in chain if n.op == "placeholder"]
        for n in chain:
            copied[n] = sub.placeholder(n.name) if n.op == "placeholder" else sub.node_copy(n, copied.__getitem__)
        sub.output(copied[chain[-1]])
        counter = fx.GraphModule(nn.Module(), sub, class_name="Targets")
        mod = TargetCount(loss.ignore_index, dtype, None, ctx.stats, 0, node.name, counter=counter)
        here = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        with gm.graph.inserting_after([n for n in gm.graph.nodes if n.op == "placeholder"][-1]):
            return gm.graph.call_module(add_module(gm, "target_count", mod), tuple(here[n.name] for n in sources))
    hoist(gm, target)
    nbytes = loss_message_bytes(len(group[1]), dtype.itemsize)[0]
    mod = TargetCount(loss.ignore_index, dtype, group, ctx.stats, nbytes, node.name)
    with gm.graph.inserting_after(target):
        return gm.graph.call_module(add_module(gm, "target_count", mod), (target,))


def _concrete(ctx: RankContext, a: Any) -> Any:
    """A size node's value at the compiled ``B``, ``S``; any other argument as it is."""
    if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), _SCALARS) and info(a) is None:
        return ctx.concrete(a)
    return a


@dataclass
class LocalCall:
    """One planned node on its way to its local form: the rank's view, and the arguments a local form edits."""

    gm: fx.GraphModule
    ctx: RankContext
    node: fx.Node
    me: NodeInfo
    #: the layouts the local computation reads
    lay: NodeLayouts
    #: the node's arguments, each size node replaced by its value (:func:`_concrete`)
    args: list[Any]
    kwargs: dict[str, Any]
    #: the local shape of each output
    outs: list[tuple[int, ...]]
    #: the dims the computed partition splits
    split: set[str]

    @classmethod
    def of(cls, gm: fx.GraphModule, ctx: RankContext, node: fx.Node, me: NodeInfo) -> LocalCall:
        lay, concrete = me.computed, partial(_concrete, ctx)
        args = list(fx.node.map_aggregate(node.args, concrete))
        kwargs = dict(fx.node.map_aggregate(node.kwargs, concrete))
        outs = [local_shape(lay.out_held(j), ctx.rank) for j in range(len(me.compute_part.op.outputs))]
        split = {d for d, p in me.compute_part.parts.items() if p > 1}
        return cls(gm, ctx, node, me, lay, args, kwargs, outs, split)

    @property
    def part(self) -> OpPartition:
        return self.me.compute_part

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def replace(self, prefix: str, mod: nn.Module, *args: Any) -> None:
        """Replace the node by a call of ``mod`` (a new submodule named after ``prefix``) on ``args``."""
        _replace(self.gm, self.node, prefix, mod, *args)


#: a local form: edits :class:`LocalCall`'s arguments (or the node's target), or replaces the node by a module and
#: returns ``True`` (nothing is left to do then)
LocalForm = Callable[[LocalCall], bool]
_LOCAL_FORMS: dict[object, LocalForm] = {}


def register_local(ops: object) -> Callable[[LocalForm], LocalForm]:
    """Decorator: register ``fn`` as the local form of one ATen ``OpOverload`` or a list of them (never strings)."""
    targets = list(ops) if isinstance(ops, (list, tuple)) else [ops]
    for op in targets:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"local forms are keyed by OpOverload objects: {op!r}")

    def deco(fn: LocalForm) -> LocalForm:
        for op in targets:
            if op in _LOCAL_FORMS and _LOCAL_FORMS[op] is not fn:
                raise ValueError(f"a local form of {op} is already registered ({_LOCAL_FORMS[op].__qualname__})")
            _LOCAL_FORMS[op] = fn
        return fn

    return deco


@register_local(list(SIZE_ARG))
def _local_sizes(call: LocalCall) -> bool:
    """The size argument set to the local shape; a ``view`` becomes a ``reshape`` (a local block may not be viewable
    where the whole tensor was)."""
    call.args[SIZE_ARG[call.node.target]] = list(call.outs[0])
    if call.node.target is aten.view.default:
        call.node.target = aten.reshape.default
    return False


@register_local(list(ARANGE))
def _local_arange(call: LocalCall) -> bool:
    """Over a split dim, the rank's part of the range, starting at its offset (as ``arange.start_step``)."""
    if not call.split:
        return False
    ((lo, hi),) = call.lay.out_held(0)[call.rank][0]
    at, args, kwargs = ARANGE[call.node.target], call.args, call.kwargs
    start = args[at.start] if at.start is not None else kwargs.pop("start", 0)
    step = args[at.step] if at.step is not None and len(args) > at.step else kwargs.pop("step", 1)
    call.args = [start + lo * step, start + hi * step, step]
    call.node.target = aten.arange.start_step
    return False


@register_local(aten.layer_norm.default)
def _local_layer_norm(call: LocalCall) -> bool:
    """``normalized_shape`` set to the local sizes; over a split normalised dim, a :class:`ShardedLayerNorm`."""
    node, op = call.node, call.part.op
    call.args[LN_SHAPE] = list(call.outs[0][-len(node.args[LN_SHAPE]) :])  # type: ignore[arg-type]
    if not op.stats & call.split:
        return False
    size = int(prod(int(sympy.sympify(op.size(d)).xreplace(call.ctx.values)) for d in op.stats))
    eps = float(arg(node, LN_EPS, "eps", 1e-5))
    mod = ShardedLayerNorm(size, eps, call.ctx.groups.get(digits_of(call.part, op.stats)), call.ctx.stats)
    mod.node = node.name
    weight, bias = arg(node, LN_WEIGHT, "weight", None), arg(node, LN_BIAS, "bias", None)
    call.replace("layer_norm", mod, call.args[LN_INPUT], weight, bias)
    return True


@register_local(aten.embedding.default)
def _local_embedding(call: LocalCall) -> bool:
    """Over a split vocabulary, a :class:`VocabEmbedding` of the rank's rows."""
    if call.part.op.inputs[EMB_WEIGHT][0][0] not in call.split:  # type: ignore[index]
        return False
    ((lo, hi),) = call.lay.in_needed(EMB_WEIGHT)[call.rank][0]
    call.replace("vocab_embedding", VocabEmbedding(lo, hi - lo), call.args[EMB_WEIGHT], call.args[EMB_INDICES])
    return True


@register_local(MOE_EXPERTS)
def _local_moe_experts(call: LocalCall) -> bool:
    """Over split experts, the experts this rank holds: tokens routed elsewhere give zero."""
    if call.part.op.inputs[MOE_UP][0][0] in call.split:  # type: ignore[index]
        ((lo, _),) = call.lay.in_needed(MOE_UP)[call.rank][0]
        call.args[MOE_EXPERT_LO] = lo
    return False


@register_local(aten.cross_entropy_loss.default)
def _local_cross_entropy(call: LocalCall) -> bool:
    """Split, a :class:`ShardedCrossEntropy`; a mean one over rows split across ranks reads the count of its
    targets (:func:`_target_count`)."""
    if not call.split:
        return False
    node, part, ctx = call.node, call.part, call.ctx
    op = part.op
    v_dim = op.dims[1]  # the classes (a vocabulary)
    reduction = REDUCTIONS[int(arg(node, CE_REDUCTION, "reduction", 1))]
    rows = set(op.summed_dims(op.outputs[0])) - {v_dim}
    mod = ShardedCrossEntropy(
        reduction,
        int(arg(node, CE_IGNORE_INDEX, "ignore_index", -100)),
        call.lay.in_needed(CE_LOGITS)[call.rank][-1][0][0],
        ctx.groups.get(digits_of(part, {v_dim})),
        # the row sums go asynchronously, on a channel of their own: with the count's node moved up on some
        # ranks only (``hoist``), no other message may fall between them in a different order on another rank
        ctx.groups.get(digits_of(part, rows), channel=f"loss {node.name}"),
        ctx.stats,
        count_local=reduction == "mean" and bool(op.extra.get("count_local")),
    )
    mod.node = node.name
    count = _target_count(call.gm, ctx, node, mod) if reduction == "mean" else None
    logits, target = call.args[CE_LOGITS], call.args[CE_TARGET]
    call.replace("cross_entropy", mod, logits, target, *([count] if count is not None else []))
    return True


@register_local(list(MEANS))
def _local_mean(call: LocalCall) -> bool:
    """Over a split dim, rescaled to the global count (its forward all-reduce sums the parts)."""
    if not call.split:
        return False
    part = call.part
    scale = 1.0 / prod(part.parts[d] for d in part.op.summed_dims(part.op.outputs[0]))
    if scale != 1.0:
        gm, node = call.gm, call.node
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node, scale))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    return False


def _keep_planned_slice(call: LocalCall) -> None:
    """A fallback node ran whole: re-lay its output out as planned."""
    gm, node, lay, planned = call.gm, call.node, call.lay, call.me.planned
    mod = redistribute_module(
        call.ctx,
        lay.out_held(0),
        planned.out_held(0),
        planned.out_grad_needed(0),
        lay.out_grad_needed(0),
        f"{node.name} whole -> planned",
        node.name,
    )
    if mod is not None:
        with gm.graph.inserting_after(node):
            r = gm.graph.call_module(add_module(gm, "redistribute", mod), (node,))
        node.replace_all_uses_with(r, delete_user_cb=lambda u, r=r: u is not r)


def _local(gm: fx.GraphModule, ctx: RankContext, node: fx.Node, me: NodeInfo) -> None:
    """Rewrite ``node`` into its local form on this rank: its op's registered form (:func:`register_local`), its
    size nodes replaced by their values; a fallback then keeps its planned output slice."""
    call = LocalCall.of(gm, ctx, node, me)
    form = _LOCAL_FORMS.get(node.target)
    if form is not None and form(call):
        return
    node.args, node.kwargs = tuple(call.args), call.kwargs
    if me.fallback:  # ran whole: keep the planned slice of the output
        _keep_planned_slice(call)


def rewrite_local_ops(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        me = info(node)
        if me is None or node.op != "call_function" or is_getitem(node):
            continue
        _local(gm, ctx, node, me)
    for node in reversed(list(gm.graph.nodes)):  # size arithmetic and shape asserts left without users
        if node.op == "call_function" and not node.users and info(node) is None:
            gm.graph.erase_node(node)
    return gm


def localize(
    graph: OpGraph,
    partitions: dict[str, PartitionSeq],
    mesh: DeviceMesh,
    rank: int,
    values: dict[sympy.Symbol, int],
    groups: ProcessGroups,
    *,
    whole_params: bool = False,
    recompute: Any = None,
) -> RankGraph:
    """Run the passes (module docstring) on a copy of ``graph``'s captured GraphModule for rank ``rank``.

    ``whole_params``: parameters arrive whole on every call (the ``torch.compile`` backend) rather than sharded.
    ``recompute``: the plan's activation recomputation (:mod:`primepar_fx.passes.recompute`).
    A failing pass raises :class:`~primepar_fx.passes.runner.PassError` (the pass's own error is its ``__cause__``).
    ``PRIMEPAR_DISABLE_PASSES`` must be the same on every rank: the passes create process groups collectively.
    """
    graph.require_captured("the per-rank passes")
    captured = graph.captured
    specs = captured.program.graph_signature.output_specs
    bad = [s for s in specs if s.kind.name != "USER_OUTPUT"]
    if bad:
        raise NotImplementedError(
            f"outputs other than user outputs ({bad[0].kind.name}: {bad[0].target}) are not supported: "
            "the model mutates a buffer in forward"
        )
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise NotImplementedError(f"node {node.name}: {node.op} nodes are not supported")
    copy = fx.Graph()
    out = copy.graph_copy(captured.gm.graph, {})
    copy.output(out)
    gm = fx.GraphModule(nn.Module(), copy, class_name=f"PrimeParRank{rank}")
    ctx = RankContext(graph, mesh, rank, values, groups, whole_params=whole_params, recompute=recompute)
    passes = [
        ("annotate_plan", partial(annotate_plan, partitions=partitions)),
        shard_parameters,
        insert_redistributions,
        insert_collectives,
        share_relayouts,
        fuse_reduce_scatters,
        defer_parameter_gradients,
        replace_ring_products,
        rewrite_local_ops,
        defer_input_gradient_sums,
        overlap_collective_matmuls,
        recompute_layers,
    ]
    gm, counts = run_passes(gm, passes, ctx, required=REQUIRED_PASSES, input_name="captured")
    # annotate_plan only fills node.meta, so its counts are the captured graph's: pass_counts never listed it
    counts = [(name, c) for name, c in counts if name != "annotate_plan"]
    layouts = {n.name: n.meta[STORAGE] for n in gm.graph.nodes if n.op == "placeholder" and STORAGE in n.meta}
    return RankGraph(gm, layouts, ctx.fallbacks, ctx.stats, counts, ctx.grad_reductions)
