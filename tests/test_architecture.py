"""docs/architecture.md matches the code: every package in its table is a package of ``primepar_fx`` and every
package is in the table; every dotted name it gives in backticks (``planning.counts.search_counts``,
``record.levers.Recompute``) is a module of the package or a name one defines; every stage of the layout test is
listed in pipeline order."""

from __future__ import annotations

import importlib
import pathlib
import re

from test_layout import ALLOWED, STAGES

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "primepar_fx"
#: a package row of the table: | `name/` | ...
ROW = re.compile(r"^\| `(\w+)/` \|", re.M)
#: a dotted name in backticks: ``package.module.name``, or ``module.name`` of a planning module (the page's steps)
DOTTED = re.compile(r"`((\w+)\.[\w.]+)(?:\(\))?`")


def packages() -> set[str]:
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def named(text: str) -> set[str]:
    """The dotted names of the page, as paths under ``primepar_fx`` (a planning module's with its package)."""
    planning = {p.stem for p in (PACKAGE / "planning").glob("*.py")}
    out = set()
    for m in DOTTED.finditer(text):
        dotted, first = m.group(1), m.group(2)
        if first in packages():
            out.add(dotted)
        elif first in planning:
            out.add(f"planning.{dotted}")
    return out


def resolves(dotted: str) -> bool:
    """Whether ``primepar_fx.<dotted>`` is a module, or a name (attribute path) of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(["primepar_fx", *parts[:cut]]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_the_table_lists_every_stage_in_pipeline_order_and_no_other_package():
    rows = ROW.findall(PAGE.read_text())
    assert rows == list(STAGES), rows
    beside = packages() - set(rows)
    text = PAGE.read_text()
    assert all(f"`{p}/`" in text for p in beside), beside  # the tools beside the pipeline are named too
    assert set(rows) | beside == packages() and beside <= set(ALLOWED)


def test_every_dotted_name_on_the_page_exists():
    text = PAGE.read_text()
    names = named(text)
    assert len(names) >= 20, sorted(names)  # the steps are named, not only described
    missing = sorted(n for n in names if not resolves(n))
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
