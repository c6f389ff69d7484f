"""Model zoo: reference decoder LMs in plain torch, named presets, and tiny Hugging Face models.

>>> model = build("gpt2-tiny")
>>> args, kwargs = example_inputs(model.config, batch=2, seq=16)
>>> loss = model(*args, **kwargs)
"""

from __future__ import annotations

from primepar_fx.models.hf import (
    HF_FAMILIES,
    build_hf_tiny,
    from_config,
    hf_example_inputs,
    hf_families,
    is_config_file,
    load_model_spec,
)
from primepar_fx.models.reference import Decoder, DecoderConfig
from primepar_fx.models.resolve import builds_examples, model_example_inputs, resolve_model
from primepar_fx.models.zoo import ZOO, build, dynamic_shapes, example_inputs, get_config

__all__ = [
    "HF_FAMILIES",
    "ZOO",
    "Decoder",
    "DecoderConfig",
    "build",
    "build_hf_tiny",
    "builds_examples",
    "dynamic_shapes",
    "example_inputs",
    "from_config",
    "get_config",
    "hf_example_inputs",
    "hf_families",
    "is_config_file",
    "load_model_spec",
    "model_example_inputs",
    "resolve_model",
]
