"""ZeRO stage 3 for a compiled module: each replicated parameter block held in chunks, gathered only while in use.

Stages 1 and 2 (:mod:`primepar_fx.runtime.zero`) split the optimizer state and the gradient of a parameter over
the ranks that hold the same block of it; stage 3 splits the block itself, as FSDP does, and runs as FSDP2 runs
it. The unit is a gradient bucket of :class:`~primepar_fx.runtime.gradsync.GradientBuckets` (one process group and
dtype), cut by :func:`~primepar_fx.compiler.zero3.zero3_units`: a whole layer, as FSDP2 wraps each block (what
Backward reads of it apart from what it does not: its biases), and the parameters before and after the layers:

* at compile time the unit's parameters are laid out in one flat tensor, padded to a multiple of the group size
  ``r``; the rank at position ``i`` of the group keeps chunk ``i`` of it (:attr:`Unit.local`, the parameters'
  dtype: the stored parameter), and the flat tensor's storage is freed. Each parameter stays an ``nn.Parameter``
  of its block's shape, a view of that storage, so the graph, the gradient hooks and the optimizer see the same
  tensors as without ZeRO;
* Forward: a node before the unit's first use in the rank graph all-gathers the chunks into the storage, one
  message, and issues the next unit's gather (asynchronous: it travels while this unit computes, and the next
  unit's node waits for it); a node after its last use (its views' uses included) frees it again
  (:func:`gather_around_uses`). Whatever is left is freed when Forward returns, but the units kept whole for
  Backward (:func:`~primepar_fx.pricing.zero3.kept_whole`: the head and the final norm, which Backward needs first);
* Backward: a tensor that autograd saves from a unit (the weight a matmul keeps for its input gradient) is kept as
  a reference (:meth:`ShardedParameters.pack`), and the unit is gathered again when Backward unpacks it, which
  issues the gather of the unit Backward needs next (the units Backward reads, in the reverse of Forward's order);
  a recomputed layer (:class:`~primepar_fx.passes.recompute.Checkpointed`) gathers what it reads before it runs
  again. The unit is freed when the gradient of each of its parameters has arrived (nothing in Backward reads it
  after that), and at the end of Backward in any case. So at most two units are whole at once, besides the kept
  ones, as with FSDP2's prefetching;
* the gradients are reduce-scattered into chunks as at stage 2, a unit's as soon as its last gradient is in
  (asynchronous, at most one in flight), and :class:`~primepar_fx.runtime.zero.ShardedOptimizer` steps the chunks
  in place (fp32; else through an fp32 master it writes back into :attr:`Unit.local`): no all-gather after the step.

So a rank sends, per parameter block of ``b`` bytes over ``r`` ranks, an all-gather before Forward of every
micro-batch and one before Backward where Backward reads the block and it was not kept (``(r-1)/r b`` each), and
one reduce-scatter a step, as the cost model prices stage 3; every gather is counted in ``comm_stats`` under the
node its parameter's gradient is priced on. Every rank of a group gathers its units in the same order: the rank
graphs run the same nodes, and Backward unpacks in the same order everywhere.

On GPUs (NCCL) the same code overlaps without a host synchronisation: an asynchronous collective runs on NCCL's
own stream, ``wait()`` makes the computing stream wait for its event (the host goes on), and the collective
records its tensors' use on its stream, so a storage freed after its last use on the computing stream is reused
only after both streams are done with it. This is designed, not yet measured: ``bench/gpu_check.py`` times this
runtime against FSDP2 per rank, and a multi-GPU run has yet to time the streams.

Outside a step the parameters hold no values: read or write them inside :meth:`ShardedParameters.whole` (what
``gather_state_dict``, ``load_state_dict`` and the checkpoints do), never through ``module.parameters()`` directly
(a freed storage read is undefined: FSDP's parameters are the same outside their ``summon_full_params``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.gradsync import BucketChunk, GradientBuckets
from primepar_fx.runtime.stats import CommStats


class Unit(BucketChunk):
    """One bucket's parameters on this rank: their flat storage (whole only while gathered) and this rank's chunk."""

    def __init__(self, buckets: GradientBuckets, index: int, rank: int) -> None:
        super().__init__(buckets, index, rank)
        self.flat = self.flatten()
        #: this rank's chunk of the flat parameters: what the rank stores between uses
        self.local = self.flat[self.start : self.start + self.chunk].clone()
        self.storage = self.flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        #: the storage holds the values, or will once :attr:`work` (a prefetch in flight) is waited on
        self.whole = True
        self.work: Any = None
        #: whether Backward gathers it again (some parameter of it is read there): the units Backward prefetches
        self.read = True
        #: kept whole from Forward to Backward (:func:`~primepar_fx.pricing.zero3.kept_whole`): not freed after Forward
        self.kept = False

    @property
    def key(self) -> int:
        return self.storage._cdata

    def write_back(self) -> None:
        """Take this rank's chunk from the whole flat tensor (after the parameters were written)."""
        with torch.no_grad():
            self.local.copy_(self.flat[self.start : self.start + self.chunk])


class ShardedParameters:
    """The stage-3 units of ``buckets`` (each bucket over more than one rank; module docstring)."""

    def __init__(
        self,
        buckets: GradientBuckets,
        rank: int,
        stats: CommStats | None = None,
        read: Collection[str] | None = None,
        kept: Collection[str] = (),
    ) -> None:
        self.stats = stats
        self.units = [Unit(buckets, b.index, rank) for b in buckets.buckets if len(b.group[1]) > 1 and b.members]
        for u in self.units:
            u.read = read is None or any(buckets.names[i] in read for i in u.members)
            u.kept = u.read and all(buckets.names[i] in kept for i in u.members)
        #: unit index -> the unit gathered next in Forward, and in Backward (:meth:`set_order`)
        self._next: tuple[dict[int, Unit], dict[int, Unit]] = ({}, {})
        #: bucket index -> its unit (what the graph's nodes name)
        self.by_index = {u.index: u for u in self.units}
        self._by_storage = {u.key: u for u in self.units}
        self._by_param = {id(p): u for u in self.units for p in u.params}
        self._left: dict[int, int] = {}  # unit index -> gradients still to come in this backward
        self._queued = False
        self.gathers = 0  # all-gathers run so far (tests and benchmarks)
        self._handles = [p.register_hook(self._arrived(u)) for u in self.units for p in u.params]
        for u in self.units:
            self.release(u)

    # ------------------------------------------------------------------------------------------------ gather / free
    def unit_of(self, value: object) -> Unit | None:
        """The unit whose storage ``value`` (a parameter or a view of one) lives in, else ``None``."""
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            return None
        try:
            return self._by_storage.get(value.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (a subclass)
            return None

    def unit_of_param(self, p: nn.Parameter) -> Unit | None:
        return self._by_param.get(id(p))

    def set_order(self, order: Sequence[int]) -> None:
        """The units in the order Forward first uses them (every rank alike): each one's gather issues the next
        one's, in Forward and, among the units Backward gathers again, in the reverse order in Backward."""
        forward = [self.by_index[i] for i in order]
        backward = [u for u in reversed(forward) if u.read and not u.kept]
        after = {a.index: b for a, b in zip(backward, backward[1:])}
        if backward:  # Backward starts with the units kept whole: their first use there issues the first gather
            after.update((u.index, backward[0]) for u in forward if u.kept)
        self._next = ({a.index: b for a, b in zip(forward, forward[1:])}, after)

    def released_after_forward(self, index: int) -> bool:
        """Whether unit ``index`` is freed after its last use in Forward (all but the kept ones)."""
        return not self.by_index[index].kept

    def gather(self, unit: Unit) -> None:
        """Make ``unit`` whole (all-gather the chunks of its group into its storage, or wait for its prefetch), and
        issue the gather of the unit after it (Forward's order, or Backward's in Backward), which then travels
        while this one's nodes compute."""
        backward = torch._C._current_graph_task_id() != -1
        self._launch(unit)
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        after = self._next[backward].get(unit.index)
        if after is not None:
            self._launch(after)

    def _launch(self, unit: Unit) -> None:
        """Issue the all-gather of ``unit`` (asynchronous: :attr:`Unit.work`) unless it is whole or on its way."""
        if unit.whole:
            return
        unit.storage.resize_(unit.nbytes)
        with torch.no_grad():
            unit.work = dist.all_gather_into_tensor(unit.flat, unit.local, group=unit.handle, async_op=True)
        unit.whole = True
        self.gathers += 1
        if self.stats is not None:
            bus = ring_factors("all-gather", unit.size)[0]
            for k, (p, r) in enumerate(zip(unit.params, unit.reductions)):
                self.stats.add("collective", bus * p.numel() * p.element_size(), r.node, calls=1 if k == 0 else 0)
        if torch._C._current_graph_task_id() != -1:  # gathered again in Backward: freed at its end at the latest
            self._queue_end()

    def release(self, unit: Unit) -> None:
        if unit.whole:
            if unit.work is not None:  # a prefetch in flight writes into the storage: let it land first
                unit.work.wait()
                unit.work = None
            unit.storage.resize_(0)
            unit.whole = False

    def release_all(self) -> None:
        for u in self.units:
            self.release(u)

    def ensure(self, values: Iterable[object]) -> None:
        """Gather every unit that a tensor of ``values`` lives in (a recomputed layer's inputs)."""
        for v in values:
            unit = self.unit_of(v)
            if unit is not None:
                self.gather(unit)

    # ------------------------------------------------------------------------------------------------ backward
    def pack(self, t: torch.Tensor) -> object:
        unit = self.unit_of(t)
        return t if unit is None else _Saved(unit, t)

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, _Saved):
            self.gather(packed.unit)
            return packed.tensor
        return packed  # type: ignore[return-value]

    def _arrived(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            self._queue_end()
            left = self._left.get(unit.index, len(unit.params)) - 1
            self._left[unit.index] = left
            if left == 0:  # every parameter's gradient is in: nothing in this backward reads the unit again
                self.release(unit)

        return hook

    def _queue_end(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        self._left = {}
        self.release_all()

    # ------------------------------------------------------------------------------------------------ contexts
    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One run of the rank graph: saved tensors of units kept as references; every unit freed after it but the
        kept ones, when a Backward is to come (they are freed when their gradients are in, and at the end of
        Backward). Whatever an earlier run left whole is freed first: the optimizer may have stepped since."""
        self.release_all()
        backward = torch.is_grad_enabled()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for u in self.units:
                if not (backward and u.kept):
                    self.release(u)

    @contextlib.contextmanager
    def whole(self, write: bool = False) -> Iterator[None]:
        """Every parameter whole inside (collective: every rank enters it); with ``write``, what was written into
        them becomes each rank's chunk on the way out."""
        self.release_all()  # a unit left whole by a Forward without Backward may hold values from before a step
        for u in self.units:
            self.gather(u)
        try:
            yield
            if write:
                for u in self.units:
                    u.write_back()
        finally:
            self.release_all()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _Saved:
    """A tensor saved for Backward that lives in a unit's storage: gathered again when Backward unpacks it."""

    __slots__ = ("tensor", "unit")

    def __init__(self, unit: Unit, tensor: torch.Tensor) -> None:
        self.unit, self.tensor = unit, tensor


# ---------------------------------------------------------------------------------------------------- graph pass
class GatherUnit(nn.Module):
    """A rank-graph node: gather unit ``index`` before its first use."""

    def __init__(self, store: ShardedParameters) -> None:
        super().__init__()
        self._store = [store]  # a list: not a submodule, its tensors not the graph module's

    def forward(self, index: int) -> None:
        store = self._store[0]
        store.gather(store.by_index[index])


class ReleaseUnit(nn.Module):
    """A rank-graph node after the last use of unit ``index`` in Forward: free it, unless an output of a node the
    pass cannot see into (``outputs``) lives in it still (then it is freed when Forward returns)."""

    def __init__(self, store: ShardedParameters) -> None:
        super().__init__()
        self._store = [store]

    def forward(self, index: int, *outputs: Any) -> None:
        store = self._store[0]
        unit = store.by_index[index]
        if any(store.unit_of(t) is unit for t in pytree.tree_leaves(outputs)):
            return
        store.release(unit)


def _aliases_input(node: fx.Node) -> bool | None:
    """Whether ``node``'s output may be a view of its inputs: ``True``/``False`` for an ATen op (its schema says)
    and ``getitem``; ``None`` where it cannot be told from the graph (a submodule or another function)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return None


def gather_around_uses(gm: fx.GraphModule, units_of: dict[str, int], store: ShardedParameters) -> int:
    """Put a :class:`GatherUnit` node before the first use of each unit's parameters (the placeholders named in
    ``units_of``, placeholder name -> unit index) and a :class:`ReleaseUnit` node after the last use of them or of
    any view of them, and tell ``store`` the order of the gathers (:meth:`ShardedParameters.set_order`: each
    prefetches the next); returns how many units got nodes. Recomputed layers gather what they read again
    (``before_run``)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in units_of and n.users:
            placeholders.setdefault(units_of[n.name], []).append(n)
    gather = attach(gm, "zero3_gather", GatherUnit(store))
    release = attach(gm, "zero3_release", ReleaseUnit(store))
    done, firsts = 0, []
    for index, starts in sorted(placeholders.items()):
        views, users, opaque = set(starts), set(), []
        stack = list(starts)
        while stack:
            for u in stack.pop().users:
                users.add(u)
                aliasing = _aliases_input(u)
                if aliasing and u not in views:
                    views.add(u)
                    stack.append(u)
                elif aliasing is None and u.op != "output" and u not in opaque:
                    opaque.append(u)
        if any(u.op == "output" for u in users):
            continue  # returned as an output: freed only when Forward returns
        first = min(users, key=order.__getitem__)
        last = max(users, key=order.__getitem__)
        with graph.inserting_before(first):
            graph.call_module(gather, (index,))
        if store.released_after_forward(index):
            with graph.inserting_after(last):
                graph.call_module(release, (index, *sorted(opaque, key=order.__getitem__)))
        firsts.append((order[first], index))
        done += 1
    store.set_order([index for _, index in sorted(firsts)])
    for mod in gm.modules():  # recomputed layers (:class:`~primepar_fx.passes.recompute.Checkpointed`)
        if hasattr(mod, "before_run"):
            mod.before_run = store.ensure
    graph.lint()
    gm.recompile()
    return done


def attach(gm: fx.GraphModule, name: str, mod: nn.Module) -> str:
    """Add ``mod`` to ``gm`` as submodule ``name`` (unless it has one of that name, from an earlier pass); its name."""
    if not hasattr(gm, name):
        gm.add_submodule(name, mod)
    return name
