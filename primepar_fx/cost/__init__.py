"""Cost model (paper §4, Eq. 7-10).

Built so far:

* :mod:`primepar_fx.cost.cluster` — cluster specs as validated data (devices, nodes, link levels with a linear
  latency model per collective kind, per-family compute models), presets ``v100-paper``, ``a100-dgx``,
  ``h100-dgx`` and ``cpu-gloo``.
* :mod:`primepar_fx.cost.redistribute` — inter-operator redistribution traffic (Eq. 8-9) from DSI slice
  intersections, exact element counts per device for Forward and Backward, merged (view) dims included.

Still to come (the cost-model issue): intra-operator cost per partition sequence (Eq. 7), pricing of the
redistribution traffic, memory, and calibration.
"""
