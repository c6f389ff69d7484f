"""Bad input fails once, clearly, naming the culprit, and leaves nothing half-built.

Planning-only cases run as rank 0 of the "fake" process group (no data moves, any world size, one process); the
run-time cases run in one process (``world_size=1``) and, where ranks must agree, on two real gloo ranks.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_checks import make
from reliability_checks import errors_on_ranks, inputs
from torch import nn

import primepar_fx
from primepar_fx.compiler.module import compile_graph
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.capture import capture
from primepar_fx.graph import build_graph
from primepar_fx.partition import PartitionError
from primepar_fx.planning.forced import forced_plan
from primepar_fx.record.fields import PlanError
from primepar_fx.rules import MissingRuleError
from primepar_fx.runtime.testing import spawn
from primepar_fx.search import InfeasibleBudget

PACKAGE = Path(primepar_fx.__file__).parent
compile_mod = importlib.import_module("primepar_fx.compiler.module")  # the module, not the function of that name
agree_mod = importlib.import_module("primepar_fx.compiler.agree")  # where the process groups are kept


@torch.library.custom_op("primepar_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An op no rule will ever cover."""
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


mystery.register_autograd(lambda ctx, grad: grad * 2)


class Tiny(nn.Module):
    """Two linears around a width of 15, which two devices cannot split."""

    def __init__(self, mysterious: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 15)
        self.down = nn.Linear(15, 16)
        self.mysterious = mysterious

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.mysterious:
            h = mystery(h)  # the line the error must name
        return self.down(h).pow(2).mean()


X = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


@contextmanager
def fake_world(size: int, rank: int = 0):
    """This process as rank ``rank`` of a fake process group of ``size`` ranks (planning only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def nothing_built():
    """The body must raise and create no process group (a failing compile builds nothing)."""
    groups = dict(agree_mod._GROUPS)
    yield
    assert agree_mod._GROUPS == groups


@pytest.fixture(scope="module")
def tiny_graph():
    return build_graph(capture(Tiny(), (X,)))


def _tiny_plan(graph, world: int = 2):
    return forced_plan(graph, "data_parallel", world_size=world, batch=4, seq=8)


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---------------------------------------------------------------------------------------------------- the call
def test_compile_without_a_process_group_raises_unless_asked_for_one_process():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group.*world_size=1"):
        primepar_fx.compile(Tiny(), (X,))
    with pytest.raises(RuntimeError, match="process group of 2 ranks"):
        primepar_fx.compile(Tiny(), (X,), world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        primepar_fx.compile(Tiny(), (X,), world_size=0)
    module = primepar_fx.compile(Tiny(), (X,), world_size=1)
    assert torch.equal(module(X), Tiny()(X))


def test_compile_options_that_cannot_be_used_fail_before_the_capture(monkeypatch):
    compile_module = sys.modules["primepar_fx.compiler.module"]  # the package's attribute is the function
    monkeypatch.setattr(compile_module, "capture", lambda *a, **k: pytest.fail("captured before checking"))
    for kwargs, message in (
        ({"memory_budget": -1}, "memory_budget must be a number of bytes per device >= 0"),
        ({"memory_budget": "2 lots"}, "not a byte size"),
        ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
        ({"fallback": "bogus"}, "unknown fallback 'bogus'"),
    ):
        with pytest.raises(ValueError, match=message):
            primepar_fx.compile(Tiny(), (X,), world_size=1, **kwargs)


def test_the_api_names_what_it_cannot_use(tmp_path, monkeypatch):
    """Forced-plan names, plan paths, meta weights and non-compiled modules fail before any work, naming them; a
    plan may also be given as its JSON text."""
    from primepar_fx import explain_choice
    from primepar_fx.compiler import checkpoint
    from primepar_fx.compiler.module import gather_state_dict, load_state_dict

    compile_module = sys.modules["primepar_fx.compiler.module"]
    real_capture = compile_module.capture
    monkeypatch.setattr(compile_module, "capture", lambda *a, **k: pytest.fail("captured before checking"))
    for kwargs, error, message in (
        ({"plan": "megatron-xp"}, ValueError, "unknown forced plan 'megatron-xp'"),
        ({"plan": "random:x"}, ValueError, "seed 'x' is not an integer"),
        ({"cluster": "nowhere"}, ValueError, "no cluster preset or spec file 'nowhere'"),
    ):
        with pytest.raises(error, match=message):
            primepar_fx.compile(Tiny(), (X,), world_size=1, **kwargs)
    with pytest.raises(ValueError, match="'up.weight' of the model is on the meta device"):
        primepar_fx.compile(Tiny().to("meta"), (X,), world_size=1)
    with pytest.raises(ValueError, match="unknown forced plan 'megatron-xp'"):
        primepar_fx.backend(plan="megatron-xp")
    monkeypatch.setattr(compile_module, "capture", real_capture)
    with pytest.raises(ValueError, match="no plan file"):
        primepar_fx.compile(Tiny(), (X,), world_size=1, plan=tmp_path / "missing")
    module = primepar_fx.compile(Tiny(), (X,), world_size=1, plan="megatron")
    again = primepar_fx.compile(Tiny(), (X,), world_size=1, plan=module.plan.to_json())  # the JSON text itself
    assert again.plan == module.plan
    for call in (gather_state_dict, lambda m: load_state_dict(m, {})):
        with pytest.raises(TypeError, match="takes a module returned by primepar_fx.compile, got Tiny"):
            call(Tiny())
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(ValueError, match="writes a directory, and .*ckpt' is a file"):
        checkpoint.save(module, tmp_path / "ckpt")
    graph = build_graph(capture(Tiny(), (X,)))
    with pytest.raises(TypeError, match="takes a Plan and a node name, got str and Plan"):
        explain_choice("linear", module.plan, graph=graph)


def test_a_world_size_other_than_the_process_group_s_is_an_error():
    with fake_world(2), nothing_built(), pytest.raises(ValueError, match="world_size=4 but the default process group"):
        primepar_fx.compile(Tiny(), (X,), world_size=4)


def test_an_op_without_a_rule_names_the_op_the_node_the_source_line_and_the_fallback():
    with pytest.raises(MissingRuleError) as err:
        primepar_fx.compile(Tiny(mysterious=True), (X,), world_size=1)
    message = str(err.value)
    assert "primepar_test.mystery.default" in message and "'mystery'" in message
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "the line the error" in text)
    assert f"test_errors.py:{line}" in message
    assert "fallback='replicate'" in message
    module = primepar_fx.compile(Tiny(mysterious=True), (X,), world_size=1, fallback="replicate")
    assert torch.equal(module(X), Tiny(mysterious=True)(X))


# ---------------------------------------------------------------------------------------------------- plans
def test_a_loaded_plan_that_splits_an_odd_dim_names_the_node_and_the_dim(tiny_graph, tmp_path):
    data = json.loads(_tiny_plan(tiny_graph).to_json())
    linear = next(n for n in data["nodes"] if n["name"] == "linear")
    linear["partition"] = "K"  # the output width, 15
    path = _write(tmp_path / "odd.json", data)
    with fake_world(2), nothing_built(), pytest.raises(PartitionError) as err:
        compile_graph(tiny_graph, plan=path)
    assert "'linear'" in str(err.value) and "dim 'K' of size 15 does not split into 2 parts" in str(err.value)


def test_plan_digits_that_do_not_multiply_to_its_world_size_name_the_field(tiny_graph, tmp_path):
    data = json.loads(_tiny_plan(tiny_graph).to_json())
    data["digits"] = [2, 2]
    with fake_world(2), nothing_built(), pytest.raises(PlanError, match=r"plan\.digits: \[2, 2\] multiply to 4"):
        compile_graph(tiny_graph, plan=_write(tmp_path / "digits.json", data))


def test_a_plan_for_another_world_size_names_both_sizes(tiny_graph, tmp_path):
    path = _tiny_plan(tiny_graph, world=4).save(tmp_path / "four.json")
    with fake_world(2), nothing_built(), pytest.raises(ValueError, match="plan is for 4 devices .* group has 2 ranks"):
        compile_graph(tiny_graph, plan=path)


def test_a_plan_for_another_model_is_refused(tiny_graph, tmp_path):
    gpt2 = make("gpt2-tiny")
    other = build_graph(capture(gpt2[0], gpt2[1], gpt2[2]))
    path = forced_plan(other, "data_parallel", world_size=2, batch=4, seq=16).save(tmp_path / "gpt2.json")
    with fake_world(2), nothing_built(), pytest.raises(PlanError, match="not in the model.*another model"):
        compile_graph(tiny_graph, plan=path)
    data = json.loads(_tiny_plan(tiny_graph).to_json())
    data["model_fingerprint"] = "0123456789abcdef"
    with fake_world(2), nothing_built(), pytest.raises(PlanError, match=r"plan\.model_fingerprint: 0123456789abcdef"):
        compile_graph(tiny_graph, plan=_write(tmp_path / "fingerprint.json", data))


def test_a_memory_budget_no_plan_meets_reports_the_smallest_feasible_one(tiny_graph):
    floor = tiny_graph.param_count() * 16 / 2  # the training state alone over both ranks
    with fake_world(2), nothing_built(), pytest.raises(InfeasibleBudget, match="the training state alone") as err:
        compile_graph(tiny_graph, memory_budget=floor - 1)  # below it: refused before any search
    assert err.value.min_memory == floor
    with fake_world(2), nothing_built(), pytest.raises(InfeasibleBudget) as err:
        compile_graph(tiny_graph, memory_budget=floor)
    least = err.value.min_memory
    assert least > floor and f"{math.ceil(least):,} bytes" in str(err.value) and "smallest" in str(err.value)
    with fake_world(2):
        module = compile_graph(tiny_graph, memory_budget=least)
    assert module.plan.predicted.peak_memory_bytes <= least


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        (lambda d: "{ not json", r"plan: not valid JSON"),
        (lambda d: json.dumps(d).replace('"batch": 4', '"batch": NaN'), r"plan: not valid JSON: NaN"),
        (lambda d: d | {"world_size": "two"}, r"plan\.world_size: must be an integer"),
        (lambda d: {k: v for k, v in d.items() if k != "nodes"}, r"plan\.nodes: required field is missing"),
        (lambda d: d | {"nodes": [d["nodes"][0] | {"bogus": 1}] + d["nodes"][1:]}, r"plan\.nodes\[0\]\.bogus"),
        (
            lambda d: d | {"nodes": [d["nodes"][0] | {"partition": "B,,"}] + d["nodes"][1:]},
            r"plan\.nodes\[0\]\.partition",
        ),
        (lambda d: d | {"predicted": d["predicted"] | {"comm_bytes": -1}}, r"plan\.predicted\.comm_bytes"),
        (lambda d: d | {"format": "primepar-plan/0"}, r"plan\.format"),
    ],
)
def test_malformed_or_tampered_plan_json_names_the_field(tiny_graph, tmp_path, tamper, field):
    path = _write(tmp_path / "plan.json", tamper(json.loads(_tiny_plan(tiny_graph).to_json())))
    with fake_world(2), nothing_built(), pytest.raises(PlanError, match=field) as err:
        compile_graph(tiny_graph, plan=path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        (lambda d: d | {"bogus": 1}, r"ClusterSpec has unknown field"),
        (lambda d: d | {"num_devices": "eight"}, r"num_devices must be an integer"),
        (lambda d: d | {"device": d["device"] | {"memory_bandwidth": -1.0}}, r"ClusterSpec\.device.*memory_bandwidth"),
        (
            lambda d: d | {"levels": [d["levels"][0] | {"collectives": {"p2p": {"bytes_coeff": "x", "fixed": 0}}}]},
            r"levels\[0\]",
        ),
    ],
)
def test_a_tampered_cluster_spec_names_the_field(tiny_graph, tmp_path, tamper, field):
    spec = json.loads(load_cluster("cpu-gloo").to_json())
    path = _write(tmp_path / "cluster.json", tamper(spec))
    with fake_world(2), nothing_built(), pytest.raises(ValueError, match=field):
        compile_graph(tiny_graph, cluster=str(path), plan="data_parallel")


def test_nothing_in_the_package_unpickles():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(
                r"\bimport (c?pickle|dill|cloudpickle)\b|\bpickle\.(loads?|dumps?)\b|weights_only=False", code
            ):
                offenders.append(f"{path.name}:{i}: {line.strip()}")
            if "torch.load(" in code and "weights_only=True" not in code:
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert offenders == []


# ---------------------------------------------------------------------------------------------------- run time
@pytest.fixture(scope="module")
def one_process():
    ref, args, kwargs = make("gpt2-tiny")
    model, _, _ = make("gpt2-tiny")
    return primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1), ref


def test_a_new_batch_and_sequence_length_rebuild_the_graph_and_keep_the_parameters(one_process):
    module, ref = one_process
    shards = {k: (id(p), p.data_ptr()) for k, p in module.shards.items()}
    layouts = dict(module._layouts)
    for b, s in ((2, 8), (6, 24), (4, 16)):
        args, kwargs = inputs("gpt2-tiny", b, s)
        assert torch.allclose(module(*args, **kwargs), ref(*args, **kwargs), rtol=1e-5, atol=1e-6), (b, s)
    assert set(module._rank_graphs) == {(4, 16), (2, 8), (6, 24)}
    assert {k: (id(p), p.data_ptr()) for k, p in module.shards.items()} == shards and module._layouts == layouts


def test_the_module_takes_the_model_s_arguments_positionally_or_by_keyword(one_process):
    module, ref = one_process
    (ids,), kwargs = inputs("gpt2-tiny", 4, 16)  # compiled as module(input_ids, labels=...)
    expected = ref(ids, **kwargs)
    for args, kw in (((ids, kwargs["labels"]), {}), ((), {"input_ids": ids, **kwargs}), ((ids,), kwargs)):
        assert torch.allclose(module(*args, **kw), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"called without 'labels', but the module was compiled with the inputs"):
        module(ids)
    with pytest.raises(TypeError, match=r"takes the model's arguments \(input_ids.*unexpected keyword .*mask"):
        module(ids, **kwargs, mask=ids)


def test_an_input_of_another_dtype_names_the_input_and_both_dtypes(one_process):
    module, _ = one_process
    args, kwargs = inputs("gpt2-tiny", 4, 16)
    with pytest.raises(TypeError, match=r"input 'input_ids' has dtype torch\.int32 .* compiled for torch\.int64"):
        module(args[0].to(torch.int32), **kwargs)


def test_inputs_that_disagree_on_a_size_name_the_input_and_the_dim(one_process):
    module, _ = one_process
    args, kwargs = inputs("gpt2-tiny", 4, 16)
    with pytest.raises(ValueError, match=r"input 'labels' dim 1 has size 8 .* makes it S = 16"):
        module(*args, labels=kwargs["labels"][:, :8])
    with pytest.raises(ValueError, match=r"input 'input_ids' has 3 dims .* compiled for 2"):
        module(args[0][None], **kwargs)


def test_a_sequence_longer_than_the_captured_range_is_an_error(one_process):
    module, _ = one_process
    long = module._ranges[primepar_fx.frontend.shapes.S][1] + 1
    ids = torch.zeros(2, long, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"S={long} is outside the range"):
        module(ids, labels=ids)


def test_on_two_gloo_ranks_new_sizes_reuse_the_plan_and_bad_plans_fail_on_every_rank(tmp_path):
    spawn(errors_on_ranks, 2, str(tmp_path), timeout=600)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        for plan in ("megatron-sp", "data_parallel"):
            for size in ("4x16", "2x8", "6x12"):
                assert r[f"{plan} {size}"] == {"close": True, "bad_grads": []}, (rank, plan, size)
            assert sorted(map(tuple, r[f"{plan} graphs"])) == [(2, 8), (4, 16), (6, 12)]
            for label in ("built", "new"):  # ranks given different sizes both raise, whatever they had built
                kind, message = r[f"{plan} mismatch {label}"]
                assert kind == "ValueError" and "the ranks got inputs of different sizes" in message, (plan, label)
            assert r[f"{plan} after mismatch"] is True
        assert r["megatron-sp odd batch"] is None  # megatron dp1 x mp2 does not split the batch
        kind, message = r["data_parallel odd batch"]
        assert kind == "PartitionError" and "'embedding'" in message and "dim 'B' of size 3" in message
        assert r["other world"][0] == "ValueError" and "plan is for 4 devices" in r["other world"][1]
        assert r["world_size"] == ["ValueError", "world_size=4 but the default process group has 2 ranks"]
    assert reports[0]["tampered"][0] == "PlanError" and "plan.nodes[0].bogus" in reports[0]["tampered"][1]
    kind, message = reports[1]["tampered"]
    assert kind == "RuntimeError" and message.startswith(
        "rank 0 could not make the plan: PlanError: plan.nodes[0].bogus"
    )
