"""ZeRO stages 1, 2 and 3 for a compiled module: the optimizer's state split over each parameter's replicas.

A plan replicates a parameter block on the devices that differ only in the digits its gradient is summed over
(:class:`~primepar_fx.runtime.gradsync.GradReduction`); with ``plan.zero`` >= 1 each of those devices keeps and
updates only its share of the block's optimizer state. The shares follow the gradient buckets of
:class:`~primepar_fx.runtime.gradsync.GradientBuckets` (one process group and dtype each): a bucket's parameters,
flattened in bucket order and padded to a multiple of the group size ``r``, are cut into ``r`` equal chunks, and
the rank at position ``i`` of the group owns chunk ``i``. It keeps that chunk in fp32 (the master copy of
mixed-precision training) and the inner optimizer's state of it (AdamW: two moments):

* stage 1: backward all-reduces the gradients whole, as without ZeRO (``.grad`` holds the sum); the step takes the
  rank's chunk of them;
* stage 2: backward reduce-scatters each bucket instead, so a rank receives only its chunk of the summed
  gradient and no parameter gets a ``.grad`` (the bytes of the all-reduce split in two: half now, half in the
  all-gather below); gradients of several backwards accumulate in the chunk until :meth:`zero_grad`.

:meth:`ShardedOptimizer.step` runs the inner optimizer on the chunks, then all-gathers every bucket's updated chunks
(cast to the parameters' dtype) into the parameters. The all-gathers are asynchronous, issued in the order the next
Forward first reads the buckets (:class:`PendingGathers`): a node of the rank graph before each bucket's first
reader waits for its gather (:func:`await_before_uses`), so the later buckets travel while the first layers compute,
as Megatron-LM's distributed optimizer overlaps its parameter all-gather with the next forward. Whatever is still in
flight is waited for when Forward returns, and before anything of the module reads or writes the parameters
(``state_dict``, ``gather_state_dict``, the checkpoints, the next step); code that reads ``module.parameters()``
itself between the step and the next Forward calls :meth:`ShardedOptimizer.settle` first (or makes the optimizer
with ``gather_in_forward=False``: the step then waits for its all-gathers; so does a step under torch's profiler).
Every stage gives the numbers of the inner optimizer on whole parameters, for an optimizer that updates each element
from that element alone (SGD, Adam, AdamW and the like; not LAMB or Adafactor, whose updates read a whole tensor's
norm). Parameters no bucket shards (held by one rank, or summed over no group) are stepped as they are. Bytes sent
are counted in ``comm_stats`` under the node each parameter's gradient is priced on, as for the gradient buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.gradsync import BucketChunk, GradientBuckets
from primepar_fx.runtime.stats import CommStats
from primepar_fx.runtime.zero3 import ShardedParameters, Unit, attach


class PendingGathers:
    """Stages 1 and 2: the all-gathers of updated parameters in flight after a step, one per bucket, waited for
    where the next Forward first reads the bucket (module docstring). ``order``: the buckets in the order Forward
    first reads them (:func:`await_before_uses`; every rank alike), the order the step issues them in."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self._work: dict[int, Any] = {}

    def add(self, index: int, work: Any) -> None:
        self._work[index] = work

    def wait(self, index: int) -> None:
        """Wait for bucket ``index``'s all-gather, if one is in flight."""
        work = self._work.pop(index, None)
        if work is not None:
            work.wait()

    def settle(self) -> None:
        """Wait for every all-gather in flight: the parameters hold the step's values after it."""
        for index in list(self._work):
            self.wait(index)

    @property
    def in_flight(self) -> int:
        return len(self._work)


class AwaitGather(nn.Module):
    """A rank-graph node before the first reader of bucket ``index``'s parameters: wait for its all-gather."""

    def __init__(self, gathers: PendingGathers) -> None:
        super().__init__()
        self._gathers = [gathers]  # a list: not a submodule

    def forward(self, index: int) -> None:
        self._gathers[0].wait(index)


def await_before_uses(gm: fx.GraphModule, buckets_of: dict[str, int], gathers: PendingGathers) -> int:
    """Put an :class:`AwaitGather` node before the first reader of each bucket's parameters in ``gm`` (the
    placeholders named in ``buckets_of``, placeholder name -> bucket index) and set ``gathers.order`` to the order
    of those readers; returns how many buckets got a node."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    firsts: dict[int, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in buckets_of and n.users:
            first, index = min(n.users, key=order.__getitem__), buckets_of[n.name]
            if index not in firsts or order[first] < order[firsts[index]]:
                firsts[index] = first
    name = attach(gm, "zero_await", AwaitGather(gathers))
    for index, first in firsts.items():
        with graph.inserting_before(first):
            graph.call_module(name, (index,))
    gathers.order = sorted(firsts, key=lambda i: order[firsts[i]])
    graph.lint()
    gm.recompile()
    return len(firsts)


class _Shard(BucketChunk):
    """One bucket's chunk on this rank: where its parameters lie in the flat bucket, and the fp32 master chunk;
    ``unit``: the bucket's ZeRO-3 unit, which stores the parameters' chunk (the master is read from and written to
    it, with no all-gather; an fp32 chunk is the master itself, stepped in place, as Megatron-LM's distributed
    optimizer steps fp32 parameters)."""

    def __init__(self, buckets: GradientBuckets, index: int, rank: int, unit: Unit | None = None) -> None:
        super().__init__(buckets, index, rank)
        self.unit = unit
        self.device = self.params[0].device  # the parameters' device (a GPU under NCCL): every buffer here lives there
        #: stages 1 and 2: the parameters as views of one flat tensor, which the all-gather after the step fills
        self.flat_params = self.flatten() if unit is None else None
        #: the master is the ZeRO-3 chunk itself (fp32 parameters): stepped in place, nothing to copy either way
        self.in_place = unit is not None and self.held.dtype == torch.float32
        if self.in_place:
            self.master = nn.Parameter(self.held)
        else:
            self.master = nn.Parameter(torch.zeros(self.chunk, dtype=torch.float32, device=self.device))
            self.reload()

    @property
    def held(self) -> torch.Tensor:
        """This rank's chunk of the parameters: the ZeRO-3 unit's, or a view of the flat parameters."""
        if self.unit is not None:
            return self.unit.local
        return self.flat_params[self.start : self.start + self.chunk]  # type: ignore[index]

    def flat(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """``tensors`` (one per parameter, ``None`` as zeros) laid out as the padded flat bucket."""
        parts = [
            torch.zeros(p.numel(), dtype=p.dtype, device=self.device) if t is None else t.detach().reshape(-1)
            for p, t in zip(self.params, tensors)
        ]
        pad = self.chunk * self.size - self.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype, device=self.device))
        return torch.cat(parts)

    def reload(self) -> None:
        """Read this rank's chunk of the parameters into the master copy (after they changed from outside)."""
        with torch.no_grad():
            if self.in_place:
                return
            self.master.copy_(self.held)

    def scatter(self) -> Any:
        """Write the stepped master into this rank's chunk of the parameters; at stages 1 and 2, issue the
        all-gather of the chunks into the flat parameters, in place (the parameters are views of it: nothing to
        copy after it), and return its handle. ZeRO-3 gathers its units where they are used: ``None``."""
        if not self.in_place:
            with torch.no_grad():
                self.held.copy_(self.master.detach())
        if self.unit is not None:
            return None
        return dist.all_gather_single(self.flat_params, self.held, group=self.handle, async_op=True)

    def count(self, stats: CommStats | None) -> None:
        """The all-gather's bytes, per parameter under its node (one message per bucket)."""
        if stats is None or self.unit is not None:
            return
        bus = ring_factors("all-gather", self.size)[0]
        for k, (p, r) in enumerate(zip(self.params, self.reductions)):
            stats.add("collective", bus * p.numel() * p.element_size(), r.node, calls=1 if k == 0 else 0)


class ShardedOptimizer:
    """An optimizer of a compiled module's parameters with ZeRO stage ``stage`` (module docstring).

    ``optimizer_class(params, **defaults)`` makes the inner optimizer; its one param group holds the master chunks
    and the unsharded parameters. ``step``, ``zero_grad`` and ``param_groups`` (to change the learning rate) work
    as on any optimizer; its state is the inner optimizer's, of chunks rather than parameters. ``gathers``
    (stages 1 and 2): where the step leaves its all-gathers for the next Forward to wait on; ``None``: the step
    waits for them itself.
    """

    def __init__(
        self,
        buckets: GradientBuckets,
        params: Iterable[nn.Parameter],
        rank: int,
        stage: int,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        stats: CommStats | None = None,
        parameters: ShardedParameters | None = None,
        gathers: PendingGathers | None = None,
        **defaults: Any,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedOptimizer runs ZeRO stage 1, 2 or 3, got {stage!r}")
        if (stage == 3) != (parameters is not None):
            raise ValueError("ZeRO stage 3, and only it, steps the chunks of ShardedParameters (pass parameters=)")
        self.stage, self.buckets, self.stats = stage, buckets, stats
        self.gathers = gathers if gathers is not None and stage < 3 else None
        units = {u.index: u for u in parameters.units} if parameters is not None else {}
        self.shards = [
            _Shard(buckets, b.index, rank, units.get(b.index))
            for b in buckets.buckets
            if len(b.group[1]) > 1 and b.members
        ]
        sharded = {id(p) for s in self.shards for p in s.params}
        self.plain = [p for p in params if p.requires_grad and id(p) not in sharded]
        if stage >= 2:
            buckets.scatter_into({s.bucket.index for s in self.shards})
        self.inner = optimizer_class([*(s.master for s in self.shards), *self.plain], **defaults)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.master.grad = None
            for p in s.params:
                p.grad = None
        for p in self.plain:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.stage >= 2:
            self.buckets.clear_scattered()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure: run forward and backward before it")
        self.settle()  # a step with no Forward since the last one: its all-gathers write the chunks stepped now
        for s in self.shards:
            if self.stage >= 2:
                grad = self.buckets.scattered(s.bucket.index)
            elif any(p.grad is not None for p in s.params):
                grad = s.flat([p.grad for p in s.params])[s.start : s.start + s.chunk]
            else:
                grad = None
            s.master.grad = None if grad is None else grad.to(torch.float32)
        self.inner.step()
        for s in self._in_forward_order():
            work = s.scatter()
            s.count(self.stats)
            if work is not None and self.gathers is not None:
                self.gathers.add(s.bucket.index, work)
            elif work is not None:
                work.wait()
        if torch._C._autograd._profiler_enabled():
            # a profiler's region may end right after the step, and torch's profiler crashes when it stops while a
            # collective is still running on the process group's thread (measured with gloo): none outlives it
            self.settle()
        return None

    def _in_forward_order(self) -> list[_Shard]:
        """The shards in the order the next Forward reads their buckets (the rest after them)."""
        rank = {index: k for k, index in enumerate(self.gathers.order)} if self.gathers is not None else {}
        return sorted(self.shards, key=lambda s: rank.get(s.bucket.index, len(rank)))

    def settle(self) -> None:
        """Wait for the step's all-gathers still in flight (stages 1 and 2): the parameters hold the stepped values
        after it. The next Forward, the module's state dicts and checkpoints do this themselves."""
        if self.gathers is not None:
            self.gathers.settle()

    def reload(self) -> None:
        """Read the master chunks from the parameters again (after a checkpoint or state dict was loaded into
        them); the inner optimizer's state is kept."""
        self.settle()
        for s in self.shards:
            s.reload()

    def as_params(self) -> PerParameterState:
        """This optimizer seen per parameter, as a plain optimizer of ``module.parameters()`` would be: each state
        tensor gathered over the bucket's group and cut to the parameter's shape (the checkpoints read and load it
        this way, so a ZeRO optimizer's state moves to any other plan). Collective: every rank calls it."""
        return PerParameterState(self)

    def describe(self) -> list[dict[str, Any]]:
        """One row per sharded bucket: its group, this rank's chunk and the parameters it spans."""
        return [
            {
                "bucket": s.bucket.index,
                "ranks": list(s.ranks),
                "chunk": [s.start, s.start + s.chunk],
                "elements": s.numel,
                "params": [self.buckets.names[i] for i in s.members],
            }
            for s in self.shards
        ]


class PerParameterState:
    """A :class:`ShardedOptimizer` as an optimizer of whole parameter blocks: ``state``, ``param_groups`` and
    ``load_state_dict`` in ``torch.optim.Optimizer``'s formats (:meth:`ShardedOptimizer.as_params`)."""

    def __init__(self, sharded: ShardedOptimizer) -> None:
        self.sharded = sharded
        inner = sharded.inner
        params = [p for s in sharded.shards for p in s.params] + list(sharded.plain)
        hyper = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        self.param_groups = [{**hyper, "params": params}]
        self.state: dict[nn.Parameter, dict[str, Any]] = {}
        for s in sharded.shards:
            held = inner.state.get(s.master, {})
            for key, value in held.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    whole = torch.empty(s.chunk * s.size, dtype=value.dtype, device=value.device)
                    dist.all_gather_single(whole, value.detach().contiguous(), group=s.handle)
                    offset = 0
                    for p in s.params:
                        self.state.setdefault(p, {})[key] = whole[offset : offset + p.numel()].view(p.shape).clone()
                        offset += p.numel()
                else:
                    for p in s.params:
                        self.state.setdefault(p, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for p in sharded.plain:
            if p in inner.state:
                self.state[p] = dict(inner.state[p])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load per-parameter state (``param_groups[0]["params"]``'s order) into the chunks and the inner
        optimizer."""
        sharded, inner = self.sharded, self.sharded.inner
        (group,) = state_dict["param_groups"]
        by_param = {p: state_dict["state"].get(i, {}) for i, p in zip(group["params"], self.param_groups[0]["params"])}
        out: dict[int, dict[str, Any]] = {}
        for index, s in enumerate(sharded.shards):
            held = [by_param[p] for p in s.params]
            if not any(held):
                continue
            chunk: dict[str, Any] = {}
            for key in held[0]:
                first = held[0][key]
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    flat = s.flat([h.get(key) for h in held])
                    chunk[key] = flat[s.start : s.start + s.chunk].to(first.dtype).clone()
                else:
                    chunk[key] = first
            out[index] = chunk
        base = len(sharded.shards)
        for k, p in enumerate(sharded.plain):
            if by_param.get(p):
                out[base + k] = dict(by_param[p])
        hyper = {k: v for k, v in group.items() if k != "params"}
        inner.load_state_dict(
            {"state": out, "param_groups": [{**hyper, "params": list(range(base + len(sharded.plain)))}]}
        )
