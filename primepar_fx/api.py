"""Public entry points. This module only orchestrates the pipeline stages; it holds no logic of its own.

capture (torch.export) -> symbolic shapes -> op dimension rules -> partition space -> ...
"""

from __future__ import annotations

from typing import Any

import torch

from primepar_fx.capture import capture
from primepar_fx.graph import OpGraph, build_graph


def analyze(
    model: torch.nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    fallback: str | None = None,
    seq_max: int | None = None,
) -> OpGraph:
    """Capture ``model`` with symbolic batch ``B`` and sequence ``S`` and apply the op dimension rules.

    ``fallback="replicate"`` runs ops without a rule replicated instead of raising
    :class:`~primepar_fx.rules.registry.MissingRuleError`.
    """
    captured = capture(model, example_args, example_kwargs, name=name, seq_max=seq_max)
    return build_graph(captured, fallback=fallback)
