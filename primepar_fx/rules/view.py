"""Views, permutes and the structural ops that cut or join tensors along a dim.

* **Reshapes** (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze`` ...):
  :func:`group_dims` pairs groups of input dims with groups of output dims whose symbolic sizes multiply to the
  same value. A merge ``(B, S) -> B*S`` maps the output dim to ``("B", "S")``; a split ``64 -> (4, 16)`` maps the
  input dim to ``("d2", "d3")``. A group that is both (``(6, 4) -> (4, 6)``) becomes unsplittable: every tensor
  dim in it gets its own ``no_split`` dim. Size-1 dims map to ``()``. The output shape is always read from
  ``ctx.out_shapes`` (so ``-1`` entries need no resolving).
* **expand**: broadcast input dims map to ``()``.  **permute / transpose / t**: the input's dims, permuted.
* **Cut / join** (``slice``, ``select``, ``narrow``, ``split``, ``chunk``, ``unbind``, ``cat``, ``stack``, ``pad``):
  the dim operated on is ``no_split`` and each tensor gets its own iteration dim there when the sizes differ;
  the other dims map 1:1. A slice or split that keeps the whole dim is an identity view, splittable everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sympy
import torch
from torch import fx

from primepar_fx.frontend.symbols import Shape
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
)
from primepar_fx.rules.spec import OpDims, TensorMap

aten = torch.ops.aten

Group = tuple[tuple[int, ...], tuple[int, ...]]


def norm_dim(dim: object, rank: int) -> int:
    if not isinstance(dim, int):
        raise RuleError(f"expected an int dim, got {dim!r}")
    if not -max(rank, 1) <= dim < max(rank, 1):
        raise RuleError(f"dim {dim} out of range for rank {rank}")
    return dim % max(rank, 1)


def dims_arg(dims: object, rank: int) -> list[int]:
    """An ``int`` / ``int[]`` / ``None`` dim argument as normalised dims (``None`` or ``[]``: all dims)."""
    if dims is None:
        return list(range(rank))
    if isinstance(dims, int):
        return [norm_dim(dims, rank)]
    dims = list(dims)  # type: ignore[call-overload]
    return [norm_dim(d, rank) for d in dims] if dims else list(range(rank))


# ------------------------------------------------------------------------------------------------ reshapes
def group_dims(src: Shape, dst: Shape) -> list[Group]:
    """Pair groups of ``src`` dims with groups of ``dst`` dims of equal size product (size-1 dims left out).

    Walks both shapes left to right, growing whichever side's product is the smaller divisor of the other;
    a group whose products never meet (a non-view, or sizes sympy cannot compare) absorbs the rest.
    """
    si = [i for i, s in enumerate(src) if not is_one(s)]
    di = [j for j, s in enumerate(dst) if not is_one(s)]
    groups: list[Group] = []
    a = b = 0
    while a < len(si) and b < len(di):
        ins, outs = [si[a]], [di[b]]
        pin, pout = sympy.sympify(src[si[a]]), sympy.sympify(dst[di[b]])
        a, b = a + 1, b + 1
        while not same_size(pin, pout):
            _, den = sympy.fraction(sympy.cancel(pout / pin))
            if is_one(den) and a < len(si):  # the output group is a multiple of the input group: grow the input
                pin, a = pin * src[si[a]], a + 1
                ins.append(si[a - 1])
            elif b < len(di):
                pout, b = pout * dst[di[b]], b + 1
                outs.append(di[b - 1])
            elif a < len(si):
                pin, a = pin * src[si[a]], a + 1
                ins.append(si[a - 1])
            else:
                break
        groups.append((tuple(ins), tuple(outs)))
    if a < len(si) or b < len(di):
        last_in, last_out = groups.pop() if groups else ((), ())
        groups.append((last_in + tuple(si[a:]), last_out + tuple(di[b:])))
    return groups


def reshape_maps(nm: DimNamer, src: Shape, dst: Shape) -> tuple[TensorMap, TensorMap, set[str]]:
    """Input map, output map and ``no_split`` dims of a reshape from ``src`` to ``dst``."""
    imap: list[tuple[str, ...]] = [()] * len(src)
    omap: list[tuple[str, ...]] = [()] * len(dst)
    no_split: set[str] = set()
    for ins, outs in group_dims(src, dst):
        exact = same_size(sympy.Mul(*(src[i] for i in ins)), sympy.Mul(*(dst[j] for j in outs)))
        if exact and len(ins) == 1:  # 1:1 or a split of one input dim
            names = tuple(nm.new(dst[j], pos=j) for j in outs)
            for j, d in zip(outs, names, strict=True):
                omap[j] = (d,)
            imap[ins[0]] = names
        elif exact and len(outs) == 1:  # a merge of input dims
            names = tuple(nm.new(src[i], pos=i) for i in ins)
            for i, d in zip(ins, names, strict=True):
                imap[i] = (d,)
            omap[outs[0]] = names
        else:  # many-to-many: nothing lines up, nothing may be split
            for i in ins:
                imap[i] = (nm.new(src[i], pos=i),)
                no_split.add(imap[i][0])
            for j in outs:
                omap[j] = (nm.new(dst[j], pos=j),)
                no_split.add(omap[j][0])
    return tuple(imap), tuple(omap), no_split


def _data(node: fx.Node) -> fx.Node:
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node):
        raise RuleError(f"expected a tensor first argument, got {x!r}")
    return x


def _out(ctx: RuleContext) -> Shape:
    if len(ctx.out_shapes) != 1:
        raise RuleError(f"expected one tensor output, got {len(ctx.out_shapes)}")
    return ctx.out_shapes[0]


_RESHAPES = [
    aten.view.default,
    aten.view_copy.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten._reshape_alias.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
    aten.unsqueeze.default,
    aten.unsqueeze_copy.default,
    aten.view_as.default,
    aten.reshape_as.default,
]


@register_rule(_RESHAPES)
def reshape_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _data(node)
    nm = DimNamer()
    imap, omap, no_split = reshape_maps(nm, ctx.shape(x), _out(ctx))
    return nm.build("view", align_inputs(node, {x: imap}), (omap,), no_split=frozenset(no_split))


@register_rule([aten.expand.default, aten.expand_copy.default, aten.expand_as.default])
def expand_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _data(node)
    dst = _out(ctx)
    nm = DimNamer()
    omap = nm.map(dst)
    return nm.build("view", align_inputs(node, {x: broadcast_map(ctx.shape(x), omap, dst)}), (omap,))


# ------------------------------------------------------------------------------------------------ permutes
def _permutation(node: fx.Node, rank: int) -> list[int]:
    target = node.target
    if target in (aten.permute.default, aten.permute_copy.default):
        perm = [norm_dim(d, rank) for d in arg(node, "dims")]  # type: ignore[union-attr]
    elif target in (aten.t.default, aten.t_copy.default, aten.numpy_T.default):
        perm = list(reversed(range(rank)))
    elif target == aten.movedim.int or target == aten.movedim.intlist:
        src = dims_arg(arg(node, "source"), rank)
        dst = dims_arg(arg(node, "destination"), rank)
        rest = [d for d in range(rank) if d not in src]
        perm = [-1] * rank
        for s, d in zip(src, dst, strict=True):
            perm[d] = s
        it = iter(rest)
        perm = [p if p >= 0 else next(it) for p in perm]
    else:  # transpose / swapaxes
        names = ("dim0", "dim1") if target in (aten.transpose.int, aten.transpose_copy.int) else ("axis0", "axis1")
        d0, d1 = (norm_dim(arg(node, n), rank) for n in names)
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    if sorted(perm) != list(range(rank)):
        raise RuleError(f"not a permutation of {rank} dims: {perm}")
    return perm


@register_rule(
    [
        aten.permute.default,
        aten.permute_copy.default,
        aten.transpose.int,
        aten.transpose_copy.int,
        aten.swapaxes.default,
        aten.t.default,
        aten.t_copy.default,
        aten.numpy_T.default,
        aten.movedim.int,
        aten.movedim.intlist,
    ]
)
def permute_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _data(node)
    src = ctx.shape(x)
    nm = DimNamer()
    imap = nm.map(src)
    omap = tuple(imap[p] for p in _permutation(node, len(src)))
    return nm.build("view", align_inputs(node, {x: imap}), (omap,))


# ------------------------------------------------------------------------------------------ cut and join
class Aligned:
    """Maps same-rank tensors onto the dims of a reference shape, except along the dims ``along_dims``.

    Along one of those dims the reference's dim and every other tensor's dim are ``no_split``; with ``share`` a
    tensor of the same size there reuses the reference's dim (``cumsum``, ``softmax``), otherwise it gets its own
    (``cat``, ``split``). A size-1 dim maps to ``()``; a size that differs from the reference's off ``along_dims``
    gets its own ``no_split`` dim too.
    """

    def __init__(self, nm: DimNamer, ref: Shape, along_dims: Iterable[int], *, share: bool = False) -> None:
        self.nm, self.ref, self.along_dims, self.share = nm, ref, set(along_dims), share
        self.no_split: set[str] = set()
        self.base: list[str | None] = []
        for i, size in enumerate(ref):
            name = None if is_one(size) else nm.new(size, pos=i)
            if name is not None and i in self.along_dims:
                self.no_split.add(name)
            self.base.append(name)
        self.ref_map: TensorMap = tuple(() if d is None else (d,) for d in self.base)

    def fit(self, shape: Shape) -> TensorMap:
        if len(shape) != len(self.ref):
            raise RuleError(f"shape {shape} does not have the rank of {self.ref}")
        out: list[tuple[str, ...]] = []
        for i, size in enumerate(shape):
            base = self.base[i]
            if is_one(size):
                out.append(())
            elif base is not None and same_size(size, self.ref[i]) and (i not in self.along_dims or self.share):
                out.append((base,))
            else:
                name = self.nm.new(size, pos=i)
                self.no_split.add(name)
                out.append((name,))
        return tuple(out)


def along_dims_rule(
    node: fx.Node,
    ctx: RuleContext,
    data: Sequence[fx.Node],
    along_dims: Iterable[int],
    *,
    kind: str = "view",
    share: bool = False,
    **kw: object,
) -> OpDims:
    """A same-rank op over ``data`` (the first is the reference) that works along ``along_dims`` (:class:`Aligned`)."""
    nm = DimNamer()
    al = Aligned(nm, ctx.shape(data[0]), along_dims, share=share)
    maps: dict[fx.Node, TensorMap | None] = {n: al.fit(ctx.shape(n)) for n in data[1:]}
    maps[data[0]] = al.ref_map
    outs = tuple(al.fit(s) for s in ctx.out_shapes)
    return nm.build(kind, align_inputs(node, maps), outs, no_split=frozenset(al.no_split), **kw)


def _keeps_whole(ctx: RuleContext, x: fx.Node, dim: int) -> bool:
    size = ctx.shape(x)[dim]
    return all(len(s) == len(ctx.shape(x)) and same_size(s[dim], size) for s in ctx.out_shapes)


@register_rule(
    [
        aten.slice.Tensor,
        aten.slice_copy.Tensor,
        aten.narrow.default,
        aten.narrow_copy.default,
        aten.split.Tensor,
        aten.split_copy.Tensor,
        aten.split_with_sizes.default,
        aten.split_with_sizes_copy.default,
        aten.chunk.default,
        aten.tensor_split.sections,
        aten.tensor_split.indices,
    ]
)
def cut_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    x = _data(node)
    dim = norm_dim(arg(node, "dim", 0), len(ctx.shape(x)))
    along_dims = () if _keeps_whole(ctx, x, dim) else (dim,)
    return along_dims_rule(node, ctx, [x], along_dims)


@register_rule([aten.select.int, aten.select_copy.int, aten.unbind.int, aten.unbind_copy.int])
def select_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``select`` / ``unbind`` drop ``dim``: the input's dim there is ``no_split`` and absent from the outputs."""
    x = _data(node)
    src = ctx.shape(x)
    dim = norm_dim(arg(node, "dim", 0), len(src))
    nm = DimNamer()
    al = Aligned(nm, src, [dim])
    omap = al.ref_map[:dim] + al.ref_map[dim + 1 :]
    kept = src[:dim] + src[dim + 1 :]
    outs = []
    for shape in ctx.out_shapes:
        if len(shape) != len(kept) or not all(same_size(a, b) for a, b in zip(shape, kept, strict=True)):
            raise RuleError(f"output {shape} is not the input {src} without dim {dim}")
        outs.append(omap)
    return nm.build("view", align_inputs(node, {x: al.ref_map}), outs, no_split=frozenset(al.no_split))


def _tensor_list(node: fx.Node) -> list[fx.Node]:
    tensors = node.args[0]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, fx.Node) for t in tensors):
        raise RuleError(f"expected a list of tensors, got {tensors!r}")
    return list(dict.fromkeys(tensors))  # type: ignore[arg-type]


@register_rule([aten.cat.default, aten.concat.default, aten.concatenate.default])
def cat_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``cat``: the joined dim is ``no_split`` (a repeated input appears once in ``all_input_nodes``)."""
    out = _out(ctx)
    dim = norm_dim(arg(node, "dim", 0), len(out))
    nm = DimNamer()
    al = Aligned(nm, out, [dim] if len(node.args[0]) > 1 else [])  # type: ignore[arg-type]
    maps: dict[fx.Node, TensorMap | None] = {t: al.fit(ctx.shape(t)) for t in _tensor_list(node)}
    return nm.build("view", align_inputs(node, maps), (al.ref_map,), no_split=frozenset(al.no_split))


@register_rule([aten.stack.default])
def stack_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``stack``: the new dim (one entry per input) is ``no_split`` and absent from the inputs."""
    out = _out(ctx)
    dim = norm_dim(arg(node, "dim", 0), len(out))
    nm = DimNamer()
    al = Aligned(nm, out[:dim] + out[dim + 1 :], [])
    new = () if is_one(out[dim]) else (nm.new(out[dim], pos=dim),)
    omap = al.ref_map[:dim] + (new,) + al.ref_map[dim:]
    maps: dict[fx.Node, TensorMap | None] = {t: al.fit(ctx.shape(t)) for t in _tensor_list(node)}
    return nm.build("view", align_inputs(node, maps), (omap,), no_split=frozenset(al.no_split) | frozenset(new))


@register_rule([aten.pad.default, aten.constant_pad_nd.default])
def pad_rule(node: fx.Node, ctx: RuleContext) -> OpDims:
    """``pad``: ``pad`` lists (before, after) pairs from the last dim backwards; padded dims are ``no_split``."""
    x = _data(node)
    rank = len(ctx.shape(x))
    pad = list(arg(node, "pad"))  # type: ignore[call-overload]
    padded = [rank - 1 - k for k in range(len(pad) // 2) if not (pad[2 * k] == 0 and pad[2 * k + 1] == 0)]
    return along_dims_rule(node, ctx, [x], padded)
