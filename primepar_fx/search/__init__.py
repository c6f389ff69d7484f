"""Search (paper §5): one partition strategy per operator, minimising intra- plus inter-operator cost.

The flow: a :class:`CostGraph` (from the cost model) goes to :func:`solve`, which runs the segmented dynamic
program (:mod:`~primepar_fx.search.dp`, Eq. 11-14) or the ILP (:mod:`~primepar_fx.search.ilp`) and returns a
:class:`Solution`. :mod:`~primepar_fx.search.problem` states the objective and the constraints.
"""

from primepar_fx.search.budget import budget_bound, least_memory, solve_budget_dp
from primepar_fx.search.dp import DPOptions, DPResult, DPSolver
from primepar_fx.search.ilp import IlpResult, solve_ilp
from primepar_fx.search.problem import (
    CostGraph,
    CutOff,
    InfeasibleBudget,
    InfeasibleGraph,
    SearchError,
    Solution,
    TableTooLarge,
    evaluate,
    plan_memory,
    reduce_graph,
    restrict,
)
from primepar_fx.search.solve import Search, smallest_memory, solve

__all__ = [
    "CostGraph",
    "CutOff",
    "DPOptions",
    "DPResult",
    "DPSolver",
    "IlpResult",
    "InfeasibleBudget",
    "InfeasibleGraph",
    "Search",
    "SearchError",
    "Solution",
    "TableTooLarge",
    "budget_bound",
    "evaluate",
    "least_memory",
    "plan_memory",
    "reduce_graph",
    "restrict",
    "smallest_memory",
    "solve",
    "solve_budget_dp",
    "solve_ilp",
]
