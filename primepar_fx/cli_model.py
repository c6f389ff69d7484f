"""The command line's MODEL argument: a zoo name, ``hf:FAMILY``, a Hugging Face ``config.json`` or
``package.module:callable``, resolved to a module on the meta device and example inputs (:func:`load_model`), and
captured (:func:`analyze_model`). Errors it finds itself are :class:`CliError`: ``error: ...``, exit status 2."""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from typing import Any

import torch

log = logging.getLogger("primepar_fx")


class CliError(Exception):
    """A bad argument or input the command line found itself: ``error: ...`` on stderr, exit status 2."""


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


def check_seq(model: torch.nn.Module, seq: int | None, name: str) -> None:
    from primepar_fx.frontend.capture import config_seq_max

    limit = config_seq_max(model)
    if seq is not None and limit is not None and seq > limit:
        raise CliError(f"--seq {seq} exceeds the maximum sequence length of {name} ({limit})")


def analyze_model(
    model: torch.nn.Module, ex_args: tuple[Any, ...], ex_kwargs: dict[str, Any], name: str, args: argparse.Namespace
) -> Any:
    """The model's graph (two layers replicated unless ``--full-capture``). A model whose sequence length cannot
    stay symbolic is captured at the example's; where ``--seq`` differs, it is captured again at ``--seq`` from
    inputs of that length (the model is on the meta device: nothing is allocated), and only that capture's warning
    is shown. Models that bring their own example inputs (``package.module:callable``) keep the first capture."""
    from primepar_fx.api import analyze
    from primepar_fx.frontend.specialize import StaticSeqWarning

    def capture(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        return analyze(model, a, k, name=name, fallback=args.fallback, replicate_layers=not args.full_capture)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        graph = capture(ex_args, ex_kwargs)
    seq, captured = getattr(args, "seq", None), graph.captured
    again = seq is not None and captured.static_seq and captured.example_seq != seq
    if again:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            ex_args, ex_kwargs = _example_inputs(model, device, captured.example_batch, seq)
        except CliError:  # its own examples: the planner says to capture it at --seq
            again = False
    for w in said:
        if not (again and issubclass(w.category, StaticSeqWarning)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if again:
        log.info("%s: captured again at --seq %d, since its sequence length cannot stay symbolic", name, seq)
        graph = capture(ex_args, ex_kwargs)
    return graph
