"""``primepar_fx.report.dump`` (``primepar-fx dump``, ``PRIMEPAR_DUMP_DIR``) and ``primepar_fx.explain``."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest

import primepar_fx
from primepar_fx.api import analyze
from primepar_fx.cli import main
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.record.plan import Plan
from primepar_fx.report.dump import dump, dump_module, edge_redistribution_bytes, fake_rank_graphs, normalize_code

WORLD, BATCH, SEQ = 4, 8, 64
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "gpt2_tiny_megatron_rank0.py"
FILES = ("captured.txt", "plan.json", "nodes.md", "passes.md", "graph.dot", "graph.svg", "report.html") + tuple(
    f"rank{r}.py" for r in range(4)
)


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config("gpt2-tiny"), BATCH, SEQ)
    return analyze(build("gpt2-tiny", device="meta"), args, kwargs, name="gpt2-tiny")


@functools.cache
def forced(name: str) -> Plan:
    return forced_plan(graph(), name, world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)


@functools.cache
def searched() -> Plan:
    return plan_graph(
        graph(), world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ, baselines=False, memory_budget=None
    )


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory) -> Path:
    """The dump written by the command line, as a user would."""
    out = tmp_path_factory.mktemp("megatron")
    argv = ["dump", "gpt2-tiny", "--world-size", "4", "--plan", "megatron-sp", "--batch", "8", "--seq", "64"]
    assert main([*argv, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def prime_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prime")
    dump(graph(), forced("prime"), out)
    return out


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown (github) table in ``text``, cells stripped."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_dump_of_gpt2_tiny_megatron_writes_every_file(megatron_dir: Path) -> None:
    for name in FILES:
        assert (megatron_dir / name).stat().st_size > 0, name
    assert (megatron_dir / "graph.svg").read_text().startswith("<svg ")
    assert Plan.load(megatron_dir / "plan.json").nodes == forced("megatron-sp").nodes
    assert "class GraphModule" in (megatron_dir / "captured.txt").read_text()


def test_nodes_table_has_one_row_per_node_with_its_partition(megatron_dir: Path) -> None:
    rows = table_rows((megatron_dir / "nodes.md").read_text())
    assert [r[0] for r in rows] == list(graph().nodes)
    plan = forced("megatron-sp")
    assert {r[0]: r[3] for r in rows} == {n.name: n.partition for n in plan.nodes}
    linear = next(r for r in rows if r[1] == "aten.linear.default")
    assert "B" in linear[2] and "S" in linear[2], "shapes are symbolic"


def test_megatron_rank_code_has_no_ring_and_prime_rank_code_does(megatron_dir: Path, prime_dir: Path) -> None:
    for r in range(WORLD):
        mega = (megatron_dir / f"rank{r}.py").read_text()
        prime = (prime_dir / f"rank{r}.py").read_text()
        assert "RingMatmul" not in mega and "self.ring_" not in mega
        assert re.search(r"^# ring_1 = RingMatmul\(\w+: P2x2", prime, re.M) and "self.ring_1(" in prime
        assert f"class PrimeParRank{r}" in mega


def test_passes_table_totals_match_the_pass_counts(megatron_dir: Path) -> None:
    counts = fake_rank_graphs(graph(), forced("megatron-sp"), [0])[0].pass_counts
    rows = table_rows((megatron_dir / "passes.md").read_text())
    total = next(r for r in rows if r[0] == "**total**")
    assert [int(x) for x in total[1:-1]] == [sum(c.values()) for _, c in counts]
    assert [r[0] for r in rows[:-1]] == sorted({op for _, c in counts for op in c})
    assert "rank 0" in (megatron_dir / "passes.md").read_text()


def test_picture_mentions_every_node_and_labels_edges_that_move_data(prime_dir: Path) -> None:
    dot = (prime_dir / "graph.dot").read_text()
    svg = (prime_dir / "graph.svg").read_text()
    for name in graph().nodes:
        assert f'"{name}" [label=' in dot, name
        assert f"<title>{name}\n" in svg, name
    assert re.search(r'fill="#c0392b">[\d.]+k? B</text>', svg), "the SVG labels the same edges"
    assert "P2x2 (9 nodes)" in svg
    assert re.search(r'-> "\w+" \[label="[\d.]+k? B"', dot), "some edge of the prime plan redistributes"
    assert "P2x2 (9 nodes)" in dot, "the legend counts each partition's nodes"


def test_edge_labels_add_up_to_each_nodes_redistribution() -> None:
    plan = forced("prime")
    per_edge = edge_redistribution_bytes(graph(), plan)
    for node in plan.nodes:
        incoming = [b for (u, v), b in per_edge.items() if v == node.name]
        want = node.cost.comm_bytes.get("redistribution", 0)
        assert abs(sum(incoming) - want) <= len(incoming), node.name  # each side rounds down per device


def test_the_picture_needs_no_graphviz(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no dot (nor anything else) to run
    files = dump(graph(), forced("megatron"), tmp_path, rank_graphs=fake_rank_graphs(graph(), forced("megatron")))
    svg = tmp_path / "graph.svg"
    assert svg in files and (tmp_path / "graph.dot") in files
    ElementTree.fromstring(svg.read_text())  # well-formed XML
    assert all(f"<title>{name}\n" in svg.read_text() for name in graph().nodes)


def test_rank_graphs_need_the_plans_sizes_to_be_the_captured_ones() -> None:
    other = forced_plan(graph(), "megatron", world_size=WORLD, cluster="cpu-gloo", batch=4, seq=16)
    with pytest.raises(ValueError, match="captured with example inputs of B=8, S=64"):
        fake_rank_graphs(graph(), other)


def test_given_rank_graphs_must_run_the_plan_being_dumped(tmp_path: Path) -> None:
    from types import SimpleNamespace

    out = tmp_path / "d"
    with pytest.raises(ValueError, match=r"rank_graphs\[0\] is a module compiled for another plan"):
        dump(graph(), forced("megatron"), out, rank_graphs={0: SimpleNamespace(plan=forced("prime"))})
    with pytest.raises(ValueError, match="rank_graphs has rank 4, but the plan is for 4 ranks"):
        dump(graph(), forced("megatron"), out, rank_graphs={4: SimpleNamespace(plan=forced("megatron"))})
    assert not out.exists()  # nothing written


def test_golden_rank0_code_of_gpt2_tiny_under_megatron(megatron_dir: Path) -> None:
    got = normalize_code((megatron_dir / "rank0.py").read_text())
    if os.environ.get("PRIMEPAR_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "set PRIMEPAR_UPDATE_GOLDEN=1 to accept the new code, then review the diff"


def test_normalize_code_drops_paths_and_addresses() -> None:
    text = "    # File: /x/y.py:3 in f, code: a\n    a = f(x)  # at 0x7f12ab34cd56\n\n\n\n    # No stacktrace found\n"
    assert normalize_code(text) == "    a = f(x)  # at 0x?\n"


# ---------------------------------------------------------------------------------------------- explain
def linear_names() -> list[str]:
    return [n for n, node in graph().nodes.items() if node.op == "aten.linear.default"]


def test_explain_marks_the_choice_and_no_alternative_of_a_searched_plan_is_cheaper() -> None:
    plan = searched()
    assert plan.search.proven_optimal and plan.search.memory_budget is None
    for name in linear_names():
        why = primepar_fx.explain(plan, name, graph=graph())
        assert why.chosen.partition == plan.node(name).partition and why.chosen.chosen
        assert len(why.alternatives) >= 3
        # one node moved, the others held: exactly the search objective's change, so never below an optimum
        assert all(o.objective_s >= why.chosen.objective_s * (1 - 1e-9) for o in why.alternatives), name
        assert not why.cheaper
        cost = plan.node(name).cost
        assert why.chosen.node_s == pytest.approx(cost.step_s - cost.redistribution_s)
        text = str(why)
        first = next(ln for ln in text.splitlines() if ln.startswith("*"))
        assert first.split()[1] == why.chosen.partition and "is the cheapest" in text


def test_explain_of_a_forced_megatron_plan_names_the_cheaper_alternatives() -> None:
    plan = forced("megatron-sp")
    found = [why for why in (primepar_fx.explain_choice(plan, n, graph=graph()) for n in linear_names()) if why.cheaper]
    assert found, "Megatron is not locally optimal for every linear of gpt2-tiny on cpu-gloo"
    assert "forced ('megatron-sp')" in found[0].reason()
    assert found[0].cheaper[0] == found[0].alternatives[0]


def test_explain_stays_a_module_with_explain_table() -> None:
    from primepar_fx.report.explain import explain_table

    assert callable(primepar_fx.explain) and callable(explain_table)
    with pytest.raises(KeyError, match="no node 'nope'"):
        primepar_fx.explain(searched(), "nope", graph=graph())


# ---------------------------------------------------------------------------------------------- PRIMEPAR_DUMP_DIR
def test_dump_dir_makes_compile_write_the_whole_dump_on_rank_0(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRIMEPAR_DUMP_DIR", str(tmp_path))
    model = build("gpt2-tiny")
    args, kwargs = example_inputs(model.config, 4, 16)
    module = primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1)  # one process
    assert {"captured.txt", "plan.json", "nodes.md", "passes.md", "rank0.py"} <= set(os.listdir(tmp_path))
    assert Plan.load(tmp_path / "plan.json") == module.plan


def test_dump_dir_makes_every_other_rank_write_only_its_code(tmp_path) -> None:
    plan = forced("prime")
    rank1 = SimpleNamespace(rank=1, plan=plan, graph_module=fake_rank_graphs(graph(), plan, [1])[1].gm)
    assert dump_module(graph(), rank1, tmp_path) == [tmp_path / "rank1.py"]
    assert os.listdir(tmp_path) == ["rank1.py"] and "class PrimeParRank1" in (tmp_path / "rank1.py").read_text()
