"""``primepar-fx explain``: a per-node table of the captured graph and the size of its partition space."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy
from tabulate import tabulate

from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, enumerate_sequences
from primepar_fx.rules.spec import OpDims, Shape
from primepar_fx.shapes import B, S


@dataclass(frozen=True, slots=True)
class NodeRow:
    name: str
    op: str
    shape: str
    flops: sympy.Expr
    sequences: int
    source: str


def fmt_shape(shape: Shape | None) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(str(s) for s in shape) + ")"


def fmt_count(x: float | int) -> str:
    x = float(x)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}" if x != int(x) else str(int(x))


@lru_cache(maxsize=4096)
def _count(op: OpDims, mesh: DeviceMesh, values: tuple[tuple[sympy.Symbol, int], ...], allow_prime: bool) -> int:
    return len(enumerate_sequences(op, mesh, values=dict(values) or None, allow_prime=allow_prime))


def explain_rows(
    graph: OpGraph, mesh: DeviceMesh, *, batch: int | None = None, seq: int | None = None, allow_prime: bool = True
) -> list[NodeRow]:
    values = tuple((sym, v) for sym, v in ((B, batch), (S, seq)) if v is not None)
    rows = []
    for node in graph.nodes.values():
        shape = node.out_shapes[0] if node.out_shapes else None
        rows.append(
            NodeRow(
                node.name,
                node.op,
                fmt_shape(shape),
                node.flops,
                _count(node.dims, mesh, values, allow_prime),
                node.source,
            )
        )
    return rows


def explain_table(
    graph: OpGraph,
    mesh: DeviceMesh,
    *,
    batch: int | None = None,
    seq: int | None = None,
    allow_prime: bool = True,
    tablefmt: str = "simple",
) -> str:
    """The table ``primepar-fx explain`` prints: node, op, symbolic shape, FLOPs, legal sequences, and totals."""
    rows = explain_rows(graph, mesh, batch=batch, seq=seq, allow_prime=allow_prime)
    subs = {k: v for k, v in ((B, batch), (S, seq)) if v is not None}
    concrete = len(subs) == 2

    def flops_cell(expr: sympy.Expr) -> str:
        if expr == 0:
            return "0"
        return fmt_count(float(expr.subs(subs))) if concrete else str(expr)

    body = [[r.name, r.op, r.shape, flops_cell(r.flops), r.sequences] for r in rows]
    total_flops = graph.total_flops()
    body.append(
        [
            "TOTAL",
            f"{len(rows)} nodes",
            f"{fmt_count(graph.param_count())} params",
            flops_cell(total_flops),
            sum(r.sequences for r in rows),
        ]
    )
    flops_head = f"FLOPs (fwd, B={batch}, S={seq})" if concrete else "FLOPs (fwd)"
    table = tabulate(body, headers=["node", "op", "shape", flops_head, "sequences"], tablefmt=tablefmt)
    head = (
        f"model {graph.name}: {len(rows)} compute nodes, world size {mesh.size} "
        f"(device digits {mesh.digits or '()'}), forward FLOPs {sympy.factor(total_flops)}"
    )
    return head + "\n" + table
