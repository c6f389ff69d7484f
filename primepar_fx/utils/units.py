"""Byte sizes as people write them (``"30GiB"``, ``"512MB"``, ``1e9``), and memory budgets checked once for every
entry point (the CLI, :func:`primepar_fx.plan`, :func:`primepar_fx.compile`, the ``torch.compile`` backend)."""

from __future__ import annotations

import math
import re

#: units of :func:`parse_bytes`, lower case: decimal (``KB`` = 1000) and binary (``KiB`` = 1024)
UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"30GiB"``, ``"512MB"``, ``"1e9"`` -> bytes; ``ValueError`` naming the text otherwise."""
    bad = ValueError(f"not a byte size: {text!r} (examples: 30GiB, 512MB, 1e9)")
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise bad
    try:
        value = float(m.group(1)) * UNITS[m.group(2).lower()]
    except ValueError:
        raise bad from None
    if not math.isfinite(value):
        raise bad
    return int(value)


def memory_budget_bytes(budget: object) -> int | float | None:
    """A memory budget as bytes per device: ``None`` (no budget), a number of bytes >= 0, or a string for
    :func:`parse_bytes`; ``ValueError`` naming the budget otherwise."""
    if budget is None:
        return None
    if isinstance(budget, str):
        return parse_bytes(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        raise ValueError(
            f"memory_budget must be a number of bytes per device >= 0 or a size such as '30GiB', got {budget!r}"
        )
    return budget


def format_bytes(nbytes: float) -> str:
    """``"28.8 GiB"``, ``"1.74 MiB"``, ``"512 B"``: binary units, three significant digits."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"
