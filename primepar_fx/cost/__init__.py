"""Cost model (paper §4, Eq. 7-10).

Built so far:

* :mod:`primepar_fx.cost.cluster` — cluster specs as validated data (devices, nodes, link levels with a linear
  latency model per collective kind, per-family compute models), presets ``v100-paper``, ``a100-dgx``,
  ``h100-dgx`` and ``cpu-gloo``.

Still to come (the cost-model issue): intra-operator cost per partition sequence (Eq. 7), inter-operator
redistribution (Eq. 8-9), memory, and calibration.
"""
