"""The P(2x2) picture in docs/concepts.md is what ``primepar_fx.report.picture`` draws from the DSIs now."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import primepar_fx
from primepar_fx.partition import PHASES, DeviceMesh, OpPartition, PartitionSeq, Phase
from primepar_fx.report.picture import bind, holdings, main, render_markdown, render_svg

DOCS = Path(__file__).resolve().parents[2] / "docs"
SVG = DOCS / "img" / "prime_2x2.svg"
CONCEPTS = DOCS / "concepts.md"
BLOCK = re.compile(r"(<!-- picture:start[^\n]*-->\n\n)(.*?)(\n<!-- picture:end -->)", re.S)
UPDATE = "set PRIMEPAR_UPDATE_GOLDEN=1 to regenerate it, then review the diff"


def test_committed_svg_is_what_the_code_draws_now():
    got = render_svg(bind())
    if os.environ.get("PRIMEPAR_UPDATE_GOLDEN") == "1":
        SVG.write_text(got)
    assert SVG.read_text() == got, f"{SVG} is stale; {UPDATE}"


def test_concepts_page_tables_are_what_the_code_draws_now():
    text = CONCEPTS.read_text()
    found = BLOCK.search(text)
    assert found, "docs/concepts.md lost its <!-- picture:start --> ... <!-- picture:end --> markers"
    got = render_markdown(bind())
    if os.environ.get("PRIMEPAR_UPDATE_GOLDEN") == "1":
        CONCEPTS.write_text(text[: found.start(2)] + got + text[found.end(2) :])
    assert found.group(2) == got, f"the picture tables in {CONCEPTS} are stale; {UPDATE}"


def test_p2x2_blocks_follow_the_paper_dsi_table():
    held = holdings(bind())
    for r in range(2):
        for c in range(2):
            rank = 2 * r + c
            for t in range(2):
                d = 1 if t == 1 else 0
                forward = {"I": (r, (r + c + t) % 2), "W": ((r + c + t) % 2, c), "O": (r, c)}
                backward = {"dO": (r, (c + t) % 2), "W": ((r + c - 1) % 2, (c + t) % 2), "dI": (r, (r + c - 1) % 2)}
                n, k = (r + c - 1 + d) % 2, (c - 1 + d) % 2
                gradient = {"I": ((r + t) % 2, n), "dO": ((r + t) % 2, k), "dW": (n, k)}
                assert held[Phase.FORWARD, t, rank] == forward
                assert held[Phase.BACKWARD, t, rank] == backward
                assert held[Phase.GRADIENT, t, rank] == gradient


def test_p2x2_holds_every_block_exactly_once_at_every_step():
    held = holdings(bind())
    for phase in PHASES:
        for t in range(2):
            for tensor in held[phase, t, 0]:
                blocks = sorted(held[phase, t, rank][tensor] for rank in range(4))
                assert blocks == [(0, 0), (0, 1), (1, 0), (1, 1)], (phase, t, tensor)


def test_the_pictured_linear_has_the_dsis_of_the_real_linear_rule():
    graph = primepar_fx.analyze(torch.nn.Linear(8, 8, bias=False), (torch.randn(2, 4, 8),))
    (node,) = graph.nodes.values()
    real = OpPartition(node.dims, PartitionSeq.parse("R,P2x2"), DeviceMesh((2, 2, 2)))
    drawn = bind("R,P2x2", (2, 2, 2))
    roles = dict(zip(real.op.matmul, drawn.op.matmul))  # ("S", "N", "K") -> ("M", "N", "K")
    for phase in PHASES:
        for t in range(2):
            for coords in drawn.mesh.devices():
                want = drawn.dsis(phase, coords, t)
                assert {roles[d]: i for d, i in real.dsis(phase, coords, t).items() if d in roles} == want


def test_module_prints_markdown_and_svg(capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == render_markdown(bind())
    assert main(["--svg", "--seq", "K,P2x2", "--digits", "2,2,2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<svg") and "device 7 (r=1, c=1)" in out


def test_a_block_several_devices_hold_is_grey_and_names_them_all():
    part = bind("M,K", (2, 2))  # N is not split: I[m, 0] is on both devices of row m
    assert "| 1 D=01 | I[0,0] · W[0,1] → O[0,1] |" in render_markdown(part)
    svg = render_svg(part)
    assert 'fill="#d9d9d9"' in svg and ">0,1</text>" in svg
    with pytest.raises(ValueError, match="no dim 'B'"):
        bind("B", (2,))
