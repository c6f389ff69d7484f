"""The pass runner: a list of graph passes run in order on a copy of a GraphModule, each one checked.

:func:`run_passes` is how :func:`~primepar_fx.passes.localize.localize` runs its passes. Around every pass it adds
what a pipeline of in-place graph rewrites needs in order to be debugged:

* the caller's GraphModule is copied once, so its graph is never changed, even by a pass that fails;
* after each pass the graph is linted and recompiled, so a pass that leaves a broken graph is named at once rather
  than by whatever pass or call trips over it later;
* an exception becomes a :class:`PassError` naming the failing pass and the passes that ran before it;
* ``PRIMEPAR_DISABLE_PASSES=name,name`` skips passes (see :func:`disabled_passes`), to find which pass breaks a
  graph or a result;
* ``PRIMEPAR_DUMP_DIR=DIR`` writes the input graph and the graph after every pass to
  ``DIR/passes/rank{r}/NN_name.txt`` (``00`` the input, then the passes in order) and a table of how each pass
  changed the op counts to ``DIR/passes/rank{r}/changes.md`` (:mod:`primepar_fx.report.dump` writes the rest of
  that folder, none of it under ``passes/``).

Both variables are read at every call, so they can be set or changed after import.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate
from torch import fx

from primepar_fx.passes.common import RankContext

log = logging.getLogger(__name__)

#: a graph pass: the graph and the passes' context in, the rewritten graph out (it may rewrite its argument)
PassFn = Callable[[fx.GraphModule, Any], fx.GraphModule]
#: a pass as :func:`run_passes` takes it: a named function, or ``(name, function)``
Pass = PassFn | tuple[str, PassFn]
#: how many nodes of each kind a graph has (:func:`op_counts`)
OpCounts = dict[str, int]

#: comma-separated names of the passes to skip
DISABLE_ENV = "PRIMEPAR_DISABLE_PASSES"
#: the dump folder; the runner writes under its ``passes/`` subfolder
DUMP_ENV = "PRIMEPAR_DUMP_DIR"


class PassError(RuntimeError):
    """A pass raised, or left a graph that does not lint or recompile; chained (``from``) to the original error.

    ``pass_name`` is the failing pass and ``ran`` the passes that completed before it, in order. The error raised is
    also an instance of the original error's class where that class allows it (:func:`pass_error`), so a caller that
    catches ``ValueError`` or ``NotImplementedError`` from ``compile`` still does.
    """

    def __init__(self, message: str, pass_name: str = "", ran: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.ran = tuple(ran)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the attributes across pickling (e.g. to another process);
        return (PassError, (str(self), self.pass_name, self.ran))  # a mixed class travels as PassError


_ERROR_CLASSES: dict[type[BaseException], type[PassError]] = {}


def _error_class(kind: type[BaseException]) -> type[PassError]:
    """``PassError`` mixed with ``kind`` (cached), or ``PassError`` itself where the two cannot be combined."""
    if kind not in _ERROR_CLASSES:
        cls: type[PassError] = PassError
        if issubclass(kind, Exception) and not issubclass(PassError, kind):
            try:
                mixed = type(f"PassError[{kind.__name__}]", (PassError, kind), {"__module__": __name__})
                mixed("probe", "", ())  # a class whose constructor or layout does not allow it is left out
                cls = mixed
            except TypeError:
                pass
        _ERROR_CLASSES[kind] = cls
    return _ERROR_CLASSES[kind]


def pass_error(message: str, pass_name: str, ran: tuple[str, ...], original: BaseException) -> PassError:
    """The :class:`PassError` for ``original``: an instance of ``PassError`` and, where possible, of its class."""
    return _error_class(type(original))(message, pass_name, ran)


def op_counts(gm: fx.GraphModule) -> OpCounts:
    """How many nodes of each kind the graph has: ATen ops by name, inserted modules by their class."""
    out: OpCounts = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = getattr(node.target, "__name__", str(node.target))
            key = str(node.target) if key in ("default", "Tensor", "int") else key
        elif node.op == "call_module":
            key = type(gm.get_submodule(node.target)).__name__
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph and the same class name.

    Nodes are new, so rewriting the copy's graph leaves ``gm``'s alone. What is not copied: submodules and attributes
    are shared with ``gm`` (they may hold process groups, which cannot be copied), and ``node.meta`` dicts are
    copied but not their values.
    """
    graph = copy.deepcopy(gm.graph)  # Graph.__deepcopy__: new nodes, meta dicts copied shallowly, codegen copied
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out


def named_passes(passes: Sequence[Pass]) -> list[tuple[str, PassFn]]:
    """``(name, function)`` for every pass; a bare function is named by its ``__name__``. Names must be unique."""
    out: list[tuple[str, PassFn]] = []
    for p in passes:
        if isinstance(p, tuple):
            name, fn = p
        else:
            name, fn = getattr(p, "__name__", None), p
        if not isinstance(name, str) or not name or not callable(fn):
            raise TypeError(f"a pass is a named function or a (name, function) pair, got {p!r}")
        out.append((name, fn))
    names = [name for name, _ in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"pass names must be unique (they key {DISABLE_ENV} and the dump files): {repeated}")
    return out


def disabled_passes(names: Sequence[str], required: Mapping[str, str] | None = None) -> set[str]:
    """The passes of ``names`` that ``PRIMEPAR_DISABLE_PASSES`` (comma-separated, read now) asks to skip.

    A name that is not a pass, or a pass in ``required`` (pass name -> why it cannot be skipped), is a
    ``ValueError``: a misspelt name would otherwise skip nothing without a word.
    """
    asked = [n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()]
    unknown = [n for n in asked if n not in names]
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown passes {unknown}; the passes are {list(names)}")
    blocked = [n for n in asked if n in (required or {})]
    if blocked:
        why = "; ".join(f"{n}: {required[n]}" for n in blocked)  # type: ignore[index]
        raise ValueError(f"{DISABLE_ENV} asks to skip required passes {blocked}, which cannot be skipped ({why})")
    return set(asked)


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[Pass],
    ctx: RankContext,
    *,
    required: Mapping[str, str] | None = None,
    input_name: str = "input",
) -> tuple[fx.GraphModule, list[tuple[str, OpCounts]]]:
    """Run ``passes`` in order on a copy of ``gm``; return the final GraphModule and the op counts after each pass.

    ``passes``: named functions ``fn(gm, ctx) -> GraphModule`` or ``(name, fn)`` pairs (a pass that needs more
    arguments is bound first, e.g. with :func:`functools.partial`). ``ctx`` is handed to every pass as it is: it is
    not copied, and :class:`RankContext` is a mutable dataclass the passes add to (fallbacks, byte counter, process
    groups), so what a pass put there stays even when a later pass fails. ``ctx.rank`` names the dump folder.
    ``required`` maps the passes that ``PRIMEPAR_DISABLE_PASSES`` may not skip to the reason why.

    The counts start with ``(input_name, counts of gm)``, then one entry per pass that ran (a skipped pass has none).
    The copy shares submodules with ``gm`` (:func:`copy_graph_module`), so ``gm`` should not yet have any that a pass
    changes in place; the captured graph has none. Raises :class:`PassError` when a pass fails (module docstring).
    """
    named = named_passes(passes)
    skip = disabled_passes([name for name, _ in named], required)
    folder = _dump_folder(ctx)
    gm = copy_graph_module(gm)
    counts: list[tuple[str, OpCounts]] = [(input_name, op_counts(gm))]
    if folder is not None:
        _write_graph(folder / f"00_{input_name}.txt", gm, f"the input graph, {input_name}")
    ran: list[str] = []

    def _table(failed: str | None = None) -> str:
        return changes_table(counts, ctx.rank, named, skip, failed)

    for i, (name, fn) in enumerate(named, 1):
        if name in skip:
            log.warning(
                "rank %s: skipping pass %s (%s): the rank's graph is not the plan's and may compute wrong results",
                ctx.rank,
                name,
                DISABLE_ENV,
            )
            continue
        failed, out = "raised", gm
        try:
            out = fn(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise TypeError(f"a pass returns a GraphModule, this one returned {type(out).__name__}")
            failed = "left a graph that does not lint"
            out.graph.lint()
            failed = "left a graph that does not recompile"
            out.recompile()
        except Exception as e:
            if folder is not None:
                broken = out if isinstance(out, fx.GraphModule) else gm  # as the pass left it
                _write_failed(folder, f"{i:02d}_{name}", broken, f"pass {name} {failed}", _table(name))
            before = ", ".join(ran) if ran else "none"
            raise pass_error(
                f"pass {name!r} {failed} (rank {ctx.rank}; passes run before it: {before}): {type(e).__name__}: {e}",
                name,
                tuple(ran),
                e,
            ) from e
        gm = out
        ran.append(name)
        counts.append((name, op_counts(gm)))
        if folder is not None:
            _write_graph(folder / f"{i:02d}_{name}.txt", gm, f"after pass {i} of {len(named)}, {name}")
    if folder is not None:
        (folder / "changes.md").write_text(_table(), encoding="utf-8")
    return gm, counts


# ---------------------------------------------------------------------------------------------- the dump
def _dump_folder(ctx: RankContext) -> Path | None:
    """``DIR/passes/rank{r}``, emptied of an earlier run's files, when ``PRIMEPAR_DUMP_DIR`` is set."""
    root = os.environ.get(DUMP_ENV)
    if not root:
        return None
    folder = Path(root) / "passes" / f"rank{ctx.rank}"
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("[0-9][0-9]_*.txt"), folder / "changes.md"]:  # a skipped pass leaves no stale file
        old.unlink(missing_ok=True)
    return folder


def _write_graph(path: Path, gm: fx.GraphModule, what: str) -> None:
    path.write_text(f"# {what}\n" + gm.print_readable(print_output=False), encoding="utf-8")


def _write_failed(folder: Path, stem: str, gm: fx.GraphModule, what: str, table: str) -> None:
    """The graph as the failing pass left it (``NN_name.failed.txt``) and the table up to it; never raises, so the
    pass's own error is the one the caller sees."""
    try:
        text = str(gm.graph)  # print_readable needs a graph that recompiles, which this one may not be
        (folder / f"{stem}.failed.txt").write_text(f"# {what}; its graph then:\n{text}\n", encoding="utf-8")
        (folder / "changes.md").write_text(table, encoding="utf-8")
    except Exception:  # the dump is a help; the pass's own error is what matters
        log.exception("could not dump the graph of failed pass %s into %s", stem, folder)


def changes_table(
    counts: list[tuple[str, OpCounts]],
    rank: Any,
    named: Sequence[tuple[str, PassFn]] = (),
    skip: set[str] | None = None,
    failed: str | None = None,
) -> str:
    """``changes.md``: per op, its count in the input, the change each pass made to it, and its final count
    (markdown). Skipped passes and a failed one are named under the table."""
    ops = sorted({op for _, c in counts for op in c})
    first, *after = counts
    rows: list[list[Any]] = []
    for op in [*ops, None]:

        def count(c: OpCounts, op: str | None = op) -> int:
            return sum(c.values()) if op is None else c.get(op, 0)

        row: list[Any] = ["**total**" if op is None else op, count(first[1])]
        prev = count(first[1])
        for _, c in after:
            row.append(f"{count(c) - prev:+d}" if count(c) != prev else "")
            prev = count(c)
        rows.append([*row, prev])
    head = ["op", first[0], *(name for name, _ in after), "final"]
    table = tabulate(rows, head, tablefmt="github", disable_numparse=True)
    note = (
        f"Rank {rank}. ATen ops by overload, inserted modules by class. The `{first[0]}` and `final` columns are "
        "counts; each pass's column is the change it made. The graph after each pass is in `NN_name.txt`."
    )
    skipped = [name for name, _ in named if name in (skip or set())]
    if skipped:
        note += f"\n\nSkipped ({DISABLE_ENV}): {', '.join(skipped)}."
    if failed is not None:
        note += f"\n\nPass {failed} failed: its graph as it left it is in its `.failed.txt`; later passes did not run."
    return f"# Op count changes per pass\n\n{note}\n\n{table}\n"
