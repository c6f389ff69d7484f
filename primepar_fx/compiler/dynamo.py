"""``torch.compile(model, backend="primepar")``: the same planner and passes behind TorchDynamo.

Dynamo hands the backend one graph of torch-level ops whose inputs are the user inputs *and* the model's
parameters and buffers. The backend exports that graph with ``torch.export`` (the user inputs with a symbolic batch
and sequence length, parameters and buffers static), which normalises it into the ATen graph ``compile()`` captures,
so one rule registry serves both paths. Rank 0 plans (or loads / forces a plan) and broadcasts it; every rank
rewrites the graph with the same passes.

**What this path shards.** Dynamo passes every parameter *whole* on every call, so parameters (and their
gradients, and the optimizer state of a ``torch.optim`` optimizer built on ``model.parameters()``) are not sharded:
each rank takes its block of a parameter locally, computes with its partition (activations, the products and their
communication are partitioned as planned), and the backward gathers every parameter's gradient whole on every rank,
as DDP leaves it. :func:`primepar_fx.compile` is the path that keeps only this rank's parameter slices, their
gradients and optimizer state; prefer it when parameter memory matters.

A new batch or sequence length makes Dynamo call the backend again; the captured graph is symbolic in ``B`` and
``S``, so the plan of the first compilation is reused (re-priced at the new sizes only when it no longer divides).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind

from primepar_fx.compiler.agree import agree_plan, compile_options, with_machine_cluster, world_rank
from primepar_fx.compiler.rankgraph import rank_graph_for
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import build_graph
from primepar_fx.planning.options import PlanOptions, parse_plan
from primepar_fx.record.plan import Plan
from primepar_fx.report.trace import trace_plan

log = logging.getLogger(__name__)


class _Wrapped(nn.Module):
    """Dynamo's graph as a module again: its parameter and buffer inputs registered as such (the same tensors),
    its user inputs as the forward arguments, so ``capture`` exports it like any model."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
        super().__init__()
        self.graph_module = gm
        self.slots: list[tuple[str, str | None]] = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
            if isinstance(value, nn.Parameter):
                self.register_parameter(f"p{i}", value)
                self.slots.append(("param", f"p{i}"))
            elif isinstance(value, torch.Tensor) and "_buffers_" in node.name.lower():
                self.register_buffer(f"b{i}", value, persistent=False)
                self.slots.append(("buffer", f"b{i}"))
            else:
                self.slots.append(("user", None))

    def forward(self, *user: Any) -> Any:
        it = iter(user)
        return self.graph_module(*(next(it) if kind == "user" else getattr(self, key) for kind, key in self.slots))


class _Runner:
    """Calls one rank's rewritten graph with Dynamo's flat inputs (parameters and buffers whole, user inputs)."""

    def __init__(self, wrapped: _Wrapped, graph, rank_graph) -> None:
        program = graph.captured.program
        self.gm = rank_graph.gm
        self.stats = rank_graph.stats
        index = {key: i for i, (_, key) in enumerate(wrapped.slots) if key is not None}
        users = [i for i, (kind, _) in enumerate(wrapped.slots) if kind == "user"]
        self.sources: list[tuple[str, Any]] = []
        for spec in program.graph_signature.input_specs:
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in index:
                self.sources.append(("arg", index[spec.target]))
            elif spec.kind is InputKind.USER_INPUT:
                self.sources.append(("arg", users.pop(0)))
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                value = program.state_dict.get(spec.target)
                self.sources.append(("const", program.constants[spec.target] if value is None else value))
            else:
                raise NotImplementedError(f"graph input {spec.target} of kind {spec.kind.name}")

    def __call__(self, *args: Any) -> Any:
        return self.gm(*(args[v] if kind == "arg" else v for kind, v in self.sources))


class _ShapeCache:
    """Rewritten rank graphs of one Dynamo graph, one per set of concrete input sizes.

    Dynamo's graph may be symbolic (after a size change it marks sizes dynamic and passes them as ``int`` inputs);
    the per-rank graph is built for concrete sizes, so each new set of sizes is captured again at those sizes
    (``torch.export``, about a second for a small model) and rewritten, reusing the plan of the first compilation
    whenever it fits: no new search.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        plan: Any,
        options: PlanOptions,
        state: dict[str, Plan],
        measure: bool = False,
    ) -> None:
        self.gm, self.plan, self.options, self.state, self.measure = gm, plan, options, state, measure
        self.cache: dict[tuple, _Runner] = {}
        if not any(isinstance(a, torch.SymInt) for a in example_inputs):
            self.build(list(example_inputs))  # a static graph: build now; a symbolic one at its first call

    @staticmethod
    def key(args: list[Any]) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)

    def build(self, args: list[Any]) -> _Runner:
        _, rank = world_rank()
        concrete = list(args)
        wrapped = _Wrapped(self.gm, concrete)
        users = tuple(v for v, (kind, _) in zip(concrete, wrapped.slots) if kind == "user")
        graph = build_graph(capture(wrapped, users, name="dynamo graph", dynamic=False))
        chosen = self.state.get("plan")
        if chosen is None or not _fits(chosen, graph):
            options = with_machine_cluster(self.options, self.plan, measure=self.measure)
            chosen = agree_plan(graph, self.plan, options, pipelines=False, what="the torch.compile backend")
            self.state["plan"] = chosen
        rank_graph = rank_graph_for(graph, chosen, rank, whole_params=True)
        trace_plan(graph, chosen, rank, rank_graph)
        runner = _Runner(wrapped, graph, rank_graph)
        self.cache[self.key(concrete)] = runner
        return runner

    def __call__(self, *args: Any) -> Any:
        runner = self.cache.get(self.key(list(args)))
        if runner is None:
            runner = self.build(list(args))
        return runner(*args)


def backend(
    *, cluster: Any = None, plan: Any = None, memory_budget: float | str | None = None, dtype: Any = None
) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A configured ``torch.compile`` backend: ``torch.compile(model, backend=primepar_fx.backend(plan="prime"))``.

    ``plan``, ``cluster``, ``memory_budget`` and ``dtype`` are as for :func:`primepar_fx.compile`: ``None``
    (search on ``cluster``), a :class:`Plan`, a plan JSON (its path or text), or a forced plan name; they are
    checked here, not at the first call. The first compilation's plan is reused for other sizes while it fits.
    """
    options = compile_options(cluster=cluster, memory_budget=memory_budget, dtype=dtype)  # checked here, not inside
    parse_plan(plan)  # Dynamo at the first call
    state: dict[str, Plan] = {}

    def compile_fn(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        log.info("primepar backend: graph with %d nodes", len(gm.graph.nodes))
        return _ShapeCache(gm, example_inputs, plan, options, state, measure=cluster is None)

    return compile_fn


def _fits(plan: Plan, graph) -> bool:
    try:
        plan.check_model((n.name, n.op) for n in graph.nodes.values())
    except ValueError:
        return False
    return True


def primepar_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The backend registered as ``"primepar"``: a searched plan on this machine's cluster (``compile``'s default)."""
    return backend()(gm, example_inputs)


def register() -> None:
    """Register ``"primepar"`` with TorchDynamo (also done by the ``torch_dynamo_backends`` entry point)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "primepar" not in _BACKENDS:
        register_backend(name="primepar")(primepar_backend)


register()
