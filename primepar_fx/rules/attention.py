"""Fused attention: ``aten.scaled_dot_product_attention`` (and the CPU flash kernel it lowers to).

``q [*b, H, S, E]``, ``k [*b, Hk, T, E]``, ``v [*b, Hk, T, Ev]`` -> ``out [*b, H, S, Ev]``, with an optional
``attn_mask`` broadcastable to ``[*b, H, S, T]``. Iteration dims: ``B`` (the leading batch dims, by size),
``H``, ``S``, ``T``, ``E``, ``Ev``.

* ``T`` is ``no_split``: it is the softmax dim (and the contraction of P.V).
* ``E`` and ``Ev`` are ``no_split``: the head-embed dims (the paper, §3.2).
* ``S`` is ``no_split`` when ``is_causal=True``: the kernel aligns its implicit mask to the local block's
  top-left corner, so a split query block would see the wrong keys. An explicit mask splits along with ``S``.
* **Grouped-query attention** (``Hk < H``, each kv head serving ``G = H / Hk`` query heads, torch's
  ``enable_gqa`` / HF's ``repeat_kv`` order: query head ``h`` uses kv head ``h // G``): the query head dim maps to
  ``("Hk", "G")`` (major first) and the kv head dim to ``("Hk",)``. Both stay splittable: a split of ``Hk`` keeps
  each kv head with its query group; a split of ``G`` reads ``k``/``v`` whole (their gradient is summed over
  ``G``). ``Hk == 1`` (multi-query) simply broadcasts ``k``/``v`` over ``H``.

FLOPs: ``2 * b * H * S * T * (E + Ev)`` (Q.K^T plus P.V), as ``torch.utils.flop_counter`` counts them; with
``is_causal=True`` and ``S == T``, ``(S + 1) / (2 S)`` of that: query ``i`` sees keys ``0..i``, and flash kernels
skip the blocks above the diagonal (``flop_counter`` still counts them whole).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from primepar_fx.rules.registry import (
    DimNamer,
    RuleContext,
    RuleError,
    align_inputs,
    arg,
    broadcast_map,
    is_one,
    register_rule,
    same_size,
    tensor_arg,
)
from primepar_fx.rules.spec import OpDims, TensorMap

aten = torch.ops.aten


@register_rule([aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default])
def sdpa_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    q, k, v = (tensor_arg(node, n) for n in ("query", "key", "value"))
    sq, sk, sv = ctx.shape(q), ctx.shape(k), ctx.shape(v)
    if not len(sq) == len(sk) == len(sv) >= 3:
        raise RuleError(f"q, k, v need the same rank >= 3, got {sq}, {sk}, {sv}")
    nb = len(sq) - 3
    nm = DimNamer()

    def opt(size: sympy.Expr, **kw: object) -> tuple[str, ...]:
        return () if is_one(size) else (nm.new(size, **kw),)  # type: ignore[arg-type]

    bmap: TensorMap = tuple(opt(s, hint="B" if i == 0 else None, pos=i) for i, s in enumerate(sq[:nb]))
    heads, kv_heads = sq[-3], sk[-3]
    groups = sympy.Integer(1)
    if same_size(heads, kv_heads) or is_one(kv_heads):
        q_h = opt(heads, role="H")
        k_h = q_h if not is_one(kv_heads) else ()
    else:
        groups = sympy.cancel(heads / kv_heads)
        if not (groups.is_Integer and groups > 1):
            raise RuleError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
        k_h = (nm.new(kv_heads, role="Hk"),)
        q_h = k_h + (nm.new(groups, role="G"),)
    s = opt(sq[-2], hint="S")
    t = opt(sk[-2], hint="T")
    if q is k or q is v:
        raise RuleError("the query must be a tensor of its own")
    e = nm.new(sq[-1], role="E")
    ev = e if v is k else nm.new(sv[-1], role="Ev")  # k is v (so E == Ev): one dim, or v's map would clash
    if not same_size(sk[-1], sq[-1]) or not same_size(sv[-2], sk[-2]):
        raise RuleError(f"q {sq}, k {sk} and v {sv} do not fit together")
    kv_batch = broadcast_map(sk[:nb], bmap, sq[:nb])
    maps: dict[fx.Node, TensorMap | None] = {
        q: bmap + (q_h, s, (e,)),
        k: kv_batch + (k_h, t, (e,)),
        v: broadcast_map(sv[:nb], bmap, sq[:nb]) + (k_h, t, (ev,)),
    }
    mask = arg(node, "attn_mask")
    if isinstance(mask, fx.Node):
        scores = sq[:-1] + (sk[-2],)
        maps[mask] = broadcast_map(ctx.shape(mask), bmap + (q_h, s, t), scores)
    omap = bmap + (q_h, s, (ev,))
    outs = [omap]
    for shape in ctx.out_shapes[1:]:  # the flash kernel's logsumexp [*b, H, S]
        if len(shape) != nb + 2:
            raise RuleError(f"unexpected attention output of shape {shape}")
        outs.append(bmap + (q_h, s))
    causal = bool(arg(node, "is_causal", False))
    no_split = {*t, e, ev} | (set(s) if causal else set())
    flops = 2 * sympy.Mul(*sq[:-1]) * sk[-2] * (sq[-1] + sv[-1])
    if causal and sympy.simplify(sq[-2] - sk[-2]) == 0:  # query i sees keys 0..i: S(S+1)/2 of the S^2 scores
        flops = sympy.expand(flops * (sk[-2] + 1) / (2 * sk[-2]))
    extra = {"is_causal": causal, "gqa_groups": int(groups)}
    return nm.build("attention", align_inputs(node, maps), outs, no_split=frozenset(no_split), flops=flops, extra=extra)
