"""Model zoo: reference decoder LMs in plain torch, named presets, and tiny Hugging Face models.

>>> model = build("gpt2-tiny")
>>> args, kwargs = example_inputs(model.config, batch=2, seq=16)
>>> loss = model(*args, **kwargs)
"""

from __future__ import annotations

import torch

from primepar_fx.models.hf import HF_FAMILIES, build_hf_tiny, hf_example_inputs, load_model_spec
from primepar_fx.models.reference import Decoder, DecoderConfig
from primepar_fx.models.zoo import ZOO, get_config

__all__ = [
    "HF_FAMILIES",
    "ZOO",
    "Decoder",
    "DecoderConfig",
    "build",
    "build_hf_tiny",
    "dynamic_shapes",
    "example_inputs",
    "get_config",
    "hf_example_inputs",
    "load_model_spec",
]


def build(
    name_or_config: str | DecoderConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Decoder:
    """Build a :class:`Decoder` from a zoo name or a config.

    ``device="meta"`` gives a weightless model in well under a second even for
    llama2-70b / bloom-176b; any other device gets deterministic weights from ``seed``.
    """
    if isinstance(name_or_config, DecoderConfig):
        config = name_or_config
    elif isinstance(name_or_config, str):
        config = get_config(name_or_config)
    else:
        raise ValueError(f"build() expects a zoo name or a DecoderConfig, got {type(name_or_config).__name__}")
    return Decoder(config, device=device, dtype=dtype, seed=seed)


def example_inputs(
    config: DecoderConfig,
    batch: int,
    seq: int,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """``((input_ids,), {"labels": input_ids})`` of shape (batch, seq), drawn from a seeded generator."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if seq > config.max_seq:
        raise ValueError(f"seq={seq} exceeds {config.name!r}'s max_seq={config.max_seq}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    if device is not None:
        ids = ids.to(device)
    return (ids,), {"labels": ids}


def dynamic_shapes(max_seq: int, names: tuple[str, ...] = ("input_ids", "labels")) -> dict[str, dict[int, object]]:
    """``dynamic_shapes`` for ``torch.export.export``: dim 0 is ``Dim("batch")``, dim 1 ``Dim("seq", max=max_seq)``.

    Keyed by argument name, so it serves both ``Decoder`` (positional ``input_ids``)
    and Hugging Face models (keyword ``input_ids``/``labels``).
    """
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq", max=max_seq)
    return {name: {0: batch, 1: seq} for name in names}
