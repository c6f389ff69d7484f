"""Pass 2: decide which slice of every parameter this rank keeps (``node.meta["primepar_storage"]``).

A parameter is stored in the Forward-start layout of its first reader, so that reader needs no traffic and a rank
holds only its own slices (a P(S x S) weight: one block per rank, no copies). A later reader of the same parameter
(tied embeddings) fetches its block from there, as the cost model prices it
(:func:`primepar_fx.pricing.price.shared_parameters`). :class:`~primepar_fx.compiler.module.PrimeParModule` cuts the
tensors by these layouts.

On the ``torch.compile`` path parameters arrive whole on every call (``ctx.whole_params``): their layout is then
the whole tensor, every reader takes its block locally, and their gradients are gathered whole on every rank.
"""

from __future__ import annotations

from torch import fx

from primepar_fx.passes.common import STORAGE, RankContext, info
from primepar_fx.runtime.exchange import full_layout


def shard_parameters(gm: fx.GraphModule, ctx: RankContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in ctx.captured.params:
            continue
        reader = next((u for u in node.users if info(u) is not None), None)
        if reader is None or ctx.whole_params:
            shape = tuple(int(s) for s in node.meta["val"].shape)
            node.meta[STORAGE] = full_layout(shape, ctx.mesh.size)
        else:
            k = reader.all_input_nodes.index(node)
            node.meta[STORAGE] = info(reader).computed.in_needed(k)  # type: ignore[union-attr]
    return gm
