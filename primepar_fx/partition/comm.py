"""Communication derived from the DSIs: ring senders (paper Table 1), collectives and their groups.

Nothing here is tabulated. For every tensor an operator touches we list its *uses* ``(phase, step)`` in training
order; between two consecutive uses, a device that needs a slice it does not hold receives it from the device that
held it (:func:`transfers`). For P(S x S) this reproduces Table 1, including the last-step dW shift and the
Backward W shift that restores the Forward-start layout. A result tensor whose summed-over dims are split leaves
partial sums on the devices that hold the same result slice; they form the groups of an all-reduce
(:func:`collectives`), whose *group indicator* is the set of digits those dims depend on.

Tensor names: ``in{k}`` / ``out{j}`` are the op's inputs and outputs, ``d_in{k}`` / ``d_out{j}`` their gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

import numpy as np

from primepar_fx.partition.dsi import PHASES, OpPartition, Phase, TensorSlice
from primepar_fx.partition.mesh import DeviceMesh, class_senders
from primepar_fx.partition.seq import PartitionSeq, Split
from primepar_fx.rules.spec import OpDims, TensorMap

Use = tuple[Phase, int]


@dataclass(frozen=True, slots=True)
class PhaseTensor:
    """A tensor one phase touches: its name (``in0``, ``out0``, ``d_out0``, ``d_in0`` ...), its dim map, and
    whether the phase produces it (``result``) rather than reads it."""

    name: str
    tmap: TensorMap
    result: bool


def gradient_phase_inputs(op: OpDims) -> frozenset[int]:
    """Inputs whose gradient the Gradient phase produces: the parameters, and a matrix product's W operand
    even when it is an activation (attention's ``K^T``, ``V``): Eq. 1 computes ``dW`` from ``I`` and ``dO``."""
    if op.matmul_operands is not None:
        return op.weights | {op.matmul_operands[1]}
    return op.weights


@lru_cache(maxsize=1 << 14)
def phase_tensors(op: OpDims) -> Mapping[Phase, tuple[PhaseTensor, ...]]:
    """The tensors each phase reads and produces (read-only, made once per ``op``).

    Forward reads the inputs and produces the outputs. Backward (data gradient) produces ``d_in`` of every
    input that is neither a parameter nor gradient-free; Gradient produces ``d_in`` of the parameters. A matrix
    product's Backward reads ``d_out`` and W, its Gradient ``d_out`` and I (paper Eq. 1); other ops read ``d_out``
    and their stashed inputs in both.
    """
    ins = [(k, m) for k, m in enumerate(op.inputs) if m is not None]
    fwd = [PhaseTensor(f"in{k}", m, False) for k, m in ins] + [
        PhaseTensor(f"out{j}", m, True) for j, m in enumerate(op.outputs)
    ]
    d_out = [PhaseTensor(f"d_out{j}", m, False) for j, m in enumerate(op.outputs)]
    grads = [(k, m) for k, m in ins if k not in op.no_grad]
    if op.matmul is not None and op.matmul_operands is not None:
        i_idx, w_idx = op.matmul_operands
        bwd_read = [PhaseTensor(f"in{w_idx}", op.inputs[w_idx], False)]  # type: ignore[arg-type]
        grad_read = [PhaseTensor(f"in{i_idx}", op.inputs[i_idx], False)]  # type: ignore[arg-type]
    else:
        bwd_read = grad_read = [PhaseTensor(f"in{k}", m, False) for k, m in ins]
    late = gradient_phase_inputs(op)
    bwd = d_out + bwd_read + [PhaseTensor(f"d_in{k}", m, True) for k, m in grads if k not in late]
    grd = d_out + grad_read + [PhaseTensor(f"d_in{k}", m, True) for k, m in grads if k in late]
    return MappingProxyType({Phase.FORWARD: tuple(fwd), Phase.BACKWARD: tuple(bwd), Phase.GRADIENT: tuple(grd)})


def tensor_uses(part: OpPartition) -> dict[str, tuple[TensorMap, list[Use]]]:
    """Each tensor's uses in training order (Forward, Backward, Gradient, each over its steps)."""
    out: dict[str, tuple[TensorMap, list[Use]]] = {}
    for phase, tensors in phase_tensors(part.op).items():
        for pt in tensors:
            uses = out.setdefault(pt.name, (pt.tmap, []))[1]
            uses.extend((phase, t) for t in range(part.steps))
    return out


@dataclass(frozen=True, slots=True)
class Transfer:
    """One ring step: between uses ``src`` and ``dst`` of ``tensor``, rank ``k`` receives from ``senders[k]``.

    It overlaps the compute of ``src``; ``wrap`` marks the shift of a parameter back to its Forward-start layout.
    """

    tensor: str
    src: Use
    dst: Use
    senders: tuple[int, ...]
    wrap: bool = False

    @property
    def moves(self) -> int:
        return sum(1 for k, s in enumerate(self.senders) if s != k)


def _slices_at(part: OpPartition, tmap: TensorMap, use: Use) -> dict[int, TensorSlice]:
    """Every rank's :meth:`~OpPartition.tensor_slice` at ``use``, from the DSIs of all devices at once."""
    idx = part.dsi_table(use[0], use[1])
    groups = [[(idx[d].tolist(), part.parts[d]) for d in group] for group in tmap]
    return {k: tuple(tuple((i[k], p) for i, p in group) for group in groups) for k in range(part.mesh.size)}


def shift_senders(part: OpPartition, tmap: TensorMap, src: Use, dst: Use) -> tuple[int, ...]:
    """For every rank, the rank it receives its ``dst`` slice of a tensor from, given the ``src`` layout.

    A rank's slice is told by one mixed-radix code of its DSIs over the parts of the tensor's iteration dims (the
    code of :meth:`~OpPartition.tensor_slice`'s ``(index, parts)`` pairs), so slices compare as ints."""
    have, want = _slice_codes(part, tmap, src), _slice_codes(part, tmap, dst)
    codes, first_at, cls = np.unique(have, return_index=True, return_inverse=True)
    first = first_at[cls.reshape(-1)]  # each slice's first holder labels its class
    senders = class_senders(tuple(first.tolist()), part.mesh)
    at = np.minimum(np.searchsorted(codes, want), len(codes) - 1)
    if (codes[at] != want).any():
        k = int(np.flatnonzero(codes[at] != want)[0])
        raise AssertionError(f"no device holds slice {_slices_at(part, tmap, dst)[k]} of {part.seq}")
    return tuple(senders[first_at[at], np.arange(part.mesh.size)].tolist())  # k itself if it holds it


def _slice_codes(part: OpPartition, tmap: TensorMap, use: Use) -> np.ndarray:
    """Every rank's slice of a tensor at ``use`` as one mixed-radix code of its DSIs."""
    idx = part.dsi_table(use[0], use[1])
    code = np.zeros(part.mesh.size, dtype=np.int64)
    for group in tmap:
        for d in group:
            code = code * part.parts[d] + idx[d]
    return code


def transfers(part: OpPartition) -> list[Transfer]:
    """Every point-to-point shift the partition needs, derived from consecutive uses of each tensor."""
    out: list[Transfer] = []
    weights = {f"in{k}" for k in part.op.weights} | {f"d_in{k}" for k in part.op.weights}
    for name, (tmap, uses) in tensor_uses(part).items():
        if _is_bias(part.op, name):
            continue  # a bias gradient is summed from d_out once, after the ring (see collectives)
        pairs = list(zip(uses, uses[1:]))
        if name in weights and name.startswith("in"):
            pairs.append((uses[-1], uses[0]))  # a parameter returns to its Forward-start layout
        for src, dst in pairs:
            senders = shift_senders(part, tmap, src, dst)
            if any(s != k for k, s in enumerate(senders)):
                out.append(Transfer(name, src, dst, senders, wrap=(dst == uses[0] and src == uses[-1])))
    return out


@dataclass(frozen=True, slots=True)
class Collective:
    """An all-reduce of a phase's result over the devices that differ only in ``digits``.

    ``count`` blocks of ``block`` are reduced (``block=None``: the result tensor's own map). A statistics
    all-reduce reduces per-row statistics (the result's rows with the statistics dims collapsed), not the result.
    """

    phase: Phase
    tensor: str
    dims: frozenset[str]
    digits: tuple[int, ...]
    kind: str = "all-reduce"
    count: int = 1
    block: TensorMap | None = None


#: per rule kind, the statistics all-reduced per row when a statistics dim is split: ``(forward, backward)``.
#: A norm all-reduces its mean and variance (two-pass) and, in backward, the gradients of both; a cross-entropy
#: all-reduces the row max, the sum of exponentials and the target logit, and needs nothing in backward.
STATISTICS = {"norm": (2, 2), "loss": (3, 0)}


def _canonical_results(op: OpDims) -> set[tuple[Phase, str]]:
    """The results P(S x S) accumulates temporally: O in Forward, dI in Backward, dW in Gradient (Eq. 1)."""
    if op.matmul_operands is None:
        return set()
    i_idx, w_idx = op.matmul_operands
    return {(Phase.FORWARD, "out0"), (Phase.BACKWARD, f"d_in{i_idx}"), (Phase.GRADIENT, f"d_in{w_idx}")}


def _is_bias(op: OpDims, name: str) -> bool:
    """The gradient of a matrix product's extra input (a bias): neither its I nor its W operand."""
    if op.matmul_operands is None or not name.startswith("d_in"):
        return False
    return int(name[4:]) not in op.matmul_operands


def _digit_changes_slice(part: OpPartition, phase: Phase, tmap: TensorMap, pos: int, t: int) -> bool:
    for coords in part.mesh.devices():
        if coords[pos] == 0:
            for v in range(1, part.mesh.digits[pos]):
                other = coords[:pos] + (v,) + coords[pos + 1 :]
                if part.tensor_slice(phase, tmap, coords, t) != part.tensor_slice(phase, tmap, other, t):
                    return True
    return False


def collectives(part: OpPartition) -> list[Collective]:
    """Collectives left by split summed-over dims (and split statistics dims), per phase and result tensor.

    A result that P(S x S) does not accumulate temporally (a bias gradient: its summed dims include a P dim) is
    also reduced over the P digits that do not change its final slice, i.e. over the devices that hold the same
    slice of it at the phase's last step. Memoised per ``(op, seq, mesh)``.
    """
    key = (part.op, part.seq, part.mesh)
    if key not in _COLLECTIVES:
        if len(_COLLECTIVES) >= _COLLECTIVES_KEPT:
            _COLLECTIVES.clear()
        _COLLECTIVES[key] = _collectives(part)
    return list(_COLLECTIVES[key])


#: :func:`collectives` per ``(op, seq, mesh)``, up to :data:`_COLLECTIVES_KEPT` of them (then started again)
_COLLECTIVES: dict[tuple[OpDims, PartitionSeq, DeviceMesh], tuple[Collective, ...]] = {}
_COLLECTIVES_KEPT = 1 << 16


@lru_cache(maxsize=1 << 12)
def _summed_results(op: OpDims) -> tuple[tuple[Phase, str, TensorMap, frozenset[str], frozenset[str], bool], ...]:
    """Per result tensor of ``op``: ``(phase, name, map, dims summed into it, those of them a P(S x S) would sum,
    whether P(S x S) accumulates it temporally)``, which depend on the op only (:func:`_collectives` asks per
    partition)."""
    canonical = _canonical_results(op)
    out = []
    for phase, tensors in phase_tensors(op).items():
        for pt in tensors:
            if not pt.result:
                continue
            summed = set(op.summed_dims(pt.tmap)) - set(op.stats)
            if _is_bias(op, pt.name):  # added once per output element: summed only over the output's dims
                summed = set(op.dims_of(op.outputs[0])) - set(op.dims_of(pt.tmap))
            prime_summed = frozenset(summed & set(op.matmul or ()))
            out.append((phase, pt.name, pt.tmap, frozenset(summed), prime_summed, (phase, pt.name) in canonical))
    return tuple(out)


def _collectives(part: OpPartition) -> tuple[Collective, ...]:
    out = []
    op, last = part.op, part.steps - 1
    # a mean over split rows also all-reduces the count of rows it divides by, unless every rank counts them whole
    # (their targets come from the inputs: ``graph.build.input_chain``)
    count = 2 if op.kind == "loss" and op.extra.get("reduction") == "mean" else 1
    count = 1 if op.extra.get("count_local") else count
    cuts = [(e.dim, p[0]) for e, p in zip(part.seq.elements, part.positions) if isinstance(e, Split)]
    for phase, name, tmap, summed, prime_summed, canonical in _summed_results(op):
        hits = [(d, p) for d, p in cuts if d in summed]
        split = set(d for d, _ in hits)
        digits = [p for _, p in hits]
        if part.prime_digits and prime_summed and not canonical:
            extra = [p for p in part.prime_digits if not _digit_changes_slice(part, phase, tmap, p, last)]
            if extra:
                digits += extra
                split |= prime_summed
        if digits:
            out.append(Collective(phase, name, frozenset(split), tuple(sorted(digits)), count=count))
    return tuple(out + statistics_collectives(part))


def statistics_collectives(part: OpPartition) -> list[Collective]:
    """All-reduces of per-row statistics when a statistics dim (the normalised dim, the classes) is split."""
    op = part.op
    hits = [(e.dim, p[0]) for e, p in zip(part.seq.elements, part.positions) if getattr(e, "dim", None) in op.stats]
    if not hits or op.inputs[0] is None:
        return []
    fwd, bwd = STATISTICS.get(op.kind, (1, 1))
    rows = tuple(() if set(group) & op.stats else group for group in op.inputs[0])
    dims, digits = frozenset(d for d, _ in hits), tuple(sorted(p for _, p in hits))
    out = [Collective(Phase.FORWARD, "out0", dims, digits, count=fwd, block=rows)]
    if bwd and 0 not in op.no_grad:
        out.append(Collective(Phase.BACKWARD, "d_in0", dims, digits, count=bwd, block=rows))
    return out


def replicated_tensors(part: OpPartition, phase: Phase = Phase.FORWARD, t: int = 0) -> dict[str, int]:
    """How many devices hold each slice of each tensor at ``(phase, t)`` (1 = never replicated)."""
    out = {}
    for pt in phase_tensors(part.op)[phase]:
        slices = _slices_at(part, pt.tmap, (phase, t))
        counts: dict[TensorSlice, int] = {}
        for s in slices.values():
            counts[s] = counts.get(s, 0) + 1
        out[pt.name] = max(counts.values())
    return out


def alignments(part: OpPartition) -> dict[str, bool]:
    """The paper's phase alignments (Feature 3) for a matrix product, checked on every device."""
    op = part.op
    if op.matmul_operands is None:
        return {}
    i_idx, w_idx = op.matmul_operands
    last = part.steps - 1
    i_map, w_map, o_map = op.inputs[i_idx], op.inputs[w_idx], op.outputs[0]

    def same(a: TensorMap, ua: tuple[Phase, int], b: TensorMap, ub: tuple[Phase, int]) -> bool:
        return all(
            part.tensor_slice(ua[0], a, c, ua[1]) == part.tensor_slice(ub[0], b, c, ub[1]) for c in part.mesh.devices()
        )

    f, b, g = PHASES
    return {
        "I: Forward end = Gradient start": same(i_map, (f, last), i_map, (g, 0)),  # type: ignore[arg-type]
        "W: Forward end = Backward start": same(w_map, (f, last), w_map, (b, 0)),  # type: ignore[arg-type]
        "dO: Backward end = Gradient start": same(o_map, (b, last), o_map, (g, 0)),
        "dW: Gradient end = W Forward start": same(w_map, (g, last), w_map, (f, 0)),  # type: ignore[arg-type]
    }
