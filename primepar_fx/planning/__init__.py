"""From an operator graph to a :class:`~primepar_fx.planning.plan.Plan`.

* :mod:`~primepar_fx.planning.options` — :class:`PlanOptions`: every planning option, validated once.
* :mod:`~primepar_fx.planning.pricing` — the whole graph priced: the search's cost graph (Eq. 10).
* :mod:`~primepar_fx.planning.baselines` — the Megatron-LM and data-parallel assignments a plan is compared with.
* :mod:`~primepar_fx.planning.planner` — price, search and summarise: :func:`plan_graph`, and forced plans.
* :mod:`~primepar_fx.planning.plan` — the plan as JSON-able data, validated on load.
"""
