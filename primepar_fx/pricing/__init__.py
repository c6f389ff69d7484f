"""An operator graph priced into the search's cost graph (Eq. 7-10), and a choice read back as a plan's figures.

* :mod:`~primepar_fx.pricing.price` — :func:`~primepar_fx.pricing.price.price_graph`: every node's partition
  sequences and every edge's re-layout priced, as a :class:`~primepar_fx.pricing.priced.PricedGraph`.
* :mod:`~primepar_fx.pricing.priced` — the priced graph: the cost graph and what the levers and the summary read.
* :mod:`~primepar_fx.pricing.deferred`, :mod:`~primepar_fx.pricing.sharing` — savings priced on edges: input-gradient
  sums that wait for the end of backward, and a tensor several consumers read in one layout.
* :mod:`~primepar_fx.pricing.summary` — a choice of strategies read back as per-node costs and whole-plan totals.
* :mod:`~primepar_fx.pricing.fixed` — fixed assignments (the baselines', a forced plan's) priced and read back.
"""
