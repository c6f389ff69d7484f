"""Embedding lookups: ``aten.embedding(weight [V, D], indices [...]) -> [..., D]``.

Iteration dims: the index dims (named by size: ``B``, ``S``), ``V`` (vocabulary) and ``D`` (hidden). ``V`` is
absent from the output and from the indices: a split of ``V`` is the vocab-parallel embedding, where each device
looks up the rows it holds, contributes zeros for the others, and the partial lookups are summed (all-reduce).
A split of ``D`` or of the index dims needs no collective. No FLOPs.
"""

from __future__ import annotations

import torch
from torch import fx

from primepar_fx.rules.registry import DimNamer, RuleContext, RuleError, align_inputs, arg, register_rule
from primepar_fx.rules.spec import OpDims

aten = torch.ops.aten


@register_rule(aten.embedding.default)
def embedding_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    weight, indices = arg(node, "weight"), arg(node, "indices")
    if not isinstance(weight, fx.Node) or not isinstance(indices, fx.Node):
        raise RuleError(f"expected tensor weight and indices, got {weight!r}, {indices!r}")
    ws = ctx.shape(weight)
    if len(ws) != 2:
        raise RuleError(f"embedding weight must be 2-d, got {ws}")
    nm = DimNamer()
    imap = nm.map(ctx.shape(indices))
    v = nm.new(ws[0], role="V")
    d = nm.new(ws[1], role="D")
    inputs = align_inputs(node, {weight: ((v,), (d,)), indices: imap})
    return nm.build("embedding", inputs, (imap + ((d,),),))
