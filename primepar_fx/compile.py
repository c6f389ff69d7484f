"""``primepar_fx.compile``: a plan made real on the ranks of a ``torch.distributed`` process group.

Every rank calls :func:`compile` with the same model and example inputs after ``init_process_group``. Rank 0
captures, plans (or loads / forces a plan) and broadcasts the plan as JSON, so every rank rewrites the same graph;
each rank then keeps only its own parameter slices (:func:`primepar_fx.passes.localize`). The returned
:class:`PrimeParModule` takes the same global inputs on every rank and returns the same global outputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.distributed as dist
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from primepar_fx.capture import capture
from primepar_fx.graph import OpGraph, build_graph
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes.localize import RankGraph, localize
from primepar_fx.plan import Plan
from primepar_fx.runtime.exchange import Exchange, full_layout
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.stats import CommStats
from primepar_fx.shapes import B, S

log = logging.getLogger(__name__)

FORCED = ("megatron", "data_parallel", "prime", "random:SEED")
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _broadcast_text(text: str | None, rank: int, world: int) -> str:
    """Rank 0's ``text`` on every rank, sent as UTF-8 bytes in a tensor (no pickling)."""
    if world == 1:
        assert text is not None
        return text
    device = _comm_device()
    size = torch.tensor(
        [len(text.encode()) if rank == 0 and text is not None else -1], dtype=torch.int64, device=device
    )
    dist.broadcast(size, 0)
    if int(size) < 0:
        raise RuntimeError("rank 0 failed to make a plan; see its error")
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))  # type: ignore[union-attr]
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).decode()


def resolve_plan(
    graph: OpGraph, plan: Any, *, world_size: int, cluster: str, memory_budget: float | None, dtype: str
) -> Plan:
    """A :class:`Plan` from ``None`` (search), a Plan, a JSON path or a forced-plan name."""
    from primepar_fx.planner import forced_plan, plan_graph

    common = {
        "world_size": world_size,
        "cluster": cluster,
        "batch": graph.captured.example_batch,
        "seq": graph.captured.example_seq,
        "dtype": dtype,
        "memory_budget": memory_budget,
    }
    if plan is None or plan == "searched":
        return plan_graph(graph, **common, baselines=False, method="dp")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)) and (str(plan).endswith(".json") or os.path.exists(plan)):
        return Plan.load(plan)
    if isinstance(plan, str):
        return forced_plan(graph, plan, **common)
    raise ValueError(f"plan must be None, a Plan, a path to a plan JSON or one of {FORCED}; got {plan!r}")


class PrimeParModule(nn.Module):
    """One rank's part of a compiled model: its parameter shards and its rewritten graph.

    Attributes:
        plan: the :class:`Plan` it runs.
        comm_stats: bytes this rank has sent, by kind (:class:`~primepar_fx.runtime.CommStats`); ``reset()`` it
            between steps.
        graph_module: the rewritten per-rank ``GraphModule`` (print ``graph_module.code`` to read it).
        fallbacks: nodes that run whole because their partition has no local form.
    """

    def __init__(self, graph: OpGraph, plan: Plan, rank_graph: RankGraph, mesh: DeviceMesh, rank: int) -> None:
        super().__init__()
        captured = graph.captured
        program = captured.program
        self.plan, self.mesh, self.rank = plan, mesh, rank
        self.graph_module = rank_graph.gm
        self.comm_stats: CommStats = rank_graph.stats
        self.fallbacks = tuple(rank_graph.fallbacks)
        self.pass_counts = list(rank_graph.pass_counts)
        self._in_spec = program.call_spec.in_spec
        self._out_spec = program.call_spec.out_spec
        self._inputs: list[tuple[str, str | None]] = []  # (kind, key) per graph placeholder
        self._layouts: dict[str, Any] = {}  # fqn -> storage layout
        self._example_shapes: list[tuple[int, ...]] = []
        self.shards = nn.ParameterDict()
        self._key_of: dict[str, str] = {}
        buffers: dict[str, torch.Tensor] = {}
        placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
        used = {s.target for n, s in zip(placeholders, program.graph_signature.input_specs) if n.users}
        tied_used = {}  # unused tied name -> the used name sharing its storage
        for alias, canon in graph.tied.items():
            if alias in used and canon not in used:
                tied_used[canon] = alias
            elif canon in used and alias not in used:
                tied_used[alias] = canon
        self._aliases = dict(tied_used)
        for node, spec in zip(placeholders, program.graph_signature.input_specs, strict=True):
            if spec.kind is InputKind.PARAMETER and not node.users and spec.target in tied_used:
                # a tied alias the graph never reads (export routes every use through one name): no copy
                self._inputs.append(("unused", tied_used[spec.target]))
            elif spec.kind is InputKind.PARAMETER:
                fqn = spec.target
                layout = rank_graph.param_layouts[node.name]
                full = program.state_dict[fqn]
                key = fqn.replace(".", "__")
                self._key_of[fqn] = key
                self._layouts[fqn] = layout
                local = Exchange.plan(full_layout(tuple(full.shape), mesh.size), layout, mesh, rank).run(full.detach())
                self.shards[key] = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
                self._inputs.append(("param", key))
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                if spec.kind is InputKind.BUFFER and spec.persistent is not False and spec.target in program.state_dict:
                    value = program.state_dict[spec.target]
                else:
                    value = program.constants[spec.target]
                key = f"b{len(buffers)}"
                buffers[key] = value
                self.register_buffer(key, value.detach().clone(), persistent=False)
                self._inputs.append(("buffer", key))
            elif spec.kind is InputKind.USER_INPUT:
                val = node.meta.get("val")
                self._example_shapes.append(tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else ())
                self._inputs.append(("user", None))
            else:
                raise NotImplementedError(f"input {spec.target} of kind {spec.kind.name} is not supported")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self._in_spec)
        flat, _ = pytree.tree_flatten((args, kwargs))
        users = iter(flat)
        call: list[Any] = []
        shapes = iter(self._example_shapes)
        for kind, key in self._inputs:
            if kind == "param":
                call.append(self.shards[key])  # type: ignore[index]
            elif kind == "unused":
                call.append(None)
            elif kind == "buffer":
                call.append(getattr(self, key))  # type: ignore[arg-type]
            else:
                try:
                    x = next(users)
                except StopIteration:
                    raise ValueError("fewer inputs than the example inputs the model was compiled with") from None
                want = next(shapes)
                if isinstance(x, torch.Tensor) and tuple(x.shape) != want:
                    raise ValueError(
                        f"input of shape {tuple(x.shape)} but the module was compiled for {want}; "
                        "compile again with example inputs of this shape"
                    )
                call.append(x)
        out = self.graph_module(*call)
        return pytree.tree_unflatten(list(out), self._out_spec)

    # ------------------------------------------------------------------------------------ full tensors
    def _gather(self, tensors: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        out = {}
        for fqn, layout in self._layouts.items():
            local = tensors[fqn]
            if local is None:
                continue
            shape = tuple(sum(b - a for a, b in s) for s in full_layout_dims(layout))
            gather = Exchange.plan(layout, full_layout(shape, self.mesh.size), self.mesh, self.rank)
            full = gather.run(local.detach().contiguous())
            out[fqn] = full.clone() if gather.identity else full  # never an alias of the live parameter
        for alias, fqn in self._aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by original name."""
        return {fqn: self.shards[key] for fqn, key in self._key_of.items()}  # type: ignore[index]

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather({fqn: p for fqn, p in self.local_parameters().items()})

    def gather_grads(self) -> dict[str, torch.Tensor]:
        return self._gather({fqn: p.grad for fqn, p in self.local_parameters().items()})

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Shard a full state dict (original names) into this rank's parameters.

        A tied parameter may appear under either of its names (checkpoints often keep only one).
        """
        other = {used: unused for unused, used in self._aliases.items()}
        found = {fqn: fqn if fqn in state else other.get(fqn) for fqn in self._layouts}
        missing = [fqn for fqn, key in found.items() if key not in state]
        if missing:
            raise KeyError(f"the state dict lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        with torch.no_grad():
            for fqn, layout in self._layouts.items():
                full = state[found[fqn]]  # type: ignore[index]
                p = self.shards[self._key_of[fqn]]
                if tuple(full.shape) != tuple(sum(b - a for a, b in s) for s in full_layout_dims(layout)):
                    raise ValueError(f"parameter {fqn!r} has shape {tuple(full.shape)} in the state dict")
                ex = Exchange.plan(full_layout(tuple(full.shape), self.mesh.size), layout, self.mesh, self.rank)
                p.copy_(ex.run(full.detach().to(p.dtype)))


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
    cluster: str = "cpu-gloo",
    plan: Any = None,
    memory_budget: float | None = None,
    dtype: str | None = None,
) -> PrimeParModule:
    """Partition ``model`` over the ranks of the default process group (module docstring).

    ``plan``: ``None`` searches the best plan for ``cluster``; a :class:`Plan` or a path to a plan JSON is used
    as is; ``"megatron"``, ``"data_parallel"``, ``"prime"`` (P(S x S) wherever legal) or ``"random:SEED"`` force
    one. Call it on every rank after ``torch.distributed.init_process_group`` (or without one, as one rank).
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    graph = build_graph(capture(model, args, example_kwargs))
    return compile_graph(graph, cluster=cluster, plan=plan, memory_budget=memory_budget, dtype=dtype)


def compile_graph(
    graph: OpGraph,
    *,
    cluster: str = "cpu-gloo",
    plan: Any = None,
    memory_budget: float | None = None,
    dtype: str | None = None,
) -> PrimeParModule:
    """:func:`compile` from an already captured graph (capture once, compile several plans).

    Parameters are copied from the captured program, so modules compiled from one graph train independently.
    """
    world, rank = _world()
    chosen = agree_plan(graph, plan, cluster=cluster, memory_budget=memory_budget, dtype=dtype)
    mesh = DeviceMesh(tuple(chosen.digits))
    module = PrimeParModule(graph, chosen, rank_graph_for(graph, chosen, rank), mesh, rank)
    if os.environ.get("PRIMEPAR_DUMP_DIR"):  # the graph dump: rank 0 writes all of it, every other rank its code
        from primepar_fx.dump import dump_module

        dump_module(graph, module, os.environ["PRIMEPAR_DUMP_DIR"])
    return module


def agree_plan(graph: OpGraph, plan: Any, *, cluster: str, memory_budget: float | None, dtype: str | None) -> Plan:
    """Rank 0 resolves the plan (:func:`resolve_plan`) and broadcasts it; every rank checks it fits."""
    world, rank = _world()
    if dtype is None:
        first = next(iter(graph.param_dtypes.values()), torch.float32)
        dtype = _DTYPES.get(first, "fp32")
    text = None
    if rank == 0:
        try:
            chosen = resolve_plan(
                graph, plan, world_size=world, cluster=cluster, memory_budget=memory_budget, dtype=dtype
            )
            text = chosen.to_json(indent=None)
        except Exception:
            if world > 1:
                _broadcast_fail()
            raise
    chosen = Plan.from_json(_broadcast_text(text, rank, world))
    if chosen.world_size != world:
        raise ValueError(f"the plan is for {chosen.world_size} devices but the process group has {world} ranks")
    chosen.check_model((n.name, n.op) for n in graph.nodes.values())
    return chosen


def rank_graph_for(graph: OpGraph, chosen: Plan, rank: int, *, whole_params: bool = False) -> RankGraph:
    """This rank's rewritten graph of ``chosen``, at the captured example's ``B`` and ``S``."""
    captured = graph.captured
    mesh = DeviceMesh(tuple(chosen.digits))
    values: dict[sympy.Symbol, int] = {B: captured.example_batch, S: captured.example_seq}
    rank_graph = localize(
        graph, chosen.partitions(), mesh, rank, values, _groups(mesh, rank), whole_params=whole_params
    )
    if rank_graph.fallbacks:
        log.warning(
            "%d nodes run whole (no local form for their partition): %s",
            len(rank_graph.fallbacks),
            ", ".join(rank_graph.fallbacks[:8]),
        )
    return rank_graph


_GROUPS: dict[tuple, ProcessGroups] = {}


def _groups(mesh: DeviceMesh, rank: int) -> ProcessGroups:
    """One :class:`ProcessGroups` per mesh and default process group, so recompiling creates no new groups."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (mesh.digits, rank, id(world))
    if key not in _GROUPS:
        _GROUPS[key] = ProcessGroups(mesh, rank)
    return _GROUPS[key]


def _broadcast_fail() -> None:
    """Tell the other ranks, waiting in :func:`_broadcast_text`, that rank 0 has no plan."""
    dist.broadcast(torch.tensor([-1], dtype=torch.int64, device=_comm_device()), 0)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_state_dict(module: PrimeParModule) -> dict[str, torch.Tensor]:
    """Full parameters keyed by their original names (every rank must call it)."""
    return module.gather_state_dict()


def gather_grads(module: PrimeParModule) -> dict[str, torch.Tensor]:
    """Full gradients keyed by the original parameter names (every rank must call it)."""
    return module.gather_grads()


def load_state_dict(module: PrimeParModule, state: Mapping[str, torch.Tensor]) -> None:
    """Shard a full state dict (original names) into ``module``'s parameters."""
    module.load_full_state_dict(state)
