"""Cost model (paper §4, Eq. 7-10).

* :mod:`primepar_fx.cost.cluster` — cluster specs as validated data (devices, nodes, link levels with a linear
  latency model per collective kind, per-family compute models), presets ``v100-paper``, ``a100-dgx``,
  ``h100-dgx`` and ``cpu-gloo``.
* :mod:`primepar_fx.cost.model` — Eq. 7 for one node and partition (:func:`~primepar_fx.cost.model.node_cost`:
  compute, rings, collectives, memory) and Eq. 8-9 priced for every strategy pair of an edge
  (:func:`~primepar_fx.cost.model.edge_cost_matrix`: point-to-point or all-to-all, whichever is cheaper).
* :mod:`primepar_fx.partition.layouts` — index sets and layouts (Eq. 8), numbered so that they compare and intersect
  as int arrays.
* :mod:`primepar_fx.cost.redistribute` — inter-operator redistribution traffic (Eq. 8-9) from DSI slice
  intersections, exact element counts per device for Forward and Backward, and the messages the runtime sends.
* :mod:`primepar_fx.cost.scatter` — when an all-reduce and the re-layout after it are one reduce-scatter.
* :mod:`primepar_fx.cost.blocks` — :class:`~primepar_fx.cost.blocks.CostOptions` and the bytes of one device's block.

The whole graph is priced in :mod:`primepar_fx.pricing.price`; cluster specs are fitted to a machine by
:mod:`primepar_fx.calibrate`.
"""
