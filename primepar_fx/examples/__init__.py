"""Runnable examples of :func:`primepar_fx.compile`; ``python -m primepar_fx.examples.train --help``."""
