"""``report.html``: one self-contained page about a plan, checked as a browser would get it."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest

from primepar_fx.api import analyze
from primepar_fx.cli import main
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition.seq import PartitionSeq
from primepar_fx.planning.forced import forced_plan
from primepar_fx.planning.planner import plan_graph
from primepar_fx.report.html import linear_seq, node_groups, report_html, write_report

WORLD, BATCH, SEQ = 4, 8, 64


@functools.cache
def graph():
    args, kwargs = example_inputs(get_config("llama-tiny"), BATCH, SEQ)
    return analyze(build("llama-tiny", device="meta"), args, kwargs, name="llama-tiny")


@functools.cache
def searched():
    return plan_graph(graph(), world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ, method="dp")


def inline_svgs(page: str) -> list[str]:
    return re.findall(r"<svg .*?</svg>", page, flags=re.S)


def test_the_report_is_self_contained_and_its_pictures_are_well_formed():
    page = report_html(graph(), searched())
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|url\((?!#)|https?://(?!www\.w3\.org/2000/svg)", page)
    svgs = inline_svgs(page)
    assert len(svgs) >= 4  # time and memory of the baselines, per layer, and a DSI picture
    for svg in svgs:
        ElementTree.fromstring(svg)


def test_the_report_compares_with_every_baseline_and_names_the_search():
    plan = searched()
    page = report_html(graph(), plan)
    for key, base in plan.baselines.items():
        assert re.escape(base.config.get("name", key)) and base.config.get("name", key) in page
    for text in ("Against the baselines", "method", "legal partition sequences per node", "Partitions, layer by layer"):
        assert text in page
    for node in plan.nodes:
        assert f"<td>{node.name}</td>" in page, node.name


def test_the_report_says_when_the_plan_is_the_split_only_searchs():
    plan = searched()
    assert "plan from" not in report_html(graph(), plan)
    kept = dataclasses.replace(plan, search=plan.search.replace(split_only_kept=True))
    assert "<td>plan from</td><td>the split-only search," in report_html(graph(), kept)


def test_layer_groups_cover_every_node_once_and_fold_only_equal_layers():
    plan = forced_plan(graph(), "prime", world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    groups = node_groups(graph(), plan)
    seen = [n for g in groups for n in g.nodes]
    assert len(seen) == len(set(seen)), "no node twice"
    assert groups[0].label == "before the layers" and groups[-1].label == "after the layers"
    units = groups[1:-1]
    assert sum(g.copies for g in units) == get_config("llama-tiny").layers
    outside = len(groups[0].nodes) + len(groups[-1].nodes)
    assert len(graph().nodes) == outside + sum(len(g.nodes) * g.copies for g in units), (
        "a folded row stands for its copies"
    )


@pytest.mark.parametrize(
    ("seq", "want"), [("B,K", "M,K"), ("S,N", "M,N"), ("P2x2", "P2x2"), ("R,B,K", "R,M,K"), ("N,P2x2", "N,P2x2")]
)
def test_matrix_product_partitions_read_on_the_papers_linear(seq, want):
    assert str(linear_seq(PartitionSeq.parse(seq), ("S", "N", "K"))) == want


def test_plan_report_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "r" / "plan.html"
    argv = ["plan", "llama-tiny", "-n", "4", "--batch", "8", "--seq", "64", "--cluster", "cpu-gloo", "--method", "dp"]
    assert main([*argv, "--report", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert "Against the baselines" in out.read_text()
    assert main([*argv, "--report", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium is not installed (apt package)")
def test_the_report_renders_in_headless_chromium_without_console_errors(tmp_path):
    plan = forced_plan(graph(), "prime", world_size=WORLD, cluster="cpu-gloo", batch=BATCH, seq=SEQ)
    page = write_report(tmp_path / "report.html", graph(), plan)
    shot = Path(os.environ.get("PRIMEPAR_REPORT_SCREENSHOT", tmp_path / "report.png"))
    cmd = [
        "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
        "--v=0", "--window-size=1200,1500", f"--screenshot={shot}", page.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    assert shot.stat().st_size > 20_000, "a screenshot of a rendered page, not a blank one"
