"""Micro-batches (gradient accumulation) for a compiled module whose plan runs ``m`` of them a step.

A plan with ``plan.micro_batches = m`` is priced at the micro-batch ``B / m``: each device holds one micro-batch's
activations, runs the step's Forward and Backward ``m`` times, and sums parameter gradients over their replicas
once, after the last. The compiled module does it within one call, so a training loop does not change:

* every user input with a ``B`` dim is cut along it into ``m`` equal micro-batches (``B`` must divide);
* in a call that records gradients, the first ``m - 1`` micro-batches run Forward and then Backward of their loss
  divided by ``m`` at once, their gradients accumulated locally in ``.grad`` (the gradient buckets wait:
  :meth:`~primepar_fx.runtime.gradsync.GradientBuckets.accumulating`); the last runs Forward only, and the call
  returns its outputs with the loss replaced by the mean of the ``m`` losses, whose Backward (the caller's
  ``loss.backward()``) adds the last micro-batch's part and sums the accumulated gradients over the replicas;
* without gradients (``torch.no_grad``) the micro-batches only run Forward, and the loss is their mean too.

The loss is a 0-dim floating output (the model's ``loss``); a mean over the micro-batches' losses is the mean
over the batch when each micro-batch averages as many terms (a token-mean loss with the same number of counted
tokens in each). Other outputs are the last micro-batch's: holding every micro-batch's logits would keep what
micro-batches are there to free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from primepar_fx.compiler.inputs import InputSpec
from primepar_fx.frontend.symbols import B


def split_inputs(specs: Sequence[InputSpec], flat: Sequence[Any], m: int) -> list[list[Any]]:
    """``m`` lists of the flat user inputs, each tensor with a ``B`` dim cut to its micro-batch there."""
    chunks: list[list[Any]] = [[] for _ in range(m)]
    for i, x in enumerate(flat):
        spec = specs[i] if i < len(specs) else None
        dims = [d for d, e in enumerate(spec.shape or ()) if sympy.sympify(e) == B] if spec is not None else []
        if not dims or not isinstance(x, torch.Tensor):
            for c in chunks:
                c.append(x)
            continue
        d = dims[0]
        if x.shape[d] % m:
            raise ValueError(
                f"input {spec.name!r} has a batch of {x.shape[d]}, which the plan's {m} micro-batches do not divide"  # type: ignore[union-attr]
            )
        for c, part in zip(chunks, x.chunk(m, dim=d)):
            c.append(part)
    return chunks


def _loss_leaves(leaves: Sequence[Any]) -> list[int]:
    return [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()]


def run_micro_batches(
    run: Callable[[list[Any]], list[Any]],
    chunks: list[list[Any]],
    accumulating: Callable[[], Any],
) -> list[Any]:
    """Run every micro-batch of ``chunks`` (module docstring); ``run`` maps flat inputs to flat outputs and
    ``accumulating()`` is the context in which Backward keeps gradients local. Returns the flat outputs."""
    m = len(chunks)
    training = torch.is_grad_enabled()
    earlier: list[torch.Tensor] = []
    for chunk in chunks[:-1]:
        leaves = run(chunk)
        losses = _loss_leaves(leaves)
        if len(losses) != 1:
            raise RuntimeError(
                f"the plan runs {m} micro-batches, which needs the model to return one loss (a 0-dim floating "
                f"tensor, such as a Hugging Face model's loss when given labels); its outputs hold {len(losses)}"
            )
        loss = leaves[losses[0]]
        if training and loss.requires_grad:
            with accumulating():
                (loss / m).backward()
        earlier.append(loss.detach())
    leaves = list(run(chunks[-1]))
    (k,) = _loss_leaves(leaves)
    leaves[k] = (leaves[k] + sum(earlier)) / m
    return leaves
