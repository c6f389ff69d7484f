"""Checked plain data for the cluster spec: field validation, the JSON view of a spec object, and TOML writing.

Every spec dataclass of :mod:`primepar_fx.cost.cluster` derives from :class:`SpecData` and checks its fields with
the helpers here, each of which names the field path in its ``ValueError``; :func:`toml_table` writes the plain
data as TOML (the standard library reads TOML but does not write it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any


def real(where: str, value: Any, unit: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number ({unit}), got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where} must be {'> 0' if positive else '>= 0'} ({unit}), got {value!r}")
    return float(value) + 0.0  # + 0.0 folds -0.0 into 0.0


def integer(where: str, value: Any, unit: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer ({unit}), got {value!r}")
    if value < 1:
        raise ValueError(f"{where} must be >= 1 ({unit}), got {value}")
    return value


def text(where: str, value: Any, *, nonempty: bool = True) -> str:
    if not isinstance(value, str) or (nonempty and not value.strip()):
        raise ValueError(f"{where} must be a {'non-empty ' if nonempty else ''}string, got {value!r}")
    return value


def set_field(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def plain(obj: Any, top: bool = True) -> Any:
    """Dataclasses, tuples and dicts as plain JSON data (field order kept, private ``_`` fields left out); a nested
    spec object by its own ``to_dict`` (which may leave out fields at their default)."""
    if not top and isinstance(obj, SpecData):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name), False) for f in dataclasses.fields(obj) if f.name[0] != "_"}
    if isinstance(obj, (tuple, list)):
        return [plain(v, False) for v in obj]
    if isinstance(obj, dict):
        return {k: plain(v, False) for k, v in obj.items()}
    return obj


def check_keys(where: str, mapping: Any, allowed: tuple[str, ...], required: tuple[str, ...], what: str) -> None:
    """Check the keys of a mapping field: all in ``allowed``, none of ``required`` missing."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{where} must map {what} {list(allowed)}, got {type(mapping).__name__}")
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise ValueError(f"{where} has unknown {what} {unknown}; use {list(allowed)}")
    missing = [k for k in required if k not in mapping]
    if missing:
        raise ValueError(f"{where} is missing {what} {missing}")


def fields(where: str, data: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check a parsed JSON/TOML object: a mapping with every required field and no unknown one."""
    check_keys(where, data, required + optional, required, "field(s)")
    return dict(data)


def data_hash(self: Any) -> int:
    """The hash of a spec with dict fields: a digest of its canonical JSON, computed once and kept in its ``_hash``
    field (pricing looks specs up in its memos tens of thousands of times). A digest rather than ``hash(str)``, so
    that a copy pickled into another process, with another ``PYTHONHASHSEED``, carries a valid one."""
    if self._hash is None:
        canonical = json.dumps(self.to_dict(), sort_keys=True).encode()
        digest = hashlib.blake2b(canonical, digest_size=8).digest()
        set_field(self, "_hash", int.from_bytes(digest, "little", signed=True))
    return self._hash


class SpecData:
    """Shared by the spec dataclasses: their plain-data view for JSON and TOML."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return plain(self)


def within(where: str, fn: Any, *args: Any) -> Any:
    """Call ``fn`` and prefix any ValueError with the path of the object being built."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_str(key)


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest round-trip form; finite by validation
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):  # an inline array (of scalars or arrays)
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {type(v).__name__} to TOML")


def toml_table(lines: list[str], path: list[str], table: Mapping[str, Any]) -> list[str]:
    """Append ``table`` as TOML (scalars, then sub-tables, then arrays of tables) to ``lines``; return them."""

    def tables(v: Any) -> bool:  # an array of tables, not an inline array
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines.extend(
        f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not (isinstance(v, dict) or tables(v))
    )
    for k, v in table.items():
        sub = ".".join(_toml_key(p) for p in [*path, k])
        if isinstance(v, dict):
            lines += ["", f"[{sub}]"]
            toml_table(lines, [*path, k], v)
        elif tables(v):
            for item in v:
                lines += ["", f"[[{sub}]]"]
                toml_table(lines, [*path, k], item)
    return lines
