"""A pipelined plan run on its ranks: each stage's graph on its own mesh, the schedule run by
``torch.distributed.pipelining``.

A plan with ``plan.pipeline`` (:class:`~primepar_fx.record.pipeline.Pipeline`) splits the ``world`` ranks into
``p`` blocks of ``q = world / p`` consecutive ranks; block ``s`` runs the stages ``s, s + p, ...`` (``v`` of them:
interleaving) on a mesh of the plan's ``digits``. Every rank

1. localises the whole captured graph, at one micro-batch's sizes, for its mesh rank ``r = rank % q``, over process
   groups of its own block (:class:`~primepar_fx.runtime.groups.ProcessGroups` with ``stages=p``: the groups of
   every block are created alike on every rank; point-to-point peers are offset by ``s * q``);
2. cuts that graph into the ``p * v`` stage graphs (:func:`~primepar_fx.passes.stages.cut_stages`, at the layers
   of ``pipeline.layers_per_stage``) and keeps its block's, each in a :class:`StageModule` with its parameters'
   shards (only the parameters its stages read);
3. wraps each in a ``PipelineStage`` on the pipeline group of its mesh position (ranks ``r, r + q, ...``): rank
   ``(s, r)`` sends the tensors leaving its stage to rank ``(s + 1, r)``, which holds the same mesh position of the
   next stage, so a block crosses unchanged;
4. runs the plan's schedule (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``) over
   ``pipeline.micro_batches`` micro-batches of the batch: :meth:`PipelinedModule.step` runs Forward and Backward
   of the whole batch and returns its loss (the mean of the micro-batches' losses, on every rank).

Gradients: each stage's gradient buckets (:class:`~primepar_fx.runtime.gradsync.GradientBuckets`) keep the
micro-batches' gradients local until the stage's last Backward, which sums them over the stage's replicas once;
each micro-batch's loss is divided by the micro-batch count before its Backward. A parameter read by two stages (a
tied embedding and head) has a copy in each; their gradients are summed between the stages' ranks after the
schedule, so the copies stay equal under an element-wise optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import sympy
import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.export._tree_utils import reorder_kwargs
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from primepar_fx.compiler.inputs import InputSpec, at_sizes, bind_call, input_spec, unused_tied
from primepar_fx.compiler.rankgraph import rank_graph_for
from primepar_fx.cost.latency import ring_factors
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes.localize import RankGraph
from primepar_fx.passes.stages import StageGraph, cut_stages
from primepar_fx.pricing.pipelined import stage_pieces
from primepar_fx.record.plan import Plan
from primepar_fx.runtime.exchange import Exchange, full_layout
from primepar_fx.runtime.gradsync import GradientBuckets
from primepar_fx.runtime.groups import ProcessGroups, set_stage_offset
from primepar_fx.runtime.stats import CommStats
from primepar_fx.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)

#: the schedules the runtime runs, by the plan's name
SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B}


def stage_of_nodes(graph: OpGraph, layers_per_stage: tuple[int, ...]) -> dict[str, int]:
    """Each captured node -> the stage its piece goes to (piece ``i`` is layer ``i``, the first and last pieces
    with the nodes before and after the layer stack)."""
    pieces = stage_pieces(graph)
    if pieces is None or len(pieces) != sum(layers_per_stage):
        held = "no layer stack" if pieces is None else f"{len(pieces)} layers"
        raise ValueError(f"the plan's stages hold {sum(layers_per_stage)} layers but {graph.name} has {held}")
    out, piece = {}, 0
    for stage, layers in enumerate(layers_per_stage):
        for _ in range(layers):
            out.update(dict.fromkeys(pieces[piece], stage))
            piece += 1
    return out


def pipeline_values(graph: OpGraph, plan: Plan) -> dict[sympy.Symbol, int]:
    """``B`` and ``S`` of one micro-batch of the example (the sizes each stage graph is built for)."""
    captured, m = graph.captured, plan.pipeline.micro_batches  # type: ignore[union-attr]
    return {B: captured.example_batch // m, S: captured.example_seq}


class StageModule(nn.Module):
    """One stage of one rank: its graph and the shards of the parameters it reads.

    Called as ``stage(*received, **inputs)``: the tensors from the stage before, then every user input by its
    placeholder name (each stage reads those it needs). The last stage returns the loss alone."""

    def __init__(self, cut: StageGraph, feeds: list[tuple[str, Any]], loss_index: int | None, stats: CommStats) -> None:
        super().__init__()
        self.graph_module = cut.gm
        self.stats = stats
        self.received = len(cut.received)
        self._feeds = feeds  # per input placeholder: ("param", key) / ("buffer", key) / ("user", name)
        self.shards = nn.ParameterDict()
        self._loss_index = loss_index

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        call: list[Any] = list(received)
        for kind, key in self._feeds:
            if kind == "param":
                call.append(self.shards[key])
            elif kind == "buffer":
                call.append(getattr(self, key))
            else:
                call.append(inputs[key])
        out = self.graph_module(*call)
        # what the engine sends: the received tensors' gradients back, this stage's outputs on
        back = sum(x.numel() * x.element_size() for x in received if x.requires_grad)
        self.stats.add("pipeline", back, calls=sum(x.requires_grad for x in received))
        if self._loss_index is None:
            self.stats.add("pipeline", sum(x.numel() * x.element_size() for x in out), calls=len(out))
            return tuple(out)
        return pytree.tree_leaves(out)[self._loss_index]


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose Backwards before the last keep their gradients local (the stage's gradient
    buckets sum them over the replicas in the last one)."""

    def __init__(self, module: StageModule, buckets: GradientBuckets, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self.buckets = buckets

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if last_backward:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        with self.buckets.accumulating():
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)


class PipelinedModule(nn.Module):
    """This rank's stages of a pipelined plan (module docstring). Train with :meth:`step`, which runs Forward and
    Backward of a whole batch; there is no separate ``forward``.

    Attributes:
        plan: the :class:`Plan` it runs.
        stage_modules: this rank's :class:`StageModule` s, in stage order (``v`` of them under interleaving).
        stage_indices: their stage numbers (``s, s + p, ...``).
        comm_stats: bytes this rank sends (:class:`~primepar_fx.runtime.CommStats`): inside its stages as any
            plan's, the sums of shared parameters' copies as ``"collective"``, and what its stages send to the next
            and back as ``"pipeline"``.
        fallbacks: nodes that run whole because their partition has no local form.
    """

    def __init__(self, graph: OpGraph, plan: Plan, rank: int, world: int, rank_graph: RankGraph, cuts, groups):
        super().__init__()
        pipeline = plan.pipeline
        assert pipeline is not None
        self.plan, self.rank = plan, rank
        self._graph = graph
        self._p, self._q = pipeline.stages, world // pipeline.stages
        self.block, self.mesh_rank = divmod(rank, self._q)
        self.mesh = DeviceMesh(tuple(plan.digits))
        self.comm_stats: CommStats = rank_graph.stats
        self.fallbacks = tuple(rank_graph.fallbacks)
        self._pp_group, self._tied_groups = groups
        self._kinds = _placeholder_kinds(graph)
        self._stage_layouts = {self._kinds[n][1]: lay for n, lay in rank_graph.param_layouts.items()}
        self._params_of = [sorted(self._kinds[n][1] for n in c.inputs if self._kinds[n][0] == "param") for c in cuts]
        self.stage_indices = [k for k in range(len(cuts)) if k % self._p == self.block]
        self._aliases = unused_tied(graph)  # unused tied name -> the used name sharing its storage
        #: each parameter this rank holds -> its layout over the world's ranks (its blocks' ranks hold it, as the
        #: stage's mesh lays it out; the others hold nothing): what checkpoints read and write
        self._layouts = {fqn: self._world_layout(fqn, world) for k in self.stage_indices for fqn in self._params_of[k]}
        #: the ZeRO optimizers of :meth:`optimizer` (their master copies follow loaded parameters)
        self._sharded: list[ShardedOptimizer] = []
        self.stage_modules = nn.ModuleList()
        self.grad_buckets: list[GradientBuckets] = []
        loss_index = _loss_index(graph)
        for k in self.stage_indices:
            self.stage_modules.append(self._stage_module(cuts[k], loss_index if k == len(cuts) - 1 else None))
            self.grad_buckets.append(self._buckets(self.stage_modules[-1], rank_graph))
        self._schedule = self._make_schedule(len(cuts))

    # ------------------------------------------------------------------------------------------------ building
    def _stage_module(self, cut: StageGraph, loss_index: int | None) -> StageModule:
        feeds: list[tuple[str, Any]] = []
        for name in cut.inputs:
            kind, what = self._kinds[name]
            feeds.append((kind, _key(what) if kind in ("param", "buffer") else f"user:{what.name}"))
        module = StageModule(cut, feeds, loss_index, self.comm_stats)
        program = self._graph.captured.program
        for name in cut.inputs:
            kind, fqn = self._kinds[name]
            if kind == "param":
                full = program.state_dict[fqn]
                shard = Exchange.plan(
                    full_layout(tuple(full.shape), self.mesh.size), self._stage_layouts[fqn], self.mesh, self.mesh_rank
                )
                module.shards[_key(fqn)] = nn.Parameter(
                    shard.run(full.detach()).clone(), requires_grad=full.requires_grad
                )
            elif kind == "buffer":
                value = program.state_dict[fqn] if fqn in program.state_dict else program.constants[fqn]
                module.register_buffer(_key(fqn), value.detach().clone(), persistent=False)
        return module

    def _world_layout(self, fqn: str, world: int) -> tuple:
        """``fqn``'s layout over the world: the stage layout on the ranks of each block that holds it."""
        stage = self._stage_layouts[fqn]
        holders = {k % self._p for k, names in enumerate(self._params_of) if fqn in names}
        nothing = tuple(() for _ in stage[0])
        return tuple(stage[g % self._q] if g // self._q in holders else nothing for g in range(world))

    def _buckets(self, module: StageModule, rank_graph: RankGraph) -> GradientBuckets:
        reductions = rank_graph.grad_reductions
        entries = []
        for name, r in reductions.items():
            key = _key(self._kinds[name][1])
            if key in module.shards:
                entries.append((self._kinds[name][1], module.shards[key], r))
        buckets = GradientBuckets(entries, self.comm_stats)
        buckets.take_deferred(module.graph_module)
        return buckets

    def _make_schedule(self, count: int) -> Any:
        pipeline = self.plan.pipeline
        assert pipeline is not None
        device = torch.device("cpu") if dist.get_backend() != "nccl" else torch.device("cuda")
        stages = [
            _Stage(mod, buckets, k, count, device, group=self._pp_group)
            for mod, buckets, k in zip(self.stage_modules, self.grad_buckets, self.stage_indices)
        ]
        specs = {f"user:{s.name}": _chunk_spec(s) for s in self._user_specs()}
        cls = SCHEDULES[pipeline.schedule]
        m = pipeline.micro_batches
        # each micro-batch's loss over m, rather than the gradients divided by m after the schedule (which divides
        # .grad only: ZeRO-2's gradients are reduce-scattered chunks by then)
        loss = functools.partial(_micro_batch_loss, m=m)
        return cls(
            stages if pipeline.virtual_stages > 1 else stages[0], m, loss, kwargs_chunk_spec=specs, scale_grads=False
        )

    def _user_specs(self) -> list[InputSpec]:
        return [what for kind, what in self._kinds.values() if kind == "user"]  # type: ignore[misc]

    # ------------------------------------------------------------------------------------------------ running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"the plan runs as a pipeline of {self.plan.pipeline.describe()}: train it with "  # type: ignore[union-attr]
            "module.step(*inputs), which runs Forward and Backward of the whole batch and returns its loss"
        )

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and Backward of one batch (the model's arguments, as compiled) under the plan's schedule; the
        parameters' ``.grad`` hold the batch's gradients after it. Returns the loss of the batch (the mean of the
        micro-batches' losses) on every rank."""
        set_stage_offset(self.block * self._q)  # (another module built in this process may have moved it)
        flat = _flat_inputs(self._graph, args, kwargs)
        specs = self._user_specs()
        if len(flat) != len(specs):
            raise ValueError(f"{len(flat)} inputs but the module was compiled with {len(specs)}")
        inputs = {f"user:{s.name}": x for s, x in zip(specs, flat)}
        m = self.plan.pipeline.micro_batches  # type: ignore[union-attr]
        losses: list[torch.Tensor] = []
        self._schedule.step(target=torch.zeros(m), losses=losses, return_outputs=False, **inputs)
        self._sum_tied_gradients()
        with torch.no_grad():  # (each micro-batch's loss is over m already)
            loss = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros(())
        dist.broadcast(loss, group=self._pp_group, group_src=self._p - 1)
        return loss

    def _sum_tied_gradients(self) -> None:
        """A parameter with copies in several stages: its gradient is the sum of theirs, on every copy."""
        for fqn, (group, mine) in self._tied_groups.items():
            copies = [m.shards[_key(fqn)] for m in self.stage_modules if _key(fqn) in m.shards]
            if not copies:
                continue
            grads = [c.grad for c in copies if c.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(copies[0])
            if group is not None and mine:
                dist.all_reduce(total, group=group)
                ranks = dist.get_world_size(group)
                self.comm_stats.add(
                    "collective", ring_factors("all-reduce", ranks)[0] * total.numel() * total.element_size()
                )
            for c in copies:
                c.grad = total.clone()

    def optimizer(self, optimizer_class: Any = torch.optim.AdamW, /, **defaults: Any) -> Any:
        """The optimizer the plan prices: ``optimizer_class(self.parameters(), **defaults)`` (every stage's shards,
        tied copies each), or with ZeRO-1 one
        :class:`~primepar_fx.runtime.zero.ShardedOptimizer` a stage, stepped together (:class:`StagesOptimizer`)."""
        if not self.plan.zero:
            return optimizer_class(self.parameters(), **defaults)
        sharded = StagesOptimizer(
            [
                ShardedOptimizer(
                    buckets, mod.parameters(), self.mesh_rank, self.plan.zero, optimizer_class, self.comm_stats,
                    **defaults,
                )
                for mod, buckets in zip(self.stage_modules, self.grad_buckets)
            ]
        )  # fmt: skip
        self._sharded.extend(sharded.optimizers)
        return sharded

    # ------------------------------------------------------------------------------------------------ full tensors
    def _gather(self, local_of: Any) -> dict[str, torch.Tensor]:
        """Whole tensors of every parameter on every rank (collective): each stage's blocks gathered in its block of
        ranks, then broadcast along the pipeline group. ``local_of(module, key)``: this rank's block, or ``None``."""
        set_stage_offset(self.block * self._q)
        out: dict[str, torch.Tensor] = {}
        program = self._graph.captured.program
        for k, names in enumerate(self._params_of):
            holder = k % self._p
            for fqn in names:
                if fqn in out:
                    continue
                shape = tuple(program.state_dict[fqn].shape)
                full = None
                if holder == self.block:
                    mod = self.stage_modules[self.stage_indices.index(k)]
                    local = local_of(mod, _key(fqn))
                    if local is None:
                        local = torch.zeros_like(mod.shards[_key(fqn)])
                    gather = Exchange.plan(
                        self._stage_layouts[fqn], full_layout(shape, self.mesh.size), self.mesh, self.mesh_rank
                    )
                    full = gather.run(local.detach().contiguous()).clone()
                else:
                    full = torch.empty(shape, dtype=program.state_dict[fqn].dtype)
                dist.broadcast(full, group=self._pp_group, group_src=holder)
                out[fqn] = full
        return out

    def _with_aliases(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for alias, fqn in unused_tied(self._graph).items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters by their original names, tied ones under each name (collective)."""
        return self._with_aliases(self._gather(lambda mod, key: mod.shards[key]))

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """Whole gradients by the original parameter names (collective)."""
        return self._with_aliases(self._gather(lambda mod, key: mod.shards[key].grad))

    def full_shape(self, fqn: str) -> tuple[int, ...]:
        """The whole shape of parameter ``fqn``."""
        return tuple(self._graph.captured.program.state_dict[fqn].shape)

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter of the model (not only this rank's stages'): its whole shape and dtype."""
        state = self._graph.captured.program.state_dict
        return {fqn: (tuple(state[fqn].shape), state[fqn].dtype) for names in self._params_of for fqn in names}

    def copies(self, fqn: str) -> list[nn.Parameter]:
        """This rank's copies of parameter ``fqn`` (one a stage of this rank that reads it)."""
        return [mod.shards[_key(fqn)] for mod in self.stage_modules if _key(fqn) in mod.shards]

    def shard_tensor(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole tensor laid out like parameter ``fqn`` (local: no communication)."""
        if tuple(full.shape) != self.full_shape(fqn):
            raise ValueError(f"{fqn!r} has shape {tuple(full.shape)}, the model's is {self.full_shape(fqn)}")
        move = Exchange.plan(
            full_layout(tuple(full.shape), self.mesh.size), self._stage_layouts[fqn], self.mesh, self.mesh_rank
        )
        return move.run(full)

    def whole_parameters(self, write: bool = False) -> Any:
        """A context in which every parameter holds its values: always (no ZeRO-3 under a pipeline)."""
        return contextlib.nullcontext()

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's block of each parameter its stages read (the first stage's copy of a tied one)."""
        out: dict[str, torch.Tensor] = {}
        for names, k in ((self._params_of[k], k) for k in self.stage_indices):
            mod = self.stage_modules[self.stage_indices.index(k)]
            for fqn in names:
                out.setdefault(fqn, mod.shards[_key(fqn)])
        return out


def _key(fqn: str) -> str:
    """A parameter or buffer's name as a key of a module (no dots)."""
    return fqn.replace(".", "__")


class StagesOptimizer:
    """The ZeRO optimizers of a rank's stages (one :class:`~primepar_fx.runtime.zero.ShardedOptimizer` each) as
    one: ``step`` and ``zero_grad`` run each; ``param_groups`` lists every one's groups (to change the rate)."""

    def __init__(self, optimizers: list[ShardedOptimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def _micro_batch_loss(output: torch.Tensor, target: Any, *, m: int) -> torch.Tensor:
    """The pipeline's loss function: the last stage returns the model's loss already; over ``m`` micro-batches."""
    return output / m


def _chunk_spec(spec: InputSpec) -> Any:
    dims = [d for d, e in enumerate(spec.shape or ()) if sympy.sympify(e) == B]
    return TensorChunkSpec(dims[0]) if dims else _Replicate()


def _placeholder_kinds(graph: OpGraph) -> dict[str, tuple[str, Any]]:
    """Each captured placeholder -> ``("param", fqn)``, ``("buffer", name)``, ``("user", InputSpec)``."""
    captured = graph.captured
    specs = captured.program.graph_signature.input_specs
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    out: dict[str, tuple[str, Any]] = {}
    for node, spec in zip(placeholders, specs, strict=True):
        if spec.kind is InputKind.PARAMETER:
            out[node.name] = ("param", spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            out[node.name] = ("buffer", spec.target)
        elif spec.kind is InputKind.USER_INPUT:
            out[node.name] = ("user", input_spec(node, captured.symbol_map))
        else:
            raise NotImplementedError(f"input {spec.target} of kind {spec.kind.name} is not supported")
    return out


def _loss_index(graph: OpGraph) -> int:
    """The position of the loss among the captured graph's flat outputs (a 0-dim floating tensor)."""
    (output,) = [n for n in graph.captured.gm.graph.nodes if n.op == "output"]
    leaves = pytree.tree_leaves(output.args[0])
    found = [
        k
        for k, n in enumerate(leaves)
        if isinstance(n, fx.Node)
        and isinstance(v := n.meta.get("val"), torch.Tensor)
        and v.dim() == 0
        and v.is_floating_point()
    ]
    if len(found) != 1:
        raise ValueError(
            f"a pipelined plan needs the model to return one loss (a 0-dim floating tensor, such as a Hugging Face "
            f"model's loss when given labels); {graph.name}'s outputs hold {len(found)}"
        )
    return found[0]


def _flat_inputs(graph: OpGraph, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
    args, kwargs = bind_call(graph.captured, args, dict(kwargs))
    in_spec = graph.captured.program.call_spec.in_spec
    if in_spec is not None:
        kwargs = reorder_kwargs(kwargs, in_spec)
    flat, _ = pytree.tree_flatten((args, kwargs))
    return flat


def pipeline_groups(plan: Plan, rank: int, world: int, shared: dict[str, tuple[int, ...]], timeout) -> tuple:
    """The pipeline group of this rank's mesh position, and per parameter read by stages on several blocks, the
    group of its copies at this mesh position (created alike on every rank)."""
    p = plan.pipeline.stages  # type: ignore[union-attr]
    q = world // p
    block, r = divmod(rank, q)
    pp = None
    for pos in range(q):
        g = dist.new_group([pos + t * q for t in range(p)], timeout=timeout)
        pp = g if pos == r else pp
    tied: dict[str, tuple[Any, bool]] = {}
    made: dict[tuple[int, ...], Any] = {}
    for fqn, holders in sorted(shared.items()):
        if len(holders) > 1 and holders not in made:
            mine = None
            for pos in range(q):
                g = dist.new_group([pos + t * q for t in holders], timeout=timeout)
                mine = g if pos == r else mine
            made[holders] = mine
        tied[fqn] = (made.get(holders), block in holders)
    return pp, tied


def compile_pipelined(graph: OpGraph, plan: Plan, rank: int, world: int, timeout: timedelta | None) -> PipelinedModule:
    """Build this rank's :class:`PipelinedModule` of ``plan`` (module docstring)."""

    pipeline = plan.pipeline
    assert pipeline is not None
    if plan.zero >= 2:
        raise NotImplementedError(
            f"the plan runs as a pipeline with ZeRO-{plan.zero}, which the pipelined runtime does not run yet (ZeRO-1 "
            "it does): make the plan with zero=1 (--zero 1) or without stages"
        )
    p, v = pipeline.stages, pipeline.virtual_stages
    q = world // p
    block, r = divmod(rank, q)
    values = pipeline_values(graph, plan)
    stage_of = stage_of_nodes(graph, pipeline.layers_per_stage)
    set_stage_offset(block * q)
    mesh = DeviceMesh(tuple(plan.digits))
    groups = ProcessGroups(mesh, r, timeout, stages=p, stage=block)
    rank_graph = rank_graph_for(at_sizes(graph, values), plan, r, values=values, timeout=timeout, groups=groups)
    cuts = cut_stages(rank_graph.gm, stage_of, p * v)
    for k, cut in enumerate(cuts[:-1]):
        log.debug("rank %d: stage %d sends %s", rank, k, ", ".join(cut.sent))
    kinds = _placeholder_kinds(graph)
    readers: dict[str, set[int]] = {}
    for k, cut in enumerate(cuts):
        for name in cut.inputs:
            if kinds[name][0] == "param":
                readers.setdefault(kinds[name][1], set()).add(k)
    shared = {fqn: tuple(sorted({k % p for k in ks})) for fqn, ks in readers.items() if len(ks) > 1}
    return PipelinedModule(
        graph, plan, rank, world, rank_graph, cuts, pipeline_groups(plan, rank, world, shared, timeout)
    )
