"""The two symbols of every shape, ``B`` (batch) and ``S`` (sequence), and the ``node.meta`` keys shapes live under.

The bottom of the frontend: :mod:`~primepar_fx.frontend.capture` maps torch.export's symbols onto these and
:mod:`~primepar_fx.frontend.shapes` writes the shapes; both, and the rules after them, read them from here.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy

#: The batch size.
B = sympy.Symbol("B", integer=True, positive=True)
#: The sequence length.
S = sympy.Symbol("S", integer=True, positive=True)
#: The only symbols a shape may mention.
ALLOWED_SYMBOLS = frozenset({B, S})

#: ``tuple[Shape, ...]``: one shape per tensor output of the node, flattened; ``()`` for non-tensor outputs.
META_SHAPES = "primepar_shapes"
#: ``tuple[torch.dtype, ...]``: one dtype per tensor output, aligned with :data:`META_SHAPES`.
META_DTYPES = "primepar_dtypes"
#: ``sympy.Expr``: the value of a node that produces a symbolic integer (``aten.sym_size.int`` ...).
META_SYMVALUE = "primepar_symvalue"

SymbolMap = Mapping[sympy.Symbol, sympy.Symbol]
#: A tensor's shape as sympy expressions in the symbols ``B`` and ``S`` (other sizes are integers).
Shape = tuple[sympy.Expr, ...]
