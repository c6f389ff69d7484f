"""The size rule: no function of the package is longer than 80 lines, from its ``def`` line to its last line, its
docstring included.

A function fits on a screen, for reading: what it does is seen at once, without scrolling back to recall what a
name held (the house style, "Layout"). A longer one is split by what it does, into named steps with
docstrings (one helper per argument group of a parser, one function per phase of a computation), never by a line
count alone. The functions are read from the source (``ast``): methods and nested functions count too.
"""

from __future__ import annotations

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "primepar_fx"
#: the most lines a function may take
LIMIT = 80
#: qualified name (``primepar_fx.module.Class.function``) -> why it may be longer, for now
EXCEPTIONS: dict[str, str] = {}


def module_name(path: pathlib.Path) -> str:
    parts = ["primepar_fx", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def function_sizes(tree: ast.AST, prefix: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, lines)`` of every function under ``tree``, nested ones and methods too."""
    found = []
    for node in ast.iter_child_nodes(tree):
        name = prefix
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((name, node.lineno, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
        found += function_sizes(node, name)
    return found


@functools.cache
def all_function_sizes() -> list[tuple[str, pathlib.Path, int, int]]:
    """``(qualified name, file, first line, lines)`` of every function of the package."""
    return [
        (name, path, line, size)
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, size in function_sizes(ast.parse(path.read_text(), str(path)), module_name(path))
    ]


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name}: {size} lines"
        for name, path, line, size in all_function_sizes()
        if size > LIMIT and name not in EXCEPTIONS
    ]
    assert not long, f"functions longer than {LIMIT} lines (split them by what they do):\n" + "\n".join(long)


def test_every_exception_names_a_long_function():
    sizes = {name: size for name, _, _, size in all_function_sizes()}
    stale = [name for name in EXCEPTIONS if sizes.get(name, 0) <= LIMIT]
    assert not stale, f"EXCEPTIONS lists functions that are gone or fit in {LIMIT} lines: {stale}"
