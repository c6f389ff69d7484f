"""Mixture-of-experts experts: ``primepar::moe_experts`` (:mod:`primepar_fx.frontend.moe`).

``hidden [T, H]``, ``top_k_index [T, k]``, ``top_k_weights [T, k]``, ``up [E, U, H]`` (``[E, H, U]`` transposed),
``down [E, H, I]`` (``[E, I, H]`` transposed), optional biases ``[E, U]`` and ``[E, H]`` -> ``[T, H]``, with
``U = 2 I`` (a gated expert's ``[gate; up]`` rows, mapped to ``(G, I)``, ``G = 2``; interleaved
``[gate0, up0, gate1, ...]`` rows, gpt-oss's, to ``(I, G)``) or ``U = I``.
Iteration dims ``T`` (tokens, named by size: ``BS``), ``k``, ``E``, ``G``, ``I``, ``H``:

* ``T`` and ``k`` split freely: each token, and each of its ``k`` choices, is computed on its own. ``k`` is
  summed into the output, so a split of it leaves partial sums.
* ``E`` (expert parallelism) and ``I`` (each expert's intermediate, as Megatron splits an MLP) are absent from
  the output and the activations: a device holding experts ``[lo, hi)`` computes the tokens routed to them on
  every token it holds and contributes zero for the rest (``expert_lo``, set by the localize pass), so the output
  is a partial sum over those digits and the input's gradient too. Tokens are not exchanged: where ``E`` is split,
  the tokens are held whole on that digit, as Megatron-core's ``allgather`` token dispatcher does.
* ``H`` is ``no_split``: it is both the up projection's contraction and the down projection's output, with the
  activation between them. ``G`` is ``no_split`` (a gate and its value stay on one device). With a down
  projection bias (gpt-oss), ``I`` is ``no_split`` too: the op adds the bias to its output, which a split of
  ``I`` leaves a partial sum of, so each device would add it once more.

FLOPs: ``2 T k H (U + I)``, the routed tokens only. A split of ``E`` divides them by its ways on the assumption
that the routing is balanced (each expert receives ``T k / E`` tokens); the capture's random routing is not used
to price a skew. Backward runs the experts' forward again (:mod:`primepar_fx.frontend.moe`): ``extra["recomputes"]``
tells the cost model, which prices Backward at twice the forward FLOPs and Gradient at once.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

import primepar_fx.frontend.moe  # noqa: F401  (registers the op)
from primepar_fx.rules.registry import DimNamer, RuleContext, RuleError, align_inputs, arg, register_rule, same_size
from primepar_fx.rules.spec import OpDims, TensorMap


def _tensor(node: fx.Node, name: str) -> fx.Node | None:
    x = arg(node, name)
    if x is not None and not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor {name}, got {x!r}")
    return x


@register_rule(torch.ops.primepar.moe_experts.default)
def moe_experts_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    names = ("hidden", "top_k_index", "top_k_weights", "up", "down", "up_bias", "down_bias")
    hidden, index, weights, up, down, up_bias, down_bias = (_tensor(node, n) for n in names)
    if hidden is None or index is None or weights is None or up is None or down is None:
        raise RuleError("moe_experts needs hidden, top_k_index, top_k_weights, up and down tensors")
    gated, transposed = bool(arg(node, "gated")), bool(arg(node, "transposed"))
    sh, si, sw, su, sd = (ctx.shape(x) for x in (hidden, index, weights, up, down))
    if len(sh) != 2 or len(si) != 2 or len(su) != 3 or len(sd) != 3:
        raise RuleError(f"unexpected moe_experts shapes: hidden {sh}, top_k_index {si}, up {su}, down {sd}")
    if tuple(si) != tuple(sw) or not same_size(si[0], sh[0]):
        raise RuleError(f"top_k_index {si} and top_k_weights {sw} must be [T, k] with T of hidden {sh}")
    nm = DimNamer()
    t = nm.new(sh[0], hint="T")
    h = nm.new(sh[1], role="H")
    k = nm.new(si[1], role="k")
    e = nm.new(su[0], role="E")
    u_size, i_size = (su[2], sd[1]) if transposed else (su[1], sd[2])
    h_up, h_down = (su[1], sd[2]) if transposed else (su[2], sd[1])
    if not (same_size(h_up, sh[1]) and same_size(h_down, sh[1]) and same_size(sd[0], su[0])):
        raise RuleError(f"experts up {su} and down {sd} do not fit hidden {sh} (transposed={transposed})")
    if not same_size(u_size, 2 * i_size if gated else i_size):
        raise RuleError(f"up {su} has {u_size} rows for an intermediate of {i_size} (gated={gated})")
    i = nm.new(i_size, role="I")
    g = nm.new(2, role="G") if gated else None
    u: tuple[str, ...] = (i,) if g is None else (i, g) if arg(node, "interleaved") else (g, i)
    up_map: TensorMap = ((e,), (h,), u) if transposed else ((e,), u, (h,))
    down_map: TensorMap = ((e,), (i,), (h,)) if transposed else ((e,), (h,), (i,))
    maps: dict[fx.Node, TensorMap | None] = {
        hidden: ((t,), (h,)),
        index: ((t,), (k,)),
        weights: ((t,), (k,)),
        up: up_map,
        down: down_map,
    }
    if up_bias is not None:
        maps[up_bias] = ((e,), u)
    if down_bias is not None:
        maps[down_bias] = ((e,), (h,))
    if len(set(maps)) != len(maps) or len(node.all_input_nodes) != len(maps):
        raise RuleError("moe_experts reads one tensor in two places")
    flops = sympy.expand(2 * sh[0] * si[1] * sh[1] * (u_size + i_size))
    # a down bias is added by every device that computes a partial sum over I: I stays whole where there is one
    no_split = frozenset({h} | ({g} if g is not None else set()) | ({i} if down_bias is not None else set()))
    inputs = align_inputs(node, maps)
    return nm.build("matmul", inputs, (((t,), (h,)),), no_split=no_split, flops=flops, extra={"recomputes": True})
