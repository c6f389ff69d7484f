"""``primepar_fx.planning.options``: every option validated in one place, one default cluster rule, one plan= reader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import primepar_fx
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.models import build, example_inputs
from primepar_fx.planning import options as options_mod
from primepar_fx.planning.options import PlanOptions, default_cluster, parse_plan, resolve_cluster
from primepar_fx.planning.planner import plan_graph
from primepar_fx.record.plan import Plan


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("PRIMEPAR_CLUSTER", raising=False)


def test_planning_for_elsewhere_defaults_to_the_papers_cluster(no_env):
    assert default_cluster(running=False) == "v100-paper"


def test_running_here_defaults_to_this_machines_cluster(no_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_cluster(running=True) == "cpu-gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpu, preset in [
        ("NVIDIA H200", "h100-dgx"),
        ("NVIDIA A100-SXM4-80GB", "a100-dgx"),
        ("Tesla V100", "v100-paper"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, g=gpu: g)
        assert default_cluster(running=True) == preset
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert default_cluster(running=True) == "cpu-gloo"


def test_the_environment_names_the_default_cluster_everywhere(monkeypatch):
    monkeypatch.setenv("PRIMEPAR_CLUSTER", "a100-dgx")
    assert default_cluster(running=False) == default_cluster(running=True) == "a100-dgx"
    assert PlanOptions.make(world_size=8).cluster.name == "a100-dgx"


def test_a_cluster_is_resolved_once_from_any_of_its_forms(no_env):
    spec = load_cluster("h100-dgx")
    assert resolve_cluster(spec) is spec
    assert resolve_cluster("h100-dgx") == spec
    assert resolve_cluster(None).name == "v100-paper"
    with pytest.raises(ValueError, match="no cluster preset or spec file 'nope'"):
        resolve_cluster("nope")
    with pytest.raises(ValueError, match="cluster must be a preset name"):
        resolve_cluster(3)


def test_make_reads_user_input_into_checked_values(no_env):
    opts = PlanOptions.make(world_size=8, memory_budget="2GiB", dtype=torch.bfloat16, digits=[2, 2, 2])
    assert isinstance(opts.cluster, ClusterSpec)
    assert (opts.memory_budget, opts.dtype, opts.digits) == (2 * 2**30, "bf16", (2, 2, 2))
    assert opts.mesh().digits == (2, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.alpha = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive integer"),
        ({"world_size": 4, "batch": 0}, "batch must be an integer >= 1"),
        ({"world_size": 4, "seq": 2.5}, "seq must be an integer >= 1"),
        ({"world_size": 4, "dtype": "int8"}, "unknown dtype 'int8'"),
        ({"world_size": 4, "memory_budget": "lots"}, "not a byte size"),
        ({"world_size": 4, "alpha": -1.0}, "alpha must be >= 0"),
        ({"world_size": 4, "alpha": float("nan")}, "alpha must be a finite number"),
        ({"world_size": 4, "method": "greedy"}, "method must be one of"),
        ({"world_size": 4, "fallback": "skip"}, "fallback"),
        ({"world_size": 6, "digits": (2, 2)}, r"device digits \(2, 2\) make 4 devices, not world size 6"),
        ({"world_size": 4, "digits": (4, 1)}, "digits must be radices >= 2"),
    ],
)
def test_make_names_the_bad_option(no_env, fields, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions.make(**fields)


def test_the_constructor_takes_only_resolved_values():
    with pytest.raises(ValueError, match="use PlanOptions.make"):
        PlanOptions(cluster="v100-paper")  # type: ignore[arg-type]
    spec = load_cluster("cpu-gloo")
    with pytest.raises(ValueError, match="use PlanOptions.make"):
        PlanOptions(cluster=spec, memory_budget="1GiB")  # type: ignore[arg-type]


def test_parse_plan_tells_every_kind_of_plan_argument(tmp_path, no_env):
    assert parse_plan(None) == ("search", None) == parse_plan("searched")
    assert parse_plan("megatron-sp") == ("forced", "megatron-sp")
    assert parse_plan("random:3") == ("forced", "random:3")
    assert parse_plan('{"model": "m"}')[0] == "json"
    path = tmp_path / "p.json"
    path.write_text("{}")
    assert parse_plan(path) == ("file", str(path))
    with pytest.raises(ValueError, match="no plan file"):
        parse_plan(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="seed 'x' is not an integer"):
        parse_plan("random:x")
    with pytest.raises(ValueError, match="unknown forced plan 'fastest'"):
        parse_plan("fastest")
    with pytest.raises(ValueError, match="plan must be None, a Plan"):
        parse_plan(42)


def test_plan_graph_gives_the_same_plan_from_options_or_keywords(no_env):
    model = build("gpt2-tiny")
    args, kwargs = example_inputs(model.config, 2, 16)
    graph = primepar_fx.analyze(model, args, kwargs)
    keywords = {"world_size": 4, "cluster": "cpu-gloo", "dtype": "fp32", "baselines": False, "method": "dp"}
    by_keywords = plan_graph(graph, **keywords)
    by_options = plan_graph(graph, PlanOptions.make(**keywords))
    assert by_options.nodes == by_keywords.nodes
    assert by_options.predicted == by_keywords.predicted
    assert (by_options.batch, by_options.seq, by_options.cluster) == (2, 16, "cpu-gloo")
    with pytest.raises(TypeError, match="not both"):
        plan_graph(graph, PlanOptions.make(**keywords), world_size=4)


def test_primepar_fx_plan_checks_every_option_before_the_capture(no_env, monkeypatch):
    monkeypatch.setattr(primepar_fx.api, "analyze", lambda *a, **k: pytest.fail("captured before checking"))
    model = build("gpt2-tiny")
    args, kwargs = example_inputs(model.config, 2, 16)
    with pytest.raises(ValueError, match="method must be one of"):
        primepar_fx.plan(model, (args, kwargs), world_size=4, method="fast")


def test_a_plan_records_the_default_cluster_it_was_priced_on(no_env):
    model = build("gpt2-tiny")
    args, kwargs = example_inputs(model.config, 2, 16)
    plan = primepar_fx.plan(model, (args, kwargs), world_size=2, baselines=False)
    assert isinstance(plan, Plan) and plan.cluster == options_mod.PAPER_CLUSTER
