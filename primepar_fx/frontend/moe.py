"""Mixture-of-experts layers captured as one op: ``primepar::moe_experts``.

Hugging Face's MoE decoders (Mixtral, Qwen2-MoE, OLMoE and every other family whose experts class carries
``@use_experts_implementation``) route each token to ``k`` of ``E`` experts and run the experts with
data-dependent shapes: a histogram of the routing (``aten.histc``), a sort, a grouped matmul over ragged groups
(``transformers::grouped_mm_fallback``) and a scatter back. None of that has a fixed-size block per device, so
:func:`experts_as_one_op` hands the exporter one op instead, whose tensors all have fixed shapes::

    moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], up [E, U, H], down [E, H, I], ...) -> [T, H]
    out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden[t])

with ``U = 2 I`` (gate and up, concatenated) for a gated expert and ``U = I`` otherwise. Every token is
independent of the others, so ``T`` and ``k`` split freely; a split of the experts ``E`` (expert parallelism) or
of the intermediate ``I`` (tensor parallelism inside each expert) leaves each device a partial sum of the output,
which the plan's all-reduce or reduce-scatter completes: ``expert_lo`` is the first expert a device holds, and a
token routed elsewhere contributes zero there. Its rule is :mod:`primepar_fx.rules.moe`.

Backward recomputes the experts' forward for the routed tokens (nothing from inside the experts is kept), so the
op stashes only its inputs; the cost model prices that recomputation.

The ops around the experts (the router's linear, softmax, ``topk`` and normalisation) are ordinary ATen ops and
keep their own rules.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

#: activations an expert may use, by the name a Hugging Face config gives them (``hidden_act``)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


#: gates other than ``act(gate) * up``, by the name :func:`_experts` takes as its ``activation``, with their
#: parameters after colons: gpt-oss's clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with
#: ``g = clamp(gate, max=l)`` (``GptOssExperts._apply_gate``)
GATES: dict[str, Callable[..., Tensor]] = {
    "clamped_swiglu": lambda gate, value, alpha, limit: (
        (value.clamp(min=-limit, max=limit) + 1) * (g := gate.clamp(max=limit)) * torch.sigmoid(g * alpha)
    ),
}


def _gate(activation: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``gate, value -> h`` of a gated expert: ``act(gate) * value``, or one of :data:`GATES` (``name:p1:p2``)."""
    name, *params = activation.split(":")
    if name in GATES:
        fn, numbers = GATES[name], [float(p) for p in params]
        return lambda gate, value: fn(gate, value, *numbers)
    act = ACTIVATIONS[activation]
    return lambda gate, value: act(gate) * value


def _experts(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    up: Tensor,
    down: Tensor,
    up_bias: Tensor | None,
    down_bias: Tensor | None,
    activation: str,
    gated: bool,
    transposed: bool,
    expert_lo: int,
    interleaved: bool = False,
) -> Tensor:
    """The experts ``[expert_lo, expert_lo + E)`` on the tokens routed to them (differentiable, plain torch).
    ``interleaved``: a gated expert's up rows alternate gate and value (``[g0, v0, g1, v1, ...]``) instead of
    holding all gates first."""
    tokens, hid = hidden.shape
    k = top_k_index.shape[-1]
    act = _gate(activation) if gated else ACTIVATIONS[activation]
    flat = top_k_index.reshape(-1) - expert_lo  # (T k,): the local expert of each (token, choice) pair
    weights = top_k_weights.reshape(-1)
    picks = hidden.new_zeros(tokens * k, down.shape[-1] if transposed else down.shape[1])
    for e in range(up.shape[0]):
        rows = (flat == e).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        x = hidden.index_select(0, rows // k)
        h = x @ up[e] if transposed else x @ up[e].t()
        if up_bias is not None:
            h = h + up_bias[e]
        if gated:
            gate, value = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
            h = act(gate, value)
        else:
            h = act(h)
        y = h @ down[e] if transposed else h @ down[e].t()
        if down_bias is not None:
            y = y + down_bias[e]
        picks = picks.index_copy(0, rows, y * weights.index_select(0, rows).unsqueeze(-1).to(y.dtype))
    return picks.view(tokens, k, -1).sum(dim=1).to(hidden.dtype).reshape(tokens, hid)


#: the op (the schema is read off :func:`_experts`'s signature)
moe_experts = torch.library.custom_op("primepar::moe_experts", _experts, mutates_args=())


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias, *_) -> Tensor:  # noqa: ANN001
    return hidden.new_empty(hidden.shape)


_DIFFERENTIABLE = (0, 2, 3, 4, 5, 6)  # hidden, top_k_weights, up, down and the biases


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(*(t for t in inputs[:7] if t is not None))
    ctx.present = tuple(t is not None for t in inputs[:7])
    ctx.flags = inputs[7:]


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if here else None for here in ctx.present]
    leaves = [
        t.detach().requires_grad_(i in _DIFFERENTIABLE and ctx.needs_input_grad[i]) if t is not None else None
        for i, t in enumerate(tensors)
    ]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads: dict[int, Tensor | None] = {}
    if wanted:
        with torch.enable_grad():
            out = _experts(*leaves, *ctx.flags)
        if out.requires_grad:  # else no token reached an expert this device holds: every gradient is zero
            found = torch.autograd.grad(out, wanted, grad, allow_unused=True)
            grads = {id(t): g for t, g in zip(wanted, found)}
    result = []
    for t in leaves:  # an input that asked for a gradient gets one (zeros where no token reached it)
        wants = t is not None and t.requires_grad
        g = grads.get(id(t)) if wants else None
        result.append(torch.zeros_like(t) if wants and g is None else g)
    return (*result, *(None for _ in ctx.flags))


moe_experts.register_autograd(_backward, setup_context=_setup_context)

#: the op's overload, as graph nodes name it in ``node.target``
MOE_EXPERTS = moe_experts._opoverload


# ------------------------------------------------------------------------------------------------ capture
def _unsupported(module: nn.Module) -> str | None:
    """Why ``module`` (a Hugging Face experts module) cannot run as :func:`moe_experts`, or ``None``."""
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    name = _activation(module)
    if name is None:
        return "a gate other than act(gate) * up or gpt-oss's clamped SwiGLU"
    if name.split(":")[0] not in (*ACTIVATIONS, *GATES):
        return f"the activation {name!r}"
    if getattr(module, "_is_expert_parallel", False):
        return "transformers' own expert parallelism"
    return None


def _activation(module: nn.Module) -> str | None:
    """The ``activation`` :func:`_experts` runs ``module``'s experts with, or ``None`` where it has no such."""
    from transformers.integrations.moe import _default_apply_gate

    name = getattr(getattr(module, "config", None), "hidden_act", None)
    if name is None:  # a config without hidden_act (LFM2-MoE): the module's own act_fn
        name = _activation_name(getattr(module, "act_fn", None))
    gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if not module.has_gate or gate is _default_apply_gate:
        return str(name)
    if gate.__qualname__ == "GptOssExperts._apply_gate" and not module.is_concatenated:
        return f"clamped_swiglu:{float(module.alpha)!r}:{float(module.limit)!r}"
    return None


def _activation_name(fn: object) -> str | None:
    """The :data:`ACTIVATIONS` name of an activation function or module (``F.silu``, ``nn.SiLU()``, ...)."""
    for name, known in ACTIVATIONS.items():
        if fn is known:
            return name
    modules = {nn.SiLU: "silu", nn.ReLU: "relu"}
    if isinstance(fn, nn.GELU):
        return "gelu" if fn.approximate == "none" else "gelu_pytorch_tanh"
    return next((name for cls, name in modules.items() if type(fn) is cls), None)


def _one_op_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = down_bias = None
    if self.has_bias:
        up_bias = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        down_bias = self.down_proj_bias
    return torch.ops.primepar.moe_experts(
        hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), up, self.down_proj, up_bias, down_bias,
        _activation(self), bool(self.has_gate), bool(self.is_transposed), 0, not self.is_concatenated,
    )  # fmt: skip


def is_experts_module(module: nn.Module) -> bool:
    """A Hugging Face experts module (its class decorated with ``@use_experts_implementation``)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "down_proj"))


@contextlib.contextmanager
def experts_as_one_op(model: nn.Module) -> Iterator[list[str]]:
    """While inside, every Hugging Face experts module of ``model`` that :func:`moe_experts` can run forwards
    through it (an instance ``forward``, removed on exit). Yields the names of the modules it took; a module it
    cannot take is left as it is, with a warning saying why (its capture then stops at the first op without a
    rule, usually ``aten.histc``)."""
    taken: list[tuple[nn.Module, object]] = []
    names: list[str] = []
    try:
        for name, module in model.named_modules():
            if not is_experts_module(module):
                continue
            why = _unsupported(module)
            if why is not None:
                warnings.warn(
                    f"{name} ({type(module).__name__}) has {why}; it is captured as transformers runs it, which "
                    "has data-dependent shapes and no rule",
                    stacklevel=3,
                )
                continue
            taken.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(_one_op_forward, module)
            names.append(name)
        if names:
            log.info("%d experts modules captured as primepar::moe_experts", len(names))
        yield names
    finally:
        for module, before in taken:
            if before is None:
                del module.forward
            else:
                module.forward = before
