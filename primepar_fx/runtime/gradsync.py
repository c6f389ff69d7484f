"""Parameter gradients summed over their replicas as DDP and FSDP2 do it: in buckets, asynchronously, during backward.

A parameter that several ranks hold the same block of gets, on each of them, only the part of its gradient that
the rank's own computation contributes; the plan sums those parts over the group (a Gradient-phase all-reduce on
the parameter input of its consumer). Done in the graph, that is one synchronous all-reduce per parameter, each
waited where autograd reaches it. :class:`GradientBuckets` does the same sums the way PyTorch's data parallelisms
do:

* the parameters are grouped into size-bounded buckets in reverse order of their use in forward (the order their
  gradients become ready), one bucket holding tensors of one process group and one dtype;
* a hook on each parameter copies its gradient for this backward into its place in the bucket's flat tensor
  (allocated once and kept, as DDP's) when autograd has computed it; when every gradient of a bucket is in, the
  bucket is all-reduced with ``async_op=True``, so the transfer runs while autograd computes the rest of backward;
* buckets launch strictly in index order on every rank, on groups of their own (the ``"grad"`` channel of
  :class:`~primepar_fx.runtime.groups.ProcessGroups`), so no peer can pair them with another collective;
* a callback at the end of backward launches what is left (a parameter whose gradient never came is left out of
  its bucket's message and its ``.grad`` untouched: every rank runs the same graph, so it is the same on all), waits
  once for every bucket and writes each parameter's ``.grad``;
* a sum of an activation's gradient that is waited only at the end of backward as well (the output gradient of a
  position table read alike on every rank: :class:`~primepar_fx.runtime.pending.DeferredGradients`) travels in
  the message of the last bucket over the same ranks (:meth:`GradientBuckets.join`): that bucket is held back and
  launched at the end of backward with those sums appended, one message for both, as the plan prices them
  (bytes, and a bucket's latency).

Gradients stay exact: ``.grad`` ends as the group sum of this backward's gradient (a view of its bucket's
flat tensor, as DDP's ``gradient_as_bucket_view``: no copy back, and the next backward writes there again, so a
``.grad`` kept past the next backward must be cloned), plus whatever ``.grad`` held
before (gradient accumulation over several backwards keeps working: the earlier value is set aside while autograd
writes this backward's part, and added back at the end). ``torch.autograd.grad`` on the parameters gets the
summed gradients too, synchronously (autograd then writes no ``.grad``, so there is nothing to overlap with).
Every bucket counts its tensors' bytes in ``comm_stats`` under the node the plan prices them on, with the same
ring volume as the graph's all-reduces, and one message per bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.collectives import all_reduce, reduce_scatter_flat
from primepar_fx.runtime.pending import DeferredGradients
from primepar_fx.runtime.stats import CommStats

#: DDP's default bucket size, and its smaller first bucket (the last gradients of backward: launched early)
BUCKET_CAP_MB = 25.0
FIRST_BUCKET_CAP_MB = 1.0


@dataclass(frozen=True)
class GradReduction:
    """The sum of one parameter's gradient over the ranks that differ only in ``digits``."""

    digits: tuple[int, ...]
    #: this rank's group: ``(handle, ranks)`` on the gradient channel
    group: tuple[object, tuple[int, ...]]
    #: the node whose partition asks for the sum (bytes are counted under it, as the plan prices them)
    node: str
    #: position of the parameter's first use in the forward graph (buckets follow the reverse of it)
    order: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.group[1]


class _Bucket:
    def __init__(self, index: int, group: tuple[object, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.index, self.group, self.dtype = index, group, dtype
        self.members: list[int] = []  # indices into GradientBuckets.params
        self.numel = 0
        self.flat: torch.Tensor | None = None
        self.sent: list[int] = []  # the members with a gradient this backward, in the order of ``flat``
        self.work: object | None = None
        self.launched = False  # in this backward
        #: the flat tensor kept from one backward to the next (allocated once, as DDP's buckets are): each gradient
        #: is copied into its place when it is ready, and each ``.grad`` ends as a view of it
        self.buffer: torch.Tensor | None = None
        self.offsets: dict[int, int] = {}  # member -> its first element in ``buffer``


class BucketChunk:
    """Bucket ``index`` of ``buckets`` as ZeRO cuts it (:mod:`primepar_fx.runtime.zero`): its parameters flattened in
    bucket order and padded to a multiple of the group size, ``chunk`` elements per rank of the group; this rank's
    chunk starts at ``start``."""

    def __init__(self, buckets: GradientBuckets, index: int, rank: int) -> None:
        bucket = buckets.buckets[index]
        self.index, self.bucket, self.members = index, bucket, list(bucket.members)
        self.params = [buckets.params[i] for i in self.members]
        self.reductions = [buckets.reductions[i] for i in self.members]
        self.handle, self.ranks = bucket.group
        self.size = len(self.ranks)
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = -(-self.numel // self.size)
        self.start = self.ranks.index(rank) * self.chunk

    def flatten(self) -> torch.Tensor:
        """Lay the parameters out in one flat tensor (padded to ``chunk * size``) and make each a view of it, so that
        one all-gather writes all of them; returns the flat tensor. The parameters stay the same objects."""
        first = self.params[0]
        flat = torch.zeros(self.chunk * self.size, dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                flat[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = flat[offset : offset + n].view(p.shape)
                offset += n
        return flat


class GradientBuckets:
    """Bucketed asynchronous gradient sums of ``params`` (module docstring).

    ``params``: ``(name, parameter, reduction)`` for every parameter whose gradient the plan sums over a group;
    parameters that do not require a gradient are left out. ``bucket_cap_mb`` bounds a bucket's bytes (the first
    bucket launched: ``first_bucket_cap_mb``); a parameter larger than the bound gets a bucket of its own.
    ``apart``: a key per parameter name; parameters of different keys never share a bucket (ZeRO-3's units: one
    node's parameters, those Backward reads apart from those it does not).
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter, GradReduction]],
        stats: CommStats | None,
        *,
        bucket_cap_mb: float = BUCKET_CAP_MB,
        first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB,
        apart: Mapping[str, Hashable] | None = None,
    ) -> None:
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(f"bucket sizes must be positive, got {bucket_cap_mb} and {first_bucket_cap_mb} MiB")
        ordered = sorted((e for e in params if e[1].requires_grad), key=lambda e: -e[2].order)
        self.names = [name for name, _, _ in ordered]
        self.params = [p for _, p, _ in ordered]
        self.reductions = [r for _, _, r in ordered]
        self.stats = stats
        self.buckets: list[_Bucket] = []
        self.bucket_of: list[int] = []
        open_: dict[tuple, _Bucket] = {}
        for i, (p, r) in enumerate(zip(self.params, self.reductions)):
            key = (r.ranks, r.digits, p.dtype, None if apart is None else apart.get(self.names[i]))
            bucket = open_.get(key)
            cap = (first_bucket_cap_mb if not self.buckets or bucket is self.buckets[0] else bucket_cap_mb) * 2**20
            if bucket is not None and bucket.members and (bucket.numel + p.numel()) * p.element_size() > cap:
                bucket = None
            if bucket is None:
                bucket = open_[key] = _Bucket(len(self.buckets), r.group, p.dtype)
                self.buckets.append(bucket)
            bucket.members.append(i)
            bucket.offsets[i] = bucket.numel
            bucket.numel += p.numel()
            self.bucket_of.append(bucket.index)
        self._scatter: set[int] = set()  # buckets reduce-scattered for ZeRO stage 2 (:mod:`primepar_fx.runtime.zero`)
        self._chunks: dict[int, torch.Tensor] = {}  # their summed chunks, accumulated until cleared
        self._local = False  # inside :meth:`accumulating`
        self._unsummed: set[int] = set()  # parameters whose .grad holds local parts not summed yet
        self._held: dict[int, torch.Tensor] = {}  # their .grad from before the first local backward
        self._late: set[int] = set()  # buckets launched at the end of backward, with the sums that join them
        self._nodes = [get_gradient_edge(p).node for p in self.params]
        #: the bus bytes of each parameter's sum, as the graph's all-reduces count them
        self._volumes = [
            ring_factors("all-reduce", len(r.ranks))[0] * p.numel() * p.element_size()
            for p, r in zip(self.params, self.reductions)
        ]
        self._handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._drops: list = []  # the post-accumulate hooks of reduce-scattered parameters (:meth:`scatter_into`)
        #: parameter -> its place in its bucket's kept buffer, shaped like it (made with the buffer, reused)
        self._places: dict[int, torch.Tensor] = {}
        self._reset()

    # ------------------------------------------------------------------------------------------------ micro-batches
    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backwards run inside keep their gradients local: autograd accumulates them into ``.grad`` and nothing
        is summed over the replicas; the next backward outside adds them to its own and sums the total once
        (micro-batches, :mod:`primepar_fx.compiler.microbatch`). What ``.grad`` held before the first such
        backward is set aside and added back after the sum, as for any accumulation."""
        if not self._local:  # a micro-batch of a step: .grad from before the step's first is set aside
            for i, p in enumerate(self.params):  # (not the earlier micro-batches' local parts: summed with the last)
                if p.grad is not None and i not in self._held and i not in self._unsummed:
                    self._held[i], p.grad = p.grad, None
        self._local = True
        try:
            yield
        finally:
            self._local = False

    # ------------------------------------------------------------------------------------------------ one backward
    def _reset(self) -> None:
        self._active = False
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._earlier: list[torch.Tensor | None] = [None] * len(self.params)
        self._missing = [len(b.members) for b in self.buckets]
        self._launched = 0
        #: bucket -> the sums joining its message in this backward: (gradient, what takes the sum, node)
        self._joined: dict[int, list[tuple[torch.Tensor, Callable[[torch.Tensor], None], str]]] = {}
        for b in self.buckets:
            b.flat, b.work, b.sent, b.launched = None, None, [], False

    def _hook(self, i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            return self._ready(i, grad)

        return hook

    def _drop(self, i: int):
        """After autograd wrote parameter ``i``'s ``.grad`` (a reduce-scattered bucket's parameter): the bucket keeps
        its own reference until it is sent, so the local gradient goes as soon as it is in the flat copy (ZeRO-2
        keeps no whole gradient). Only those parameters carry the hook: one Python call less per gradient else."""

        def hook(p: torch.Tensor) -> None:
            if not self._local and self.bucket_of[i] in self._scatter:
                p.grad = None

        return hook

    def _ready(self, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        try:
            accumulates = torch._C._will_engine_execute_node(self._nodes[i])
        except RuntimeError:  # torch.autograd.grad(): the gradient is returned, not accumulated into .grad
            accumulates = False
        if not accumulates:
            return self._reduce_now(i, grad)
        if self._local:  # a micro-batch before the last: autograd adds it to .grad; summed with the last
            self._unsummed.add(i)
            return None
        self._activate()
        p = self.params[i]
        if i in self._unsummed:  # the earlier micro-batches' local parts join this one's, summed together
            self._unsummed.discard(i)
            if p.grad is not None:
                grad, p.grad = grad + p.grad, None
            self._earlier[i] = self._held.pop(i, None)
        elif p.grad is not None:  # set aside what earlier backwards left; autograd now writes this one's part
            self._earlier[i], p.grad = p.grad, None
        b = self.bucket_of[i]
        self._grads[i] = self._stage(self.buckets[b], i, grad)
        self._missing[b] -= 1
        while self._launched < len(self.buckets) and self._missing[self._launched] == 0:
            if self._launched not in self._late:  # a late bucket waits for the end of backward
                self._launch(self.buckets[self._launched])
            self._launched += 1
        return None

    def _activate(self) -> None:
        if not self._active:
            self._active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    # ------------------------------------------------------------------------------------------------ joined sums
    def hold_for(self, ranks: Sequence[int]) -> int | None:
        """Hold the last bucket summed over ``ranks`` to the end of backward, so that sums over the same ranks ready
        only then may :meth:`join` its message; returns its index (``None``: no bucket sums over ``ranks``). Every
        rank of ``ranks`` holds the same buckets and the same joiners, so each holds the same one."""
        index = max((b.index for b in self.buckets if b.group[1] == tuple(ranks)), default=None)
        if index is not None:
            self._late.add(index)
        return index

    def take_deferred(self, module: nn.Module) -> None:
        """Let every :class:`~primepar_fx.runtime.pending.DeferredGradients` node of ``module`` (a rank graph) send
        its sum in the last bucket over its ranks (:meth:`hold_for`)."""
        for mod in module.modules():
            if isinstance(mod, DeferredGradients):
                index = self.hold_for(mod.group[1])
                mod.bucket = None if index is None else (self, index)

    def join(self, index: int, grad: torch.Tensor, then: Callable[[torch.Tensor], None], node: str) -> bool:
        """Sum ``grad`` in the message of bucket ``index`` (held by :meth:`hold_for`) at the end of this backward and
        call ``then`` with the sum when it is in, before backward returns; its bytes count under ``node``. ``False``
        (nothing taken: the caller sends its own) inside :meth:`accumulating`, for a ZeRO-2 bucket or another
        dtype, which every rank decides alike."""
        bucket = self.buckets[index]
        if self._local or index not in self._late or index in self._scatter or grad.dtype != bucket.dtype:
            return False
        self._activate()
        self._joined.setdefault(index, []).append((grad.detach(), then, node))
        return True

    def _stage(self, bucket: _Bucket, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Copy parameter ``i``'s gradient into its place in ``bucket``'s kept buffer; returns that place (or the
        gradient itself for a ZeRO-2 bucket, which is reduce-scattered from a padded copy)."""
        if bucket.index in self._scatter:
            return grad
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.params[i].device)
        place = self._place(bucket, i)
        earlier = self._earlier[i]
        if earlier is not None and earlier.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
            self._earlier[i] = earlier.clone()  # last backward's .grad is a view of the place about to be written
        place.copy_(grad)
        return place

    def _place(self, bucket: _Bucket, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in ``bucket``'s kept buffer, shaped like it (made once per buffer: a buffer that
        grows drops its members' places)."""
        assert bucket.buffer is not None
        place = self._places.get(i)
        if place is None:
            p = self.params[i]
            place = self._places[i] = bucket.buffer[bucket.offsets[i] : bucket.offsets[i] + p.numel()].view(p.shape)
        return place

    def _append(self, bucket: _Bucket, joined: list) -> torch.Tensor:
        """The bucket's kept buffer with the joined sums copied after its gradients (it grows once to hold them:
        they are the same size every step), as the flat tensor to send."""
        assert bucket.buffer is not None
        end = bucket.numel + sum(g.numel() for g, _, _ in joined)
        if bucket.buffer.numel() < end:
            grown = torch.empty(end, dtype=bucket.dtype, device=bucket.buffer.device)
            grown[: bucket.numel].copy_(bucket.buffer[: bucket.numel])
            bucket.buffer = grown
            for i in bucket.members:
                self._places.pop(i, None)
        offset = bucket.numel
        for g, _, _ in joined:
            bucket.buffer[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        return bucket.buffer[:end]

    def _reduce_now(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        r = self.reductions[i]
        return all_reduce(grad, r.group[0], len(r.ranks), self.stats, node=r.node)

    def _count(self, i: int, calls: int = 1) -> None:
        if self.stats is not None:
            self.stats.add("collective", self._volumes[i], self.reductions[i].node, calls=calls)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if bucket.index in self._scatter:
            self._launch_scatter(bucket)
            return
        bucket.sent = [i for i in bucket.members if self._grads[i] is not None]
        joined = self._joined.get(bucket.index, [])
        if not bucket.sent and not joined:
            return
        if len(bucket.sent) == len(bucket.members):  # every gradient is in its place already
            bucket.flat = self._append(bucket, joined) if joined else bucket.buffer
        else:  # a parameter without a gradient this backward keeps its place (and its .grad) untouched
            parts = [self._grads[i].reshape(-1) for i in bucket.sent]  # type: ignore[union-attr]
            bucket.flat = torch.cat(parts + [g.reshape(-1) for g, _, _ in joined])
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group[0], async_op=True)
        for k, i in enumerate(bucket.sent):
            self._count(i, calls=1 if k == 0 else 0)
        if self.stats is not None:
            factor = ring_factors("all-reduce", len(bucket.group[1]))[0]
            for k, (g, _, node) in enumerate(joined):
                first = not bucket.sent and k == 0
                self.stats.add("collective", factor * g.numel() * g.element_size(), node, calls=1 if first else 0)

    def _launch_scatter(self, bucket: _Bucket) -> None:
        """ZeRO stage 2: reduce-scatter the whole bucket (a missing gradient as zeros), padded to the group. The
        reduce-scatters launched before are waited for first (they have had the Backward of a bucket to travel):
        each holds a flat copy of its bucket's gradients until then, so at most one is in flight, as in FSDP2."""
        if all(self._grads[i] is None for i in bucket.members):
            return
        for earlier in self.buckets[: bucket.index]:
            if earlier.work is not None and earlier.index in self._scatter:
                self._take_scatter(earlier)
        bucket.sent = list(bucket.members)
        size = len(bucket.group[1])
        device = self.params[bucket.members[0]].device  # the parameters' device (a GPU under NCCL), never the CPU's
        parts = [
            torch.zeros(self.params[i].numel(), dtype=bucket.dtype, device=device) if g is None else g.reshape(-1)
            for i, g in ((i, self._grads[i]) for i in bucket.members)
        ]
        chunk = -(-bucket.numel // size)
        if chunk * size > bucket.numel:
            parts.append(torch.zeros(chunk * size - bucket.numel, dtype=bucket.dtype, device=device))
        flat = torch.cat(parts)
        del parts
        for i in bucket.members:  # the local parts are in the flat copy now: free them (ZeRO-2 keeps none)
            self._grads[i] = None
            self.params[i].grad = None
        bucket.flat = torch.empty(chunk, dtype=bucket.dtype, device=device)
        bucket.work = reduce_scatter_flat(bucket.flat, flat, *bucket.group)
        if self.stats is not None:
            for k, i in enumerate(bucket.sent):
                p, r = self.params[i], self.reductions[i]
                volume = ring_factors("reduce-scatter", size)[0] * p.numel() * p.element_size()
                self.stats.add("collective", volume, r.node, calls=1 if k == 0 else 0)

    def scatter_into(self, buckets: set[int]) -> None:
        """Reduce-scatter ``buckets`` from now on: each rank keeps its chunk of the sum (:meth:`scattered`), and
        their parameters get no ``.grad`` (ZeRO stage 2)."""
        self._scatter = set(buckets)
        for h in self._drops:
            h.remove()
        self._drops = [
            self.params[i].register_post_accumulate_grad_hook(self._drop(i))
            for b in sorted(self._scatter)
            for i in self.buckets[b].members
        ]

    def scattered(self, index: int) -> torch.Tensor | None:
        """This rank's chunk of bucket ``index``'s summed gradients since :meth:`clear_scattered`, or ``None``."""
        return self._chunks.get(index)

    def clear_scattered(self) -> None:
        self._chunks = {}

    def _finish(self) -> None:
        """End of backward: launch what is left, wait once for every bucket, write the sums into ``.grad``."""
        try:
            for bucket in self.buckets:  # what is left, and the late buckets, in index order
                if not bucket.launched:
                    self._launch(bucket)
            for bucket in self.buckets:
                if bucket.work is None:
                    continue
                if bucket.index in self._scatter:
                    self._take_scatter(bucket)
                    continue
                bucket.work.wait()  # type: ignore[attr-defined]
                if len(bucket.sent) == len(bucket.members):  # sent from the kept buffer: each sum is in its place
                    for i in bucket.sent:
                        self._write(i, self._place(bucket, i))
                    offset = bucket.numel
                else:
                    offset = 0
                    for i in bucket.sent:
                        n = self.params[i].numel()
                        self._write(i, bucket.flat[offset : offset + n])  # type: ignore[index]
                        offset += n
                for g, then, _ in self._joined.get(bucket.index, []):
                    then(bucket.flat[offset : offset + g.numel()].view(g.shape))  # type: ignore[index]
                    offset += g.numel()
        finally:
            self._reset()

    def _take_scatter(self, bucket: _Bucket) -> None:
        """Wait for a reduce-scatter and add its chunk to the ones summed since :meth:`clear_scattered` (its flat
        input goes with the work)."""
        bucket.work.wait()  # type: ignore[union-attr]
        bucket.work = None
        done = self._chunks.get(bucket.index)
        self._chunks[bucket.index] = bucket.flat if done is None else done.add_(bucket.flat)  # type: ignore[arg-type]
        for i in bucket.members:  # what autograd wrote there is the local part, now in the chunk
            self.params[i].grad = None

    def _write(self, i: int, summed: torch.Tensor) -> None:
        p, earlier = self.params[i], self._earlier[i]
        summed = summed.view(p.shape)
        if earlier is not None:
            p.grad = earlier.add_(summed)
        else:  # the bucket's own slice, no copy (what autograd wrote there is the local part, now summed)
            p.grad = summed

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in (*self._handles, *self._drops):
            h.remove()
        self._handles, self._drops = [], []

    def describe(self) -> list[dict]:
        """One row per bucket: its group, dtype, parameters and bytes (for ``explain`` and tests)."""
        return [
            {
                "bucket": b.index,
                "ranks": list(b.group[1]),
                "dtype": str(b.dtype).removeprefix("torch."),
                "params": [self.names[i] for i in b.members],
                "bytes": b.numel * torch.empty((), dtype=b.dtype).element_size(),
            }
            for b in self.buckets
        ]
