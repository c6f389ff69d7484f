"""``python -m primepar_fx``: the ``primepar-fx`` command line."""

from primepar_fx.cli import run

run()
