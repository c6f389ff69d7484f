"""What the ``primepar-fx`` command line reads from its arguments: argparse value types, and the MODEL argument
made into a module with example inputs (:func:`load_model`; the forms are in :mod:`primepar_fx.cli`)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch

MODEL_HELP = "zoo name, hf:FAMILY, a Hugging Face config.json, or package.module:callable"


class CliError(Exception):
    """A bad argument or input the command line found itself: ``error: ...`` on stderr, exit status 2."""


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


def _example_inputs(
    model: torch.nn.Module, device: torch.device, batch: int = 2, seq: int = 16
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from primepar_fx.models import Decoder, example_inputs, hf_example_inputs

    if isinstance(model, Decoder):
        return example_inputs(model.config, batch, seq, device=device)
    if hasattr(getattr(model, "config", None), "vocab_size"):
        args, kwargs = hf_example_inputs(model, batch, seq)
        return args, {k: v.to(device) for k, v in kwargs.items()}
    raise CliError(
        f"cannot make example inputs for {type(model).__name__}: have your callable return (model, args, kwargs)"
    )


def load_model(
    spec: str, *, meta: bool = True, batch: int = 2, seq: int = 16, layers: int | None = None
) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """Resolve a MODEL argument to ``(module, example_args, example_kwargs, name)``; example inputs of ``batch`` x
    ``seq`` tokens unless a ``package.module:callable`` returns its own. ``layers`` cuts a Hugging Face config
    file's model to its first layers."""
    from primepar_fx.models import ZOO, build, build_hf_tiny, from_config, is_config_file, load_model_spec

    if layers is not None and not is_config_file(spec):
        raise CliError("--layers applies to a Hugging Face config file (path/to/config.json)")
    if is_config_file(spec):
        path = spec[3:] if spec.startswith("hf:") else spec
        try:
            model = from_config(path, layers=layers, device="meta" if meta else "cpu")
        except (ValueError, ImportError) as e:
            raise CliError(str(e)) from None
        name = os.path.splitext(os.path.basename(path))[0]
        if name == "config":  # a checkpoint directory's config.json: name it by the directory
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or name
        if layers is not None:
            name = f"{name}-{layers}l"
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args, kwargs = _example_inputs(model, device, batch, seq)
        return model, args, kwargs, name
    elif spec in ZOO:
        model = build(spec, device="meta" if meta else None)
    elif spec.startswith("hf:"):
        try:
            model = build_hf_tiny(spec[3:])
        except ValueError as e:
            raise CliError(str(e)) from None
    else:
        try:
            got = load_model_spec(spec)
        except ValueError as e:
            raise CliError(str(e)) from None
        if isinstance(got, tuple):
            model, args, kwargs = got
            return model, tuple(args), dict(kwargs), spec
        model = got
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = _example_inputs(model, device, batch, seq)
    return model, args, kwargs, spec


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
