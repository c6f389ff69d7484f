"""What the cost model assumes about training (:class:`CostOptions`) and the size of one device's block of a tensor.

The bottom of the cost stage: :mod:`~primepar_fx.cost.model` (Eq. 7) and :mod:`~primepar_fx.cost.scatter` (the
reduce-scatter saving) both price blocks through :func:`block_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from primepar_fx.cost.cluster import dtype_key
from primepar_fx.partition import OpPartition, Phase
from primepar_fx.partition.comm import Collective
from primepar_fx.partition.enumerate import ValuesKey
from primepar_fx.partition.layouts import concrete_sizes
from primepar_fx.rules.spec import OpDims, TensorMap

#: The ZeRO stages the cost model prices and the runtime runs (0: none; 3 is also the FSDP baseline's)
ZERO_STAGES = (0, 1, 2, 3)
PRICED_ZERO_STAGES = ZERO_STAGES

#: Bytes per element of each training dtype.
ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class CostOptions:
    """What the cost model assumes about training: dtype, what a parameter keeps, and the memory weight ``alpha``.

    Parameters and activations are in ``dtype``. Per parameter element a device also keeps its gradient in
    ``grad_dtype`` (``None``: ``dtype``), an fp32 master copy if ``master_weights`` (``None``: when ``dtype`` is 16
    bits, as mixed-precision training does), and ``optimizer_states`` moments in ``state_dtype`` (Adam: two, fp32).
    The default is the standard 16 bytes a parameter in every dtype: fp32 4 + 4 + 4 + 4; bf16 or fp16 2 (parameter)
    + 2 (gradient) + 4 (master) + 4 + 4 (moments).

    ``zero`` is ZeRO's stage for the plan's own parameters, each over the devices that hold the same block of it
    (the group that sums its gradient; a node's :attr:`~primepar_fx.cost.model.NodeCost.shard_bytes`): 1 splits the
    master copy and the moments (the gradient is all-reduced whole, and the updated parameter all-gathered after
    the step: the all-gather's bytes on top), 2 also the gradient (reduce-scattered instead: the bytes of the
    all-reduce it replaces). The shard is stepped as an fp32 copy (the master copy; without master weights, one
    more). Stage 3 also splits the parameter (FSDP; :mod:`primepar_fx.runtime.zero3`): it is all-gathered before
    Forward and again before Backward of every micro-batch and its gradient reduce-scattered once a step, with
    no all-gather after the step: one all-gather's bytes more than the all-reduce with one micro-batch.

    ``micro_batches`` ``m``: the graph is priced at the micro-batch (``B / m``) and a step runs it ``m`` times,
    summing parameter gradients locally and over their replicas once, at the last (gradient accumulation). What
    runs once a step (the bucketed gradient all-reduces and ZeRO's all-gathers) is priced at ``1/m`` per
    micro-batch, so that ``m`` times a node's cost is its cost in the step. The local gradients they accumulate
    are whole, so ZeRO-2 with micro-batches keeps a whole gradient as stage 1 does.

    ``distributed_optimizer``: Megatron-LM's distributed optimizer, priced as ZeRO-2 (``zero`` must be 2: the
    gradient reduce-scattered and the parameter all-gathered after the step over each block's replicas, the bytes
    of the all-reduce they replace) with its two differences: the gradient stays whole in its contiguous buffer,
    and the shard is stepped in place (its master copy, or the fp32 parameter itself: no copy). A block that has no
    replicas (an expert split over the data-parallel ranks) keeps its whole state.

    ``stages``: the graph is searched as one stage's plan of a pipeline of that many stages
    (:mod:`~primepar_fx.planning.staged`): a device then keeps the parameter state of a ``1 / stages`` share of the
    nodes, so each node's memory counts ``1 / stages`` of its state (:meth:`held_state_bytes`), while its stashed
    activations count whole: under 1F1B the first stage holds ``stages`` micro-batches' activations of its share of
    the layers. The pipeline's own pricing (:func:`~primepar_fx.pricing.pipelined.price_pipeline`) then counts each
    stage's state and stash exactly.
    """

    dtype: str = "fp32"
    optimizer_states: int = 2  # Adam keeps two moments per parameter
    alpha: float = 0.0
    grad_dtype: str | None = None
    master_weights: bool | None = None
    state_dtype: str = "fp32"
    zero: int = 0
    micro_batches: int = 1
    #: ZeRO-3 as FSDP runs it: every parameter gathered again before Backward (FSDP unshards a whole module before
    #: its Backward); ``False``, ours: only those Backward reads (:func:`zero_gather_share`)
    regather_all: bool = False
    distributed_optimizer: bool = False
    stages: int = 1

    def __post_init__(self) -> None:
        for name in ("dtype", "grad_dtype", "state_dtype"):
            value = getattr(self, name)
            if value is not None and dtype_key(value) not in ITEMSIZE:
                raise ValueError(f"{name} must be one of {sorted(ITEMSIZE)}, got {value!r}")
        if self.master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be True, False or None (auto), got {self.master_weights!r}")
        if self.zero not in PRICED_ZERO_STAGES or isinstance(self.zero, bool):
            raise ValueError(f"zero must be a ZeRO stage in {list(PRICED_ZERO_STAGES)}, got {self.zero!r}")
        if self.distributed_optimizer and self.zero != 2:
            raise ValueError(f"distributed_optimizer is priced as ZeRO stage 2: zero must be 2, got {self.zero!r}")
        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1, got {m!r}")
        p = self.stages
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"stages must be a whole number >= 1, got {p!r}")
        if isinstance(self.optimizer_states, bool) or not isinstance(self.optimizer_states, int):
            raise ValueError(f"optimizer_states must be a whole number of moments, got {self.optimizer_states!r}")
        if self.optimizer_states < 0 or self.alpha < 0:
            raise ValueError("optimizer_states and alpha must be non-negative")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[dtype_key(self.dtype)]

    @property
    def keeps_master(self) -> bool:
        """Whether an fp32 master copy of each parameter is kept (``master_weights``, or auto: a 16-bit dtype)."""
        return self.itemsize < 4 if self.master_weights is None else self.master_weights

    @property
    def param_state_bytes(self) -> int:
        """Bytes a device keeps per element of its parameter blocks, unsharded: parameter, gradient, master copy,
        moments."""
        return self.param_grad_bytes + self.optimizer_bytes

    @property
    def param_grad_bytes(self) -> int:
        """Bytes per parameter element of the parameter and its gradient."""
        return self.itemsize + ITEMSIZE[dtype_key(self.grad_dtype or self.dtype)]

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter element of the master copy and the moments, before ZeRO splits them."""
        master = 4 if self.keeps_master else 0
        return master + self.optimizer_states * ITEMSIZE[dtype_key(self.state_dtype)]

    def state_bytes(self, param_elems: int, shard_elems: int | None = None) -> int:
        """Bytes a device keeps for ``param_elems`` elements of parameter blocks; ``shard_elems``: this device's
        share of them under ZeRO (``zero``), each block split over its replicas."""
        if self.zero == 0 or shard_elems is None:
            return param_elems * self.param_state_bytes
        grad = self.param_grad_bytes - self.itemsize
        # the optimizer steps an fp32 copy of the shard (:mod:`primepar_fx.runtime.zero`): the master, or one more;
        # Megatron-LM's distributed optimizer steps an fp32 parameter's shard in place, and so does ZeRO-3 (the
        # shard is its own master, whatever ``master_weights`` says)
        if self.zero >= 3 and self.itemsize == 4:
            kept = self.optimizer_bytes - (4 if self.keeps_master else 0)
        else:
            kept = self.optimizer_bytes + (0 if self.keeps_master or self.distributed_optimizer else 4)
        held = shard_elems if self.zero >= 3 else param_elems
        # stage 2 keeps a gradient shard, but micro-batches accumulate whole local gradients until the last one (and
        # the distributed optimizer's buffer holds every gradient)
        whole = self.micro_batches > 1 or self.distributed_optimizer
        grads = shard_elems if self.zero >= 2 and not whole else param_elems
        return held * self.itemsize + grads * grad + shard_elems * kept

    def describe_state(self) -> str:
        """``"16 B a parameter: bf16 parameter and gradient, fp32 master, 2 fp32 moments"`` and the like."""
        grad = dtype_key(self.grad_dtype or self.dtype)
        kept = (
            f"{self.dtype} parameter and gradient" if grad == self.dtype else f"{self.dtype} parameter, {grad} gradient"
        )
        if self.keeps_master:
            kept += ", fp32 master"
        n = self.optimizer_states
        if n:
            kept += f", {n} {dtype_key(self.state_dtype)} moment{'s' if n > 1 else ''}"
        zero = f"; ZeRO-{self.zero} over each parameter's replicas" if self.zero else ""
        return f"{self.param_state_bytes} B a parameter: {kept}{zero}"

    def training_state(self) -> dict[str, object]:
        """What a plan records of these (``plan.search.training_state``; :meth:`from_training_state`)."""
        return {
            "grad_dtype": dtype_key(self.grad_dtype or self.dtype),
            "master_weights": self.keeps_master,
            "optimizer_states": self.optimizer_states,
            "state_dtype": dtype_key(self.state_dtype),
            "bytes_per_parameter": self.param_state_bytes,
            "zero": self.zero,
            "micro_batches": self.micro_batches,
        }

    @classmethod
    def from_training_state(cls, dtype: str, alpha: float, state: object) -> CostOptions:
        """The options a plan was priced with, from its ``dtype``, ``alpha`` and recorded training state (a plan
        without one: the defaults)."""
        if state is None:
            return cls(dtype=dtype, alpha=alpha)
        if not isinstance(state, dict):
            raise ValueError(f"plan.search.training_state must be a mapping, got {type(state).__name__}")
        known = (
            "grad_dtype",
            "master_weights",
            "optimizer_states",
            "state_dtype",
            "zero",
            "micro_batches",
            "bytes_per_parameter",
        )
        unknown = sorted(set(state) - set(known))
        if unknown:
            raise ValueError(f"plan.search.training_state has unknown field(s) {unknown}; use {list(known)}")
        kept = {k: state[k] for k in known[:-1] if k in state}
        opts = cls(dtype=dtype, alpha=alpha, **kept)
        if "bytes_per_parameter" in state and state["bytes_per_parameter"] != opts.param_state_bytes:
            raise ValueError(
                f"plan.search.training_state.bytes_per_parameter is {state['bytes_per_parameter']!r} but its other "
                f"fields make {opts.param_state_bytes}"
            )
        return opts


@lru_cache(maxsize=1 << 16)
def block_elems(op: OpDims, parts: tuple[int, ...], tmap: TensorMap, vkey: ValuesKey) -> int:
    """Elements of one device's block of ``tmap`` when iteration dim ``op.dims[i]`` is cut into ``parts[i]``."""
    part_of, sizes = dict(zip(op.dims, parts)), concrete_sizes(op, vkey)
    dims = [d for group in tmap for d in group]
    whole, cuts = prod(sizes[d] for d in dims), prod(part_of[d] for d in dims)
    return whole // cuts if whole % cuts == 0 else round(whole / cuts)  # int / int is correctly rounded


def block_bytes(part: OpPartition, tmap: TensorMap, vkey: ValuesKey, itemsize: int) -> int:
    """Bytes of one device's block of ``tmap`` under ``part``, ``itemsize`` bytes an element."""
    return block_elems(part.op, tuple(part.parts.values()), tmap, vkey) * itemsize


def tensor_map(op: OpDims, name: str) -> TensorMap:
    """The TensorMap of a tensor named like ``in0``, ``out1``, ``d_in2``, ``d_out0``."""
    base = name.removeprefix("d_")
    maps = op.inputs if base.startswith("in") else op.outputs
    tmap = maps[int(base.lstrip("inout"))]
    assert tmap is not None, name
    return tmap


def zero_gather_share(opts: CostOptions, read: bool = True) -> float:
    """How many of :func:`~primepar_fx.cost.model.zero_gather_price`'s all-gathers ZeRO prices per micro-batch:
    stage 1 one a step (``1/m`` of one); stage 3 one before Forward of every micro-batch and, for a weight that
    Backward reads (``read``, :func:`~primepar_fx.cost.model.weights_read_in_backward`), one before Backward, less
    the reduce-scatter's share of the all-reduce priced with the gradient (``2 - 1/m`` or ``1 - 1/m``: with one
    micro-batch one more than stage 2, or none); others none."""
    m = opts.micro_batches
    return 1 / m if opts.zero == 1 else 1 + read - 1 / m if opts.zero == 3 else 0.0


def in_bucket(op: OpDims, c: Collective) -> bool:
    """Whether the runtime sums ``c`` in a gradient bucket (:mod:`primepar_fx.runtime.gradsync`): the all-reduce of a
    parameter's gradient. Its bytes cost as any all-reduce's; its latency is the bucket's, shared by many. A tied
    parameter whose readers keep their own all-reduces in the graph pays theirs on its shared-parameter edge
    (:func:`~primepar_fx.cost.share.input_all_reduce_latency`)."""
    return (
        c.phase is Phase.GRADIENT
        and c.kind == "all-reduce"
        and c.block is None
        and c.tensor.startswith("d_in")
        and int(c.tensor[4:]) in op.weights
    )
