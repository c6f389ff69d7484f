"""What an op-dimension rule states about one graph node.

An operator is a loop nest over named *iteration dims* (for ``aten.linear``: ``B, S, N, K``; the paper
calls the sequence dim ``M``). Every tensor the node reads or writes is described by a :data:`TensorMap`:
for each tensor dim, the iteration dims it is made of, major first. A plain dim maps to one iteration
dim, a dim that a view merged maps to several (``(H, E)``), and a broadcast size-1 dim maps to none.

From that description alone the partition space (``primepar_fx.partition``) derives which slice of
every tensor a device holds, which dims are summed over (an iteration dim that is absent from a
result tensor) and therefore which collectives a split needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import sympy

from primepar_fx.frontend.symbols import Shape

#: For each tensor dim, the iteration dims it is made of (major first); ``()`` for a broadcast dim.
TensorMap = tuple[tuple[str, ...], ...]

#: Rule families, used for grouping in tables and for the per-family compute model.
KINDS = frozenset(
    {"matmul", "attention", "pointwise", "norm", "reduce", "view", "embedding", "loss", "factory", "meta"}
)


@dataclass(frozen=True, slots=True)
class OpDims:
    """The iteration space of one node and how its tensors map onto it.

    Attributes:
        kind: rule family (one of :data:`KINDS`).
        dims: iteration dim names, in a fixed order.
        sizes: the size of each iteration dim (sympy, in ``B`` and ``S``).
        inputs: one :data:`TensorMap` per entry of ``node.all_input_nodes`` (``None`` for a non-tensor input).
        outputs: one :data:`TensorMap` per tensor output (flattened).
        no_split: dims that may not be split (a softmax dim, the head-embed dim, a sliced dim).
        stats: dims that a split forces a statistics all-reduce over although they stay in the output
            (the normalised dim of a norm, the class dim of a cross-entropy).
        matmul: ``(M, N, K)`` roles when the node is a matrix product ``O[M,K] = I[M,N] . W[N,K]``
            (other iteration dims are batch-like); the P(S x S) primitive needs them.
        matmul_operands: indices into ``inputs`` of the ``I`` and ``W`` operands when ``matmul`` is set.
        flops: forward floating-point operations (matrix products only, 2 per multiply-add, the
            convention of ``torch.utils.flop_counter``; element-wise work is costed by bytes moved).
        weights: indices into ``inputs`` filled by the graph analysis with the inputs that are parameters.
        no_grad: indices into ``inputs`` that take no gradient (integer indices, masks), filled likewise.
    """

    kind: str
    dims: tuple[str, ...]
    sizes: tuple[sympy.Expr, ...]
    inputs: tuple[TensorMap | None, ...]
    outputs: tuple[TensorMap, ...]
    no_split: frozenset[str] = frozenset()
    stats: frozenset[str] = frozenset()
    matmul: tuple[str, str, str] | None = None
    matmul_operands: tuple[int, int] | None = None
    flops: sympy.Expr = sympy.Integer(0)
    weights: frozenset[int] = frozenset()
    no_grad: frozenset[int] = frozenset()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    #: ``extra`` as sorted ``(key, value)`` pairs, set from it: what ``extra`` says takes part in equality and
    #: hashing (a mean loss all-reduces its row count and a sum loss does not; the caches keyed on OpDims must tell
    #: them apart), although the dict itself cannot be hashed
    extra_key: tuple[tuple[str, Any], ...] = field(init=False, repr=False, default=())
    #: the hash, computed once: OpDims key the planner's memos (a few hundred thousand lookups in a large plan)
    _hash: int | None = field(init=False, repr=False, compare=False, default=None)

    def __hash__(self) -> int:
        if self._hash is None:
            fields = (self.kind, self.dims, self.sizes, self.inputs, self.outputs, self.no_split, self.stats)
            fields += (self.matmul, self.matmul_operands, self.flops, self.weights, self.no_grad, self.extra_key)
            object.__setattr__(self, "_hash", hash(fields))
        return self._hash  # type: ignore[return-value]

    def __reduce__(self) -> tuple:
        """Pickled (and copied) through the constructor: the cached hash is not carried over, since a ``str``'s hash
        differs between processes (``PYTHONHASHSEED``)."""
        return OpDims, (
            self.kind, self.dims, self.sizes, self.inputs, self.outputs, self.no_split, self.stats, self.matmul,
            self.matmul_operands, self.flops, self.weights, self.no_grad, self.extra,
        )  # fmt: skip

    def __post_init__(self) -> None:
        extra_key = tuple(sorted(self.extra.items()))
        try:
            hash(extra_key)
        except TypeError:
            bad = [k for k, v in extra_key if not isinstance(v, Hashable)]
            raise ValueError(f"OpDims.extra values must be hashable; {bad} are not") from None
        object.__setattr__(self, "extra_key", extra_key)
        if self.kind not in KINDS:
            raise ValueError(f"unknown rule kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if len(self.dims) != len(self.sizes):
            raise ValueError(f"{len(self.dims)} dims but {len(self.sizes)} sizes")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"iteration dim names repeat: {self.dims}")
        known = set(self.dims)
        for where, maps in (("input", self.inputs), ("output", self.outputs)):
            for i, tmap in enumerate(maps):
                if tmap is None:
                    continue
                used = [d for group in tmap for d in group]
                unknown = set(used) - known
                if unknown:
                    raise ValueError(f"{where} {i} maps onto unknown iteration dims {sorted(unknown)}")
                if len(used) != len(set(used)):
                    raise ValueError(f"{where} {i} uses an iteration dim twice: {tmap}")
        for name, group in (("no_split", self.no_split), ("stats", self.stats)):
            if not set(group) <= known:
                raise ValueError(f"{name} names unknown dims {sorted(set(group) - known)}")
        if self.matmul is not None:
            if len(self.matmul) != 3 or not set(self.matmul) <= known:
                raise ValueError(f"matmul roles {self.matmul} must be three of the dims {self.dims}")
            if self.matmul_operands is None:
                raise ValueError("matmul roles need matmul_operands (the I and W input indices)")

    # ----------------------------------------------------------------------------------- queries
    def size(self, dim: str) -> sympy.Expr:
        return self.sizes[self.dims.index(dim)]

    def dims_of(self, tmap: TensorMap) -> frozenset[str]:
        """The iteration dims a tensor spans."""
        return frozenset(d for group in tmap for d in group)

    def summed_dims(self, result: TensorMap) -> frozenset[str]:
        """Iteration dims absent from ``result``: a split of one of them leaves partial sums of it."""
        return frozenset(self.dims) - self.dims_of(result)

    @property
    def splittable(self) -> tuple[str, ...]:
        return tuple(d for d in self.dims if d not in self.no_split)

    def with_roles(self, weights: frozenset[int], no_grad: frozenset[int]) -> OpDims:
        """A copy that knows which inputs are parameters and which take no gradient."""
        return dataclasses.replace(self, weights=frozenset(weights), no_grad=frozenset(no_grad))


def tensor_shape(op: OpDims, tmap: TensorMap) -> Shape:
    """The full (unpartitioned) shape a :data:`TensorMap` describes."""
    out = []
    for group in tmap:
        size = sympy.Integer(1)
        for d in group:
            size = size * op.size(d)
        out.append(size)
    return tuple(out)
