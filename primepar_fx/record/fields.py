"""Checks of a plan's JSON fields, each raising :class:`PlanError` with the path of the field at fault (the plan
format itself is :mod:`primepar_fx.record.plan`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

from primepar_fx.partition.seq import PartitionSeq


class PlanError(ValueError):
    """A ValueError whose message starts with the path of the offending field, e.g. ``plan.nodes[3].partition``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def fail(where: str, reason: str) -> NoReturn:
    raise PlanError(where, reason)


def set_attr(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def seconds(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        fail(where, f"must be a finite number of seconds, got {value!r}")
    if value < 0:
        fail(where, f"must be >= 0 seconds, got {value!r}")
    return float(value) + 0.0  # + 0.0 folds -0.0 into 0.0


def nbytes(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(where, f"must be an integer number of bytes, got {value!r}")
    if value < 0:
        fail(where, f"must be >= 0 bytes, got {value}")
    return value


def count(where: str, value: Any, unit: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(where, f"must be an integer ({unit}), got {value!r}")
    if value < 1:
        fail(where, f"must be >= 1 ({unit}), got {value}")
    return value


def text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(where, f"must be a non-empty string, got {value!r}")
    return value


def mapping(where: str, value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        fail(where, f"must be a JSON object ({what}), got {type(value).__name__}")
    return value


def json_plain(where: str, value: Any) -> Any:
    """A copy of ``value`` as plain JSON data (str keys; tuples become lists); raises on anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(where, f"must be finite to be written as JSON, got {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return [json_plain(f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                fail(where, f"keys must be strings, got {k!r}")
        return {k: json_plain(f"{where}[{k!r}]", v) for k, v in value.items()}
    fail(where, f"must be plain JSON data (null, bool, number, string, list, object), got {type(value).__name__}")


def fields(where: str, data: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check a parsed JSON object: every required field present, no unknown one."""
    if not isinstance(data, Mapping):
        fail(where, f"must be a JSON object, got {type(data).__name__}")
    allowed = required + optional
    for k in data:
        if k not in allowed:
            fail(f"{where}.{k}", f"unknown field; expected one of {list(allowed)}")
    for k in required:
        if k not in data:
            fail(f"{where}.{k}", "required field is missing")
    return dict(data)


@contextmanager
def rebase(where: str, label: str) -> Iterator[None]:
    """Re-root errors raised under ``label`` (an object's own name for itself) at ``where`` (its path here)."""
    try:
        yield
    except PlanError as e:
        if e.path == label or e.path.startswith((f"{label}.", f"{label}[")):
            raise PlanError(where + e.path[len(label) :], e.reason) from None
        raise PlanError(f"{where}.{e.path}", e.reason) from None


def partition(where: str, text: Any) -> str:
    """The canonical text of a partition sequence (``"B, P2x2"`` -> ``"B,P2x2"``)."""
    if not isinstance(text, str):
        fail(where, f"must be a partition string like 'B,P2x2,N', got {text!r}")
    try:
        return str(PartitionSeq.parse(text))
    except ValueError as e:
        fail(where, str(e))


def check_prime(where: str, text: str, world_size: int) -> None:
    prime = PartitionSeq.parse(text).prime
    if prime is not None and world_size % (prime.size * prime.size):
        s = prime.size
        fail(where, f"{prime} in {text!r} needs {s}*{s}={s * s} devices, which does not divide world_size {world_size}")


def json_hash(self: Any) -> int:
    return hash(json.dumps(self.to_dict(), sort_keys=True))


def ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.2f}x" if ours > 0 else ("1.00x" if theirs == 0 else "inf")
