"""Collectives whose result is needed late: launched asynchronously, waited where the value is first read.

The global loss is the one collective of a data-parallel step that DDP does not send (DDP returns each rank's own
loss; a compiled plan returns the loss of the whole batch on every rank, as one device computes it). A mean over
rows split across ranks needs two sums: the count of targets that are not ignored, which backward needs (the
gradient of every row is ``1 / count``), and the sum of the row losses, which only the caller reads. Neither has to
stop the step:

* :class:`TargetCount` sums the count as soon as the targets are known (the passes move the targets' computation
  to the start of the graph), so the message travels while forward computes;
* :func:`lazy_all_reduce` sums the loss with ``async_op=True`` and returns a :class:`PendingTensor`: autograd
  starts backward from it without reading it (``ones_like`` and the other ops that only read its shape do not
  wait), and the first op that reads its value (``detach()`` included) waits for the sum and computes the mean.

Values and gradients are the synchronous ones: the same sums over the same ranks, the same division.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_map

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.stats import CommStats

aten = torch.ops.aten
Group = tuple[object | None, tuple[int, ...]]

#: ops that read only a tensor's shape, dtype and device: they run without waiting for the value
SHAPE_ONLY = frozenset(
    {
        aten.ones_like.default,
        aten.zeros_like.default,
        aten.empty_like.default,
        aten.full_like.default,
        aten.new_empty.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    }
)


class Pending:
    """The buffer of an asynchronous collective, its work handle and what to compute from it once it is in."""

    def __init__(self, buf: torch.Tensor, work: object | None, then: Callable[[torch.Tensor], torch.Tensor] | None):
        self.buf, self._work, self._then = buf, work, then
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The value (waits for the collective the first time; the later calls return the same tensor)."""
        if self._value is None:
            if self._work is not None:
                self._work.wait()  # type: ignore[attr-defined]
                self._work = None
            self._value = self._then(self.buf) if self._then is not None else self.buf
        return self._value

    @property
    def done(self) -> bool:
        return self._value is not None


class PendingTensor(torch.Tensor):
    """A tensor whose value an asynchronous collective is still computing (module docstring).

    It behaves as the finished tensor: any op that reads its value waits first (``detach()`` too, so
    ``loss.detach().numpy()`` and ``dist.all_reduce(loss.detach())`` get a plain tensor), and :meth:`wait` returns
    the plain tensor. It holds no gradient of its own; the autograd node that made it carries the graph.
    """

    pending: Pending

    @staticmethod
    def __new__(cls, pending: Pending, like: torch.Tensor) -> PendingTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )

    def __init__(self, pending: Pending, like: torch.Tensor) -> None:
        self.pending = pending

    def wait(self) -> torch.Tensor:
        return self.pending.wait()

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return repr(self.pending.wait())

    # what reads a tensor's memory without an ATen op: the plain tensor's, once it is in
    def numpy(self, *args: object, **kwargs: object):  # type: ignore[override]
        return self.wait().numpy(*args, **kwargs)

    def untyped_storage(self):  # type: ignore[override]
        return self.wait().untyped_storage()

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.wait().data_ptr()

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        return self.wait().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in SHAPE_ONLY:

            def plain(t: object) -> object:  # the buffer has the final shape and dtype; its values are not read
                return t.pending.buf if isinstance(t, PendingTensor) else t
        else:

            def plain(t: object) -> object:
                return t.pending.wait() if isinstance(t, PendingTensor) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def launch_all_reduce(
    x: torch.Tensor,
    group: Group,
    stats: CommStats | None,
    node: str = "",
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    nbytes: int | None = None,
) -> Pending:
    """Start a sum of ``x`` over ``group`` (a copy: ``x`` is left alone); ``then`` runs on the sum when it is waited.
    ``nbytes``: what ``comm_stats`` counts, when the plan prices this message together with another."""
    handle, ranks = group
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    if handle is None or len(ranks) < 2:
        return Pending(buf, None, then)
    work = dist.all_reduce(buf, group=handle, async_op=True)
    if stats is not None:
        if nbytes is None:
            nbytes = int(round(ring_factors("all-reduce", len(ranks))[0] * buf.numel() * buf.element_size()))
        stats.add("collective", nbytes, node)
    return Pending(buf, work, then)


class _LazySum(torch.autograd.Function):
    """Forward: the group sum of ``x``, pending, then the division by ``divisor``; backward: ``g / divisor`` (the sum is
    a ``"forward"`` all-reduce, whose backward is the identity on every rank)."""

    @staticmethod
    def forward(ctx, x, divisor, group, stats, node, nbytes):  # type: ignore[override]
        ctx.divisor = divisor
        then = None if divisor is None else (lambda total: total / divisor)
        pending = launch_all_reduce(x, group, stats, node, then, nbytes)
        return PendingTensor(pending, pending.buf)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if isinstance(g, PendingTensor):
            g = g.wait()
        return (g if ctx.divisor is None else g / ctx.divisor), None, None, None, None, None


def lazy_all_reduce(
    x: torch.Tensor,
    group: Group,
    stats: CommStats | None,
    node: str = "",
    divisor: torch.Tensor | None = None,
    nbytes: int | None = None,
) -> torch.Tensor:
    """``sum over group(x) / divisor`` as a :class:`PendingTensor`, differentiable in ``x`` (module docstring);
    ``divisor`` is the same on every rank and is not differentiated."""
    return _LazySum.apply(x, divisor, group, stats, node, nbytes)


class TargetCount(nn.Module):
    """A graph node: starts the sum over ``group`` of the targets that are not ``ignore_index``; returns the
    :class:`Pending` sum, which :class:`~primepar_fx.runtime.lowered.ShardedCrossEntropy` waits for. ``nbytes``:
    what ``comm_stats`` counts for it (the plan prices the count and the loss sum as one message of both).

    With ``counter`` (a graph computing the whole targets from the graph's inputs, which every rank holds whole) the
    node is called with those inputs and counts every target itself: the global count, no message."""

    def __init__(
        self,
        ignore_index: int,
        dtype: torch.dtype,
        group: Group | None,
        stats: CommStats,
        nbytes: int,
        node: str = "",
        counter: nn.Module | None = None,
    ):
        super().__init__()
        self.ignore_index, self.dtype, self.group, self.stats, self.nbytes = ignore_index, dtype, group, stats, nbytes
        self.node, self.counter = node, counter

    def forward(self, *inputs: torch.Tensor) -> Pending:
        if self.counter is not None:
            count = (self.counter(*inputs) != self.ignore_index).sum().to(self.dtype)
            return Pending(count, None, None)
        assert self.group is not None
        count = (inputs[0] != self.ignore_index).sum().to(self.dtype)
        return launch_all_reduce(count, self.group, self.stats, self.node, nbytes=self.nbytes)

    def extra_repr(self) -> str:
        where = "counted whole from the inputs" if self.counter is not None else f"ranks={self.group[1]}"
        return f"ignore_index={self.ignore_index}, {where}"


class _DeferredFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, *inputs):  # type: ignore[override]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() if k in mod.params else x for k, x in enumerate(inputs)]
            out = mod.run(leaves)
        ctx.mod, ctx.out = mod, out
        ctx.leaves = [leaves[k] for k in mod.params]
        ctx.params = [inputs[k] for k in mod.params]
        return out.detach()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        mod, out, leaves, params = ctx.mod, ctx.out, ctx.leaves, ctx.params
        none = [None] * (1 + mod.arity)
        accumulates = all(_accumulates(p) for p in params)

        def accumulate(summed: torch.Tensor) -> None:
            for p, grad in zip(params, torch.autograd.grad(out, leaves, summed)):
                p.grad = grad if p.grad is None else p.grad.add_(grad)

        if accumulates and mod.bucket is not None:  # in a gradient bucket's message, at the end of backward
            buckets, index = mod.bucket
            if buckets.join(index, g, accumulate, mod.node):
                return tuple(none)
        pending = launch_all_reduce(g, mod.group, mod.stats, mod.node)
        if not accumulates:  # torch.autograd.grad(): the gradients are returned now
            for k, grad in zip(mod.params, torch.autograd.grad(out, leaves, pending.wait())):
                none[1 + k] = grad
            return tuple(none)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: accumulate(pending.wait()))
        return tuple(none)


def _accumulates(p: torch.Tensor) -> bool:
    """Whether this backward accumulates into ``p.grad`` (not a ``torch.autograd.grad`` call)."""
    if not p.requires_grad or p.grad_fn is not None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(get_gradient_edge(p).node))
    except RuntimeError:  # torch.autograd.grad(): the gradient is returned, not accumulated into .grad
        return False


class DeferredGradients(nn.Module):
    """A graph node: ``op`` of parameters (and inputs without a gradient), computed alike on every rank of ``group``,
    whose output gradient arrives partial over ``group`` (its consumer splits a dim the output lacks, so each rank
    holds its own rows' part). The plan sums that gradient over the group before ``op``'s backward; here the sum is
    launched asynchronously where the consumer's backward leaves it, and the parameters' gradients are computed
    from it at the end of backward, while the rest of backward runs. ``op``'s backward is linear in its output
    gradient and the same on every rank, so this is the plan's sum, in the plan's bytes.

    When ``GradientBuckets.take_deferred`` sets ``bucket`` (``(GradientBuckets, index)``: the last gradient bucket
    over the same ranks, held to the end of backward), the sum travels in that bucket's message instead of one of
    its own (:meth:`~primepar_fx.runtime.gradsync.GradientBuckets.join`); inside micro-batches, for
    ``torch.autograd.grad`` and with ZeRO-2 it is sent alone.

    ``args``: ``op``'s arguments with ``None`` at the positions the node passes (``slots``); ``params``: which of the
    passed ones are parameters.
    """

    def __init__(
        self,
        op: Callable,
        args: list,
        kwargs: dict,
        slots: tuple[int, ...],
        params: tuple[int, ...],
        group: Group,
        stats: CommStats,
        node: str = "",
    ) -> None:
        super().__init__()
        self.op, self.args, self.kwargs, self.slots, self.params = op, list(args), dict(kwargs), slots, params
        self.group, self.stats, self.node = group, stats, node
        self.arity = len(slots)
        self.bucket: tuple[Any, int] | None = None  # set by the compiled module

    def run(self, inputs: list) -> torch.Tensor:
        args = list(self.args)
        for k, x in zip(self.slots, inputs):
            args[k] = x
        return self.op(*args, **self.kwargs)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and any(inputs[k].requires_grad for k in self.params)):
            return self.run(list(inputs))
        return _DeferredFn.apply(self, *inputs)

    def extra_repr(self) -> str:
        return f"{self.op}, its output gradient summed over ranks {self.group[1]} asynchronously"
