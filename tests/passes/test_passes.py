"""``primepar_fx.passes.runner.run_passes``: the pass runner, and ``localize`` running its passes through it.

The runner's own tests use small traced functions and a context that has only a rank; the ``localize`` tests build
one rank's graph of a two-linear MLP under the "fake" process group (no data moves, any world size, one process).
"""

from __future__ import annotations

import functools
import importlib
import logging
import operator
import pickle
import re
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import sympy
import torch
import torch.distributed as dist
from torch import fx, nn

from primepar_fx.api import analyze
from primepar_fx.frontend.symbols import B, S
from primepar_fx.partition import DeviceMesh
from primepar_fx.passes import (
    PassError,
    annotate_plan,
    defer_input_gradient_sums,
    defer_parameter_gradients,
    fuse_reduce_scatters,
    insert_collectives,
    insert_redistributions,
    localize,
    op_counts,
    recompute_layers,
    replace_ring_products,
    rewrite_local_ops,
    run_passes,
    shard_parameters,
    share_relayouts,
)
from primepar_fx.passes.common import RankContext
from primepar_fx.passes.overlap import overlap_collective_matmuls
from primepar_fx.planning.forced import forced_plan
from primepar_fx.report.dump import normalize_code
from primepar_fx.runtime.groups import ProcessGroups

CTX = SimpleNamespace(rank=3)
WORLD, BATCH, SEQ = 4, 4, 8
LOCALIZE_COUNTS = [
    "captured",
    "shard_parameters",
    "insert_redistributions",
    "insert_collectives",
    "share_relayouts",
    "fuse_reduce_scatters",
    "defer_parameter_gradients",
    "replace_ring_products",
    "rewrite_local_ops",
    "defer_input_gradient_sums",
    "overlap_collective_matmuls",
    "recompute_layers",
]


@pytest.fixture(autouse=True)
def _no_pass_env(monkeypatch) -> None:
    """The runner reads these at every call: a value set in the shell must not leak into the tests."""
    monkeypatch.delenv("PRIMEPAR_DISABLE_PASSES", raising=False)
    monkeypatch.delenv("PRIMEPAR_DUMP_DIR", raising=False)


# ---------------------------------------------------------------------------------------------- toy passes
def traced() -> fx.GraphModule:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + 1) * 2

    return fx.symbolic_trace(f)


def add_to_sub(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``x + 1`` becomes ``x - 1``; the graph is changed but not recompiled (the runner does that)."""
    for node in gm.graph.nodes:
        if node.target is operator.add:
            node.target = operator.sub
    return gm


def double_output(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """One more ``mul`` before the output."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        twice = gm.graph.call_function(operator.mul, (out.args[0], 2))
    out.args = (twice,)
    return gm


def use_before_define(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Leaves a graph that reads ``relu`` before computing it: Python compiles that, only a lint notices."""
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        gm.graph.call_function(operator.neg, (relu,))
    return gm


def explode(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    raise ValueError("the plan has no partition for node relu")


X = torch.arange(-3.0, 3.0)


# ---------------------------------------------------------------------------------------------- the runner
def test_the_runner_rewrites_a_copy_and_leaves_its_input_graph_module_alone() -> None:
    gm = traced()
    code, nodes = gm.code, [(n.name, n.target, n.args) for n in gm.graph.nodes]
    out, _ = run_passes(gm, [add_to_sub, double_output], CTX)
    assert out is not gm and out.graph is not gm.graph
    assert gm.code == code and [(n.name, n.target, n.args) for n in gm.graph.nodes] == nodes
    assert torch.equal(gm(X), torch.relu(X + 1) * 2)
    assert type(out).__name__ == type(gm).__name__


def test_the_runner_recompiles_after_each_pass_so_the_result_runs_the_rewritten_graph() -> None:
    out, _ = run_passes(traced(), [add_to_sub, double_output], CTX)
    assert "x - 1" in out.code and torch.equal(out(X), torch.relu(X - 1) * 2 * 2)


def test_the_counts_start_with_the_input_and_follow_every_pass_under_its_name() -> None:
    _, counts = run_passes(traced(), [("to_sub", add_to_sub), double_output], CTX, input_name="traced")
    assert [name for name, _ in counts] == ["traced", "to_sub", "double_output"]
    assert counts[0][1] == {"add": 1, "mul": 1, "relu": 1}
    assert counts[1][1] == {"mul": 1, "relu": 1, "sub": 1}
    assert counts[2][1] == {"mul": 2, "relu": 1, "sub": 1}


def test_a_pass_that_leaves_a_graph_that_does_not_lint_is_caught_and_named() -> None:
    with pytest.raises(PassError, match=r"pass 'use_before_define' left a graph that does not lint") as err:
        run_passes(traced(), [add_to_sub, use_before_define, double_output], CTX)
    assert "used before it has been defined" in str(err.value)  # lint's own message, kept
    assert err.value.pass_name == "use_before_define" and err.value.ran == ("add_to_sub",)


def test_an_error_names_the_failing_pass_and_the_passes_before_it_and_keeps_the_original() -> None:
    with pytest.raises(PassError) as err:
        run_passes(traced(), [add_to_sub, ("second", double_output), explode, double_output], CTX)
    message = str(err.value)
    assert "pass 'explode' raised" in message and "passes run before it: add_to_sub, second" in message
    assert "ValueError: the plan has no partition for node relu" in message and "rank 3" in message
    assert isinstance(err.value, RuntimeError) and isinstance(err.value.__cause__, ValueError)
    assert isinstance(err.value, ValueError), "a caller catching the original error's class still catches it"
    assert (err.value.pass_name, err.value.ran) == ("explode", ("add_to_sub", "second"))


def test_a_pass_error_pickles_with_its_pass_names() -> None:
    with pytest.raises(PassError) as err:
        run_passes(traced(), [add_to_sub, explode], CTX)
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is PassError and str(back) == str(err.value)
    assert (back.pass_name, back.ran) == ("explode", ("add_to_sub",))


def test_an_error_in_the_first_pass_says_no_pass_ran_before_it() -> None:
    with pytest.raises(PassError, match=r"pass 'explode' raised \(rank 3; passes run before it: none\)"):
        run_passes(traced(), [explode, add_to_sub], CTX)


def test_a_pass_that_returns_no_graph_module_is_an_error_naming_it() -> None:
    with pytest.raises(PassError, match=r"'forgets_return'.*returned NoneType"):
        run_passes(traced(), [("forgets_return", lambda gm, ctx: None)], CTX)


def test_passes_without_a_name_or_with_the_same_name_are_refused() -> None:
    with pytest.raises(TypeError, match="a named function or a"):
        run_passes(traced(), [functools.partial(add_to_sub)], CTX)
    with pytest.raises(ValueError, match=r"unique.*\['add_to_sub'\]"):
        run_passes(traced(), [add_to_sub, add_to_sub], CTX)


# ---------------------------------------------------------------------------------------------- PRIMEPAR_DISABLE_PASSES
def test_disable_passes_skips_the_named_pass_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", " add_to_sub ,")
    with caplog.at_level(logging.WARNING, logger="primepar_fx.passes.runner"):
        out, counts = run_passes(traced(), [add_to_sub, double_output], CTX)
    assert [name for name, _ in counts] == ["input", "double_output"]
    assert torch.equal(out(X), torch.relu(X + 1) * 2 * 2)
    assert any("skipping pass add_to_sub" in r.getMessage() for r in caplog.records)


def test_disable_passes_with_an_unknown_name_is_a_value_error_listing_the_passes(monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", "add_to_sub,double")
    with pytest.raises(ValueError, match=r"unknown passes \['double'\].*\['add_to_sub', 'double_output'\]"):
        run_passes(traced(), [add_to_sub, double_output], CTX)


def test_disable_passes_refuses_a_required_pass_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", "double_output")
    required = {"double_output": "the loss needs it"}
    with pytest.raises(ValueError, match=r"required passes \['double_output'\].*double_output: the loss needs it"):
        run_passes(traced(), [add_to_sub, double_output], CTX, required=required)


# ---------------------------------------------------------------------------------------------- PRIMEPAR_DUMP_DIR
def table(text: str) -> dict[str, list[str]]:
    """The first markdown table of ``text``: its header under ``"op"``, then one row per op, cells stripped."""
    lines = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("|")]
    return {row[0]: row[1:] for row in [lines[0], *lines[2:]]}


def test_dump_dir_gets_each_pass_s_graph_and_a_table_of_op_count_changes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    run_passes(traced(), [add_to_sub, double_output], CTX)
    folder = tmp_path / "passes" / "rank3"
    assert sorted(p.name for p in folder.iterdir()) == [
        "00_input.txt",
        "01_add_to_sub.txt",
        "02_double_output.txt",
        "changes.md",
    ]
    assert "add" in (folder / "00_input.txt").read_text() and "sub" not in (folder / "00_input.txt").read_text()
    after = (folder / "01_add_to_sub.txt").read_text()
    assert after.startswith("# after pass 1 of 2, add_to_sub\n") and "x - 1" in after
    assert len(re.findall(r" \* 2;", (folder / "02_double_output.txt").read_text())) == 2
    rows = table((folder / "changes.md").read_text())
    assert rows["op"] == ["input", "add_to_sub", "double_output", "final"]
    assert rows["add"] == ["1", "-1", "", "0"]
    assert rows["sub"] == ["0", "+1", "", "1"]
    assert rows["mul"] == ["1", "", "+1", "2"]
    assert rows["**total**"] == ["3", "", "+1", "4"]


def test_dump_dir_names_a_skipped_pass_and_drops_its_file_from_an_earlier_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    run_passes(traced(), [add_to_sub, double_output], CTX)
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", "add_to_sub")
    run_passes(traced(), [add_to_sub, double_output], CTX)
    folder = tmp_path / "passes" / "rank3"
    assert not (folder / "01_add_to_sub.txt").exists() and (folder / "02_double_output.txt").exists()
    changes = (folder / "changes.md").read_text()
    assert "Skipped (PRIMEPAR_DISABLE_PASSES): add_to_sub." in changes
    assert table(changes)["op"] == ["input", "double_output", "final"]


def test_dump_dir_keeps_the_graph_a_failing_pass_left(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    with pytest.raises(PassError):
        run_passes(traced(), [add_to_sub, use_before_define], CTX)
    folder = tmp_path / "passes" / "rank3"
    failed = (folder / "02_use_before_define.failed.txt").read_text()
    assert "does not lint" in failed and "call_function[target=operator.neg](args = (%relu,)" in failed
    assert "Pass use_before_define failed" in (folder / "changes.md").read_text()


# ---------------------------------------------------------------------------------------------- localize
class MLP(nn.Module):
    """layer_norm and two linears: enough for redistributions, all-reduces, a reduce-scatter and a ring."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x)))).pow(2).mean()


@functools.cache
def mlp_graph():
    return analyze(MLP(), (torch.randn(BATCH, SEQ, 16),), name="mlp")


@contextmanager
def fake_rank(rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def localized(plan_name: str, rank: int = 0):
    plan = forced_plan(mlp_graph(), plan_name, world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    mesh = DeviceMesh(tuple(plan.digits))
    with fake_rank(rank):
        return localize(mlp_graph(), plan.partitions(), mesh, rank, {B: BATCH, S: SEQ}, ProcessGroups(mesh, rank))


def inline(plan_name: str, rank: int = 0) -> tuple[fx.GraphModule, list]:
    """The passes called one after the other, as ``localize`` did before it had a runner."""
    graph = mlp_graph()
    plan = forced_plan(graph, plan_name, world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    mesh = DeviceMesh(tuple(plan.digits))
    values: dict[sympy.Symbol, int] = {B: BATCH, S: SEQ}
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph.captured.gm.graph, {}))
    gm = fx.GraphModule(nn.Module(), copy, class_name=f"PrimeParRank{rank}")
    with fake_rank(rank):
        ctx = RankContext(graph, mesh, rank, values, ProcessGroups(mesh, rank))
        counts = [("captured", op_counts(gm))]
        gm = annotate_plan(gm, ctx, plan.partitions())
        for p in (
            shard_parameters,
            insert_redistributions,
            insert_collectives,
            share_relayouts,
            fuse_reduce_scatters,
            defer_parameter_gradients,
            replace_ring_products,
            rewrite_local_ops,
            defer_input_gradient_sums,
            overlap_collective_matmuls,
            recompute_layers,
        ):
            gm = p(gm, ctx)
            counts.append((p.__name__, op_counts(gm)))
    gm.recompile()
    return gm, counts


def code(gm: fx.GraphModule) -> str:
    return normalize_code(gm.print_readable(print_output=False))


@pytest.mark.parametrize("plan_name", ["megatron-sp", "prime"])
def test_localize_through_the_runner_gives_the_pass_counts_and_code_of_the_passes_run_inline(plan_name) -> None:
    got = localized(plan_name, rank=1)
    gm, counts = inline(plan_name, rank=1)
    assert [name for name, _ in got.pass_counts] == LOCALIZE_COUNTS
    assert got.pass_counts == counts
    assert got.pass_counts[0][1] == op_counts(mlp_graph().captured.gm)
    assert got.pass_counts[-1][1] == op_counts(got.gm)
    assert code(got.gm) == code(gm) and "class PrimeParRank1" in code(got.gm)


def test_localize_leaves_the_captured_graph_as_it_was() -> None:
    before = str(mlp_graph().captured.gm.graph)
    localized("prime")
    assert str(mlp_graph().captured.gm.graph) == before


def test_localize_without_fuse_reduce_scatters_keeps_every_all_reduce(monkeypatch) -> None:
    fused = localized("megatron-sp").pass_counts[-1][1]
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", "fuse_reduce_scatters")
    skipped = localized("megatron-sp")
    assert [name for name, _ in skipped.pass_counts] == [n for n in LOCALIZE_COUNTS if n != "fuse_reduce_scatters"]
    assert skipped.pass_counts[-1][1]["AllReduce"] == fused["AllReduce"] + 1


def test_localize_refuses_to_skip_rewrite_local_ops(monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DISABLE_PASSES", "rewrite_local_ops")
    with pytest.raises(ValueError, match=r"required passes \['rewrite_local_ops'\].*local form"):
        localized("megatron")


def test_localize_names_the_pass_that_fails(monkeypatch) -> None:
    def broken(gm, ctx):
        raise AssertionError("operand linear is no longer an input of its product")

    monkeypatch.setattr(importlib.import_module("primepar_fx.passes.localize"), "replace_ring_products", broken)
    with pytest.raises(PassError) as err:
        localized("prime")
    assert err.value.pass_name == "broken"
    assert err.value.ran[-2:] == ("fuse_reduce_scatters", "defer_parameter_gradients")
    assert "no longer an input of its product" in str(err.value)


def test_localize_with_a_dump_dir_writes_every_pass_of_the_rank(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    got = localized("prime", rank=2)
    folder = tmp_path / "passes" / "rank2"
    names = ["captured", "annotate_plan", *LOCALIZE_COUNTS[1:]]
    assert sorted(p.name for p in folder.glob("*.txt")) == [f"{i:02d}_{n}.txt" for i, n in enumerate(names)]
    last = folder / f"{len(names) - 1:02d}_recompute_layers.txt"
    assert last.read_text().endswith(got.gm.print_readable(print_output=False))
    assert "RingMatmul" in table((folder / "changes.md").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passes"]  # nothing the graph dump writes


def test_compile_with_a_dump_dir_writes_the_pass_graphs_beside_the_graph_dump(tmp_path: Path, monkeypatch) -> None:
    import primepar_fx

    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    x = torch.randn(BATCH, SEQ, 16)
    module = primepar_fx.compile(MLP(), (x,), plan="megatron", world_size=1)  # one process
    assert {"captured.txt", "plan.json", "passes.md", "rank0.py", "passes"} <= {p.name for p in tmp_path.iterdir()}
    assert (tmp_path / "passes" / "rank0" / "09_rewrite_local_ops.txt").exists()
    rows = table((tmp_path / "passes" / "rank0" / "changes.md").read_text())
    assert rows["op"] == ["captured", "annotate_plan", *LOCALIZE_COUNTS[1:], "final"]
    first, final = module.pass_counts[0][1], module.pass_counts[-1][1]
    assert (rows["**total**"][0], rows["**total**"][-1]) == (str(sum(first.values())), str(sum(final.values())))
    assert torch.allclose(module(x), MLP()(x))


def test_a_ring_product_whose_weight_gradient_goes_to_a_bucket_keeps_its_operands() -> None:
    """``linear_1`` at ``P2x2,B`` on 8 devices: a P(S x S) ring whose weight is replicated over the batch digit, so
    its gradient is summed in a bucket; the ring pass still finds the weight (the parameter, no longer the
    all-reduce that ``defer_parameter_gradients`` removed) among the product's operands."""
    graph = mlp_graph()
    plan = forced_plan(graph, "random:64", world_size=8, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    assert plan.node("linear_1").partition == "P2x2,B"
    mesh = DeviceMesh(tuple(plan.digits))
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        got = localize(graph, plan.partitions(), mesh, 0, {B: BATCH, S: SEQ}, ProcessGroups(mesh, 0))
    finally:
        dist.destroy_process_group()
    ring = next(n for n in got.gm.graph.nodes if n.op == "call_module" and n.target == "ring_1")
    assert "p_down_weight" in [a.name for a in ring.all_input_nodes]
    assert got.grad_reductions["p_down_weight"].digits == (2,)
