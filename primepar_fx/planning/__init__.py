"""The planner's policy: from an operator graph and its options to a :class:`~primepar_fx.record.plan.Plan`.

* :mod:`~primepar_fx.planning.planner` — :func:`~primepar_fx.planning.planner.plan_graph`, the policy as a short
  list of named steps, and the plan's record.
* :mod:`~primepar_fx.planning.state` — the one state object those steps share, and the plan to beat (``Bound``).
* :mod:`~primepar_fx.planning.counts` — the micro-batch counts searched in turn, probed and bounded.
* :mod:`~primepar_fx.planning.meshes` — one count on every grouping: priced, bounded, the levers searched.
* :mod:`~primepar_fx.planning.groupings` — which meshes the search runs on past three device digits.
* :mod:`~primepar_fx.planning.baselines`, :mod:`~primepar_fx.planning.compare` — Megatron-LM's, data parallelism's,
  FSDP's and split-only plans, priced with the same cost model.
* :mod:`~primepar_fx.planning.forced` — plans that follow a named strategy instead of the search.
* :mod:`~primepar_fx.planning.options` — :class:`~primepar_fx.planning.options.PlanOptions`: every option, validated
  once.
* :mod:`~primepar_fx.planning.workers` — the one helper that runs planning work in forked worker processes.
"""
