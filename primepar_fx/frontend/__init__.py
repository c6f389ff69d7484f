"""Stages 1-2: capture a model with ``torch.export`` and give every node symbolic shapes in ``B`` and ``S``.

* :mod:`~primepar_fx.frontend.symbols` — the symbols ``B`` and ``S``, the ``node.meta`` keys and the shape type.
* :mod:`~primepar_fx.frontend.capture` — :func:`capture`: an ATen FX graph with the batch and sequence dims symbolic.
* :mod:`~primepar_fx.frontend.shapes` — :func:`annotate`: every node's shapes as sympy expressions in ``B`` and ``S``.
* :mod:`~primepar_fx.frontend.specialize` — why ``B`` or ``S`` could not stay symbolic, as an error or a warning.
"""

from primepar_fx.frontend.capture import Captured, capture
from primepar_fx.frontend.specialize import ShapeSpecializationError, StaticSeqWarning
from primepar_fx.frontend.symbols import B, S, Shape

__all__ = ["B", "Captured", "S", "Shape", "ShapeSpecializationError", "StaticSeqWarning", "capture"]
