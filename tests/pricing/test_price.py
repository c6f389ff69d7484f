"""Pricing a graph on a mesh (``pricing.price``): a space whose edge matrices would not fit this machine's memory
is refused before any is laid out."""

from __future__ import annotations

import functools

import pytest

from primepar_fx import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.partition import DeviceMesh
from primepar_fx.pricing import price


@functools.cache
def graph(name: str):
    config = get_config(name)
    return analyze(build(config, device="meta"), *example_inputs(config, 2, 16), name=name)


def test_a_space_whose_edge_matrices_would_not_fit_in_memory_is_refused_before_they_are_priced(monkeypatch, capsys):
    """The full 32-device mesh of llama2-70b would hold 3.4e8 edge-matrix entries (~48 GiB; the 16-device one
    1.4e7): pricing stops before any re-layout is priced, naming the digits, the entries, the widest node and what
    to search instead; at exactly the memory it needs it goes on. The command line prints the one error."""
    from primepar_fx.cli import main

    cluster, values, mesh = load_cluster("v100-paper"), {B: 8, S: 64}, DeviceMesh((2, 2))
    full = price.price_graph(graph("gpt2-tiny"), mesh, cluster, values, CostOptions())
    # one matrix per distinct data-flow edge (identical layers share theirs)
    entries = sum({id(full.edge_bytes[e]): full.edge_bytes[e].size for e in full.flows}.values())
    need = entries * price.BYTES_PER_ENTRY
    monkeypatch.setattr(price, "physical_memory", lambda: need - 1)
    monkeypatch.setattr(price._Pricing, "_add_layouts", lambda *_: pytest.fail("an edge was laid out"))
    with pytest.raises(price.SpaceTooLarge, match=rf"digits \(2, 2\) .* have {entries:,} entries") as info:
        price.price_graph(graph("gpt2-tiny"), mesh, cluster, values, CostOptions())
    widest = max(full.strategies, key=lambda n: len(full.strategies[n]))
    assert f"node {widest} alone has {len(full.strategies[widest])} strategies" in str(info.value)
    assert "groupings of the digits" in str(info.value)
    assert main(["plan", "gpt2-tiny", "--world-size", "4", "--batch", "8", "--seq", "64", "--no-baselines"]) == 2
    assert capsys.readouterr().err.startswith("error: the partition space on device digits (2, 2) is too large")
    monkeypatch.undo()
    monkeypatch.setattr(price, "physical_memory", lambda: need)
    assert price.price_graph(graph("gpt2-tiny"), mesh, cluster, values, CostOptions()).strategies == full.strategies
