"""Input-gradient sums that wait for the end of backward: priced on the edge from a replicated producer.

A consumer that splits a dim its input lacks (an ``add`` of a batch-split activation and a learned position table)
holds a partial gradient of that input on each rank of a group, and the plan all-reduces it before the producer's
backward reads it. When the producer is computed alike on every rank of the group and only feeds its parameters
(the table lookup), its backward is the same linear map on every rank, so the sum may be taken as late as the end of
backward: :class:`~primepar_fx.runtime.pending.DeferredGradients` launches it asynchronously and computes the
parameters' gradients from it there, as a gradient bucket's sum is waited. The bytes stay the plan's; the seconds
become a bucket's (:func:`~primepar_fx.cost.share.deferred_input_sum`).

Whether it applies depends on both ends' strategies (the producer replicating the sum's digits, no re-layout
between them), so the saving is a matrix on the edge, subtracted from its cost; :func:`~primepar_fx.planning.
summary.summarize` reports it as less collective time of the consumer. The rules here and in
:func:`~primepar_fx.passes.gradsync.deferrable` are the same facts, read from the plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import sympy
import torch

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.cost.share import deferred_input_sum, flat_arguments, moves_nothing
from primepar_fx.graph import OpGraph
from primepar_fx.partition import OpPartition, collectives
from primepar_fx.partition.enumerate import values_key


@dataclass(frozen=True)
class DeferredSaving:
    """Edge ``u -> v``: ``seconds[i, j]`` saved when ``u`` runs strategy ``i`` and ``v`` strategy ``j`` (0 where the
    sum cannot wait)."""

    seconds: np.ndarray


def producer_qualifies(graph: OpGraph, u: str, v: str, readers: Counter) -> bool:
    """The graph facts: ``u`` needs a gradient, feeds only ``v`` (once), takes plain arguments, and its inputs with a
    gradient are parameters that only it reads."""
    node = graph.nodes[u]
    if not node.requires_grad or list(graph.graph.successors(u)) != [v] or graph.input_names(v).count(u) != 1:
        return False
    fx_node = graph.fx_node(u)
    if not flat_arguments(fx_node):
        return False
    params = graph.captured.params
    found = False
    for name, a in zip(graph.input_names(u), fx_node.all_input_nodes):
        if a.name in params:
            fqn = params[a.name]
            if readers[fqn] != 1 or fqn in graph.tied or fqn in graph.tied.values():
                return False
            found = True
        elif name is not None:
            if graph.nodes[name].requires_grad:
                return False
        elif isinstance(val := a.meta.get("val"), torch.Tensor) and val.is_floating_point():
            return False  # a user input that may carry a gradient
    return found


def deferred_sums(
    graph: OpGraph,
    flows: list[tuple[str, str, int, int]],
    partitions: dict[str, list[OpPartition]],
    cluster: ClusterSpec,
    values: dict[sympy.Symbol, int],
    itemsize: int,
) -> dict[tuple[str, str], DeferredSaving]:
    """Every edge ``(u, v, k_in, k_out)`` of ``flows`` where some strategy pair lets ``v``'s sum of input ``k_in``'s
    gradient wait (module docstring), with its saving."""
    vkey = values_key(values)
    readers = Counter(fqn for node in graph.nodes.values() for fqn in set(node.params))
    out = {}
    for u, v, k_in, k_out in flows:
        if k_out != 0 or not producer_qualifies(graph, u, v, readers):
            continue
        target = graph.nodes[v].target
        sums = [deferred_input_sum(p, target, k_in, cluster, vkey, itemsize) for p in partitions[v]]
        if not any(sums):
            continue
        seconds = np.zeros((len(partitions[u]), len(partitions[v])))
        for i, pu in enumerate(partitions[u]):
            if collectives(pu):  # a collective of its own: the passes put a node next to it
                continue
            for j, found in enumerate(sums):
                if found is None or found[0] <= 0 or not set(found[1]) <= set(pu.replicate_digits):
                    continue
                if moves_nothing(pu, 0, partitions[v][j], k_in, vkey):
                    seconds[i, j] = found[0]
        if seconds.any():
            seconds.flags.writeable = False
            out[(u, v)] = DeferredSaving(seconds)
    return out
