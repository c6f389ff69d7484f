"""A model named as the command line names it: a zoo name, ``hf:FAMILY``, a Hugging Face ``config.json`` or
``package.module:callable``, with example inputs (:func:`resolve_model`)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from primepar_fx.models.hf import build_hf_tiny, from_config, hf_example_inputs, is_config_file, load_model_spec
from primepar_fx.models.reference import Decoder
from primepar_fx.models.zoo import ZOO, build, example_inputs


def model_example_inputs(
    model: nn.Module, device: torch.device, batch: int = 2, seq: int = 16
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs of ``batch`` x ``seq`` tokens on ``device`` for a zoo :class:`Decoder` or a Hugging Face causal
    LM; ``ValueError`` for any other module."""
    if isinstance(model, Decoder):
        return example_inputs(model.config, batch, seq, device=device)
    if hasattr(getattr(model, "config", None), "vocab_size"):
        args, kwargs = hf_example_inputs(model, batch, seq)
        return args, {k: v.to(device) for k, v in kwargs.items()}
    raise ValueError(
        f"cannot make example inputs for {type(model).__name__}: have your callable return (model, args, kwargs)"
    )


def builds_examples(spec: str) -> bool:
    """Whether :func:`resolve_model` makes ``spec``'s example inputs itself (a zoo name, ``hf:FAMILY``, a config
    file) rather than a ``package.module:callable`` (which may return its own)."""
    return is_config_file(spec) or spec in ZOO or spec.startswith("hf:")


def resolve_model(
    spec: str, *, meta: bool = True, batch: int = 2, seq: int = 16, layers: int | None = None
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """Resolve a MODEL argument to ``(module, example_args, example_kwargs, name)``; example inputs of ``batch`` x
    ``seq`` tokens unless a ``package.module:callable`` returns its own. ``meta``: build zoo models and config files
    on the meta device. ``layers`` cuts a Hugging Face config file's model to its first layers.

    Raises ``ValueError`` with the reason (a bad spec, a config transformers rejects, ``transformers`` missing for a
    config file, ``layers`` given for anything but a config file)."""
    if layers is not None and not is_config_file(spec):
        raise ValueError("--layers applies to a Hugging Face config file (path/to/config.json)")
    if is_config_file(spec):
        path = spec[3:] if spec.startswith("hf:") else spec
        try:
            model = from_config(path, layers=layers, device="meta" if meta else "cpu")
        except ImportError as e:
            raise ValueError(str(e)) from None
        name = os.path.splitext(os.path.basename(path))[0]
        if name == "config":  # a checkpoint directory's config.json: name it by the directory
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or name
        if layers is not None:
            name = f"{name}-{layers}l"
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args, kwargs = model_example_inputs(model, device, batch, seq)
        return model, args, kwargs, name
    if spec in ZOO:
        model = build(spec, device="meta" if meta else None)
    elif spec.startswith("hf:"):
        model = build_hf_tiny(spec[3:])
    else:
        got = load_model_spec(spec)
        if isinstance(got, tuple):
            model, args, kwargs = got
            return model, tuple(args), dict(kwargs), spec
        model = got
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs = model_example_inputs(model, device, batch, seq)
    return model, args, kwargs, spec
