"""What the per-rank passes share: the rank's context, the per-node plan annotation and small graph helpers."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx, nn

from primepar_fx.frontend.capture import Captured
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh, OpPartition
from primepar_fx.passes.layouts import NodeLayouts, vkey_of
from primepar_fx.runtime.gradsync import GradReduction
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.stats import CommStats

aten = torch.ops.aten
#: node.meta key of a planned node's :class:`NodeInfo`
META = "primepar"
#: node.meta key of a parameter placeholder's storage layout
STORAGE = "primepar_storage"


@dataclass
class RankContext:
    """One rank's view: mesh, rank, concrete sizes, process groups and the byte counter every module shares."""

    graph: OpGraph
    mesh: DeviceMesh
    rank: int
    values: dict[sympy.Symbol, int]
    groups: ProcessGroups
    stats: CommStats = field(default_factory=CommStats)
    fallbacks: list[str] = field(default_factory=list)
    #: parameters arrive whole on every call (the torch.compile path) instead of as this rank's shards
    whole_params: bool = False
    #: the plan's activation recomputation (a ``record.levers.Recompute``: ``stack``, ``layers``, ``active``;
    #: read by passes/recompute.py); ``None``: none
    recompute: Any = None
    #: parameter placeholder -> the sum of its gradient that the gradient buckets do (passes/gradsync.py)
    grad_reductions: dict[str, GradReduction] = field(default_factory=dict)

    @property
    def captured(self) -> Captured:
        return self.graph.captured

    @property
    def vkey(self):
        return vkey_of(self.values)

    def concrete(self, node: fx.Node) -> Any:
        """The value of a size node (``sym_size``, shape arithmetic) at this rank's concrete ``B`` and ``S``."""
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            subs = {sym: sympy.Integer(self.values[ours]) for sym, ours in self.captured.symbol_map.items()}
            out = sympy.sympify(val.node.expr).xreplace(subs)
            return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(val)](out)
        if isinstance(val, (int, float, bool)):
            return val
        raise ValueError(f"node {node.name} ({node.target}) is used as a constant but its value {val!r} is not one")


@dataclass
class NodeInfo:
    """A planned node: its partition, and the partition it actually computes with (all-``Replicate`` when it has
    no local form for its plan and runs whole, a *fallback*)."""

    name: str
    target: object
    part: OpPartition
    compute_part: OpPartition
    fallback: bool
    requires_grad: bool
    vkey: Any

    @property
    def planned(self) -> NodeLayouts:
        """The layouts the plan promises to neighbours (what the node holds and needs at its boundary)."""
        return NodeLayouts(self.part, self.vkey, self.requires_grad)

    @property
    def computed(self) -> NodeLayouts:
        """The layouts the local computation reads (equal to :attr:`planned` unless a fallback)."""
        return NodeLayouts(self.compute_part, self.vkey, self.requires_grad)

    @property
    def multi_output(self) -> bool:
        return len(self.part.op.outputs) > 1


def info(node: fx.Node) -> NodeInfo | None:
    return node.meta.get(META)


def add_module(gm: fx.GraphModule, prefix: str, mod: nn.Module) -> str:
    """Register ``mod`` on ``gm`` under a fresh ``prefix_N`` name."""
    n = 1
    while hasattr(gm, f"{prefix}_{n}"):
        n += 1
    name = f"{prefix}_{n}"
    gm.add_submodule(name, mod)
    return name


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def arg(node: fx.Node, pos: int, name: str, default: Any) -> Any:
    """Positional-or-keyword argument ``pos`` / ``name`` of an ATen call."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def digits_of(part: OpPartition, dims: set[str] | frozenset[str]) -> tuple[int, ...]:
    """The digit positions of the ``Split`` elements of ``part`` on ``dims``."""
    return tuple(p for e, pos in zip(part.seq.elements, part.positions) if getattr(e, "dim", None) in dims for p in pos)
