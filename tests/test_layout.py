"""The package's layout: one subpackage per pipeline stage, no import cycles, no upward imports.

The import graph is read from the source (``ast``), every ``import`` and ``from ... import`` counted, those inside
functions and under ``TYPE_CHECKING`` included: a cycle broken only by a late import is still a cycle.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from collections import Counter

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "primepar_fx"
TESTS = PACKAGE.parent / "tests"
#: the folders beside the package whose files import it
IMPORTERS = (TESTS, PACKAGE.parent / "bench")

#: The stages in pipeline order, then the tools beside it. The root modules (``__init__``, ``api``, ``cli``,
#: ``__main__``) orchestrate and may import any stage.
STAGES = (
    "utils",
    "frontend",
    "rules",
    "graph",
    "partition",
    "cost",
    "search",
    "record",
    "pricing",
    "levers",
    "planning",
    "runtime",
    "passes",
    "report",
    "compiler",
)

#: stage -> the stages it may import (itself always). A pipeline stage imports only stages before it; the
#: edges it does not need are left out, so a new dependency is a decision made here.
ALLOWED: dict[str, set[str]] = {
    "utils": set(),
    "models": {"utils"},  # utils: the helpers every package may use (it imports none of ours)
    "frontend": {"utils"},
    "rules": {"frontend"},
    "graph": {"frontend", "rules"},
    "partition": {"rules"},
    "cost": {"rules", "partition"},
    "search": set(),
    "record": {"utils", "partition", "cost"},  # the plan as data: its partitions and its training state's costs
    "pricing": {"utils", "frontend", "graph", "partition", "cost", "search", "record"},
    "levers": {"utils", "graph", "partition", "cost", "search", "record", "pricing"},
    "planning": {"utils", "frontend", "rules", "graph", "partition", "cost", "search", "record", "pricing", "levers"},
    "runtime": {"partition", "cost"},
    "passes": {"frontend", "graph", "partition", "cost", "runtime"},
    "report": {
        "utils",
        "frontend",
        "rules",
        "graph",
        "partition",
        "cost",
        "record",
        "pricing",
        "levers",
        "planning",
        "runtime",
        "passes",
    },
    "compiler": {
        "utils",
        "frontend",
        "graph",
        "partition",
        "cost",
        "record",
        "pricing",  # ZeRO-3's units as the pricing priced them (pricing.zero3)
        "levers",
        "planning",
        "runtime",
        "passes",
        "report",
        "calibrate",
    },
    "calibrate": {"cost", "runtime"},
    "examples": {"root", "utils", "models", "partition", "cost", "record", "planning", "runtime"},
    "root": set(STAGES) - {"passes", "runtime"} | {"models", "calibrate"},
}
ROOT_MODULES = {"__init__", "api", "cli", "__main__"}


def module_name(path: pathlib.Path) -> str:
    parts = ["primepar_fx", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, str, int]]:
    """``(module, imported name or "", line)`` for every import of this package in one module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("primepar_fx")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("primepar_fx"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in known else (target, alias.name, node.lineno))
    return found


def stage_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in ROOT_MODULES):
        return "root"
    return parts[1]


def import_graph() -> nx.DiGraph:
    mods = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        for target, _, line in imports(name, path, set(mods)):
            assert target in mods, f"{path}:{line} imports {target}, which is not a module of the package"
            if target != name:
                graph.add_edge(name, target, line=line)
    return graph


def test_the_root_holds_only_the_entry_points():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose <= ROOT_MODULES, f"modules outside a stage: {sorted(loose - ROOT_MODULES)}"
    assert len(loose) <= 4


def test_every_subpackage_is_a_known_stage_or_tool():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(ALLOWED), f"subpackages without a row in ALLOWED: {sorted(packages - set(ALLOWED))}"


def test_the_import_graph_has_no_cycle():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_the_stages_import_only_the_stages_before_them():
    graph = import_graph()
    stages = nx.DiGraph()
    bad = []
    for a, b, data in graph.edges(data=True):
        sa, sb = stage_of(a), stage_of(b)
        if sa == sb:
            continue
        stages.add_edge(sa, sb)
        if sb not in ALLOWED[sa]:
            bad.append(f"{a} (line {data['line']}) -> {b}: {sa} may not import {sb}")
    assert not bad, "\n".join(bad)
    assert nx.is_directed_acyclic_graph(stages)


def test_the_pipeline_stages_are_ordered():
    for i, stage in enumerate(STAGES):
        later = set(STAGES[i:])
        assert not (ALLOWED[stage] & later), f"{stage} is allowed to import a later stage: {ALLOWED[stage] & later}"


def test_no_private_name_is_imported_across_modules():
    mods = modules()
    private = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}.{what}"
        for name, path in mods.items()
        for target, what, line in imports(name, path, set(mods))
        if what.startswith("_")
        and not what.startswith("__")
        or target.rpartition(".")[2].startswith("_")
        and not target.endswith(("__init__", "__main__"))
    ]
    assert not private, "\n".join(private)


def importers() -> dict[str, pathlib.Path]:
    """The package's modules, then the tests' and the benchmarks' files (``tests.cost.test_cluster``)."""
    found = modules()
    for folder in IMPORTERS:
        found |= {
            ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in sorted(folder.rglob("*.py"))
        }
    return found


@functools.cache
def top_level(path: pathlib.Path) -> tuple[frozenset[str], frozenset[str]]:
    """``(names defined, names imported)`` at a module's top level: ``def``, ``class`` and assignments, those under a
    top-level ``if`` or ``try`` included, and the names its imports there bind."""
    defined, imported = set(), set()
    body = list(ast.parse(path.read_text(), str(path)).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {
                n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {a.asname or a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.If):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return frozenset(defined), frozenset(imported)


def module_under_test(path: pathlib.Path) -> str | None:
    """The module a test file tests: ``tests/cost/test_cluster.py`` tests ``primepar_fx.cost.cluster``."""
    if not (path.is_relative_to(TESTS) and path.stem.startswith("test_")):
        return None
    return ".".join(["primepar_fx", *path.relative_to(TESTS).parent.parts, path.stem.removeprefix("test_")])


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_name_is_imported_from_the_module_that_defines_it():
    """``from primepar_fx.X import name`` in the package, the tests and the benchmarks: ``name`` is a submodule of X,
    a name X's source defines, or, X being a package, a public name its ``__init__`` imports (the package's
    interface). No module passes on another module's names."""
    mods = modules()
    wrong = []
    for name, path in importers().items():
        for target, what, line in imports(name, path, set(mods)):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target not in mods:
                wrong.append(f"{where} imports {target}, which is not a module of the package")
                continue
            defined, imported = top_level(mods[target])
            interface = mods[target].name == "__init__.py" and not is_private(what) and what in imported
            if what and what not in defined and not interface:
                wrong.append(f"{where} imports {what} from {target}, which does not define it")
    assert not wrong, "\n".join(wrong)


def test_a_test_imports_private_names_only_from_the_module_it_tests():
    mods = modules()
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}{'.' + what if what else ''}"
        for name, path in importers().items()
        if path.is_relative_to(TESTS)
        for target, what, line in imports(name, path, set(mods))
        if is_private(what or target.rpartition(".")[2]) and target != module_under_test(path)
    ]
    assert not wrong, "\n".join(wrong)


def test_a_test_file_tests_the_module_its_path_names():
    assert module_under_test(TESTS / "cost" / "test_cluster.py") == "primepar_fx.cost.cluster"
    assert module_under_test(TESTS / "test_cli.py") == "primepar_fx.cli"
    assert module_under_test(TESTS / "conftest.py") is None
    assert module_under_test(PACKAGE / "cli.py") is None


def test_top_level_names_are_the_defined_and_the_imported_ones(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "import os.path\n"
        "from x import y as z\n"
        "A, (B, *C) = 1, (2, 3)\n"
        "D: int = 4\n"
        "A.attr = 5\n"
        "if A:\n    def f(): G = 1\nelse:\n    class K: H = 1\n"
        "try:\n    E = 1\nexcept ImportError:\n    F = 2\n"
    )
    assert top_level(source) == ({"A", "B", "C", "D", "E", "F", "f", "K"}, {"os", "z"})


@pytest.mark.parametrize("source", ["from .seq import Split", "from . import mesh"])
def test_relative_imports_resolve_to_the_module_they_name(source, tmp_path):
    path = PACKAGE / "partition" / "dsi.py"
    tree_path = tmp_path / "dsi.py"
    tree_path.write_text(source + "\n")
    known = set(modules())
    [(target, what, _)] = imports("primepar_fx.partition.dsi", tree_path, known)
    assert path.exists()
    if source.startswith("from . import"):
        assert (target, what) == ("primepar_fx.partition.mesh", "")
    else:
        assert (target, what) == ("primepar_fx.partition.seq", "Split")


def test_the_tests_mirror_the_packages():
    tests = PACKAGE.parent / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("golden", "data", "__pycache__")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders <= packages, f"test folders without a package: {sorted(folders - packages)}"
    for folder in folders:
        for test in (tests / folder).glob("test_*.py"):
            assert not (tests / test.name).exists(), f"{test.name} is both in tests/ and tests/{folder}/"
    # pytest imports each test file by its base name (its default import mode): two of one name cannot both run
    names = Counter(test.name for test in tests.rglob("test_*.py"))
    twice = [n for n, k in names.items() if k > 1]
    assert not twice, f"test files of one name: {twice}"


CYCLE_PROBE = r"""
import builtins, importlib.abc, importlib.machinery, sys

initializing = []  # the package's modules whose code is running, outermost first
found = []


class Tracking(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith("primepar_fx"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            run = spec.loader.exec_module

            def exec_module(module, run=run):
                initializing.append(module.__name__)
                try:
                    run(module)
                finally:
                    initializing.pop()

            spec.loader.exec_module = exec_module
        return spec


real_import = builtins.__import__


def checked_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if level == 0 and name.startswith("primepar_fx") and importer.startswith("primepar_fx"):
        targets = [name] + [f"{name}.{f}" for f in fromlist or () if f"{name}.{f}" in sys.modules]
        for target in targets:
            ancestor = importer.startswith(target + ".")
            if target in initializing and target != importer and not ancestor:
                found.append(f"{importer} imports {target} while {target} is still running")
    return real_import(name, globals, locals, fromlist, level)


sys.meta_path.insert(0, Tracking())
builtins.__import__ = checked_import
import primepar_fx  # noqa: E402
import primepar_fx.cli  # noqa: E402

print("\n".join(found) or "no cycle")
"""


def test_importing_the_package_runs_into_no_half_initialised_module():
    """``import primepar_fx`` in a fresh interpreter: no module of the package imports one whose code is still
    running (other than its own enclosing packages), which is what an import cycle does at run time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CYCLE_PROBE], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "no cycle", out.stdout


def test_no_two_classes_of_the_package_share_a_name():
    """One class per name: a reader who meets ``Plan`` or ``Found`` knows which one it is without its import."""
    owners: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                owners.setdefault(node.name, []).append(name)
    shared = {cls: where for cls, where in owners.items() if len(where) > 1}
    assert not shared, shared
