"""Pass 11 (pipelined plans only): one rank's graph cut into the graphs of its pipeline stages.

A pipelined plan (:class:`~primepar_fx.record.pipeline.Pipeline`) runs each stage on its own mesh of ``q`` ranks;
every rank localises the *whole* captured graph for its mesh rank (the same graph on the ranks of every stage, over
their own process groups), and this pass cuts the result at the stage boundaries (:func:`cut_stages`):

* a **planned** node belongs to the stage of its captured node (``stage_of``: each piece of
  :func:`~primepar_fx.pricing.pipelined.stage_pieces` to the stage its layers go to), raised to the latest stage
  of its inputs, so that the cut never runs backwards through a pass that moved a node;
* a node the passes added (a re-layout, a collective, a recomputed layer) belongs to the latest stage of its
  inputs, so a re-layout into a later stage's consumer runs in the producer's stage and its result crosses;
* a node that reads only the graph's inputs (parameters, buffers, the user's inputs) and no planned node belongs
  to no stage: it is copied into every stage that reads it (a tied embedding read by the first and the last
  stage, the targets' count of a loss, the sizes of a view).

The tensors made in stages ``<= k`` and read after stage ``k`` leave stage ``k`` as its outputs, in graph order, and
enter stage ``k + 1`` as its first inputs (each one passes through the stages between its maker and its readers);
the last stage returns what the graph returns. Values that cross must be tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from primepar_fx.passes.common import info


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph: it takes ``received`` (the tensors entering from the stage before it, in order) and then
    ``inputs`` (the names of the rank graph's placeholders it reads), and returns ``sent`` (the tensors leaving for
    the next stage; the last stage returns the rank graph's outputs)."""

    gm: fx.GraphModule
    received: tuple[str, ...]
    inputs: tuple[str, ...]
    sent: tuple[str, ...]


def node_stages(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> dict[fx.Node, int | None]:
    """Each node's stage (module docstring); ``None`` for the graph's inputs and the nodes that read only them."""
    out: dict[fx.Node, int | None] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            out[node] = None
            continue
        found = [out[a] for a in node.all_input_nodes if out[a] is not None]
        found += [stage_of[name] for name in _planned(gm, node) if name in stage_of]
        out[node] = max(found, default=None)  # type: ignore[type-var]
    return out


def _planned(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The captured nodes ``node`` computes: its own, or those inside a submodule's graph (a recomputed layer)."""
    me = info(node)
    if me is not None:
        return [me.name]
    if node.op != "call_module":
        return []
    found = []
    for mod in gm.get_submodule(node.target).modules():  # type: ignore[arg-type]
        if isinstance(mod, fx.GraphModule):
            found += [i.name for n in mod.graph.nodes if (i := info(n)) is not None]
    return found


def cut_stages(gm: fx.GraphModule, stage_of: Mapping[str, int], count: int) -> list[StageGraph]:
    """``gm`` cut into ``count`` stage graphs (module docstring); ``stage_of`` maps captured node names to stages."""
    stages = node_stages(gm, stage_of)
    nodes = list(gm.graph.nodes)
    (output,) = [n for n in nodes if n.op == "output"]
    last_read = {n: max((count - 1 if u is output else stages[u] or 0) for u in n.users) for n in nodes if n.users}
    out, received = [], ()
    for k in range(count):
        sent = tuple(
            n
            for n in nodes
            if stages[n] is not None and stages[n] <= k and last_read.get(n, -1) > k  # type: ignore[operator]
        )
        out.append(_stage_graph(gm, stages, k, received, sent if k < count - 1 else None))
        received = sent
    return out


def _stage_graph(
    gm: fx.GraphModule,
    stages: dict[fx.Node, int | None],
    k: int,
    received: tuple[fx.Node, ...],
    sent: tuple[fx.Node, ...] | None,
) -> StageGraph:
    """Stage ``k``'s graph: ``received`` in, its nodes and the unstaged nodes they read, ``sent`` out (``None``: the
    last stage, which returns the graph's output)."""
    mine = [n for n in gm.graph.nodes if stages[n] == k]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    roots = list(sent or ()) if sent is not None else list(output.all_input_nodes)
    needed = _unstaged_reads(stages, [*mine, *(r for r in roots if stages[r] is None)])
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in received:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder" and n in needed)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    for n in gm.graph.nodes:
        if n.op != "placeholder" and (n in needed or stages[n] == k) and n not in env and n.op != "output":
            env[n] = graph.node_copy(n, lambda a: _read(env, a, k))
    if sent is None:
        graph.output(fx.map_arg(output.args[0], lambda a: _read(env, a, k)))
    else:
        graph.output(tuple(graph.call_function(_contiguous, (_read(env, n, k),)) for n in sent))
    stage = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Stage{k}")
    return StageGraph(stage, tuple(n.name for n in received), inputs, tuple(n.name for n in sent or ()))


def _unstaged_reads(stages: dict[fx.Node, int | None], roots: list[fx.Node]) -> set[fx.Node]:
    """The unstaged nodes ``roots`` read, directly or through other unstaged nodes (``roots`` that are unstaged
    included)."""
    needed: set[fx.Node] = set()
    todo = [r for r in roots if stages[r] is None] + [a for r in roots for a in r.all_input_nodes]
    while todo:
        n = todo.pop()
        if stages[n] is None and n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    return needed


def _read(env: dict[fx.Node, fx.Node], node: fx.Node, k: int) -> fx.Node:
    if node not in env:
        raise RuntimeError(f"stage {k} reads {node.name}, which neither it nor a stage before it sends")
    return env[node]


def _contiguous(x: object) -> torch.Tensor:
    """A tensor that leaves its stage, contiguous (point-to-point sends take contiguous buffers)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"a value crossing between pipeline stages must be a tensor, got {type(x).__name__}")
    return x.contiguous()
