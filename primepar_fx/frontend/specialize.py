"""Why the batch or sequence length could not stay symbolic, and what capture says about it.

:func:`record_shape_events` records, while ``torch.export`` traces, the symbols the ShapeEnv creates and the
guards and replacements it adds, each with the model source line it came from (:func:`_model_frame`: the innermost
frame outside torch, the standard library and primepar_fx). When export then fails with a constraint violation
(:func:`is_constraint_violation`), :func:`specialization_error` turns it into a :class:`ShapeSpecializationError`
that names the dim, the model line and export's findings and suggested fixes.

A sequence length that cannot stay symbolic is not fatal: :func:`~primepar_fx.frontend.capture.capture` captures
again at the example's length and :func:`warn_static_seq` says so (:class:`StaticSeqWarning`).
"""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import re
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from primepar_fx.utils.configs import unset_note

_SYMBOLIC_SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"
DIM_NAMES = ("batch", "seq")


class ShapeSpecializationError(ValueError):
    """The batch or sequence length could not stay symbolic: the model's code fixed or constrained it.

    Attributes:
        dims: the dims concerned (``"batch"``, ``"seq"``).
        location: the model source line responsible, when it is known.
    """

    def __init__(self, message: str, *, dims: tuple[str, ...] = (), location: str | None = None) -> None:
        super().__init__(message)
        self.dims = dims
        self.location = location


class StaticSeqWarning(UserWarning):
    """The model's code would not let the sequence length stay symbolic: it was captured at the example's."""


def why_specialised(model: nn.Module, e: ShapeSpecializationError) -> str:
    """The model line that constrained the sequence when it lies in the model's own source files, else what export
    found (a guard such as ``seq != 64``; export adds some guards after tracing, with no model line to show)."""
    files = set()
    for m in model.modules():
        try:
            files.add(inspect.getsourcefile(type(m)))
        except TypeError:  # a class defined in C or at the prompt
            pass
    if e.location and any(f and e.location.startswith(f + ":") for f in files):
        return f"{e.location} constrains it"
    found = [line.strip().removeprefix("export: ") for line in str(e).splitlines() if line.startswith("  export: ")]
    return f"export: {found[0]}" if found else "the model's code constrains it"


def warn_static_seq(model_name: str, seq: int, why: str) -> None:
    """Warn that ``model_name`` is captured at the example's sequence length ``seq``, and ``why``."""
    message = (
        f"{model_name}: the sequence length cannot stay symbolic ({why}); captured at the example's S={seq} "
        f"instead, so plans and the compiled module are for S={seq} only"
    )
    level, frame = 1, sys._getframe(0)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1  # shown at the caller's line, outside primepar_fx
    warnings.warn(message, StaticSeqWarning, stacklevel=level)


# ------------------------------------------------------------------------------------ specialisation errors
@dataclass(frozen=True, slots=True)
class ShapeEvent:
    """One ShapeEnv event logged while tracing: a new symbol, a guard or a replacement."""

    kind: str  # "symbol", "guard" or "replacement"
    text: str  # the symbol, the guard expression or "sym = target"
    value: str  # the example value of a new symbol or the replacement target ("" for a guard)
    location: str | None  # the innermost model frame (outside torch and the standard library)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # primepar_fx itself
_SKIP_PREFIXES = (os.path.dirname(torch.__file__) + os.sep, _PACKAGE)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE_PACKAGES = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))


def _model_frame() -> str | None:
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _in_model(filename):
            return _source_line(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def _in_model(filename: str) -> bool:
    """Whether ``filename`` is the model's code: not torch, the standard library, primepar_fx or generated code (an
    installed package such as transformers is a model's code, though its site-packages may lie in the stdlib's
    folder)."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith(_SKIP_PREFIXES):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_SITE_PACKAGES)


def _source_line(filename: str, lineno: int, function: str) -> str:
    code = linecache.getline(filename, lineno).strip()
    loc = f"{filename}:{lineno} in {function}"
    return f"{loc}: {code}" if code else loc


class CaptureError(ValueError):
    """``torch.export`` could not trace the model on its example inputs (the model's own code raised, or export does
    not support what it does). ``location``: the innermost model source line the error passed through, if any."""

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.location = location


def capture_error(model_name: str, exc: BaseException, config: Any = None) -> CaptureError:
    """``exc``, raised while exporting ``model_name``, as a :class:`CaptureError` that quotes it and names the
    innermost model line of its traceback (the model's forward failing on its example inputs: a config field left
    unset, an input it needs that the examples lack). Where the error is about ``None`` and the model's ``config``
    leaves fields unset (:func:`~primepar_fx.utils.configs.unset_note`), it names them."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _in_model(f.filename)]
    where = _source_line(frames[-1].filename, frames[-1].lineno or 0, frames[-1].name) if frames else None
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    message = f"capturing {model_name} failed: {type(exc).__name__}: {first}"
    if where:
        message += f" (model source: {where})"
    if "None" in first:
        message += unset_note(config, "the model's config")
    return CaptureError(message, location=where)


@contextmanager
def record_shape_events() -> Iterator[list[ShapeEvent]]:
    """Record ShapeEnv symbols, guards and replacements, with the model line each came from.

    Lowers the ShapeEnv logger to INFO for the duration and drops, through a filter, every record that the
    logger's previous level would have dropped, so nothing new reaches the user's handlers.
    """
    logger = logging.getLogger(_SYMBOLIC_SHAPES_LOGGER)
    old_level, threshold = logger.level, logger.getEffectiveLevel()
    events: list[ShapeEvent] = []

    def keep(record: logging.LogRecord) -> bool:
        try:
            event = _event_of(record)
        except Exception:  # a changed log format must never break capture
            event = None
        if event is not None:
            events.append(event)
        return record.levelno >= threshold

    logger.addFilter(keep)
    logger.setLevel(min(threshold, logging.INFO))
    try:
        yield events
    finally:
        logger.removeFilter(keep)
        logger.setLevel(old_level)


def _event_of(record: logging.LogRecord) -> ShapeEvent | None:
    msg, args = record.msg, record.args
    if not isinstance(msg, str) or not isinstance(args, tuple):
        return None
    if msg.startswith("create_symbol") and len(args) >= 2:
        return ShapeEvent("symbol", str(args[0]), str(args[1]), None)
    if msg.startswith("set_replacement") and len(args) >= 2:
        return ShapeEvent("replacement", str(args[0]), str(args[1]), _model_frame())
    if "[guard added]" in msg and len(args) >= 2 and "suppressed" not in str(args[0]):
        return ShapeEvent("guard", str(args[1]), "", _model_frame())
    return None


def is_constraint_violation(exc: BaseException) -> bool:
    error_type = getattr(exc, "error_type", None)
    if error_type is not None and getattr(error_type, "name", "") == "CONSTRAINT_VIOLATION":
        return True
    text = str(exc)
    return "Constraints violated" in text or "specialized" in text or "Suggested fixes" in text


def specialization_error(message: str, events: list[ShapeEvent], examples: dict[str, int]) -> ShapeSpecializationError:
    named = re.search(r"Constraints violated \(([^)]*)\)", message)
    dims = tuple(d.strip() for d in named.group(1).split(",")) if named else ()
    dims = tuple(d for d in dims if d in DIM_NAMES) or tuple(d for d in DIM_NAMES if d in message)
    pinned = re.search(r"specialized it to be a constant \((-?\d+)\)", message)
    findings = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
    fixes = _suggested_fixes(message)

    symbols = {e.text for e in events if e.kind == "symbol" and e.value in {str(examples[d]) for d in dims}}
    location = _culprit(events, symbols, pinned.group(1) if pinned else None)
    what = " and ".join(f"{d} (example size {examples[d]})" for d in dims) or "batch/seq"
    if pinned:
        head = f"torch.export specialised the {what} dim to the constant {pinned.group(1)}"
    else:
        head = f"torch.export could not keep the {what} dim fully dynamic: the model's code constrains it"
    parts = [f"{head}; primepar_fx needs the batch and sequence lengths symbolic."]
    if location:
        parts.append(f"  model source line: {location}")
    parts.extend(f"  export: {f}" for f in findings[:4])
    if fixes:
        parts.append(f"  export suggests: {'; '.join(fixes)}")
    parts.append(
        "Fix: compute sizes from the input (x.shape[0] / x.shape[1], or -1 in view/reshape) instead of hard-coding "
        "a batch or sequence length, and avoid Python branches on the sequence length (if x.shape[1] > ...). "
        "A model that really needs a sequence length of a special form (e.g. a multiple of 8) cannot be captured "
        "with a free S."
    )
    return ShapeSpecializationError("\n".join(parts), dims=dims, location=location)


def _suggested_fixes(message: str) -> list[str]:
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Suggested fixes"):
            fixes = []
            for follow in lines[i + 1 :]:
                if not follow.startswith(" ") or not follow.strip():
                    break
                fixes.append(follow.strip())
            return fixes
    return []


def _culprit(events: list[ShapeEvent], symbols: set[str], constant: str | None) -> str | None:
    """The model line of the event that pinned (or else first constrained) one of ``symbols``."""

    def mentions(text: str) -> bool:
        return any(re.search(rf"\b{re.escape(s)}\b", text) for s in symbols)

    ranked = [e for e in events if e.kind == "replacement" and e.text in symbols and e.value == constant]
    ranked += [e for e in events if e.kind == "guard" and mentions(e.text)]
    ranked += [e for e in events if e.kind == "replacement" and e.text in symbols]
    for event in ranked:
        if event.location:
            return event.location
    return None
