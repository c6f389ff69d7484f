"""Pass 5: every P(S x S)-partitioned matrix product becomes one :class:`~primepar_fx.runtime.RingMatmul` node.

The node reads this rank's Forward-start blocks of I and W and returns its block of the product at the end of the
Forward phase; its backward runs the Backward and Gradient phases (Table 1). A bias was split off by
:mod:`primepar_fx.passes.collectives`, so the ring only multiplies.
"""

from __future__ import annotations

from torch import fx

from primepar_fx.passes.collectives import OPERANDS
from primepar_fx.passes.common import META, RankContext, add_module, info
from primepar_fx.runtime.ring import RingMatmul


def replace_ring_products(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        me = info(node)
        if me is None or me.part.steps < 2:
            continue
        i_idx, w_idx = me.part.op.matmul_operands  # type: ignore[misc]
        operands = node.meta.get(OPERANDS) or (node.all_input_nodes[i_idx], node.all_input_nodes[w_idx])
        current = node.all_input_nodes  # the operands, possibly behind redistributions / all-reduces now
        i_node, w_node = (_current(operands[0], current), _current(operands[1], current))
        name = add_module(gm, "ring", RingMatmul(me.part, me.target, ctx.rank, ctx.stats, node.name))
        with g.inserting_before(node):
            ring = g.call_module(name, (i_node, w_node))
        ring.meta[META] = me
        node.replace_all_uses_with(ring)
        g.erase_node(node)
    return gm


def _current(original: fx.Node, inputs: list[fx.Node]) -> fx.Node:
    if original in inputs:
        return original
    raise AssertionError(f"operand {original.name} is no longer an input of its product")
