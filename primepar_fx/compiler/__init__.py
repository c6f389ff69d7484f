"""Turn a plan into per-rank training code and run it.

* :mod:`~primepar_fx.compiler.agree` — the plan every rank runs: options checked on every rank, rank 0 resolves it.
* :mod:`~primepar_fx.compiler.inputs` — the sizes a compiled module accepts and how a call's sizes are read.
* :mod:`~primepar_fx.compiler.module` — :func:`compile` and :class:`PrimeParModule`.
* :mod:`~primepar_fx.compiler.dynamo` — the ``"primepar"`` backend of ``torch.compile``.
* :mod:`~primepar_fx.compiler.checkpoint` — saving and loading a compiled module's shards.
"""
