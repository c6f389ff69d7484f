"""``primepar_fx.compile``: a plan made real on the ranks of a ``torch.distributed`` process group.

Every rank calls :func:`compile` with the same model and example inputs after ``init_process_group``. Rank 0
captures, plans (or loads / forces a plan) and broadcasts the plan as JSON, so every rank rewrites the same graph;
each rank then keeps only its own parameter slices (:func:`primepar_fx.passes.localize`). The returned
:class:`PrimeParModule` takes the same global inputs on every rank and returns the same global outputs.

Bad input fails before anything is built (no process group, no module), with one error naming the culprit: no
process group (pass ``world_size=1`` to run as one process), a plan for another world size or model, a plan whose
partition does not divide a dim at the example's ``B`` and ``S`` (:class:`~primepar_fx.partition.PartitionError`
naming the node and the dim). When rank 0 cannot make the plan, every other rank raises with rank 0's message
(:mod:`primepar_fx.compiler.agree`: the options, the plan and its broadcast).

At run time a batch or sequence length other than the compiled one rebuilds this rank's graph for the new sizes
(the capture is symbolic in ``B`` and ``S``; the plan is reused, and the parameters stay where they are: their
storage layouts do not depend on ``B`` or ``S``). Every rank must see the same sizes, as it sees the same inputs:
each call checks it first with one all-reduce of four integers (``check_sizes``), so ranks given different sizes
raise a ``ValueError`` together instead of computing on mismatched shards or waiting for each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from primepar_fx.compiler.agree import (
    agree_plan,
    check_plan_fits,
    check_same_sizes_everywhere,
    checked_world,
    compile_options,
    set_default_timeout,
    timeout_text,
    with_machine_cluster,
)
from primepar_fx.compiler.inputs import (
    InputSpec,
    at_sizes,
    bind_call,
    input_spec,
    size_ranges,
    sizes_of,
    unused_tied,
)
from primepar_fx.compiler.microbatch import run_micro_batches, split_inputs
from primepar_fx.compiler.rankgraph import rank_graph_for
from primepar_fx.compiler.zero3 import zero3_units
from primepar_fx.cost.blocks import ZERO_STAGES
from primepar_fx.frontend.capture import capture
from primepar_fx.frontend.symbols import B, S
from primepar_fx.graph import OpGraph, graph_of
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes.localize import RankGraph
from primepar_fx.planning.options import PlanOptions, parse_plan
from primepar_fx.record.plan import Plan
from primepar_fx.report.trace import trace_plan
from primepar_fx.runtime.exchange import Exchange, full_layout
from primepar_fx.runtime.gradsync import GradientBuckets
from primepar_fx.runtime.groups import set_stage_offset
from primepar_fx.runtime.stats import CommStats
from primepar_fx.runtime.zero import PendingGathers, ShardedOptimizer, await_before_uses
from primepar_fx.runtime.zero3 import ShardedParameters, gather_around_uses

log = logging.getLogger(__name__)

#: what gloo and nccl say when a peer died or stopped answering
#: ZeRO-3's buckets are its units (:func:`~primepar_fx.compiler.zero3.zero3_units`), whole layers whatever their
#: size (one all-gather each, as FSDP2's): no size bound splits them
_ZERO3_BUCKETS = {"bucket_cap_mb": float("inf"), "first_bucket_cap_mb": float("inf")}
_PEER_FAILURE = ("connection closed", "connection reset", "timed out", "broken pipe", "nccl error", "watchdog")


class RankFailureError(RuntimeError):
    """A collective or point-to-point transfer of a compiled step failed: another rank died, raised or timed out."""


class PrimeParModule(nn.Module):
    """One rank's part of a compiled model: its parameter shards and its rewritten graph.

    Attributes:
        plan: the :class:`Plan` it runs.
        comm_stats: bytes this rank has sent, by kind (:class:`~primepar_fx.runtime.CommStats`); ``reset()`` it
            between steps.
        graph_module: the rewritten per-rank ``GraphModule`` of the sizes last run (print ``graph_module.code``).
        fallbacks: nodes that run whole because their partition has no local form.
        grad_buckets: the buckets that sum parameter gradients over their replicas during backward
            (:class:`~primepar_fx.runtime.gradsync.GradientBuckets`; ``grad_buckets.describe()`` lists them).
        check_sizes: whether each call first checks that every rank got inputs of the same ``B`` and ``S`` (one
            all-reduce of four integers, not counted in ``comm_stats``; default ``True``). With ``False`` only a
            rebuild for new sizes checks it, and ranks given different sizes that each have a graph for them run on
            mismatched shards.
    """

    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        rank_graph: RankGraph,
        mesh: DeviceMesh,
        rank: int,
        *,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()
        captured = graph.captured
        program = captured.program
        self.plan, self.mesh, self.rank = plan, mesh, rank
        self.graph_module = rank_graph.gm
        self.comm_stats: CommStats = rank_graph.stats
        self.fallbacks = tuple(rank_graph.fallbacks)
        self.pass_counts = list(rank_graph.pass_counts)
        self._graph, self._timeout = graph, timeout
        self.check_sizes = True
        self._sizes = (captured.example_batch, captured.example_seq)
        self._rank_graphs: dict[tuple[int, int], RankGraph] = {self._sizes: rank_graph}
        self._in_spec = program.call_spec.in_spec
        self._out_spec = program.call_spec.out_spec
        self._inputs: list[tuple[str, str | None]] = []  # (kind, key) per graph placeholder
        self._layouts: dict[str, Any] = {}  # fqn -> storage layout
        self._param_of: dict[str, str] = {}  # placeholder name -> fqn
        self._user_specs: list[InputSpec] = []  # per user input: name, symbolic shape (in B and S), dtype
        self.shards = nn.ParameterDict()
        self._key_of: dict[str, str] = {}
        self._aliases = unused_tied(graph)  # unused tied name -> the used name sharing its storage
        self._take_inputs(rank_graph)
        self._ranges = size_ranges(captured)
        if plan.zero not in ZERO_STAGES:
            raise NotImplementedError(
                f"the plan asks for ZeRO stage {plan.zero}, which the runtime does not run (stages {list(ZERO_STAGES)})"
            )
        self._sharded: list[ShardedOptimizer] = []  # the ZeRO optimizer made by :meth:`optimizer`, if any
        self._warned_zero = False
        #: ZeRO-3's parameter chunks (:mod:`primepar_fx.runtime.zero3`; ``None`` below stage 3)
        self.zero3: ShardedParameters | None = None
        #: ZeRO-1/2's all-gathers after a step, waited for where Forward first reads each bucket (``None`` else)
        self.zero_gathers = PendingGathers() if plan.zero in (1, 2) else None
        self._sync_gradients(rank_graph)

    def _take_inputs(self, rank_graph: RankGraph) -> None:
        """What each graph input is (``_inputs``): this rank's shard of a parameter, a buffer or constant, a user
        input (its spec kept), or a tied parameter the graph never reads."""
        captured = self._graph.captured
        specs = captured.program.graph_signature.input_specs
        placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
        buffers = 0
        for node, spec in zip(placeholders, specs, strict=True):
            if spec.kind is InputKind.PARAMETER and not node.users and spec.target in self._aliases:
                # a tied alias the graph never reads (export routes every use through one name): no copy
                self._inputs.append(("unused", self._aliases[spec.target]))
            elif spec.kind is InputKind.PARAMETER:
                key = self._take_parameter(spec.target, node.name, rank_graph.param_layouts[node.name])
                self._inputs.append(("param", key))
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self._inputs.append(("buffer", self._take_buffer(spec, f"b{buffers}")))
                buffers += 1
            elif spec.kind is InputKind.USER_INPUT:
                self._user_specs.append(input_spec(node, captured.symbol_map))
                self._inputs.append(("user", None))
            else:
                raise NotImplementedError(f"input {spec.target} of kind {spec.kind.name} is not supported")

    def _take_parameter(self, fqn: str, placeholder: str, layout: Any) -> str:
        """Keep this rank's block of parameter ``fqn`` (read by ``placeholder``, stored as ``layout``) in ``shards``;
        its key there."""
        full = self._graph.captured.program.state_dict[fqn]
        key = fqn.replace(".", "__")
        self._key_of[fqn] = key
        self._layouts[fqn] = layout
        self._param_of[placeholder] = fqn
        mesh, rank = self.mesh, self.rank
        local = Exchange.plan(full_layout(tuple(full.shape), mesh.size), layout, mesh, rank).run(full.detach())
        self.shards[key] = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
        return key

    def _take_buffer(self, spec: Any, key: str) -> str:
        """Register a copy of buffer or constant ``spec`` (a persistent buffer's value is the state dict's) as
        ``key``; returns ``key``."""
        program = self._graph.captured.program
        if spec.kind is InputKind.BUFFER and spec.persistent is not False and spec.target in program.state_dict:
            value = program.state_dict[spec.target]
        else:
            value = program.constants[spec.target]
        self.register_buffer(key, value.detach().clone(), persistent=False)
        return key

    def _sync_gradients(self, rank_graph: RankGraph) -> None:
        """The buckets that sum parameter gradients over their replicas (taking the sums the graph defers), and at
        ZeRO-3 the parameter chunks, gathered around their uses."""
        plan = self.plan
        self.grad_reductions = dict(rank_graph.grad_reductions)
        units = zero3_units(self._graph, plan.recompute) if plan.zero == 3 else {}
        self.grad_buckets = GradientBuckets(
            [
                (self._param_of[n], self.shards[self._key_of[self._param_of[n]]], r)  # type: ignore[index]
                for n, r in rank_graph.grad_reductions.items()
            ],
            self.comm_stats,
            **(_ZERO3_BUCKETS | {"apart": units} if plan.zero == 3 else {}),
        )
        self.grad_buckets.take_deferred(rank_graph.gm)
        if plan.zero == 3:
            read = {fqn for fqn, key in units.items() if key.read}
            kept = {fqn for fqn, key in units.items() if key.kept}
            self.zero3 = ShardedParameters(self.grad_buckets, self.rank, self.comm_stats, read=read, kept=kept)
        self._gather_in(rank_graph.gm)

    def _gather_in(self, gm: Any) -> None:
        """ZeRO-3: gather each unit of parameters in ``gm`` (a rank graph) around its uses; ZeRO-1/2: wait for each
        sharded bucket's all-gather after the step before its first use. Other plans: nothing to do."""
        if self.zero3 is None and self.zero_gathers is None:
            return
        if self.zero3 is not None:
            index_of = {id(p): u.index for u in self.zero3.units for p in u.params}
        else:
            index_of = {
                id(self.grad_buckets.params[i]): b.index
                for b in self.grad_buckets.buckets
                if len(b.group[1]) > 1
                for i in b.members
            }
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        units = {}
        for node, (kind, key) in zip(placeholders, self._inputs, strict=True):
            index = index_of.get(id(self.shards[key])) if kind == "param" else None  # type: ignore[index]
            if index is not None:
                units[node.name] = index
        if self.zero3 is not None:
            gather_around_uses(gm, units, self.zero3)
        else:
            await_before_uses(gm, units, self.zero_gathers)  # type: ignore[arg-type]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict``: this rank's parameter blocks (use :meth:`gather_state_dict` for whole tensors).
        Under ZeRO-3 only inside :meth:`whole_parameters` (between uses the blocks hold no values)."""
        self.settle_parameters()
        if self.zero3 is not None and not all(u.whole for u in self.zero3.units):
            raise RuntimeError(
                "the plan keeps its parameters as ZeRO-3 chunks, which hold no whole values outside a step: call "
                "state_dict() inside `with module.whole_parameters():`, or use primepar_fx.gather_state_dict(module) "
                "or primepar_fx.checkpoint.save"
            )
        return super().state_dict(*args, **kwargs)

    def whole_parameters(self, write: bool = False) -> Any:
        """A context in which every parameter holds its values (ZeRO-3 gathers them; collective: every rank enters
        it); with ``write``, what was written into them is kept. ZeRO-1/2: the step's all-gathers are waited for
        first."""
        self.settle_parameters()
        return contextlib.nullcontext() if self.zero3 is None else self.zero3.whole(write)

    def settle_parameters(self) -> None:
        """ZeRO-1/2: wait for the all-gathers of the last step still in flight (:mod:`primepar_fx.runtime.zero`),
        so that the parameters hold the stepped values; Forward waits for each where it first reads it."""
        if self.zero_gathers is not None:
            self.zero_gathers.settle()

    # ------------------------------------------------------------------------------------------------ running
    def _as_captured(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call as the example made it (:func:`~primepar_fx.compiler.inputs.bind_call`)."""
        return bind_call(self._graph.captured, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._as_captured(args, kwargs)
        if self._in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self._in_spec)
        flat, _ = pytree.tree_flatten((args, kwargs))
        if len(flat) < len(self._user_specs):
            raise ValueError(
                f"{len(flat)} inputs but the module was compiled with {len(self._user_specs)} "
                f"({', '.join(spec.name for spec in self._user_specs)})"
            )
        if self.plan.zero and not self._sharded and torch.is_grad_enabled() and not self._warned_zero:
            self._warned_zero = True
            warnings.warn(
                f"the plan shards optimizer state (ZeRO-{self.plan.zero}), but no module.optimizer(...) was made: "
                "gradients are summed whole and an optimizer of module.parameters() keeps all of its state, "
                "more memory than the plan predicts"
                + (
                    "; at stage 3 the parameters hold no values outside a step, so only module.optimizer(...) can "
                    "step them"
                    if self.plan.zero == 3
                    else ""
                ),
                stacklevel=2,
            )
        m = self.plan.micro_batches
        if m > 1:  # the plan's micro-batches, gradients accumulated (compiler/microbatch.py)
            chunks = split_inputs(self._user_specs, flat, m)
            out = run_micro_batches(self._run, chunks, self.grad_buckets.accumulating)
        else:
            out = self._run(flat)
        return pytree.tree_unflatten(list(out), self._out_spec)

    def _run(self, flat: list[Any]) -> list[Any]:
        """One run of the rank graph on the flat user inputs ``flat``; its flat outputs."""
        set_stage_offset(0)  # (a pipelined module built in this process may have moved it)
        sizes = sizes_of(self._user_specs, flat, self._ranges, self._sizes)
        if self.check_sizes and self.mesh.size > 1:
            self._peer_call(check_same_sizes_everywhere, sizes, self.mesh.size)
        rank_graph = self._rank_graph_for_sizes(sizes)
        users = iter(flat)
        call: list[Any] = []
        for kind, key in self._inputs:
            if kind == "param":
                call.append(self.shards[key])  # type: ignore[index]
            elif kind == "unused":
                call.append(None)
            elif kind == "buffer":
                call.append(getattr(self, key))  # type: ignore[arg-type]
            else:
                call.append(next(users))
        if self.zero3 is None or not self.zero3.units:
            out = list(self._peer_call(rank_graph.gm, *call))
            self._peer_call(self.settle_parameters)  # buckets this Forward did not read
            return out
        with self.zero3.running():
            return list(self._peer_call(rank_graph.gm, *call))

    def optimizer(
        self,
        optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        /,
        *,
        gather_in_forward: bool = True,
        **defaults: Any,
    ) -> Any:
        """The optimizer the plan prices: ``optimizer_class(self.parameters(), **defaults)``, or, for a plan with
        ZeRO (``plan.zero`` 1, 2 or 3), a :class:`~primepar_fx.runtime.zero.ShardedOptimizer` that keeps this
        rank's share of the state (an element-wise optimizer such as AdamW, Adam or SGD; make one per module).

        ``gather_in_forward`` (ZeRO-1/2): the step's all-gathers of the updated parameters travel while the next
        Forward's first layers compute, each waited for where Forward first reads it; until then
        ``self.parameters()`` may hold the values from before the step (call ``optimizer.settle()`` to read them in
        between). ``False``: the step waits for them."""
        if not self.plan.zero:
            return optimizer_class(self.parameters(), **defaults)
        if self._sharded:
            raise RuntimeError("this module already has its sharded optimizer; make one optimizer per module")
        opt = ShardedOptimizer(
            self.grad_buckets,
            self.parameters(),
            self.rank,
            self.plan.zero,
            optimizer_class,
            self.comm_stats,
            parameters=self.zero3,
            gathers=self.zero_gathers if gather_in_forward else None,
            **defaults,
        )
        self._sharded.append(opt)
        return opt

    def _peer_call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, which talks to the other ranks: a failure that says a peer died, raised or stopped
        answering becomes a :class:`RankFailureError`."""
        try:
            return fn(*args)
        except RuntimeError as e:
            if self.mesh.size > 1 and any(k in str(e).lower() for k in _PEER_FAILURE):
                raise RankFailureError(
                    f"rank {self.rank}: a collective or transfer of the compiled step failed; another rank has "
                    f"probably died, raised or stopped answering ({timeout_text(self._timeout)}): {e}"
                ) from e
            raise

    def _rank_graph_for_sizes(self, sizes: tuple[int, int]) -> RankGraph:
        """This rank's graph for ``(B, S)``: built once per sizes, the plan reused (module docstring)."""
        if sizes not in self._rank_graphs:
            values = {B: sizes[0], S: sizes[1]}
            check_plan_fits(self._graph, self.plan, values)
            if not self.check_sizes:  # else every call has checked them already
                self._peer_call(check_same_sizes_everywhere, sizes, self.mesh.size)
            log.info("rank %d: rebuilding the graph for B=%d, S=%d (the plan is reused)", self.rank, *sizes)
            at = at_sizes(self._graph, values)
            built = rank_graph_for(at, self.plan, self.rank, values=values, timeout=self._timeout)
            for name, fqn in self._param_of.items():
                if built.param_layouts[name] != self._layouts[fqn]:
                    raise RuntimeError(f"parameter {fqn!r} would be stored differently at B={sizes[0]}, S={sizes[1]}")
            first = self._rank_graphs[self._sizes].grad_reductions
            if {n: r.digits for n, r in built.grad_reductions.items()} != {n: r.digits for n, r in first.items()}:
                raise RuntimeError(f"the gradient buckets would differ at B={sizes[0]}, S={sizes[1]}")
            for f in dataclasses.fields(CommStats):  # one counter for every size: share its dicts
                setattr(built.stats, f.name, getattr(self.comm_stats, f.name))
            self.grad_buckets.take_deferred(built.gm)
            self._gather_in(built.gm)
            self._rank_graphs[sizes] = built
        built = self._rank_graphs[sizes]
        if built.gm is not self.graph_module:
            self.graph_module = built.gm
        return built

    # ------------------------------------------------------------------------------------------------ full tensors
    def full_shape(self, fqn: str) -> tuple[int, ...]:
        """The whole shape of parameter ``fqn`` (every rank holds a block of it)."""
        return tuple(sum(b - a for a, b in s) for s in full_layout_dims(self._layouts[fqn]))

    def gather_tensors(self, local: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's blocks laid out like the parameters of the same names (collective).

        ``local`` maps parameter names to tensors shaped like this rank's shard (gradients, optimizer state);
        ``None`` values and names it lacks are skipped (on every rank alike).
        """
        set_stage_offset(0)
        out = {}
        for fqn, layout in self._layouts.items():
            value = local.get(fqn)
            if value is None:
                continue
            gather = Exchange.plan(layout, full_layout(self.full_shape(fqn), self.mesh.size), self.mesh, self.rank)
            full = gather.run(value.detach().contiguous())
            out[fqn] = full.clone() if gather.identity else full  # never an alias of the live tensor
        return out

    def shard_tensor(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole tensor laid out like parameter ``fqn`` (local: no communication)."""
        if tuple(full.shape) != self.full_shape(fqn):
            raise ValueError(f"{fqn!r} has shape {tuple(full.shape)}, the model's is {self.full_shape(fqn)}")
        layout = self._layouts[fqn]
        return Exchange.plan(full_layout(tuple(full.shape), self.mesh.size), layout, self.mesh, self.rank).run(full)

    def _with_aliases(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for alias, fqn in self._aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter: its whole shape and dtype."""
        return {fqn: (self.full_shape(fqn), p.dtype) for fqn, p in self.local_parameters().items()}

    def copies(self, fqn: str) -> list[torch.Tensor]:
        """This rank's block of parameter ``fqn``, as a list (a pipelined module holds one a stage that reads it)."""
        return [self.local_parameters()[fqn]]

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by original name (under ZeRO-3 their values only inside
        :meth:`whole_parameters`)."""
        return {fqn: self.shards[key] for fqn, key in self._key_of.items()}  # type: ignore[index]

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        with self.whole_parameters():
            return self._with_aliases(self.gather_tensors(self.local_parameters()))

    def gather_grads(self) -> dict[str, torch.Tensor]:
        return self._with_aliases(self.gather_tensors({fqn: p.grad for fqn, p in self.local_parameters().items()}))

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Shard a full state dict (original names) into this rank's parameters.

        A tied parameter may appear under either of its names (checkpoints often keep only one). Every name and
        shape is checked before any parameter changes; keys that name no parameter (buffers) are ignored.
        """
        other = {used: unused for unused, used in self._aliases.items()}
        found = {fqn: fqn if fqn in state else other.get(fqn) for fqn in self._layouts}
        missing = [fqn for fqn, key in found.items() if key not in state]
        if missing:
            raise KeyError(f"the state dict lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        for fqn, key in found.items():
            if tuple(state[key].shape) != self.full_shape(fqn):  # type: ignore[index]
                raise ValueError(
                    f"parameter {fqn!r} has shape {tuple(state[key].shape)} in the state dict, "  # type: ignore[index]
                    f"{self.full_shape(fqn)} in the model"
                )
        with torch.no_grad(), self.whole_parameters(write=True):
            for fqn, key in found.items():
                p = self.shards[self._key_of[fqn]]
                p.copy_(self.shard_tensor(fqn, state[key].detach().to(p.dtype)))  # type: ignore[index]
        for opt in self._sharded:  # its master copies follow the new parameters
            opt.reload()


def full_layout_dims(layout) -> tuple:
    """Per tensor dim, the union of what every rank holds (the whole dim for a complete layout)."""
    dims = []
    for d in range(len(layout[0])):
        lo = min(iv[0] for r in layout for iv in r[d])
        hi = max(iv[1] for r in layout for iv in r[d])
        dims.append(((lo, hi),))
    return tuple(dims)


def compile(
    model: nn.Module,
    example_inputs: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    cluster: Any = None,
    plan: Any = None,
    memory_budget: float | str | None = None,
    dtype: Any = None,
    fallback: str | None = None,
    world_size: int | None = None,
    timeout: float | None = None,
) -> PrimeParModule:
    """Partition ``model`` over the ranks of the default process group (module docstring).

    ``example_inputs`` (a tuple of positional arguments, or one tensor) and ``example_kwargs`` are one call of
    ``model``, with the batch in dim 0 and the sequence in dim 1 of the token inputs; the module takes the same
    arguments, positionally or by keyword. The model's weights must be real (not on the meta device).

    ``plan``: ``None`` (or ``"searched"``) searches the best plan for ``cluster`` (a preset name, a spec file or a
    :class:`~primepar_fx.cost.cluster.ClusterSpec`; default: this machine's, see
    :func:`~primepar_fx.planning.options.default_cluster`); a
    :class:`Plan`, a path to a plan JSON or its text is used as is; ``"megatron"``, ``"megatron-sp"``,
    ``"data_parallel"``, ``"prime"`` (P(S x S) wherever legal) or ``"random:SEED"`` force one. ``memory_budget``
    bounds each device's predicted peak (bytes, or a size such as ``"30GiB"``); ``dtype`` is the dtype the plan is
    priced at (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or a torch dtype; default: the first parameter's).
    Call it on every rank after ``torch.distributed.init_process_group``. Without a process group it raises, unless
    ``world_size=1`` asks for one process; with one, ``world_size`` (if given) must be its size.

    ``fallback="replicate"`` runs ops that have no dimension rule replicated instead of raising
    :class:`~primepar_fx.rules.MissingRuleError`. ``timeout`` (seconds) bounds how long a step waits for the other
    ranks before raising: it is the timeout of the process groups this creates and, because the module's
    point-to-point transfers run on it, of the default process group too (``None`` keeps the default group's
    timeout, from ``init_process_group(timeout=...)``, for every group).
    """
    checked_world(world_size)  # before the capture: no work for a call that cannot run
    on_meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"{on_meta!r} of the model is on the meta device: compile needs its values (load or materialise the "
            "weights first; primepar_fx.plan works on meta models)"
        )
    options = compile_options(cluster=cluster, memory_budget=memory_budget, dtype=dtype, fallback=fallback)
    parse_plan(plan)
    _check_timeout(timeout)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    graph = graph_of(lambda static: capture(model, args, example_kwargs, static_seq=static), fallback=fallback)
    options = with_machine_cluster(options, plan, measure=cluster is None)
    module = compile_graph(graph, plan=plan, options=options, world_size=world_size, timeout=timeout)
    program = graph.captured.program
    for fqn in graph.captured.params.values():  # the module holds its shards; let the whole weights go
        program.state_dict[fqn] = program.state_dict[fqn].detach().to("meta")
    return module


def _check_timeout(timeout: object) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def compile_graph(
    graph: OpGraph,
    *,
    cluster: Any = None,
    plan: Any = None,
    memory_budget: float | str | None = None,
    dtype: Any = None,
    world_size: int | None = None,
    timeout: float | None = None,
    options: PlanOptions | None = None,
) -> PrimeParModule:
    """:func:`compile` from an already captured graph (capture once, compile several plans).

    ``options`` (from :func:`~primepar_fx.compiler.agree.compile_options`) replaces ``cluster``, ``memory_budget``
    and ``dtype``. Parameters are copied from the captured program, so modules compiled from one graph train
    independently.
    """
    graph.require_captured("compile_graph")
    world, rank = checked_world(world_size)
    if options is None:
        options = compile_options(cluster=cluster, memory_budget=memory_budget, dtype=dtype)
        options = with_machine_cluster(options, plan, measure=cluster is None)
    elif (cluster, memory_budget, dtype) != (None, None, None):
        raise TypeError("pass options or cluster / memory_budget / dtype, not both")
    parse_plan(plan)
    _check_timeout(timeout)
    wait = timedelta(seconds=timeout) if timeout is not None else None
    chosen = agree_plan(graph, plan, options)
    if chosen.pipeline is not None:
        return _pipelined(graph, chosen, rank, world, wait)
    set_stage_offset(0)  # point-to-point peers are global ranks (a pipelined module built here may have moved it)
    mesh = DeviceMesh(tuple(chosen.digits))
    rank_graph = rank_graph_for(graph, chosen, rank, timeout=wait)
    trace_plan(graph, chosen, rank, rank_graph)
    module = PrimeParModule(graph, chosen, rank_graph, mesh, rank, timeout=wait)
    if wait is not None and world > 1:  # once the module is built: a compile that fails changes nothing
        set_default_timeout(wait)
    if os.environ.get("PRIMEPAR_DUMP_DIR"):  # the graph dump: rank 0 writes all of it, every other rank its code
        from primepar_fx.report.dump import dump_module

        dump_module(graph, module, os.environ["PRIMEPAR_DUMP_DIR"])
    return module


def _pipelined(graph: OpGraph, chosen: Plan, rank: int, world: int, wait: timedelta | None) -> Any:
    """:func:`compile_graph` of a plan with pipeline stages (:mod:`primepar_fx.compiler.pipelined`)."""
    from primepar_fx.compiler.pipelined import compile_pipelined

    module = compile_pipelined(graph, chosen, rank, world, wait)
    if wait is not None and world > 1:
        set_default_timeout(wait)
    return module


def require_compiled(module: object, what: str) -> PrimeParModule:
    """``module`` itself when it is a :class:`PrimeParModule`; a ``TypeError`` naming ``what`` otherwise."""
    if not isinstance(module, PrimeParModule):
        raise TypeError(f"{what} takes a module returned by primepar_fx.compile, got {type(module).__name__}")
    return module


def gather_state_dict(module: PrimeParModule) -> dict[str, torch.Tensor]:
    """Full parameters keyed by their original names (every rank must call it)."""
    return require_compiled(module, "gather_state_dict").gather_state_dict()


def gather_grads(module: PrimeParModule) -> dict[str, torch.Tensor]:
    """Full gradients keyed by the original parameter names (every rank must call it)."""
    return require_compiled(module, "gather_grads").gather_grads()


def load_state_dict(module: PrimeParModule, state: Mapping[str, torch.Tensor]) -> None:
    """Shard a full state dict (original names) into ``module``'s parameters: every parameter's name and shape is
    checked before any changes (``KeyError``, ``ValueError``); keys that name no parameter (buffers) are ignored."""
    require_compiled(module, "load_state_dict").load_full_state_dict(state)
