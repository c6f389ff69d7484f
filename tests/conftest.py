"""The tests mirror the package: ``tests/<stage>/test_<module>.py``. Shared helpers (``opdims``, the
``*_checks`` modules run on spawned ranks, ``golden/``) stay in ``tests/``, which is put on ``sys.path`` here so the
tests of every stage, and the ranks they spawn, import them by name."""

import os
import sys
from pathlib import Path

# compile() without a cluster prices on this machine as measured (primepar_fx.calibrate.machine), which differs
# from machine to machine and from run to run: the suite prices on the cpu-gloo preset, as it always has, so its
# plans are the same everywhere. tests/calibrate/test_machine.py unsets this to test the measured default.
os.environ.setdefault("PRIMEPAR_CLUSTER", "cpu-gloo")

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
