"""Fixed assignments (a baseline's, a forced plan's: one sequence per node) priced and read back as plans' figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from primepar_fx.cost.cluster import ClusterSpec
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, PartitionSeq
from primepar_fx.pricing.price import price_graph
from primepar_fx.pricing.priced import PricedGraph
from primepar_fx.pricing.summary import Summary, summarize


def price_fixed(
    graph: OpGraph, assignment: dict[str, PartitionSeq], mesh: DeviceMesh, cluster: ClusterSpec, values, opts
) -> Summary:
    """One assignment (a sequence for every node) priced and read back (:func:`price_assignments`)."""
    priced, (choice,) = price_assignments(graph, [assignment], mesh, cluster, values, opts)
    return summarize(graph, priced, choice, opts)


def price_assignments(
    graph: OpGraph,
    assignments: Sequence[Mapping[str, PartitionSeq]],
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    values,
    opts,
) -> tuple[PricedGraph, list[dict[str, int]]]:
    """One pricing of every node's distinct sequences over ``assignments`` (a sequence for every node), and each
    assignment as a choice of strategies in it. Costs are per sequence and per pair of sequences, so
    :func:`summarize` of a choice gives what pricing its assignment alone gives, and the graph is walked once
    instead of once per assignment."""
    union: dict[str, dict[PartitionSeq, int]] = {}  # per node, its distinct sequences in order of first use
    for assignment in assignments:
        for name in graph.nodes:
            seqs = union.setdefault(name, {})
            seqs.setdefault(assignment[name], len(seqs))
    priced = price_graph(graph, mesh, cluster, values, opts, fixed={n: list(s) for n, s in union.items()})
    return priced, [{n: union[n][a[n]] for n in graph.nodes} for a in assignments]
