"""What a person reads: per-node tables, why a node got its partition, graph dumps and DSI pictures.

* :mod:`~primepar_fx.report.explain` — ``primepar-fx explain`` tables and :func:`explain_choice`.
* :mod:`~primepar_fx.report.dump` — ``primepar-fx dump`` and ``PRIMEPAR_DUMP_DIR``.
* :mod:`~primepar_fx.report.picture` — text and SVG pictures of a partition's DSIs.
"""
