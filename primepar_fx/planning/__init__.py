"""From an operator graph to a :class:`~primepar_fx.record.plan.Plan`.

* :mod:`~primepar_fx.planning.options` — :class:`PlanOptions`: every planning option, validated once.
* :mod:`~primepar_fx.pricing.price` — the whole graph priced: the search's cost graph (Eq. 10).
* :mod:`~primepar_fx.planning.baselines` — the Megatron-LM and data-parallel assignments a plan is compared with.
* :mod:`~primepar_fx.planning.planner` — price, search and summarise: :func:`plan_graph`, and forced plans.
* :mod:`~primepar_fx.record.plan` — the plan as JSON-able data, validated on load.
"""
