"""argparse value types of the command lines (``primepar-fx``, ``examples/train.py``): each raises
``argparse.ArgumentTypeError`` saying what it expected."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def digit_list(text: str) -> tuple[int, ...]:
    """An argparse type: device-ID digit radices such as ``3,2,2`` (each >= 2)."""
    try:
        digits = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected radices separated by commas, such as 3,2,2; got {text!r}") from None
    if any(d < 2 for d in digits):
        raise argparse.ArgumentTypeError(f"every radix must be >= 2, got {text!r}")
    return digits


def table_format(text: str) -> str:
    """An argparse type: one of tabulate's table formats."""
    from tabulate import tabulate_formats

    if text not in tabulate_formats:
        raise argparse.ArgumentTypeError(f"unknown table format {text!r}; choose one of {', '.join(tabulate_formats)}")
    return text


def parse_bytes(text: str) -> int:
    """An argparse type: ``"30GiB"``, ``"512MB"``, ``"1e9"`` -> bytes (:func:`primepar_fx.utils.units.parse_bytes`)."""
    from primepar_fx.utils.units import parse_bytes as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_budget(text: str) -> int | str:
    """An argparse type: :func:`parse_bytes`, or ``"none"`` (no budget) and ``"device"`` (the default) as such."""
    if text.strip().lower() in ("none", "device"):
        return text.strip().lower()
    return parse_bytes(text)
