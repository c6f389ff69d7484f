"""Baseline plans in our IR: Megatron-LM tensor(+sequence) parallelism x data parallelism, and pure data parallelism.

A plan is a dict ``node name -> PartitionSeq`` covering every node of an :class:`~primepar_fx.graph.OpGraph`; every
sequence is legal on the mesh (it builds as ``OpPartition(node.dims, seq, mesh)`` and is one of
``enumerate_sequences(node.dims, mesh)``). The paper (§7) compares against "Megatron-LM, taking the best
data-parallel x model-parallel split": :func:`megatron_configs` lists the splits, the caller prices each plan.

Digits. The data-parallel size ``dp`` takes the leading (most significant) digits whose product is ``dp``; the
model-parallel size ``mp = world / dp`` takes the remaining digits.

Rules of :func:`megatron_assignment`, node by node:

* **DP digits** split the node's batch dim: a dim whose size is a multiple of the symbol ``B`` (``B`` itself, a merged
  ``B*S`` or ``B*heads``), preferring the dim named ``B``. A node without one (factories, masks, the scalar loss
  tail) replicates on those digits.
* **Linears** (matrix products with a parameter operand) are classified by structure (:func:`classify_linears`).
  Column-parallel ones split their output features (``K``), row-parallel ones their contraction dim (``N``).
* **Tensor-parallel region**: the image of a column-parallel ``K`` is followed forward through the graph and the
  image of a row-parallel ``N`` backward; every node reached splits that dim (the head dim ``H`` of attention, the
  hidden dim before the head split, the activation's features, GQA's kv-head dim, ALiBi's head dim, the class
  dim ``V`` of a vocab-parallel cross-entropy after the lm_head). Linears, nodes with parameters (norms) and
  embeddings stop the walk, a loss ends it. A tensor dim made of several iteration dims is represented by its
  *lead*: the first member that is not a batch dim, so ``K -> (H, E)`` maps to ``H`` and ``(B, H) -> BH`` maps the
  head split onto the merged dim (split after its batch split; its slices are then contiguous chunks of the
  B-major merge, which is as close as the IR gets and is listed in :attr:`Assignment.notes`).
* **Embeddings** whose indices come from a graph input (token ids) are vocab-parallel (split ``V``); position
  tables (indices built by the graph) fall under the last rule.
* **Everything else** (norms, residual adds, dropout, position embeddings, masks) replicates on the MP digits;
  with ``sequence_parallel=True`` the nodes that carry gradients (activations, not masks or labels) split their
  sequence dim there instead (a dim of size ``S``, else a merged ``B*S`` after its batch split).

A rule that cannot be applied legally on a digit (a no-split dim, a size that does not divide) replicates on that
digit; each case is logged at debug level and listed in :attr:`Assignment.fallbacks`.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Any

import sympy

from primepar_fx.frontend.moe import MOE_EXPERTS
from primepar_fx.frontend.symbols import B as BATCH
from primepar_fx.frontend.symbols import S as SEQ
from primepar_fx.graph import OpGraph, OpNode
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Replicate, Split
from primepar_fx.partition.enumerate import ValuesKey, fits_at, size_at, values_key
from primepar_fx.rules.registry import op_name
from primepar_fx.rules.spec import OpDims

log = logging.getLogger(__name__)

#: element-wise ops that are an MLP's non-linearity (what a row-parallel linear reads)
ACTIVATIONS = frozenset(
    {
        "gelu", "relu", "silu", "tanh", "sigmoid", "erf", "mish", "hardswish", "hardsigmoid", "elu", "selu",
        "celu", "leaky_relu", "softplus", "relu6", "hardtanh", "glu", "gelu_", "relu_", "silu_",
    }
)  # fmt: skip
#: module names of row-parallel linears, used only when the structure is ambiguous
ROW_NAME_HINT = re.compile(r"(^|[._])(o_proj|out_proj|c_proj|dense|down_proj|fc2|dense_4h_to_h|wo|w2|proj_out)$")


@dataclass(frozen=True)
class Fallback:
    """A digit on which a rule could not be applied, so the node replicates there."""

    node: str
    rule: str
    dim: str | None
    digit: int
    reason: str

    def __str__(self) -> str:
        return f"{self.node}: {self.rule} {self.dim or '-'} on digit {self.digit} -> R ({self.reason})"


class Assignment(dict):
    """``node name -> PartitionSeq``; ``fallbacks`` lists the replicated digits, ``roles`` which rule placed a node."""

    def __init__(self, seqs=(), *, fallbacks=(), roles=None, notes=(), config=None) -> None:
        super().__init__(seqs)
        self.fallbacks: list[Fallback] = list(fallbacks)
        self.roles: dict[str, str] = dict(roles or {})
        self.notes: list[str] = list(notes)
        self.config: dict = dict(config or {})

    def fallback_nodes(self) -> list[str]:
        return list(dict.fromkeys(f.node for f in self.fallbacks))


@dataclass(frozen=True)
class Linear:
    """A matrix product with a parameter operand: its parallel style and the dims that style splits."""

    node: str
    style: str  # "column" or "row"
    features: str  # output-feature dim (split when column-parallel)
    contraction: str  # summed dim (split when row-parallel)
    act_input: int  # index of the activation operand in node.dims.inputs
    how: str  # "structure" or "name hint"


@dataclass(frozen=True)
class _Edge:
    src: str
    out: int
    dst: str
    inp: int


@dataclass
class _Analysis:
    """What megatron_assignment derives once per graph."""

    linears: dict[str, Linear]
    tags: dict[str, str]
    blocked: dict[str, str]
    vocab: dict[str, str]
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ small helpers
@lru_cache(maxsize=1 << 14)
def _multiple_of(size: sympy.Expr, sym: sympy.Symbol) -> bool:
    expr = sympy.sympify(size)
    return sym in expr.free_symbols and sympy.expand(expr.subs(sym, 0)) == 0


def _is_batch(op: OpDims, dim: str) -> bool:
    return _multiple_of(op.size(dim), BATCH)


def _lead(op: OpDims, group: tuple[str, ...]) -> str | None:
    """The member of a merged tensor dim that stands for it: the first that is not a batch dim."""
    if not group:
        return None
    return next((d for d in group if not _is_batch(op, d)), group[-1])


def _base(node: OpNode) -> str:
    name = op_name(node.target)
    return name.split(".")[1] if name.startswith("aten.") else name


def _vkey(values: dict | None) -> ValuesKey | None:
    """``values`` (symbols or their names ``"B"``, ``"S"``) as a :func:`~primepar_fx.partition.enumerate.values_key`."""
    if not values:
        return None
    named = {"B": BATCH, "S": SEQ}
    return values_key({named.get(k, k) if isinstance(k, str) else k: int(v) for k, v in values.items()})


def _parameterised(node: OpNode) -> bool:
    d = node.dims
    return d.matmul is not None and d.matmul_operands is not None and bool(set(d.matmul_operands) & d.weights)


def _carries_grad(op: OpDims) -> bool:
    return bool(op.weights) or any(m is not None and k not in op.no_grad for k, m in enumerate(op.inputs))


def dp_digits(mesh: DeviceMesh, dp: int) -> int:
    """How many leading digits make up the data-parallel size ``dp`` (ValueError if no digit prefix does)."""
    sizes = [prod(mesh.digits[:k]) for k in range(len(mesh.digits) + 1)]
    if dp not in sizes:
        raise ValueError(f"dp={dp} is not a product of leading device digits {mesh.digits}; choose one of {sizes}")
    return sizes.index(dp)


# ------------------------------------------------------------------------------------------------ graph structure
def _edges(graph: OpGraph) -> list[_Edge]:
    """Data-flow edges with the producer's output index (``getitem`` selects one) and the consumer's input index.

    Read from the fx graph so an input used twice (``mul(x, x)``) yields both edges; ``graph.graph`` otherwise.
    """
    fx = getattr(graph, "captured", None) is not None
    out = []
    for name, node in graph.nodes.items():
        if fx:
            pairs = [(a, i) for i, a in enumerate(graph.input_names(name)) if a is not None]
        else:
            pairs = [(src, graph.graph.edges[src, name]["dst_in"]) for src in graph.graph.predecessors(name)]
        for src, i in pairs:
            if src not in graph.nodes or i >= len(node.dims.inputs) or node.dims.inputs[i] is None:
                continue
            j = node.dims.extra.get("selects", 0) if len(graph.nodes[src].dims.outputs) > 1 else 0
            if isinstance(j, int) and j < len(graph.nodes[src].dims.outputs):
                out.append(_Edge(src, j, name, i))
    return out


def _stop_class(node: OpNode) -> str | None:
    """What a walk back through views and element-wise ops finds at ``node`` (None: walk on through it)."""
    d = node.dims
    if d.kind == "attention" or (d.matmul is not None and not d.weights):
        return "signal"
    if d.kind == "norm" and not d.weights and _base(node) in ("softmax", "_softmax", "log_softmax"):
        return "signal"
    if d.matmul is not None:
        return "matmul"
    if d.kind == "factory":
        return "const"
    if d.kind in ("view", "pointwise") and not d.weights:
        return "signal" if _base(node) in ACTIVATIONS else None
    return "stream"


def _sources(graph: OpGraph, in_edges: dict[str, list[_Edge]]) -> dict[str, frozenset[str]]:
    """For every node, the stop classes its value comes from through views/element-wise ops (topological pass)."""
    out: dict[str, frozenset[str]] = {}
    for name, node in graph.nodes.items():
        cls = _stop_class(node)
        if cls is not None:
            out[name] = frozenset({cls})
            continue
        fed = {e.inp for e in in_edges[name]}
        acc = {c for e in in_edges[name] for c in out[e.src]}
        if any(m is not None and k not in fed for k, m in enumerate(node.dims.inputs)):
            acc.add("input")
        out[name] = frozenset(acc)
    return out


def _classify(graph: OpGraph, in_edges: dict[str, list[_Edge]]) -> dict[str, Linear]:
    """Column/row style of every parameterised matrix product; see :func:`classify_linears` for the rule."""
    sources = _sources(graph, in_edges)
    out = {}
    for name, node in graph.nodes.items():
        if not _parameterised(node):
            continue
        d = node.dims
        m, n, k = d.matmul  # type: ignore[misc]
        i_idx, w_idx = d.matmul_operands  # type: ignore[misc]
        features, act = (k, i_idx) if w_idx in d.weights else (m, w_idx)
        src = next((e.src for e in in_edges[name] if e.inp == act), None)
        found = sources[src] if src is not None else frozenset({"input"})
        if "signal" in found and "stream" not in found:
            style, how = "row", "structure"
        elif "signal" not in found and found & {"stream", "matmul"}:
            style, how = "column", "structure"
        else:
            modules = [p.rsplit(".", 1)[0] for p in node.params]
            style = "row" if any(ROW_NAME_HINT.search(mod) for mod in modules) else "column"
            how = "name hint"
            log.debug("linear %s: ambiguous structure %s, name hint says %s", name, sorted(found), style)
        out[name] = Linear(name, style, features, n, act, how)
    return out


def classify_linears(graph: OpGraph) -> dict[str, str]:
    """``node -> "column" | "row"`` for every matrix product with a parameter operand.

    Rule (structural): walk back from the activation operand through views and element-wise ops. If the walk
    reaches an attention op (SDPA, a matmul of two activations such as softmax . V, a softmax) or an MLP
    non-linearity (:data:`ACTIVATIONS`; a gated MLP's ``mul`` is walked through to its ``silu``), the linear is
    row-parallel; if it reaches only the residual stream (norms, embeddings, reductions, other linears), it is
    column-parallel. When the walk finds both a non-linearity and the residual stream, or nothing but graph inputs
    and constants, the structure is ambiguous and the module name decides (:data:`ROW_NAME_HINT`: ``o_proj``,
    ``out_proj``, ``c_proj``, ``dense``, ``down_proj``, ``fc2``, ``dense_4h_to_h``, ... are row-parallel).
    """
    in_edges = defaultdict(list)
    for e in _edges(graph):
        in_edges[e.dst].append(e)
    return {name: lin.style for name, lin in _classify(graph, in_edges).items()}


def _image(src_map, dst_map, src_op: OpDims, dst_op: OpDims, dim: str) -> list[str]:
    """The dims of the other end of an edge that carry ``dim`` (tensor dims whose lead is ``dim``)."""
    if src_map is None or dst_map is None or len(src_map) != len(dst_map):
        return []
    out = []
    for a, b in zip(src_map, dst_map):
        if a and b and _lead(src_op, a) == dim:
            out.append(_lead(dst_op, b))
    return out


def _tensor_parallel(graph: OpGraph, edges: list[_Edge], linears: dict[str, Linear]) -> tuple[dict, dict]:
    """Follow column-parallel ``K`` forward and row-parallel ``N`` backward; returns (tags, blocked).

    ``tags[node]`` is the dim the node splits on the MP digits, ``blocked[node]`` a dim the walk reached that may
    not be split (the node replicates there). Linears, nodes with parameters and embeddings stop the walk; a loss
    takes its tag (vocab-parallel cross-entropy) and ends it.
    """
    outs, ins = defaultdict(list), defaultdict(list)
    for e in edges:
        outs[e.src].append(e)
        ins[e.dst].append(e)
    tags = {n: (lin.features if lin.style == "column" else lin.contraction) for n, lin in linears.items()}
    blocked: dict[str, str] = {}
    queue = deque(tags)

    def accept(name: str, dim: str) -> None:
        node = graph.nodes[name]
        if name in linears or node.dims.weights or node.dims.kind == "embedding":
            return
        if dim in node.dims.no_split:
            blocked.setdefault(name, dim)
        elif name not in tags:
            tags[name] = dim
            if node.dims.kind != "loss":
                queue.append(name)
        elif tags[name] != dim:
            log.debug("tensor-parallel walk: %s already splits %s, ignoring %s", name, tags[name], dim)

    while queue:
        name = queue.popleft()
        node, dim, lin = graph.nodes[name], tags[name], linears.get(name)
        if lin is None or lin.style == "column":
            for e in outs[name]:
                dst = graph.nodes[e.dst].dims
                for y in _image(node.dims.outputs[e.out], dst.inputs[e.inp], node.dims, dst, dim):
                    accept(e.dst, y)
        if lin is None or lin.style == "row":
            for e in ins[name]:
                if lin is not None and e.inp != lin.act_input:
                    continue
                src = graph.nodes[e.src].dims
                for y in _image(node.dims.inputs[e.inp], src.outputs[e.out], node.dims, src, dim):
                    accept(e.src, y)
    return tags, {n: d for n, d in blocked.items() if n not in tags}


def _vocab_embeddings(graph: OpGraph, in_edges: dict[str, list[_Edge]]) -> dict[str, str]:
    """Embeddings whose indices come from a graph input through views/casts only (token ids) -> their vocab dim."""
    out = {}
    for name, node in graph.nodes.items():
        d = node.dims
        if d.kind != "embedding" or not d.weights:
            continue
        table = d.inputs[min(d.weights)] or ()
        vocab = [g[0] for g in table if g and g[0] not in d.dims_of(d.outputs[0])]
        stack, from_input = [e.src for e in in_edges[name]], not in_edges[name]
        seen: set[str] = set()
        while stack:
            src = stack.pop()
            if src in seen:
                continue
            seen.add(src)
            sn = graph.nodes[src]
            if sn.dims.kind not in ("view", "pointwise") or sn.dims.weights:
                from_input = False
                break
            preds = in_edges[src]
            from_input = from_input or not preds
            stack.extend(e.src for e in preds)
        if from_input and vocab:
            out[name] = vocab[0]
    return out


def _analyse(graph: OpGraph) -> _Analysis:
    edges = _edges(graph)
    in_edges = defaultdict(list)
    for e in edges:
        in_edges[e.dst].append(e)
    linears = _classify(graph, in_edges)
    tags, blocked = _tensor_parallel(graph, edges, linears)
    notes = [
        f"{n}: head split lands on the B-major merged dim {d} (chunks of the merge, not whole heads)"
        for n, d in tags.items()
        if n not in linears and _is_batch(graph.nodes[n].dims, d)
    ]
    return _Analysis(linears, tags, blocked, _vocab_embeddings(graph, in_edges), notes)


# ------------------------------------------------------------------------------------------------ sequences
@lru_cache(maxsize=1 << 14)
def _batch_dim(op: OpDims) -> tuple[str | None, str | None]:
    """(the dim DP splits, why none) — a splittable multiple of ``B``, preferring the dim named ``B``."""
    cands = [d for d in op.dims if _is_batch(op, d)]
    ok = sorted((d for d in cands if d not in op.no_split), key=lambda d: d != "B")
    if ok:
        return ok[0], None
    return None, (f"batch dims {cands} may not be split" if cands else None)


@lru_cache(maxsize=1 << 14)
def _seq_dim(op: OpDims) -> tuple[str | None, str | None]:
    """(the dim SP splits, why none) — a splittable dim of size ``S``, else a splittable multiple of ``S``."""
    cands = [d for d in op.dims if _multiple_of(op.size(d), SEQ)]
    ok = sorted((d for d in cands if d not in op.no_split), key=lambda d: sympy.sympify(op.size(d)) != SEQ)
    if ok:
        return ok[0], None
    return None, (f"sequence dims {cands} may not be split" if cands else None)


def _greedy(name: str, op: OpDims, mesh: DeviceMesh, wants, vkey: ValuesKey | None):
    """One element per digit: ``Split(dim)`` where legal, else ``Replicate`` plus a :class:`Fallback`.

    ``wants[i] = (dim or None, rule, reason when dim is None and that is a fallback)``; ``vkey``: the size symbols'
    values as a :func:`~primepar_fx.partition.enumerate.values_key`.
    """
    seq, misses = _greedy_seq(op, mesh, tuple(wants), vkey)
    fallbacks = [Fallback(name, rule, dim, pos, reason) for rule, dim, pos, reason in misses]
    for fb in fallbacks:
        log.debug("baseline fallback %s", fb)
    return seq, fallbacks


@lru_cache(maxsize=1 << 14)
def _greedy_seq(op: OpDims, mesh: DeviceMesh, wants: tuple, vkey: ValuesKey | None):
    """:func:`_greedy` of one op, shared by its nodes: the sequence and ``(rule, dim, digit, reason)`` per miss."""
    parts = {d: 1 for d in op.dims}
    elements, misses = [], []
    for pos, (dim, rule, why) in enumerate(wants):
        radix = mesh.digits[pos]
        if dim is None:
            reason = why
        elif dim not in parts:
            reason = f"the op has no dim {dim}"
        elif dim in op.no_split:
            reason = f"{dim} may not be split"
        elif not fits_at(op.size(dim), parts[dim] * radix, vkey or ()):
            size, n = op.size(dim), size_at(op.size(dim), vkey or ())
            shown = f"{size} = {n}" if n is not None and str(size) != str(n) else str(size)
            reason = f"{dim} of size {shown} does not split into {parts[dim] * radix}"
        else:
            parts[dim] *= radix
            elements.append(Split(dim))
            continue
        elements.append(Replicate())
        if reason:
            misses.append((rule, dim, pos, reason))
    return PartitionSeq(tuple(elements)), tuple(misses)


def _mp_rule(name: str, node: OpNode, info: _Analysis, sp: bool) -> tuple[str | None, str, str | None]:
    """(dim, role, reason-if-none) of a node on the model-parallel digits."""
    if node.target is MOE_EXPERTS:  # Megatron-core's default expert tensor parallelism: each expert's MLP split
        return "I", "expert-tensor-parallel", None
    lin = info.linears.get(name)
    if lin is not None:
        return (lin.features if lin.style == "column" else lin.contraction), lin.style, None
    if name in info.tags:
        return info.tags[name], ("vocab-loss" if node.dims.kind == "loss" else "tensor-parallel"), None
    if name in info.blocked:
        return None, "tensor-parallel", f"{info.blocked[name]} may not be split"
    if name in info.vocab:
        return info.vocab[name], "vocab", None
    if sp and _carries_grad(node.dims):
        dim, why = _seq_dim(node.dims)
        return dim, "sequence-parallel", why
    return None, "replicate", None


def megatron_assignment(
    graph: OpGraph,
    mesh: DeviceMesh,
    *,
    dp: int,
    mp: int | None = None,
    sequence_parallel: bool = False,
    values: dict | None = None,
) -> Assignment:
    """Megatron-LM's plan at data-parallel size ``dp`` (leading digits) x model-parallel ``world/dp``.

    The rules are in the module docstring. ``mp``, when given, must equal ``world/dp``; ``values`` (``{B: 8, S: 16}``,
    symbols or their names) decides divisibility of the symbolic sizes, which are assumed divisible otherwise.
    """
    config = {"dp": dp, "mp": mp, "sequence_parallel": sequence_parallel}
    return megatron_assignments(graph, mesh, [config], values=values)[0]


def megatron_assignments(
    graph: OpGraph, mesh: DeviceMesh, configs: Sequence[Mapping[str, Any]], *, values: dict | None = None
) -> list[Assignment]:
    """:func:`megatron_assignment` for each of ``configs`` (its keyword arguments ``dp``, ``mp`` and
    ``sequence_parallel``), with the graph's linears and tensor-parallel dims found once for them all."""
    info, vals = _analyse(graph), _vkey(values)
    return [_megatron(graph, mesh, info, vals, **config) for config in configs]


def _megatron(
    graph: OpGraph,
    mesh: DeviceMesh,
    info: _Analysis,
    vals: ValuesKey | None,
    *,
    dp: int,
    mp: int | None = None,
    sequence_parallel: bool = False,
    expert_parallel: bool = False,
) -> Assignment:
    k = dp_digits(mesh, dp)
    if mp is not None and mp * dp != mesh.size:
        raise ValueError(f"dp={dp} x mp={mp} != world size {mesh.size}")
    seqs, fallbacks, roles = {}, [], {}
    for name, node in graph.nodes.items():
        bdim, bwhy = _batch_dim(node.dims)
        dp_role = "data-parallel"
        if expert_parallel and node.target is MOE_EXPERTS:  # the experts over the data-parallel ranks
            bdim, bwhy, dp_role = "E", None, "expert-parallel"
        mdim, role, mwhy = _mp_rule(name, node, info, sequence_parallel)
        wants = [(bdim, dp_role, bwhy)] * k + [(mdim, role, mwhy)] * (len(mesh.digits) - k)
        seqs[name], fbs = _greedy(name, node.dims, mesh, wants, vals)
        fallbacks += fbs
        roles[name] = role
    config = {"dp": dp, "mp": mesh.size // dp, "sequence_parallel": sequence_parallel}
    if expert_parallel:
        config["expert_parallel"] = True
    return Assignment(seqs, fallbacks=fallbacks, roles=roles, notes=info.notes if k < len(mesh) else (), config=config)


def data_parallel_assignment(graph: OpGraph, mesh: DeviceMesh, values: dict | None = None) -> Assignment:
    """Pure data parallelism: every digit splits the batch dim (nested ``Split``) where legal, else ``Replicate``."""
    vals, seqs, fallbacks = _vkey(values), {}, []
    for name, node in graph.nodes.items():
        bdim, why = _batch_dim(node.dims)
        seqs[name], fbs = _greedy(name, node.dims, mesh, [(bdim, "data-parallel", why)] * len(mesh), vals)
        fallbacks += fbs
    roles = dict.fromkeys(graph.nodes, "data-parallel")
    return Assignment(seqs, fallbacks=fallbacks, roles=roles, config={"dp": mesh.size, "mp": 1})


def megatron_configs(mesh: DeviceMesh, *, experts: bool = False) -> list[dict]:
    """Every Megatron split of the mesh: ``dp`` a product of leading digits, each with and without sequence
    parallelism (only once when ``mp == 1``). Each dict is ``{"dp", "mp", "sequence_parallel"}`` and can be passed
    as ``megatron_assignment(graph, mesh, **config)``; the caller prices them and keeps the best.

    ``experts`` (the graph has mixture-of-experts layers): each configuration with ``dp > 1`` also with expert
    parallelism over the data-parallel ranks (``"expert_parallel": True``: the experts split over the ``dp`` digits,
    each rank's tokens gathered to them, Megatron-core's ``allgather`` token dispatcher). Without it, and on the
    model-parallel digits always, each expert's MLP is split as Megatron splits an MLP (its expert tensor
    parallelism, by default the tensor-parallel size)."""
    out = []
    for k in range(len(mesh.digits) + 1):
        dp = prod(mesh.digits[:k])
        mp = mesh.size // dp
        for sp in (False, True) if mp > 1 else (False,):
            out.append({"dp": dp, "mp": mp, "sequence_parallel": sp})
            if experts and dp > 1:
                out.append({"dp": dp, "mp": mp, "sequence_parallel": sp, "expert_parallel": True})
    return out


def config_name(config: dict) -> str:
    """``"megatron dp2 x mp4 +SP"``, ``"megatron dp8 x mp4 +SP +distributed optimizer +full recompute +4
    micro-batches"``, ``"megatron dp4 x mp8 x pp4 +SP +128 micro-batches +interleaved v2"``."""
    sp = " +SP" if config.get("sequence_parallel") else ""
    sp += f" +EP{config['dp']}" if config.get("expert_parallel") else ""
    dist = " +distributed optimizer" if config.get("distributed_optimizer") else ""
    recompute = f" +{config['recompute']} recompute" if config.get("recompute") else ""
    m = config.get("micro_batches", 1)
    micro = f" +{m} micro-batches" if m > 1 else ""
    pp = f" x pp{config['pp']}" if config.get("pp") else ""
    if config.get("virtual_stages", 1) > 1:
        micro += f" +interleaved v{config['virtual_stages']}"
    return f"megatron dp{config['dp']} x mp{config.get('mp', '?')}{pp}{sp}{dist}{recompute}{micro}"


def assignment_from_text(
    graph: OpGraph,
    mapping: dict[str, str],
    *,
    mesh: DeviceMesh | None = None,
    default: str | None = None,
) -> Assignment:
    """Parse ``{node: "B,K,K"}`` into an :class:`Assignment`.

    Unknown node names raise ``KeyError``. ``default`` fills the nodes the mapping leaves out; with ``mesh`` every
    sequence is bound to its node (``OpPartition``), raising :class:`~primepar_fx.partition.PartitionError` if illegal.
    """
    unknown = sorted(set(mapping) - set(graph.nodes))
    if unknown:
        raise KeyError(f"no such nodes in graph {graph.name!r}: {unknown}")
    texts = dict(mapping)
    if default is not None:
        texts = {n: mapping.get(n, default) for n in graph.nodes}
    seqs = {n: PartitionSeq.parse(t) for n, t in texts.items()}
    if mesh is not None:
        for n, seq in seqs.items():
            OpPartition(graph.nodes[n].dims, seq, mesh)
    return Assignment(seqs, roles=dict.fromkeys(seqs, "text"))
