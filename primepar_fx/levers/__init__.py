"""The memory levers, weighed against the budget on one priced mesh and micro-batch count.

* :mod:`~primepar_fx.levers.choices` — what options may ask of each lever, and the micro-batch counts tried.
* :mod:`~primepar_fx.levers.floor` — the least memory any plan needs (the training state over every device).
* :mod:`~primepar_fx.levers.peak` — the search under the reported peak: one budgeted search per ring-buffer cap.
* :mod:`~primepar_fx.levers.recompute` — activation recomputation priced per layer, and the policy chosen.
* :mod:`~primepar_fx.levers.choose` — the ZeRO stage and recomputation of one mesh's plan.
"""
