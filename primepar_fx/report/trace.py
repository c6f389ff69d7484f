"""The plan among ``TORCH_TRACE``'s structured artifacts, for tlparse and anyone who reads the trace.

With ``TORCH_TRACE=DIR`` set, torch writes a structured log per rank into ``DIR`` and ``tlparse`` turns it into
pages. :func:`trace_plan` adds three artifacts to it, each a ``trace_structured("artifact", ...)`` record that
tlparse lists under its name (inside the Dynamo compilation that asked for it, for the ``"primepar"`` backend):

* ``primepar_plan`` (json): the plan, as :meth:`~primepar_fx.record.plan.Plan.to_json` writes it;
* ``primepar_cost`` (string): the per-node cost breakdown, ``nodes.md`` of the dump;
* ``primepar_rank{r}_graph`` (string): this rank's rewritten code, ``rank{r}.py`` of the dump.

Nothing is built when no trace is being written: the payloads are made only if torch's trace log has a handler.
"""

from __future__ import annotations

from typing import Any

from torch._logging import trace_structured

from primepar_fx.graph import OpGraph
from primepar_fx.record.plan import Plan
from primepar_fx.report.dump import nodes_table, rank_code


def trace_plan(graph: OpGraph, plan: Plan, rank: int, rank_graph: Any) -> None:
    """Log the plan, its cost breakdown and ``rank``'s graph as structured trace artifacts (module docstring)."""
    artifacts = (
        ("primepar_plan", "json", plan.to_json),
        ("primepar_cost", "string", lambda: nodes_table(graph, plan)),
        (f"primepar_rank{rank}_graph", "string", lambda: rank_code(rank_graph, rank, plan)),
    )
    for name, encoding, payload in artifacts:
        trace_structured(
            "artifact",
            metadata_fn=lambda name=name, encoding=encoding: {"name": name, "encoding": encoding},
            payload_fn=payload,
            expect_trace_id=False,
        )
