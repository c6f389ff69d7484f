"""Plans: construction, JSON round-trips, validation naming the field path, model checks and the summary table."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from primepar_fx.partition.seq import PartitionSeq, Prime, Split
from primepar_fx.record.fields import PlanError
from primepar_fx.record.plan import PLAN_FORMAT, Baseline, CostBreakdown, NodePlan, Plan, Predicted
from primepar_fx.record.search import GroupingRecord, SearchRecord

MiB = 1 << 20
GRAPH = [("fc1", "aten.mm.default"), ("relu", "aten.relu.default"), ("fc2", "aten.mm.default")]


def _cost(**over: Any) -> CostBreakdown:
    kw: dict[str, Any] = dict(
        compute_s=2e-3,
        ring_s=1e-3,
        collective_s=5e-4,
        redistribution_s=1e-4,
        memory_bytes=3 * MiB,
        comm_bytes={"p2p": 1000, "all-reduce": 4096},
        step_s=2.7e-3,
        phase_s={"forward": 8e-4, "backward": 8e-4, "gradient": 5e-4},
    )
    return CostBreakdown(**(kw | over))


def _plan(**over: Any) -> Plan:
    kw: dict[str, Any] = dict(
        model="mlp",
        model_fingerprint=Plan.fingerprint(GRAPH),
        world_size=8,
        digits=(2, 2, 2),
        cluster="h100-dgx",
        batch=8,
        seq=128,
        dtype="bf16",
        nodes=(
            NodePlan("fc1", "aten.mm.default", "B,P2x2", _cost()),
            NodePlan("relu", "aten.relu.default", "B,N,R"),
            NodePlan("fc2", "aten.mm.default", "B, P2x2", _cost(ring_s=0.0, step_s=2.6e-3)),
        ),
        predicted=Predicted(0.01, 1024 * MiB, 10192),
        baselines={
            "megatron": Baseline("megatron", {"tp": 8, "dp": 1}, Predicted(0.015, 2048 * MiB, 20000), {"fc1": "R,R,N"}),
            "data_parallel": Baseline("data_parallel", {"dp": 8}, Predicted(0.02, 512 * MiB, 40000)),
        },
        search=SearchRecord(method="dp", search_s=0.5, proven_optimal=True, alpha=0.0, memory_budget=None),
    )
    return Plan(**(kw | over))


def _tampered(edit) -> str:
    data = json.loads(_plan().to_json())
    edit(data)
    return json.dumps(data)


def _raises(text: str, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        Plan.from_json(text)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------------- round-trips
def test_plan_round_trips_through_json_and_files(tmp_path):
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert hash(again) == hash(plan)
    assert plan.save(tmp_path / "plan.json") == tmp_path / "plan.json"
    assert Plan.load(tmp_path / "plan.json") == plan
    assert not list(tmp_path.glob(".*.tmp"))


def test_json_layout_has_exactly_the_documented_keys():
    data = json.loads(_plan().to_json())
    assert list(data) == [
        "format",
        "model",
        "model_fingerprint",
        "world_size",
        "digits",
        "cluster",
        "batch",
        "seq",
        "dtype",
        "nodes",
        "predicted",
        "baselines",
        "search",
    ]
    assert data["format"] == PLAN_FORMAT
    assert data["nodes"][0]["partition"] == "B,P2x2"
    assert data["nodes"][2]["partition"] == "B,P2x2"  # canonical text
    assert "cost" not in data["nodes"][1]
    assert set(data["predicted"]) == {"step_time_s", "peak_memory_bytes", "comm_bytes"}
    assert set(data["baselines"]["megatron"]) == {"config", "predicted", "partitions"}
    assert set(data["baselines"]["data_parallel"]) == {"config", "predicted"}
    assert data["search"]["proven_optimal"] is True


def test_optional_top_level_fields_default_when_absent():
    def drop(d):
        del d["baselines"], d["search"], d["model_fingerprint"]

    plan = Plan.from_json(_tampered(drop))
    assert plan.baselines == {} and plan.search == SearchRecord() and plan.model_fingerprint == ""


def test_times_given_as_ints_round_trip_equal():
    cost = _cost(compute_s=1, ring_s=0, collective_s=0, redistribution_s=0, step_s=1, phase_s={})
    assert isinstance(cost.step_s, float)
    node = NodePlan("fc1", "aten.mm.default", "B,P2x2", cost)
    assert NodePlan.from_dict(json.loads(json.dumps(node.to_dict()))) == node


def test_the_search_record_round_trips_with_its_groupings():
    groupings = (
        GroupingRecord(digits=(2, 4, 4), objective=1.5, bound=1.25, seconds=0.5),
        GroupingRecord(digits=[4, 8]),
    )
    plan = _plan(search=SearchRecord(method="dp", micro_batches_tried=[1, 2], groupings=groupings, groupings_s=2.0))
    assert plan.search.micro_batches_tried == (1, 2) and plan.search.groupings[1].digits == (4, 8)
    data = json.loads(plan.to_json())["search"]
    assert data["groupings"] == [
        {"digits": [2, 4, 4], "objective": 1.5, "bound": 1.25, "seconds": 0.5},
        {"digits": [4, 8], "objective": None, "seconds": 0.0},
    ]
    assert data["memory_budget"] is None and "split_only_kept" not in data and "forced" not in data
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        ({"bogus": 1}, "plan.search.bogus: unknown field"),
        ({"proven_optimal": "yes"}, "plan.search.proven_optimal: must be true or false"),
        ({"micro_batches_tried": [1, 0]}, "plan.search.micro_batches_tried[1]"),
        ({"objective": "fast"}, "plan.search.objective: must be a finite number"),
        ({"groupings": [{"digits": [2, 2], "seconds": -1}]}, "plan.search.groupings[0].seconds"),
        ({"groupings": [{"objective": 1.0}]}, "plan.search.groupings[0].digits: required field is missing"),
        ({"training_state": [16]}, "plan.search.training_state"),
    ],
)
def test_a_bad_search_record_names_the_field(edit, where):
    _raises(_tampered(lambda d: d["search"].update(edit)), where)


# ---------------------------------------------------------------------------------------------------- queries
def test_node_seq_and_partitions_parse_the_text():
    plan = _plan()
    assert plan.node("fc1").seq == PartitionSeq((Split("B"), Prime(2)))
    assert list(plan.partitions()) == ["fc1", "relu", "fc2"]
    assert str(plan.partitions()["relu"]) == "B,N,R"
    with pytest.raises(KeyError, match="nope"):
        plan.node("nope")


def test_cost_time_is_the_stored_step_time_not_a_sum():
    cost = _cost()
    assert cost.time_s == cost.step_s == 2.7e-3
    assert cost.total_comm_bytes == 5096


def test_check_model_accepts_the_same_graph():
    _plan().check_model(GRAPH)
    _plan().check_model(iter(GRAPH))


def test_check_model_names_a_renamed_node():
    graph = [("fc1", "aten.mm.default"), ("relu_1", "aten.relu.default"), ("fc2", "aten.mm.default")]
    with pytest.raises(ValueError, match=r"plan\.nodes\[1\]\.name: node 'relu' is not in the model.*'relu_1'"):
        _plan().check_model(graph)


def test_check_model_names_a_changed_op():
    graph = [("fc1", "aten.mm.default"), ("relu", "aten.gelu.default"), ("fc2", "aten.mm.default")]
    with pytest.raises(ValueError, match=r"plan\.nodes\[1\]\.op: .*'aten\.gelu\.default'"):
        _plan().check_model(graph)


def test_check_model_names_a_model_node_the_plan_lacks():
    with pytest.raises(ValueError, match=r"plan\.nodes: model node 'fc3' has no partition in the plan \(1 of 4"):
        _plan().check_model([*GRAPH, ("fc3", "aten.mm.default")])
    with pytest.raises(ValueError, match="order differs"):
        _plan().check_model(GRAPH[::-1])
    _plan(model_fingerprint="").check_model(GRAPH[::-1])  # no fingerprint: the order is not checked
    # a node deleted from the plan file: the fingerprint, which is the model's, still matches
    edited = Plan.from_dict({**_plan().to_dict(), "nodes": [n.to_dict() for n in _plan().nodes[:-1]]})
    with pytest.raises(ValueError, match=r"plan\.nodes: model node 'fc2' has no partition"):
        edited.check_model(GRAPH)


def test_fingerprint_is_16_hex_and_depends_on_names_and_ops():
    fp = Plan.fingerprint(GRAPH)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == Plan.fingerprint(list(GRAPH))
    assert fp != Plan.fingerprint([("fc1", "aten.mm.default"), ("relu", "aten.relu.default")])
    assert fp != Plan.fingerprint([(n, "aten.add.Tensor") for n, _ in GRAPH])


def test_summary_table_lists_nodes_totals_and_baseline_ratios():
    text = _plan().summary_table()
    for needle in ("fc1", "relu", "B,P2x2", "B,N,R", "forward ms", "gradient ms", "all-reduce B", "p2p B"):
        assert needle in text
    assert "memory MiB" in text and "3.000" in text and "2.700" in text
    megatron = next(line for line in text.splitlines() if line.startswith("megatron"))
    assert "1.50x" in megatron and "2.00x" in megatron
    dp = next(line for line in text.splitlines() if line.startswith("data_parallel"))
    assert "2.00x" in dp and "0.50x" in dp
    assert "|" in _plan().summary_table("github")


def test_summary_table_without_costs_or_baselines():
    nodes = (NodePlan("fc1", "aten.mm.default", "B,P2x2"),)
    text = _plan(nodes=nodes, baselines={}).summary_table()
    assert "fc1" in text and "step ms" in text and "ms" not in text.splitlines()[1]
    assert "megatron" not in text


# ---------------------------------------------------------------------------------------------------- validation
def test_wrong_format_names_the_expected_format():
    _raises(_tampered(lambda d: d.update(format="primepar-plan/3")), "plan.format", "'primepar-plan/2'")
    with pytest.raises(ValueError, match="plan.format.*primepar-plan/2"):
        _plan(format="v1")
    # the format before the memory levers: rejected with what to do
    _raises(_tampered(lambda d: d.update(format="primepar-plan/1")), "plan.format", "no longer read", "make it again")


def test_future_format_is_reported_before_unknown_fields():
    _raises(_tampered(lambda d: d.update(format="primepar-plan/3", shards=[])), "plan.format")


@pytest.mark.parametrize(
    ("path", "where"),
    [
        (("world_size",), "plan.world_size"),
        (("nodes",), "plan.nodes"),
        (("nodes", 0, "partition"), "plan.nodes[0].partition"),
        (("nodes", 0, "cost", "step_s"), "plan.nodes[0].cost.step_s"),
        (("predicted", "comm_bytes"), "plan.predicted.comm_bytes"),
        (("baselines", "megatron", "predicted"), "plan.baselines['megatron'].predicted"),
    ],
)
def test_missing_field_is_named(path, where):
    def edit(d):
        for p in path[:-1]:
            d = d[p]
        del d[path[-1]]

    _raises(_tampered(edit), f"{where}: required field is missing")


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ((), "plan.shards"),
        (("nodes", 1), "plan.nodes[1].shards"),
        (("nodes", 0, "cost"), "plan.nodes[0].cost.shards"),
        (("predicted",), "plan.predicted.shards"),
        (("baselines", "megatron"), "plan.baselines['megatron'].shards"),
    ],
)
def test_unknown_field_is_rejected(path, where):
    def edit(d):
        for p in path:
            d = d[p]
        d["shards"] = 1

    _raises(_tampered(edit), f"{where}: unknown field")


def test_unknown_comm_kind_and_phase_are_rejected():
    _raises(_tampered(lambda d: d["nodes"][0]["cost"]["comm_bytes"].update(bcast=1)), "cost.comm_bytes['bcast']")
    _raises(_tampered(lambda d: d["nodes"][0]["cost"]["phase_s"].update(optim=1.0)), "plan.nodes[0].cost.phase_s")
    _raises(_tampered(lambda d: d["nodes"][0]["cost"]["phase_s"].pop("gradient")), "missing phase(s) ['gradient']")


@pytest.mark.parametrize("text", ["P2x3", "B,P2x2,P2x2", "B,1x", "B,,N"])
def test_bad_partition_text_names_the_node(text):
    _raises(_tampered(lambda d: d["nodes"][1].update(partition=text)), "plan.nodes[1].partition")


def test_prime_that_does_not_fit_the_world_is_rejected():
    msg = _raises(_tampered(lambda d: d["nodes"][1].update(partition="P4x4")), "plan.nodes[1].partition", "16")
    assert "world_size 8" in msg
    _raises(_tampered(lambda d: d["baselines"]["megatron"]["partitions"].update(fc1="P3x3")), "['megatron'].partitions")


def test_digits_must_multiply_to_world_size():
    _raises(_tampered(lambda d: d.update(digits=[2, 2])), "plan.digits", "world_size 8")
    _raises(_tampered(lambda d: d.update(digits=[8, 1])), "plan.digits[1]")
    _raises(_tampered(lambda d: d.update(digits="2,2,2")), "plan.digits")
    assert _plan(world_size=1, digits=(), nodes=(), baselines={}).digits == ()


def test_duplicate_node_names_are_rejected():
    def dup(d):
        d["nodes"][2]["name"] = "fc1"

    _raises(_tampered(dup), "plan.nodes[2].name", "duplicate", "plan.nodes[0]")


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d["nodes"][0]["cost"].update(ring_s=-1e-3), "plan.nodes[0].cost.ring_s"),
        (lambda d: d["nodes"][0]["cost"]["phase_s"].update(forward=-1.0), "plan.nodes[0].cost.phase_s['forward']"),
        (lambda d: d["predicted"].update(step_time_s=-0.5), "plan.predicted.step_time_s"),
        (
            lambda d: d["baselines"]["megatron"]["predicted"].update(step_time_s=-1),
            "['megatron'].predicted.step_time_s",
        ),
    ],
)
def test_negative_time_is_rejected(edit, where):
    _raises(_tampered(edit), where, ">= 0")


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d["nodes"][0]["cost"].update(memory_bytes=1.5), "plan.nodes[0].cost.memory_bytes"),
        (lambda d: d["nodes"][0]["cost"]["comm_bytes"].update(p2p="12"), "plan.nodes[0].cost.comm_bytes['p2p']"),
        (lambda d: d["predicted"].update(peak_memory_bytes=1.0), "plan.predicted.peak_memory_bytes"),
        (lambda d: d["predicted"].update(comm_bytes=True), "plan.predicted.comm_bytes"),
        (lambda d: d["nodes"][0]["cost"].update(memory_bytes=-1), "plan.nodes[0].cost.memory_bytes"),
    ],
)
def test_non_int_or_negative_bytes_are_rejected(edit, where):
    _raises(_tampered(edit), where, "bytes")


@pytest.mark.parametrize(
    ("key", "value", "where"),
    [
        ("world_size", "8", "plan.world_size"),
        ("world_size", 0, "plan.world_size"),
        ("batch", True, "plan.batch"),
        ("seq", 1.5, "plan.seq"),
        ("dtype", "fp64", "plan.dtype"),
        ("model", "", "plan.model"),
        ("cluster", 3, "plan.cluster"),
        ("model_fingerprint", "XYZ", "plan.model_fingerprint"),
        ("nodes", {"fc1": "B"}, "plan.nodes"),
        ("predicted", [1, 2, 3], "plan.predicted"),
        ("baselines", [], "plan.baselines"),
        ("search", "dp", "plan.search"),
    ],
)
def test_wrong_types_name_the_field(key, value, where):
    _raises(_tampered(lambda d: d.update({key: value})), where)


def test_wrong_types_inside_nodes_name_the_field():
    _raises(_tampered(lambda d: d["nodes"][0].update(name=7)), "plan.nodes[0].name")
    _raises(_tampered(lambda d: d["nodes"][0].update(partition=["B"])), "plan.nodes[0].partition")
    _raises(_tampered(lambda d: d["nodes"][0].update(cost=[])), "plan.nodes[0].cost")
    _raises(_tampered(lambda d: d["nodes"][0]["cost"].update(compute_s="fast")), "plan.nodes[0].cost.compute_s")
    _raises(_tampered(lambda d: d["baselines"]["megatron"].update(config=[1])), "plan.baselines['megatron'].config")


def test_non_finite_numbers_and_bad_json_are_rejected():
    _raises(_plan().to_json().replace('"step_time_s": 0.01', '"step_time_s": NaN'), "not valid JSON", "NaN")
    _raises("{", "plan: not valid JSON")
    _raises("[]", "plan: must be a JSON object")


def test_step_time_must_lie_between_overlapped_and_serial_sums():
    with pytest.raises(ValueError, match=r"cost\.step_s"):
        _cost(step_s=10.0)  # more than compute + ring + rest (e.g. milliseconds written as seconds)
    with pytest.raises(ValueError, match=r"cost\.step_s"):
        _cost(step_s=1e-3)  # less than compute alone
    _raises(_tampered(lambda d: d["nodes"][0]["cost"].update(step_s=1.0)), "plan.nodes[0].cost.step_s")
    assert _cost(step_s=3.6e-3).step_s == 3.6e-3  # ring fully exposed is fine
    with pytest.raises(ValueError, match=r"cost\.phase_s: sums to"):
        _cost(phase_s={"forward": 2e-3, "backward": 2e-3, "gradient": 0.0})


def test_constructor_errors_name_the_object_field():
    with pytest.raises(ValueError, match=r"node\.partition: .*square"):
        NodePlan("fc1", "aten.mm.default", "P2x3")
    with pytest.raises(ValueError, match=r"baseline\.config\['f'\]"):
        Baseline("megatron", {"f": float("inf")}, Predicted(1.0, 1, 1))
    with pytest.raises(ValueError, match=r"plan\.baselines\['dp'\]\.name"):
        _plan(baselines={"dp": Baseline("data_parallel", {}, Predicted(1.0, 1, 1))})
    with pytest.raises(ValueError, match=r"plan\.nodes\[0\]: must be a NodePlan"):
        _plan(nodes=({"name": "fc1"},))
    with pytest.raises(PlanError) as info:
        _plan(nodes=(NodePlan("fc1", "aten.mm.default", "P4x4"),))
    assert info.value.path == "plan.nodes[0].partition"


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(_tampered(lambda d: d.update(batch=0)), encoding="utf-8")
    with pytest.raises(ValueError, match=r"plan\.batch: .*bad\.json"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"\x80\x04\x95 binary", r"not a JSON text file: byte 0 is not UTF-8"), (b"plan: yaml", r"not valid JSON")],
)
def test_a_binary_or_non_json_file_is_a_plan_error_naming_it(tmp_path, content, reason):
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    with pytest.raises(PlanError, match=reason + r".*weights\.bin"):
        Plan.load(path)


def test_plans_are_frozen_and_inputs_are_copied():
    config = {"tp": 2}
    plan = _plan(search=SearchRecord(forced="megatron", config=config))
    config["tp"] = 4
    assert plan.search.config == {"tp": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.search.method = "ilp"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch = 4  # type: ignore[misc]
    data = json.loads(plan.to_json())
    assert Plan.from_dict(copy.deepcopy(data)) == plan
