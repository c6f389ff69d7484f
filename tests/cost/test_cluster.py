"""Cluster specs: presets, JSON/TOML round-trips, validation, group levels and the collective latency model."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import json
import math
import os
from pathlib import Path

import pytest

from primepar_fx.cost import cluster as cluster_mod
from primepar_fx.cost.cluster import (
    OP_FAMILIES,
    ClusterSpec,
    DeviceSpec,
    LinkLevel,
    dtype_key,
    list_clusters,
    load_cluster,
)
from primepar_fx.cost.latency import COLLECTIVES, ComputeModel, LinearLatency, fit_collective, ring_factors
from primepar_fx.partition.mesh import DeviceMesh

PRESETS = ("a100-dgx", "cpu-gloo", "h100-dgx", "v100-edr", "v100-fig9", "v100-paper")
MiB = 1 << 20


def _brute_level(mesh: DeviceMesh, positions: tuple[int, ...], devices_per_node: int) -> int:
    """1 if two devices that differ only in ``positions`` sit on different nodes (rank // devices_per_node)."""
    for a, b in itertools.combinations(range(mesh.size), 2):
        ca, cb = mesh.coords(a), mesh.coords(b)
        if all(x == y for i, (x, y) in enumerate(zip(ca, cb)) if i not in positions):
            if a // devices_per_node != b // devices_per_node:
                return 1
    return 0


def _spec(num_devices: int = 12, devices_per_node: int = 4) -> ClusterSpec:
    levels = (LinkLevel.from_bandwidth("intra-node", 100e9, 2e-6), LinkLevel.from_bandwidth("inter-node", 10e9, 5e-6))
    device = DeviceSpec("toy", {"fp32": 1e13, "bf16": 1e14, "fp16": 1e14}, 1e12, 16 << 30, 5e-6)
    return ClusterSpec(
        "toy", num_devices, devices_per_node, device, levels[: 1 if num_devices == devices_per_node else 2]
    )


# ---------------------------------------------------------------------------------------------------- presets
def test_all_presets_are_listed_and_load():
    assert set(PRESETS) <= set(list_clusters())
    for name in PRESETS:
        spec = load_cluster(name)
        assert spec.name == name
        assert spec.mesh().size == spec.num_devices
        assert set(spec.levels[0].collectives) == set(COLLECTIVES)
        assert spec.levels[0].name == "intra-node"
        if spec.num_nodes > 1:
            assert spec.levels[1].name == "inter-node"


def test_preset_files_are_canonical_json():
    root = Path(cluster_mod.__file__).with_name("presets")
    for name in PRESETS:
        text = (root / f"{name}.json").read_text("utf-8")
        assert load_cluster(name).to_json() == text, f"{name}.json is not what to_json() writes"


def test_v100_paper_preset_matches_the_paper_cluster():
    spec = load_cluster("v100-paper")
    assert (spec.num_devices, spec.devices_per_node, spec.num_nodes) == (32, 4, 8)
    assert spec.device.peak_flops["bf16"] == spec.device.peak_flops["fp16"] == 125e12
    assert spec.device.peak_flops["fp32"] == 15.7e12
    assert spec.device.memory_bandwidth == 900e9
    assert spec.levels[0].bandwidth > spec.levels[1].bandwidth
    assert "bf16" in spec.description and not spec.calibrated


def test_cpu_gloo_preset_is_a_single_node_placeholder():
    spec = load_cluster("cpu-gloo")
    assert (spec.num_devices, spec.devices_per_node, len(spec.levels)) == (8, 8, 1)
    assert not spec.calibrated and "placeholder" in spec.source and "calibrate" in spec.source
    mesh = spec.mesh(4)
    t = {k: spec.collective_time(k, 4 * MiB, mesh, (0, 1)) for k in COLLECTIVES}
    assert 0.020 <= t["all-reduce"] <= 0.040
    assert 0.007 <= t["reduce-scatter"] <= 0.016
    assert 0.004 <= t["all-to-all"] <= 0.006
    assert 0.005 <= t["p2p"] <= 0.006


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="v100-paper"):
        load_cluster("no-such-cluster")


# ---------------------------------------------------------------------------------------------------- round-trips
def _variants() -> list[ClusterSpec]:
    base = load_cluster("v100-paper")
    odd = base.with_calibration(
        source='measured "today" \\ on héllo\tbox \x7f',
        collectives={"inter-node": {"p2p": LinearLatency(1.2345678901234567e-10, 3e-6)}},
        compute={"matmul:bf16": ComputeModel(1.1e-14, 2.2e-12, 4e-6), "norm": ComputeModel(0.0, 1.5e-12)},
    )
    return [load_cluster(n) for n in PRESETS] + [odd, _spec(), _spec(4, 4)]


def test_json_round_trip_is_exact():
    for spec in _variants():
        again = ClusterSpec.from_json(spec.to_json())
        assert again == spec and hash(again) == hash(spec)


def test_toml_round_trip_is_exact():
    for spec in _variants():
        again = ClusterSpec.from_toml(spec.to_toml())
        assert again == spec and again.to_json() == spec.to_json()


def test_spec_files_load_from_a_temp_path(tmp_path):
    spec = _variants()[-3]
    (tmp_path / "c.json").write_text(spec.to_json(), encoding="utf-8")
    (tmp_path / "c.toml").write_text(spec.to_toml(), encoding="utf-8")
    assert ClusterSpec.from_file(tmp_path / "c.json") == spec
    assert ClusterSpec.from_file(tmp_path / "c.toml") == spec
    assert load_cluster(str(tmp_path / "c.toml")) == spec
    (tmp_path / "c.yaml").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.json or \.toml"):
        ClusterSpec.from_file(tmp_path / "c.yaml")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON"):
        load_cluster(tmp_path / "bad.json")


def test_specs_are_hashable_and_equal_by_value():
    a, b = load_cluster("a100-dgx"), load_cluster("a100-dgx")
    assert a == b and {a: 1}[b] == 1
    assert a != load_cluster("h100-dgx")


def test_a_specs_hash_is_its_contents_in_every_process():
    """The hash is a digest of the canonical JSON, kept once computed: a changed copy hashes anew, and another
    interpreter with another ``PYTHONHASHSEED`` (where ``hash(str)`` differs) finds the same one, so a spec
    pickled to a worker still finds its entries in the memos it carries."""
    import subprocess
    import sys

    spec = load_cluster("a100-dgx")
    assert "_hash" not in spec.to_dict() and hash(spec) == hash(copy.copy(spec))
    changed = dataclasses.replace(spec, gradient_overlap=0.5)
    assert hash(changed) != hash(spec) and hash(changed) == hash(dataclasses.replace(spec, gradient_overlap=0.5))
    code = "from primepar_fx.cost.cluster import load_cluster; print(hash(load_cluster('a100-dgx')))"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert int(out.stdout) == hash(spec), out.stderr


# ---------------------------------------------------------------------------------------------------- validation
def _mutate(path: str, value: object = None, *, delete: bool = False) -> dict:
    data = copy.deepcopy(load_cluster("v100-paper").to_dict())
    *parents, last = path.split("/")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    key = int(last) if isinstance(node, list) else last
    if delete:
        del node[key]
    else:
        node[key] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "delete", "field"),
    [
        ("devices_per_node", None, True, "devices_per_node"),
        ("device/memory_bandwidth", None, True, "memory_bandwidth"),
        ("levels/0/collectives/all-reduce/fixed", None, True, "fixed"),
        ("levels/1/bandwidth", -100e9, False, "bandwidth"),
        ("levels/1/bandwidth", 0, False, "bandwidth"),
        ("levels/0/collectives/broadcast", {"bytes_coeff": 1e-11, "fixed": 1e-6}, False, "broadcast"),
        ("levels/0/collectives/p2p", None, True, "p2p"),
        ("num_devices", 30, False, "num_devices"),
        ("num_devices", "32", False, "num_devices"),
        ("num_devices", 0, False, "num_devices"),
        ("levels/0/bandwidth", "fast", False, "bandwidth"),
        ("levels/0/collectives/all-gather/bytes_coeff", float("nan"), False, "bytes_coeff"),
        ("levels/0/collectives/all-gather/fixed", -1e-6, False, "fixed"),
        ("calibrated", "yes", False, "calibrated"),
        ("name", "", False, "name"),
        ("device/peak_flops/fp32", True, False, "peak_flops"),
        ("device/peak_flops/bf16", None, True, "bf16"),
        ("device/peak_flops/int4", 1e15, False, "int4"),
        ("device/memory_capacity", 1.5, False, "memory_capacity"),
        ("device/compute", {"matmull": {"flops_coeff": 1e-12, "bytes_coeff": 1e-12}}, False, "matmull"),
        ("device/compute", {"matmul": {"flops_coeff": 1e-12}}, False, "bytes_coeff"),
        ("device/compute", [], False, "compute"),
        ("levels", {}, False, "levels"),
        ("levels/0", [], False, "levels"),
        ("bandwith", 1e9, False, "bandwith"),
    ],
)
def test_malformed_specs_raise_value_error_naming_the_field(path, value, delete, field):
    data = _mutate(path, value, delete=delete)
    with pytest.raises(ValueError, match=field):
        ClusterSpec.from_dict(data)
    with pytest.raises(ValueError, match=field):
        ClusterSpec.from_json(json.dumps(data))


def test_several_nodes_need_an_inter_node_level():
    data = _mutate("levels", [load_cluster("v100-paper").levels[0].to_dict()])
    with pytest.raises(ValueError, match="levels"):
        ClusterSpec.from_dict(data)


def test_constructors_validate_directly():
    with pytest.raises(ValueError, match="bytes_coeff"):
        LinearLatency(-1.0, 0.0)
    with pytest.raises(ValueError, match="fixed"):
        LinearLatency(1e-9, math.inf)
    with pytest.raises(ValueError, match=r"collectives\['p2p'\]"):
        LinkLevel("x", 1e9, {k: (LinearLatency(1e-9, 0) if k != "p2p" else {"bytes_coeff": 1}) for k in COLLECTIVES})
    with pytest.raises(ValueError, match="device"):
        ClusterSpec("x", 4, 4, "not a device", _spec(4, 4).levels)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_devices"):
        _spec(10, 4)
    with pytest.raises(ValueError, match="kind"):
        ring_factors("broadcast", 4)


# ---------------------------------------------------------------------------------------------------- group levels
def test_group_level_on_32_devices_as_8_nodes_of_4():
    spec = load_cluster("v100-paper")
    mesh = spec.mesh()
    assert mesh.digits == (2, 2, 2, 2, 2)
    assert [spec.group_level(mesh, (i,)) for i in range(5)] == [1, 1, 1, 0, 0]
    assert spec.group_level(mesh, ()) == 0
    assert spec.group_level(mesh, (3, 4)) == 0
    assert spec.group_level(mesh, (2, 3)) == 1
    for r in range(6):
        for pos in itertools.combinations(range(5), r):
            assert spec.group_level(mesh, pos) == _brute_level(mesh, pos, 4), pos


def test_group_level_on_12_devices_with_4_per_node():
    spec = load_cluster("v100-paper")
    mesh = spec.mesh(12)
    assert mesh.digits == (3, 2, 2)
    assert [spec.group_level(mesh, (i,)) for i in range(3)] == [1, 0, 0]
    assert spec.group_size(mesh, (0, 2)) == 6


def test_group_level_is_exact_for_layouts_that_do_not_align_with_nodes():
    spec = _spec(12, 4)
    for digits in [(2, 3, 2), (3, 2, 2), (2, 2, 3), (12,), (4, 3), (2, 6)]:
        mesh = DeviceMesh(digits)
        for r in range(len(digits) + 1):
            for pos in itertools.combinations(range(len(digits)), r):
                assert spec.group_level(mesh, pos) == _brute_level(mesh, pos, 4), (digits, pos)
    mesh = DeviceMesh((2, 3, 2))  # d1 moves the rank by 2: {0, 2, 4} spans nodes 0 and 1
    assert [spec.group_level(mesh, (i,)) for i in range(3)] == [1, 1, 0]


def test_group_level_rejects_bad_digits_and_oversized_meshes():
    spec = load_cluster("v100-paper")
    with pytest.raises(ValueError, match="digits"):
        spec.group_level(spec.mesh(), (5,))
    with pytest.raises(ValueError, match="not a whole number of its 4-device nodes"):
        spec.mesh(34)
    with pytest.raises(ValueError, match="does not fit: world_size 16 exceeds cluster 'cpu-gloo': one node"):
        load_cluster("cpu-gloo").group_level(DeviceMesh((2,) * 4), (0,))


@pytest.mark.parametrize(("preset", "world"), [("h100-dgx", 64), ("v100-paper", 128)])
def test_a_preset_grows_by_whole_nodes(preset: str, world: int):
    """A preset describes its nodes and network; more devices than it names are more nodes of the same kind."""
    spec = load_cluster(preset)
    assert world > spec.num_devices
    mesh = spec.mesh(world)
    assert mesh.size == world
    nodes = world // spec.devices_per_node
    node_digits = next(n for n in range(len(mesh.digits) + 1) if math.prod(mesh.digits[:n]) == nodes)
    assert spec.group_level(mesh, range(node_digits)) == 1  # across nodes
    assert spec.group_level(mesh, range(node_digits, len(mesh.digits))) == 0  # inside one
    inside = [k ^ 1 for k in range(world)]  # neighbours swap within a node
    assert spec.shift_time(MiB, inside) == spec.levels[0].p2p_time(MiB)
    across = [(k - spec.devices_per_node) % world for k in range(world)]  # the first node receives from the last
    assert across[0] == world - spec.devices_per_node and spec.shift_time(MiB, across) == spec.levels[1].p2p_time(MiB)


# ---------------------------------------------------------------------------------------------------- latency
def test_ring_factors_follow_the_documented_table():
    assert ring_factors("all-reduce", 4) == (1.5, 6)
    assert ring_factors("all-gather", 4) == (0.75, 3)
    assert ring_factors("reduce-scatter", 8) == (0.875, 7)
    assert ring_factors("all-to-all", 2) == (0.5, 1)
    assert ring_factors("p2p", 8) == (1.0, 1)
    assert all(ring_factors(k, 1) == (0.0, 0) for k in COLLECTIVES)


def test_collective_time_is_the_ring_formula_at_the_group_level():
    spec = load_cluster("v100-paper")
    mesh = spec.mesh()
    lat = spec.levels[0].collectives["all-reduce"]
    assert spec.collective_time("all-reduce", 8 * MiB, mesh, (3, 4)) == pytest.approx(
        lat.bytes_coeff * 1.5 * 8 * MiB + lat.fixed * 6
    )
    assert spec.collective_time("all-reduce", 8 * MiB, mesh, ()) == 0.0


def test_v100_edr_is_the_paper_cluster_with_100_gbit_infiniband():
    """The same cluster but for the inter-node link: 12.5 GB/s a node where v100-paper reads 100 GB/s, so every
    inter-node byte costs 8x; latencies, the node's links and the device are v100-paper's."""
    paper, edr = load_cluster("v100-paper"), load_cluster("v100-edr")
    assert (edr.num_devices, edr.devices_per_node, edr.device) == (
        paper.num_devices,
        paper.devices_per_node,
        paper.device,
    )
    assert edr.levels[0] == paper.levels[0]
    (inter_p, inter_e) = paper.levels[1], edr.levels[1]
    assert inter_e.bandwidth == 12.5e9 / edr.devices_per_node == inter_p.bandwidth / 8
    for kind in COLLECTIVES:
        p, e = inter_p.collectives[kind], inter_e.collectives[kind]
        assert e.fixed == p.fixed
        assert e.bytes_coeff == pytest.approx(8 * p.bytes_coeff, rel=1e-5), kind
    assert not edr.calibrated and "EDR" in edr.source


def _fig9_script():
    path = Path(__file__).resolve().parents[2] / "bench" / "fig9_preset.py"
    spec = importlib.util.spec_from_file_location("fig9_preset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_v100_fig9_is_what_its_script_derives_and_reproduces_the_figure():
    """The preset is bench/fig9_preset.py's output, and it prices Fig. 9's kernels and collectives near the times
    the figure prints: within the spread of the figure's own samples of one size (the GEMM phases 162-169 ms,
    the two intra-node all-reduces 24 and 41 ms, the inter-node ones 128-377 ms)."""
    fig9 = _fig9_script()
    derived, steps = fig9.derive()
    assert derived == load_cluster("v100-fig9").to_dict() and len(steps) >= 10
    spec = load_cluster("v100-fig9")
    flops, nbytes = fig9.gemm_phase()
    gemm_ms = 1e3 * spec.device.compute_time("matmul", flops, nbytes, "fp32")
    for ms in [*fig9.MEGATRON_KERNELS.values(), *map(sum, fig9.PRIMEPAR_KERNELS.values())]:
        assert gemm_ms == pytest.approx(ms, rel=0.03)
    for level, samples, rel in ((0, fig9.INTRA_NODE, 0.36), (1, fig9.INTER_NODE, 0.25)):
        model = spec.levels[level].collectives["all-reduce"]
        priced = [1e3 * model.collective("all-reduce", g, n * fig9.ITEM) for _, g, n, _ in samples]
        for (_, _, _, ms), got in zip(samples, priced):
            assert got == pytest.approx(ms, rel=rel)
    # the per-node rate it reads sits within EDR InfiniBand's 12.5 GB/s and far below the text's 100 GB/s
    per_node = spec.devices_per_node / spec.levels[1].collectives["all-reduce"].bytes_coeff
    assert 5e9 < per_node < 12.5e9
    assert spec.device.compute_model("matmul", "fp16") == load_cluster("v100-paper").device.compute_model(
        "matmul", "fp16"
    )


def test_collective_time_grows_with_bytes_and_is_slower_across_nodes():
    for name in ("v100-paper", "v100-edr", "v100-fig9", "a100-dgx", "h100-dgx"):
        spec = load_cluster(name)
        mesh = spec.mesh()
        node_digit, intra_digit = (0,), (len(mesh) - 1,)
        assert spec.group_size(mesh, node_digit) == spec.group_size(mesh, intra_digit) == 2
        for kind in COLLECTIVES:
            sizes = [0, 1, 1 << 10, MiB, 64 * MiB]
            for digits in (node_digit, intra_digit):
                times = [spec.collective_time(kind, n, mesh, digits) for n in sizes]
                assert times == sorted(times) and times[0] < times[-1], (name, kind, digits)
            for n in sizes:
                intra = spec.collective_time(kind, n, mesh, intra_digit)
                assert spec.collective_time(kind, n, mesh, node_digit) > intra, (name, kind, n)


def test_shift_time_uses_the_slowest_link_a_sender_crosses():
    spec = load_cluster("v100-paper")
    inside = [k ^ 1 for k in range(32)]  # swap neighbours within a node
    across = [(k + 4) % 32 for k in range(32)]  # every rank receives from the next node
    assert spec.shift_time(MiB, range(32)) == 0.0
    # inside a node a shift goes to one NVLink peer: 2 of the 6 links, a third of the p2p rate
    p2p = spec.levels[0].collectives["p2p"]
    assert spec.shift_time(MiB, inside) == pytest.approx(p2p.fixed + 3 * p2p.bytes_coeff * MiB, rel=1e-12)
    assert spec.shift_time(MiB, across) == spec.levels[1].collectives["p2p"](MiB)


def test_peer_bandwidth_prices_few_messages_at_one_peers_links():
    """v100-paper's board: 150 GB/s over 6 links, 50 GB/s to one peer. One message moves at the peer's rate, three
    equal messages from three peers at the device's; the collectives keep the whole bandwidth."""
    intra = load_cluster("v100-paper").levels[0]
    assert (intra.bandwidth, intra.peer_bandwidth, intra.peer_factor) == (150e9, 50e9, 3.0)
    p2p = intra.collectives["p2p"]
    assert intra.p2p_time(MiB) == pytest.approx(p2p.fixed + 3 * p2p.bytes_coeff * MiB, rel=1e-12)
    assert intra.p2p_time(MiB, 2) == pytest.approx(2 * p2p.fixed + 1.5 * p2p.bytes_coeff * MiB, rel=1e-12)
    assert intra.p2p_time(MiB, 3) == pytest.approx(3 * p2p.fixed + p2p.bytes_coeff * MiB, rel=1e-12)
    assert intra.p2p_time(MiB, 6) == pytest.approx(6 * p2p.fixed + p2p.bytes_coeff * MiB, rel=1e-12)
    assert intra.collective_time("all-gather", 4, MiB) == intra.collectives["all-gather"].collective(
        "all-gather", 4, MiB
    )
    # a switch (NVSwitch) gives one peer the whole bandwidth: no peer_bandwidth, no factor, not written
    nvswitch = load_cluster("h100-dgx").levels[0]
    assert (
        nvswitch.peer_bandwidth is None and nvswitch.peer_factor == 1.0 and "peer_bandwidth" not in nvswitch.to_dict()
    )
    assert nvswitch.p2p_time(MiB) == nvswitch.collectives["p2p"](MiB)
    assert LinkLevel.from_dict(intra.to_dict()) == intra and intra.to_dict()["peer_bandwidth"] == 50e9
    with pytest.raises(ValueError, match="peer_bandwidth .* cannot exceed"):
        dataclasses.replace(intra, peer_bandwidth=200e9)
    with pytest.raises(ValueError, match="peer_bandwidth must be > 0"):
        dataclasses.replace(intra, peer_bandwidth=0.0)


def test_a_measured_p2p_rate_replaces_the_peer_bandwidth():
    """Calibration measures p2p as a ring shift, one peer's rate: it prices every p2p of the level from then on."""
    spec = load_cluster("v100-paper")
    measured = LinearLatency(2e-11, 3e-6)
    cal = spec.with_calibration(source="test", collectives={0: {"p2p": measured}})
    assert cal.levels[0].peer_bandwidth is None and cal.levels[0].p2p_time(MiB) == measured(MiB)
    kept = spec.with_calibration(source="test", collectives={0: {"all-reduce": measured}})
    assert kept.levels[0].peer_bandwidth == 50e9


def test_fit_collective_recovers_per_step_coefficients():
    true = LinearLatency(2e-10, 3e-5)
    samples = [(n, true.collective("all-reduce", 4, n)) for n in (MiB, 4 * MiB, 16 * MiB)]
    fit = fit_collective("all-reduce", 4, samples)
    assert fit.bytes_coeff == pytest.approx(true.bytes_coeff) and fit.fixed == pytest.approx(true.fixed)
    assert fit.collective("all-reduce", 8, MiB) == pytest.approx(true.collective("all-reduce", 8, MiB))
    with pytest.raises(ValueError, match="distinct"):
        fit_collective("p2p", 2, [(MiB, 1e-3), (MiB, 2e-3)])


def test_fit_collective_over_group_sizes_separates_latency_per_call_from_per_step():
    """Measured at two group sizes, a fit recovers all three coefficients; at one it cannot tell them apart, and
    prices a group of 2 at a third of a group of 4's latency (what the machine's measurement corrects)."""
    true = LinearLatency(2e-10, 3e-4, 9e-4)
    assert true.collective("all-reduce", 4, 0) == pytest.approx(6 * 3e-4 + 9e-4)
    assert true.collective("all-reduce", 1, MiB) == 0.0 and true(MiB) == pytest.approx(2e-10 * MiB + 1.2e-3)
    by_size = {g: [(n, true.collective("all-reduce", g, n)) for n in (4096, MiB)] for g in (2, 4)}
    fit = fit_collective("all-reduce", by_size)
    assert (fit.bytes_coeff, fit.fixed, fit.call) == pytest.approx((2e-10, 3e-4, 9e-4))
    one = fit_collective("all-reduce", 4, by_size[4])
    assert one.call == 0 and one.collective("all-reduce", 4, MiB) == pytest.approx(
        true.collective("all-reduce", 4, MiB)
    )
    assert one.collective("all-reduce", 2, 0) == pytest.approx(one.collective("all-reduce", 4, 0) / 3)
    # all of the latency per call (a negative per-step term is dropped, not kept)
    flat = {g: [(n, 1e-3 + 1e-10 * n) for n in (4096, MiB)] for g in (2, 4)}
    fit = fit_collective("all-gather", flat)
    assert fit.fixed == 0 and fit.call > 0 and fit.bytes_coeff > 0
    # the spec's JSON keeps "call" only where it is measured; both load back
    assert "call" not in one.to_dict() and LinearLatency.from_dict(true.to_dict()) == true


# ---------------------------------------------------------------------------------------------------- compute
def test_default_compute_models_follow_peak_and_bandwidth():
    dev = load_cluster("v100-paper").device
    assert dev.compute == {}
    mm = dev.compute_model("matmul", "torch.bfloat16")
    assert mm.flops_coeff == pytest.approx(1 / (125e12 * 0.6))
    assert mm.bytes_coeff == pytest.approx(1 / (900e9 * 0.8))
    assert dev.compute_model("matmul", "fp32").flops_coeff == pytest.approx(1 / (15.7e12 * 0.6))
    for family in ("view", "meta"):
        assert dev.compute_time(family, 1e12, 1e9) == 0.0
    for family in OP_FAMILIES:
        assert dev.compute_time(family, 2e9, 2e6) >= dev.compute_time(family, 1e9, 1e6)
    with pytest.raises(ValueError, match="op family"):
        dev.compute_model("conv")
    with pytest.raises(ValueError, match="dtype"):
        dtype_key("int8")


def test_with_calibration_merges_measurements():
    base = load_cluster("a100-dgx")
    mm = ComputeModel(1e-14, 1e-12, 1e-5)
    cal = base.with_calibration(
        source="unit test",
        collectives={0: {"all-reduce": LinearLatency(1e-11, 1e-6)}},
        compute={"matmul:bf16": mm},
    )
    assert cal.calibrated and cal.source == "unit test" and not base.calibrated
    assert cal.levels[0].collectives["all-reduce"] == LinearLatency(1e-11, 1e-6)
    assert cal.levels[0].collectives["p2p"] == base.levels[0].collectives["p2p"]
    assert cal.device.compute_model("matmul", "bf16") == mm
    assert cal.device.compute_model("matmul", "fp32") == base.device.compute_model("matmul", "fp32")
    with pytest.raises(ValueError, match="no level"):
        base.with_calibration(source="x", collectives={"rack": {}})


def test_no_pickle_in_the_cluster_module():
    assert "pickle" not in Path(cluster_mod.__file__).read_text("utf-8")


# ------------------------------------------------------------------------------------------- gradient overlap
def test_gradient_overlap_hides_that_fraction_of_a_bucketed_all_reduce_only():
    spec = load_cluster("v100-paper")
    half = dataclasses.replace(spec, gradient_overlap=0.5)
    mesh = spec.mesh(8)
    for digits in ((0,), (len(mesh) - 1,)):
        bucketed = spec.collective_time("all-reduce", 8 * MiB, mesh, digits, bucketed=True)
        assert half.collective_time("all-reduce", 8 * MiB, mesh, digits, bucketed=True) == pytest.approx(bucketed / 2)
        alone = spec.collective_time("all-reduce", 8 * MiB, mesh, digits)
        assert half.collective_time("all-reduce", 8 * MiB, mesh, digits) == alone  # in the graph: not hidden
    assert spec.gradient_overlap == 0.0


def test_gradient_overlap_is_a_fraction_written_only_when_set():
    spec = load_cluster("v100-paper")
    assert "gradient_overlap" not in spec.to_dict()  # the default keeps older spec files canonical
    set_ = dataclasses.replace(spec, gradient_overlap=0.75)
    assert set_.to_dict()["gradient_overlap"] == 0.75
    assert ClusterSpec.from_json(set_.to_json()) == set_
    assert ClusterSpec.from_toml(set_.to_toml()) == set_
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="gradient_overlap"):
            ClusterSpec.from_dict({**spec.to_dict(), "gradient_overlap": bad})


def test_a_data_parallel_plan_is_faster_with_overlap_and_sends_the_same_bytes():
    from primepar_fx.api import analyze
    from primepar_fx.models import build, example_inputs, get_config
    from primepar_fx.planning.forced import forced_plan

    args, kwargs = example_inputs(get_config("llama-tiny"), 4, 16)
    graph = analyze(build("llama-tiny", device="meta"), args, kwargs, name="llama-tiny")
    spec = load_cluster("v100-paper")
    plans = [
        forced_plan(
            graph, "data_parallel", world_size=8, batch=4, seq=16, cluster=dataclasses.replace(spec, gradient_overlap=o)
        )
        for o in (0.0, 0.5, 1.0)
    ]
    times = [p.predicted.step_time_s for p in plans]
    assert times[0] > times[1] > times[2]
    assert times[0] - times[1] == pytest.approx(times[1] - times[2], rel=1e-9)  # linear in the fraction
    assert len({p.predicted.comm_bytes for p in plans}) == 1
