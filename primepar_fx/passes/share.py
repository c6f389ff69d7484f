"""Pass 4a: one re-layout and one gradient all-reduce for all consumers of a tensor that need it alike.

After :func:`~primepar_fx.passes.redistribute.insert_redistributions` and
:func:`~primepar_fx.passes.collectives.insert_collectives`, every consumer input has its own chain in front of it::

    producer -> Redistribute -> AllReduce("backward") -> consumer        (either module may be absent)

When every planned consumer of a producer's value has the same :func:`~primepar_fx.cost.share.signature` on the
input it reads (the rule and why it is exact: :mod:`primepar_fx.cost.share`), the first consumer's chain is kept
and the others read its end: the forward re-layout runs once, autograd sums the consumers' gradients at the shared
node, and the all-reduce and the backward re-layout run once on the sum. The plan prices exactly this
(:func:`primepar_fx.pricing.summary.summarize`), so the bytes the ranks send stay the predicted bytes. The pass runs
before :func:`~primepar_fx.passes.collectives.fuse_reduce_scatters`, which then fuses the one shared all-reduce with
the backward re-layout into a reduce-scatter, as it would for a single consumer.

A parameter that several nodes read (tied embeddings) is stored in its first reader's layout
(:mod:`~primepar_fx.passes.shard`); every later reader with the first's signature reads the first's all-reduce, so
that the summed gradient is all-reduced once (and, a parameter's only use then, it goes to the gradient buckets,
:mod:`~primepar_fx.passes.gradsync`). This one is pairwise, each later reader with the first, as the plan prices it
(:class:`~primepar_fx.pricing.priced.TiedSaving`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from torch import fx

from primepar_fx.cost.share import signature
from primepar_fx.passes.collectives import rename_operand
from primepar_fx.passes.common import STORAGE, RankContext, info, is_getitem
from primepar_fx.passes.redistribute import SOURCE
from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.runtime.exchange import Redistribute

log = logging.getLogger(__name__)


def _own_chain(gm: fx.GraphModule, head: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The value a consumer input reads and the modules in between that only this input uses (nearest first)."""
    chain, x = [], head
    while x.op == "call_module" and len(x.users) == 1:
        mod = gm.get_submodule(x.target)  # type: ignore[arg-type]
        own = (isinstance(mod, Redistribute) and mod.kind == "redistribution") or (
            isinstance(mod, AllReduce) and mod.mode == "backward"
        )
        if not own:
            break
        chain.append(x)
        x = x.args[0]  # type: ignore[assignment]
    return x, chain


def _is_planned_value(node: fx.Node) -> bool:
    """A planned node's value: its output, or what the passes put after it (its forward all-reduce, a bias split off
    it), or its re-layout after a getitem. Not a parameter or user input, which the plan does not price as edges."""
    src = node.meta.get(SOURCE, node)
    if src.op == "placeholder":
        return False
    me = info(src)
    return me is None or not me.multi_output


def _is_stored_parameter(node: fx.Node, ctx: RankContext) -> bool:
    """A parameter this rank stores a slice of (not the ``torch.compile`` path's whole parameters)."""
    return node.op == "placeholder" and STORAGE in node.meta and not ctx.whole_params


def share_relayouts(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    # value -> [(consumer, input head, chain, signature)] in graph order; value -> consumers reading it twice
    members: dict[fx.Node, list[tuple[fx.Node, fx.Node, list[fx.Node], Hashable]]] = {}
    twice: set[fx.Node] = set()
    for c in gm.graph.nodes:
        me = info(c)
        if me is None or c.op != "call_function" or is_getitem(c):
            continue
        seen: set[fx.Node] = set()
        for k, head in enumerate(c.all_input_nodes):
            value, chain = _own_chain(gm, head)
            if not (_is_planned_value(value) or _is_stored_parameter(value, ctx)):
                continue
            if value in seen:
                twice.add(value)
            seen.add(value)
            if me.part.op.inputs[k] is None:
                continue  # read whole (an index list), not a priced edge
            sig = object() if me.fallback else signature(me.part, me.target, k, ctx.vkey)
            members.setdefault(value, []).append((c, head, chain, sig))
    shared = 0
    for value, group in members.items():
        if len(group) < 2 or value in twice:
            continue
        _, first, chain, first_sig = group[0]
        if value.op == "placeholder":  # a tied parameter: each later reader like its first joins it
            group = [group[0]] + [m for m in group[1:] if m[3] == first_sig]
        elif len({sig for *_, sig in group}) != 1:
            continue
        if not chain:
            continue  # nothing runs between the value and its consumers
        for c, head, own, _ in group[1:]:
            if len(own) != len(chain):
                raise AssertionError(
                    f"{value.name}: consumers {group[0][0].name} and {c.name} agree on their "
                    "layouts and all-reduces but not on the modules that run them"
                )
            c.replace_input_with(head, first)
            rename_operand(c, head, first)
            for node in own:
                target = node.target
                gm.graph.erase_node(node)
                delattr(gm, target)  # type: ignore[arg-type]
            shared += 1
    if shared:
        log.debug("rank %s: %d consumer inputs share another consumer's re-layout", ctx.rank, shared)
    return gm
