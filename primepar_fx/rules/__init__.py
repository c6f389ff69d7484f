"""Op-dimension rules: for every ATen op, its iteration dims and how each tensor maps onto them.

One registry (:mod:`primepar_fx.rules.registry`) keyed by ATen ``OpOverload`` objects, filled on import by the
family modules. :func:`~primepar_fx.rules.apply.op_dims` applies the rule of a node; a node without one raises
:class:`MissingRuleError` unless ``fallback="replicate"`` is asked for.

Dims are named so that a plan reads well: after their symbolic size (``B``, ``S``; a second ``S``-sized dim is
``T``; ``B*S`` is ``BS``), else by role (``N``/``K`` of a matrix product, ``H``/``E``/``Ev`` of attention,
``V``/``D`` of an embedding, ``D`` of a norm), else by position (``d0``, ``d1`` ...).
"""

from primepar_fx.rules.apply import op_dims  # imports every family, which registers its rules
from primepar_fx.rules.registry import (
    MissingRuleError,
    RuleContext,
    RuleError,
    register_rule,
    registered_ops,
)
from primepar_fx.rules.spec import OpDims

__all__ = [
    "MissingRuleError",
    "OpDims",
    "RuleContext",
    "RuleError",
    "op_dims",
    "register_rule",
    "registered_ops",
]
