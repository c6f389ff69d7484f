"""One rank's rewritten graph of a plan (:func:`rank_graph_for`): the passes of :mod:`primepar_fx.passes` run on
the captured graph for one mesh rank, at concrete sizes, over its process groups. ``compile`` builds one per rank
(and again for new sizes), the ``torch.compile`` backend one with whole parameters, a pipelined plan one per rank
that it cuts into stages."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import timedelta

import sympy

from primepar_fx.compiler.agree import groups_for
from primepar_fx.compiler.inputs import no_specialisation
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes.localize import RankGraph, localize
from primepar_fx.record.plan import Plan
from primepar_fx.runtime.groups import ProcessGroups

log = logging.getLogger(__name__)


#: one rank graph built at a time: the captured program's shape environment is shared by the ranks that build from
#: it, which are threads of one process where ranks are simulated (:mod:`primepar_fx.runtime.simulated`)
_BUILDING = threading.Lock()


def rank_graph_for(
    graph: OpGraph,
    chosen: Plan,
    rank: int,
    *,
    whole_params: bool = False,
    values: Mapping[sympy.Symbol, int] | None = None,
    timeout: timedelta | None = None,
    groups: ProcessGroups | None = None,
) -> RankGraph:
    """This rank's rewritten graph of ``chosen``, at ``values`` of ``B`` and ``S`` (default: the example's), over
    ``groups`` (default: the mesh's own, :func:`~primepar_fx.compiler.agree.groups_for`)."""
    captured = graph.captured
    mesh = DeviceMesh(tuple(chosen.digits))
    sizes: dict[sympy.Symbol, int] = {B: captured.example_batch, S: captured.example_seq, **(values or {})}
    with _BUILDING, no_specialisation(captured):
        rank_graph = localize(
            graph,
            chosen.partitions(),
            mesh,
            rank,
            sizes,
            groups or groups_for(mesh, rank, timeout),
            whole_params=whole_params,
            recompute=chosen.recompute,
        )
    if rank_graph.fallbacks:
        log.warning(
            "%d nodes run whole (no local form for their partition): %s",
            len(rank_graph.fallbacks),
            ", ".join(rank_graph.fallbacks[:8]),
        )
    return rank_graph
