"""Fit a cluster spec to this machine: collectives and kernels (``primepar-fx calibrate``), and measured step times.

A measuring tool beside the pipeline: it starts its own ranks (through :mod:`primepar_fx.runtime`) and writes the
JSON cluster specs that :mod:`primepar_fx.cost.cluster` loads.

* :mod:`~primepar_fx.calibrate.measure` — time collectives and kernels on spawned ranks and fit their latency.
* :mod:`~primepar_fx.calibrate.machine` — ``compile()``'s default cluster: this machine measured on the live ranks
  in seconds, cached per host, backend, world size and torch version.
* :mod:`~primepar_fx.calibrate.stepfit` — fit the compute model to measured whole-step times.
"""
