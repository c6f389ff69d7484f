"""The tests mirror the package: ``tests/<stage>/test_<module>.py``. Shared helpers (``opdims``, the
``*_checks`` modules run on spawned ranks, ``golden/``) stay in ``tests/``, which is put on ``sys.path`` here so the
tests of every stage, and the ranks they spawn, import them by name."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
