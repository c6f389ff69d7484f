"""Capture two layers of a deep model and replicate them into the whole graph (a planning-only shortcut).

``torch.export`` traces every decoder layer, so capturing a deep model takes time in proportion to its depth,
while the planner only needs one layer's nodes and how layers connect. :func:`analyze_replicated` therefore:

1. finds the layer stack: the ``nn.ModuleList`` holding the most parameters whose children share one class and
   one parameter and buffer signature (names, shapes, dtypes) (:func:`find_layer_stack`);
2. captures the model with that list cut to its first two layers (the model is restored afterwards);
3. checks that layer 1 repeats layer 0: node for node the same op, dims, shapes, FLOPs, bytes and source line;
   inputs from its own layer, from the layer before (the *carried* state, such as the hidden states) or from
   the same node before the stack (shared tensors, such as masks and rotary tables); node names that
   advance by a fixed count per layer (:func:`_check_repeat`);
4. writes out the whole :class:`~primepar_fx.graph.OpGraph`: the nodes before the stack, the layer ``L`` times,
   then the nodes after it, each named as :func:`~primepar_fx.frontend.capture.capture` names the full model's nodes
   (``add``, ``add_1``, ... densely in graph order, so a layer's ``k``-th ``add`` is ``first + layer * per_layer``).

The result is the graph the full capture gives (``tests/graph/test_replicate.py`` checks this node for node on the
zoo's and Hugging Face's models), so a plan made from it applies to the full model: it carries the same
``model_fingerprint``. It has no per-layer ``GraphModule``, so it can be planned but not compiled
(:attr:`OpGraph.replicated <primepar_fx.graph.OpGraph.replicated>` is set and the passes refuse it).

When layer 1 does not repeat layer 0 (layer 0 built a cache that later layers reuse, as Hugging Face's BLOOM
does), three layers are captured and layers 1 and 2 are the template. When the model has no such stack, or
neither pair repeats, the full model is captured instead. The check sees only the first layers: a model whose
forward treats a later layer differently (say every fourth layer with another attention) must be captured whole
(``primepar_fx.plan(..., replicate_layers=False)``, ``primepar-fx plan --full-capture``).

A Hugging Face config's ``layer_types`` that are not all the same (sliding-window and full attention in turn, as
Gemma 2 and GPT-OSS have) repeat with a *period* ``p``: there the unit replicated is ``p`` consecutive layers
instead of one, where the depth holds more than two units; else the model is captured whole. Everything above
then reads "unit" for "layer". A depth that ``p`` does not divide (Gemma 3's 62 layers in units of 6) ends in a
*tail* of ``r < p`` layers, the first ``r`` of a unit: two units and the tail are captured (``2p + r`` layers),
the tail is checked to repeat the start of the second unit, and it is written out after the last unit, before
the nodes after the stack.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import networkx as nx
from torch import fx, nn

from primepar_fx.frontend.capture import capture, split_name
from primepar_fx.graph import LayerStack, OpGraph, OpNode, graph_of

log = logging.getLogger(__name__)


class NotRepeated(Exception):
    """Layer 1 of the short capture does not repeat layer 0 (the message says where); the caller captures whole."""


# ------------------------------------------------------------------------------------------------ the stack
def _signature(module: nn.Module) -> tuple:
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return type(module), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors)


class ModuleStack(NamedTuple):
    """A model's layer stack: its FQN, the module list and the period of its layers' types (1: all alike)."""

    fqn: str
    layers: nn.ModuleList
    period: int


def layer_period(types: Sequence[Any] | None, count: int) -> int | None:
    """The fewest layers after which ``types`` (a config's ``layer_types``) repeat, where the ``count`` layers hold
    more than two such units (a tail of fewer may follow: the first layers of a unit); 1 where there are no types
    or all are one; ``None`` otherwise (and where the list does not have one entry per layer)."""
    if types is None or len(set(types)) <= 1:
        return 1
    types = list(types)
    if len(types) != count:
        return None
    for period in range(2, count // 3 + 1):
        if all(t == types[i % period] for i, t in enumerate(types)):
            return period
    return None


def find_layer_stack(model: nn.Module) -> ModuleStack | None:
    """The model's largest stack of more than two identical layers, with the period of its ``config.layer_types``
    (:func:`layer_period`), or ``None``."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) <= 2 or not fqn:
            continue
        signatures = {_signature(child) for child in module}
        if len(signatures) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, fqn, module)
    if best is None:
        return None
    types = getattr(getattr(model, "config", None), "layer_types", None)
    period = layer_period(types, len(best[2]))
    if period is None:
        log.info(
            "layer stack %s: config.layer_types differ (%s) and do not repeat in units of more than two; capturing "
            "whole",
            best[1],
            sorted(set(types)),  # type: ignore[arg-type]
        )
        return None
    return ModuleStack(best[1], best[2], period)


def _set_submodule(model: nn.Module, fqn: str, value: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, value)


# ------------------------------------------------------------------------------------------------ entry point
#: the length of a model's longest module list from which its whole capture uses FakeTensor's dispatch cache: where
#: capture times with and without it crossed (docs/benchmarks/measured_in_code.md)
FAKE_CACHE_LAYERS = 6


def analyze_replicated(
    model: nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    fallback: str | None = None,
    seq_max: int | None = None,
) -> OpGraph:
    """:func:`~primepar_fx.api.analyze` for planning: capture two layers (or units) and replicate them (module doc).

    Falls back to capturing the whole model when it has no layer stack or its layers do not repeat.
    """
    found = find_layer_stack(model)
    whole = dict(name=name, seq_max=seq_max)
    if found is not None:
        fqn, stack, period = found
        units, tail = divmod(len(stack), period)
        for first in (0, 1):  # units 0 and 1 as the template, else units 1 and 2 (layer 0 set up a cache)
            if units <= first + 2:
                break
            _set_submodule(model, fqn, nn.ModuleList(list(stack)[: (first + 2) * period + tail]))
            try:
                short = graph_of(  # few layers: no FakeTensor cache
                    lambda static: capture(
                        model, example_args, example_kwargs, **whole, fake_cache=False, static_seq=static
                    ),
                    fallback=fallback,
                )
            finally:
                _set_submodule(model, fqn, stack)
            try:
                return replicate(short, fqn, len(stack), first=first, period=period)
            except NotRepeated as exc:
                what = "layer" if period == 1 else f"unit of {period} layers"
                log.info("layer stack %s: %s %d does not repeat %s %d (%s)", fqn, what, first + 1, what, first, exc)
        log.warning("layer stack %s does not repeat; capturing the whole model", fqn)
    # FakeTensor's dispatch cache pays where many modules of a list repeat their ops (a deep stack that does not
    # repeat exactly, or whose config says its layers differ); a shallow model is captured faster without it
    depth = max((len(m) for m in model.modules() if isinstance(m, nn.ModuleList)), default=0)
    cache = depth >= FAKE_CACHE_LAYERS
    return graph_of(
        lambda static: capture(model, example_args, example_kwargs, **whole, static_seq=static, fake_cache=cache),
        fallback=fallback,
    )


# ------------------------------------------------------------------------------------------------ replication
def _layer_of(node: fx.Node, fqn: str) -> int | None:
    """The stack index of the layer whose module stack ``node`` was traced in, or ``None``."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(fqn + "."):
            index = path[len(fqn) + 1 :].split(".", 1)[0]
            if index.isdigit():
                return int(index)
    return None


def _numbered(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


@dataclasses.dataclass
class _Layout:
    """The short graph cut into the nodes before the stack, its two units, the tail and the nodes after it."""

    pre: list[str]
    layers: tuple[list[str], list[str]]
    post: list[str]
    per_layer: Counter  # name base -> op nodes of that name per unit (every op node, not only compute nodes)
    tail: list[str] = dataclasses.field(default_factory=list)  # the tail's nodes (the first ones of a unit)


def _cut(short: OpGraph, fqn: str, first: int, period: int = 1, tail: int = 0) -> _Layout:
    """Cut the op nodes where units ``first`` and ``first + 1`` (of ``period`` layers each) start; a unit runs to
    the next one's start.

    A unit holds its layers' own nodes and any the loop around them adds (a residual ``add`` outside the layer's
    module); the second unit is as long as the first, then come the ``tail`` layers (as long as the first unit up
    to its layer ``tail``), and the rest is after the stack. Earlier layers count as nodes before the stack.
    """
    ops = [n for n in short.captured.gm.graph.nodes if n.op == "call_function"]
    numbers: dict[str, list[int]] = {}
    for node in ops:
        base, num = split_name(node.name)
        numbers.setdefault(base, []).append(num)
    for base, nums in numbers.items():
        if nums[0] > 1 or nums != list(range(nums[0], nums[0] + len(nums))):  # capture() numbers densely
            raise NotRepeated(f"the {base} nodes are not numbered consecutively")
    layer_tags = [_layer_of(n, fqn) for n in ops]
    tags = [None if layer is None else layer // period for layer in layer_tags]
    if first not in tags or first + 1 not in tags:
        raise NotRepeated(f"no node was traced inside unit {first} and unit {first + 1}")
    start, second = tags.index(first), tags.index(first + 1)
    third = second + (second - start)
    if tags[second:third] != [None if t is None else t + 1 for t in tags[start:second]]:
        raise NotRepeated(f"unit {first + 1}'s nodes from {ops[second].name} on are not laid out as unit {first}'s")
    end = third
    if tail:
        # the tail repeats the first unit up to the start of its layer ``tail``, two units on
        unit = layer_tags[start:second]
        if first * period + tail not in unit:
            raise NotRepeated(f"no node was traced inside layer {first * period + tail}")
        end = third + unit.index(first * period + tail)
        shifted = [None if t is None else t + 2 * period for t in layer_tags[start : start + end - third]]
        if layer_tags[third:end] != shifted:
            raise NotRepeated(f"the last {tail} layers are not laid out as the first {tail} of a unit")
    if any(t is not None and t >= first for t in tags[:start]) or any(t is not None for t in tags[end:]):
        raise NotRepeated("a node of the stack lies outside its layers' units")
    kept = lambda nodes: [n.name for n in nodes if n.name in short.nodes]  # noqa: E731
    per_layer = Counter(split_name(n.name)[0] for n in ops[second:third])
    layers = (kept(ops[start:second]), kept(ops[second:third]))
    if not layers[0]:
        raise NotRepeated(f"layer {first} has no compute node")
    return _Layout(kept(ops[:start]), layers, kept(ops[end:]), per_layer, kept(ops[third:end]))


def _param_renamer(fqn: str, first: int, period: int = 1):
    heads = {f"{fqn}.{first * period + r}.": r for r in range(period)}  # the template unit's layers

    def rename(param: str, unit: int) -> str:  # a parameter of unit ``first`` -> the same one of ``unit``
        head = param[: param.find(".", len(fqn) + 1) + 1] if param.startswith(fqn + ".") else ""
        r = heads.get(head)
        return param if r is None else f"{fqn}.{unit * period + r}.{param[len(head) :]}"

    return rename


def _inputs(graph: OpGraph, node: str) -> dict[int, str]:
    return {i: u for i, u in enumerate(graph.input_names(node)) if u is not None}


def _repeated_inputs(
    short: OpGraph, a: str, prev: str, b: str, params: tuple[str, ...], advance: int
) -> tuple[dict[int, str], dict[int, str]]:
    """Check that ``b`` is ``a`` with ``params`` and numbered ``advance`` past ``prev`` (``a`` or a repeat of it);
    return the inputs of ``prev`` and ``b`` by slot, which must be the same slots."""
    if dataclasses.replace(short.nodes[a], name=b, params=params) != short.nodes[b]:
        raise NotRepeated(f"{b} differs from {a}")
    base, num = split_name(prev)
    if split_name(b) != (base, num + advance):
        raise NotRepeated(f"{b} is not numbered {advance} past {prev}")
    ins_prev, ins_b = _inputs(short, prev), _inputs(short, b)
    if ins_prev.keys() != ins_b.keys():
        raise NotRepeated(f"{prev} and {b} take different inputs")
    return ins_prev, ins_b


def _check_repeat(short: OpGraph, rename, first: int, cut: _Layout) -> dict[str, int]:
    """Check that the second template layer repeats the first; return the carried inputs: node before -> index."""
    l0, l1 = cut.layers
    where = {n: (0, j) for j, n in enumerate(l0)} | {n: (1, j) for j, n in enumerate(l1)}
    carried: dict[str, int] = {}
    for a, b in zip(l0, l1):
        params = tuple(rename(p, first + 1) for p in short.nodes[a].params)
        ins_a, ins_b = _repeated_inputs(short, a, a, b, params, cut.per_layer[split_name(a)[0]])
        for slot, ub in ins_b.items():
            ua = ins_a[slot]
            layer, j = where.get(ub, (None, None))
            if layer == 1 and where.get(ua) == (0, j):
                continue
            if layer is None and ua == ub:
                continue
            if layer == 0 and ua not in where and carried.setdefault(ua, j) == j:
                continue
            raise NotRepeated(f"input {slot} of {b} ({ub}) does not repeat input {slot} of {a} ({ua})")
    shared = {u for n in l0 for u in _inputs(short, n).values() if u not in where and u not in carried}
    if shared & carried.keys():
        raise NotRepeated(f"{sorted(shared & carried.keys())[0]} is both carried and shared")
    for n in cut.tail + cut.post:
        for u in _inputs(short, n).values():
            if where.get(u, (1,))[0] == 0:
                raise NotRepeated(f"{n}, after the stack, reads layer {first}'s {u}")
    return carried


def _check_tail(short: OpGraph, rename, first: int, cut: _Layout) -> None:
    """Check that the tail repeats the start of the second template unit: the same nodes (numbered a unit past its
    nodes), reading the tail's own nodes where it reads its own, the second unit's where it reads the first's,
    and the same nodes before the stack."""
    l0, l1 = cut.layers
    own = {n: j for j, n in enumerate(l1)}
    before = {n: j for j, n in enumerate(l0)}
    for j, c in enumerate(cut.tail):
        a, b = l0[j], l1[j]
        params = tuple(rename(p, first + 2) for p in short.nodes[a].params)
        try:
            ins_b, ins_c = _repeated_inputs(short, a, b, c, params, cut.per_layer[split_name(a)[0]])
        except NotRepeated as exc:
            raise NotRepeated(f"the tail's {exc}") from None
        for slot, ub in ins_b.items():
            if ub in own:  # the unit's own node: the tail's at that place
                want = cut.tail[own[ub]] if own[ub] < len(cut.tail) else None
            else:  # the first unit's (carried): the second's at that place; a node before the stack: itself
                want = l1[before[ub]] if ub in before else ub
            if ins_c[slot] != want:
                raise NotRepeated(f"input {slot} of {c} ({ins_c[slot]}) does not repeat input {slot} of {b} ({ub})")


def replicate(short: OpGraph, fqn: str, count: int, *, first: int = 0, period: int = 1) -> OpGraph:
    """The ``count``-layer graph from ``short``, the graph of the model with the stack ``fqn`` cut to
    ``(first + 2) * period + count % period`` layers.

    Units ``first`` and ``first + 1`` (each of ``period`` consecutive layers) are the template; earlier ones stay as
    they were captured; the ``count % period`` layers after them are the tail, the first layers of a unit. Raises
    :class:`NotRepeated` when unit ``first + 1`` does not repeat unit ``first`` or the tail the start of a unit.
    Below, "layer" reads "unit".

    The steps: cut the short graph at the layers (:func:`_cut`), check that the template and the tail repeat
    (:func:`_check_repeat`, :func:`_check_tail`), name every node of the whole graph (:func:`_name_nodes`), wire
    each to its inputs (:func:`_wire`, :func:`_digraph`) and write the parameter tables out layer by layer
    (:func:`_whole_table`).
    """
    units, tail = divmod(count, period)
    cut = _cut(short, fqn, first, period, tail)
    rename = _param_renamer(fqn, first, period)
    carried = _check_repeat(short, rename, first, cut)
    if cut.tail:
        _check_tail(short, rename, first, cut)
    # from here on the tail is written out as the nodes after the stack are: numbered past the units the short graph
    # lacks, its parameters those of the model's last layers
    later = _tail_renamer(fqn, (first + 2) * period, (units - first - 2) * period)
    cut = dataclasses.replace(cut, post=cut.tail + cut.post, tail=[])
    named = _name_nodes(short, cut, rename, first, units, later)
    origin, inputs = _wire(short, cut, carried, named, first, units)
    g = _digraph(named.nodes, inputs)
    stack = LayerStack(fqn=fqn, count=count, captured=(first + 2) * period + tail)
    log.info(
        "graph %s: %d compute nodes from %d captured (%s: %d layers)",
        short.name,
        len(named.nodes),
        len(short.nodes),
        fqn,
        count,
    )
    layers = range(first, units)
    return OpGraph(
        short.captured,
        named.nodes,
        g,
        _whole_table(short.param_shapes, fqn, first, layers, rename, period, later),
        _whole_table(short.param_dtypes, fqn, first, layers, rename, period, later),
        _whole_table(short.tied, fqn, first, layers, rename, period, later),
        replicated=stack,
        origin=origin,
        inputs=inputs,
    )


@dataclasses.dataclass
class _Named:
    """The whole graph's nodes, and the names the short graph's nodes take in it."""

    nodes: dict[str, OpNode]  # name in the whole graph -> node, in graph order
    layer: dict[tuple[str, int], str]  # (a node of the first template layer, layer) -> its name in that layer
    after: dict[str, str]  # a node after the stack -> its name in the whole graph


def _layer_name(name: str, layer: int, first: int, per_layer: Counter) -> str:
    """The name of ``name``, a node of template layer ``first``, in ``layer``: capture numbers each name base
    densely, so its number advances by that base's count per layer."""
    base, num = split_name(name)
    return _numbered(base, num + (layer - first) * per_layer[base])


def _name_nodes(short: OpGraph, cut: _Layout, rename, first: int, count: int, later=lambda p: p) -> _Named:
    """Every node of the whole graph, named as the full capture names it: the nodes before the stack as captured,
    the first template layer once per layer ``first .. count - 1`` (with that layer's parameters), then the nodes
    after the stack, numbered past the layers the short graph lacks."""
    names: dict[tuple[str, int], str] = {}
    nodes: dict[str, OpNode] = {}
    for n in cut.pre:
        nodes[n] = short.nodes[n]
    layers = range(first, count)
    for layer in layers:
        for n in cut.layers[0]:
            names[n, layer] = new = _layer_name(n, layer, first, cut.per_layer)
            node = short.nodes[n]
            nodes[new] = dataclasses.replace(node, name=new, params=tuple(rename(p, layer) for p in node.params))
    captured = first + 2
    after = {n: _layer_name(n, count - captured + first, first, cut.per_layer) for n in cut.post}
    for n in cut.post:
        node = short.nodes[n]
        nodes[after[n]] = dataclasses.replace(node, name=after[n], params=tuple(later(p) for p in node.params))
    if len(nodes) != len(cut.pre) + len(layers) * len(cut.layers[0]) + len(cut.post):
        raise NotRepeated("two replicated nodes would share a name")
    return _Named(nodes, names, after)


def _wire(
    short: OpGraph, cut: _Layout, carried: dict[str, int], named: _Named, first: int, count: int
) -> tuple[dict[str, str], dict[str, tuple[str | None, ...]]]:
    """``(origin, inputs)``: per node of the whole graph, the captured node it repeats and its inputs' names.

    Each node repeats a captured one: the last layer repeats the second template layer (its users come after the
    stack), every other layer the first. Its facts (dtypes, users, arguments) are that node's.
    """
    l0, l1 = cut.layers
    index0 = {n: j for j, n in enumerate(l0)}
    index1 = {n: j for j, n in enumerate(l1)}

    def source(u: str, template: int, layer: int) -> str:
        """The name of input ``u`` of a node that repeats a node of template layer ``template`` in ``layer``."""
        if u in index0:
            return named.layer[u, layer if template == 0 else layer - 1]
        if u in index1:
            return named.layer[l0[index1[u]], layer]
        if u in carried and template == 0 and layer > first:
            return named.layer[l0[carried[u]], layer - 1]
        return named.after.get(u, u)

    origin: dict[str, str] = {n: n for n in cut.pre}
    inputs: dict[str, tuple[str | None, ...]] = {n: short.input_names(n) for n in cut.pre}
    for layer in range(first, count):
        template = 1 if layer == count - 1 else 0
        for j, n in enumerate(l0):
            name, src = named.layer[n, layer], (l0, l1)[template][j]
            origin[name] = src
            inputs[name] = tuple(None if u is None else source(u, template, layer) for u in short.input_names(src))
    for n in cut.post:
        origin[named.after[n]] = n
        inputs[named.after[n]] = tuple(None if u is None else source(u, 1, count - 1) for u in short.input_names(n))
    return origin, inputs


def _digraph(nodes: dict[str, OpNode], inputs: dict[str, tuple[str | None, ...]]) -> nx.DiGraph:
    """The data-flow graph: an edge ``u -> v`` with ``dst_in=i`` where ``u`` is input ``i`` of ``v``."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    for name, ins in inputs.items():
        for i, u in enumerate(ins):
            if u is not None:
                g.add_edge(u, name, dst_in=i)
    return g


def _whole_table(table: dict, fqn: str, first: int, layers: range, rename, period: int = 1, later=lambda p: p) -> dict:
    """A table keyed by parameter FQN (shapes, dtypes, ties) for the whole graph: the template's entries unit by
    unit, in place of the two template units' entries; every other entry as it is, the tail's renamed ``later``."""
    head = tuple(f"{fqn}.{first * period + r}." for r in range(period))
    skip = tuple(f"{fqn}.{(first + 1) * period + r}." for r in range(period))
    template = [(k, v) for k, v in table.items() if k.startswith(head)]
    out = {}
    for key, value in table.items():
        if key.startswith(head + skip):
            if key == template[0][0]:
                for layer in layers:
                    for k, v in template:
                        out[rename(k, layer)] = rename(v, layer) if isinstance(v, str) else v
        else:
            out[later(key)] = later(value) if isinstance(value, str) else value
    return out


def _tail_renamer(fqn: str, start: int, by: int):
    """A parameter of the stack's layer ``start`` or later (the tail's, in the short capture) -> the same one of the
    layer ``by`` later; any other as it is."""

    def later(param: str) -> str:
        index, dot, rest = param[len(fqn) + 1 :].partition(".") if param.startswith(fqn + ".") else ("", "", "")
        if not dot or not index.isdigit() or int(index) < start:
            return param
        return f"{fqn}.{int(index) + by}.{rest}"

    return later
