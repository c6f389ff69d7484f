"""Graph passes, each ``GraphModule -> GraphModule``, that turn the captured graph and a plan into one rank's graph.

In order (:func:`~primepar_fx.passes.localize.localize` runs them on a copy of the captured graph):

1. :func:`~primepar_fx.passes.annotate.annotate_plan`: bind every node to its partition; mark fallbacks.
2. :func:`~primepar_fx.passes.shard.shard_parameters`: the slice of every parameter this rank keeps.
3. :func:`~primepar_fx.passes.redistribute.insert_redistributions`: point-to-point layout changes on edges,
   input slicing, output gathering.
4. :func:`~primepar_fx.passes.collectives.insert_collectives`: forward / backward all-reduces of each partition;
   :func:`~primepar_fx.passes.share.share_relayouts`: consumers that need a tensor alike share one re-layout and
   one gradient all-reduce; :func:`~primepar_fx.passes.collectives.fuse_reduce_scatters`: an all-reduce and the
   slice after it become one reduce-scatter; :func:`~primepar_fx.passes.gradsync.defer_parameter_gradients`: a
   parameter's gradient sum leaves the graph for the compiled module's gradient buckets (asynchronous, overlapped
   with backward).
5. :func:`~primepar_fx.passes.ring.replace_ring_products`: one ring operator per P(S x S) product.
6. :func:`~primepar_fx.passes.localize.rewrite_local_ops`: every op on its local block (a mean cross-entropy over
   split rows also gets its asynchronous count of targets); :func:`~primepar_fx.passes.gradsync.
   defer_input_gradient_sums`: a replicated parameter lookup whose output gradient is summed over a group (a
   learned position table) takes its gradient from that sum at the end of backward, the sum asynchronous.
7. :func:`~primepar_fx.passes.overlap.overlap_collective_matmuls`: a re-layout that moves whole rows fused with the
   linears beside it (collective matmul), so that the transfer and the product overlap.
8. :func:`~primepar_fx.passes.recompute.recompute_layers`: the plan's recomputed layers, each one checkpointed.

:func:`~primepar_fx.passes.runner.run_passes` runs them: on a copy, linting and recompiling after each pass, naming
the failing pass in a :class:`~primepar_fx.passes.runner.PassError`, skipping those ``PRIMEPAR_DISABLE_PASSES``
names and writing each pass's graph under ``PRIMEPAR_DUMP_DIR``.
"""

from primepar_fx.passes.annotate import annotate_plan
from primepar_fx.passes.collectives import fuse_reduce_scatters, insert_collectives
from primepar_fx.passes.gradsync import defer_input_gradient_sums, defer_parameter_gradients
from primepar_fx.passes.localize import RankGraph, localize, rewrite_local_ops
from primepar_fx.passes.recompute import recompute_layers
from primepar_fx.passes.redistribute import insert_redistributions
from primepar_fx.passes.ring import replace_ring_products
from primepar_fx.passes.runner import PassError, op_counts, run_passes
from primepar_fx.passes.shard import shard_parameters
from primepar_fx.passes.share import share_relayouts

__all__ = [
    "PassError",
    "RankGraph",
    "annotate_plan",
    "defer_input_gradient_sums",
    "defer_parameter_gradients",
    "fuse_reduce_scatters",
    "insert_collectives",
    "insert_redistributions",
    "localize",
    "op_counts",
    "recompute_layers",
    "replace_ring_products",
    "rewrite_local_ops",
    "run_passes",
    "shard_parameters",
    "share_relayouts",
]
