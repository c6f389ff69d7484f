"""The plan record: what a search hands to the graph passes and what a user saves, diffs and reloads.

* :mod:`~primepar_fx.record.plan` — :class:`~primepar_fx.record.plan.Plan` and its parts (nodes, costs, baselines),
  frozen dataclasses that validate themselves and round-trip through JSON.
* :mod:`~primepar_fx.record.search` — :class:`~primepar_fx.record.search.SearchRecord`: how the plan was found.
* :mod:`~primepar_fx.record.levers` — :class:`~primepar_fx.record.levers.Recompute`: what the plan recomputes.
* :mod:`~primepar_fx.record.fields` — the field checks every record uses, naming the offending field path.
"""
