"""Calibration: exact fits on synthetic samples, a real 2-rank gloo calibration, and a hang that is reported."""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import pytest
from opdims import linear_dims

from primepar_fx.calibrate import measure as cal
from primepar_fx.calibrate.fitting import fit_compute, fit_quality, nnls
from primepar_fx.calibrate.stepfit import StepFit, StepSample, fit_steps, op_counting_spec, step_fitted_spec
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import ClusterSpec, load_cluster
from primepar_fx.cost.latency import COLLECTIVES, LinearLatency, fit_collective
from primepar_fx.cost.model import NodeCost, node_cost
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="primepar-fx")
    cal.add_calibrate_parser(p.add_subparsers(dest="command", required=True))
    return p


# ---------------------------------------------------------------------------------------------------- fitting
def test_fit_compute_recovers_exact_coefficients():
    rng = np.random.default_rng(0)
    flops_coeff, bytes_coeff, fixed = 1e-11, 2.5e-10, 7e-6
    samples = []
    for _ in range(12):
        flops, nbytes = float(rng.integers(1, 1 << 30)), float(rng.integers(1, 1 << 24))
        samples.append((flops, nbytes, flops_coeff * flops + bytes_coeff * nbytes + fixed))
    model = fit_compute(samples)
    assert model.flops_coeff == pytest.approx(flops_coeff, rel=1e-9)
    assert model.bytes_coeff == pytest.approx(bytes_coeff, rel=1e-9)
    assert model.fixed == pytest.approx(fixed, rel=1e-9)
    r2, max_rel = fit_quality([model(f, n) for f, n, _ in samples], [t for *_, t in samples])
    assert r2 == pytest.approx(1.0) and max_rel < 1e-9


def test_fit_compute_without_flops_pins_flops_coeff_to_zero():
    samples = [(123.0, n, 4e-11 * n + 3e-6) for n in (1e5, 1e6, 1e7, 3e7)]
    model = fit_compute(samples, use_flops=False)
    assert model.flops_coeff == 0.0
    assert model.bytes_coeff == pytest.approx(4e-11, rel=1e-9) and model.fixed == pytest.approx(3e-6, rel=1e-9)


def test_nnls_clips_a_negative_coefficient_and_satisfies_kkt():
    x = np.arange(1.0, 9.0)
    cols = [list(x), [1.0] * len(x)]
    y = list(2.0 * x - 5.0)  # unconstrained least squares wants a negative intercept
    coef = nnls(cols, y)
    assert coef[1] == 0.0 and coef[0] > 0
    a = np.asarray(cols).T
    grad = a.T @ (a @ np.asarray(coef) - np.asarray(y))
    assert abs(grad[0]) < 1e-9 and grad[1] >= -1e-9  # active coefficient stationary, clipped one pushes down
    assert nnls([[1.0, 2.0]], [3.0, 6.0]) == pytest.approx([3.0])


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("world", [2, 4])
def test_fit_collective_recovers_per_bus_byte_and_per_step_coefficients(kind, world):
    truth = LinearLatency(3e-10, 40e-6)
    samples = [(n, truth.collective(kind, world, n)) for n in cal.QUICK_COLLECTIVE_SIZES]
    fit = fit_collective(kind, world, samples)
    assert fit.bytes_coeff == pytest.approx(truth.bytes_coeff, rel=1e-9)
    assert fit.fixed == pytest.approx(truth.fixed, rel=1e-9)


def test_base_grows_to_the_calibrated_world_size():
    grown = cal.resize_spec(load_cluster("cpu-gloo"), 16)
    assert grown.num_devices == grown.devices_per_node == 16
    assert cal.resize_spec(load_cluster("cpu-gloo"), 2).num_devices == load_cluster("cpu-gloo").num_devices


def test_world_size_is_checked_before_anything_runs(tmp_path):
    args = _parser().parse_args(["calibrate", "--world-size", "1", "-o", str(tmp_path / "x.toml")])
    with pytest.raises(ValueError, match="--world-size"):
        args.func(args)


# ---------------------------------------------------------------------------------------------------- step fit
STEP_TRUTH = StepFit(op_s=400e-6, compute=2.0, message_s=1.8e-3, byte_s=2.7e-9)


def _step_samples(n: int = 8) -> list[StepSample]:
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(n):
        ops, compute = float(rng.integers(600, 700)), float(rng.uniform(0.05, 0.1))
        messages, nbytes = float(rng.integers(30, 800)), float(rng.uniform(2e7, 1.4e8))
        rows.append(StepSample(ops, compute, messages, nbytes, 1.0))
    return [dataclasses.replace(s, measured_s=STEP_TRUTH(s)) for s in rows]


def test_fit_steps_recovers_the_coefficients_that_made_the_steps():
    fit = fit_steps(_step_samples())
    for name in ("op_s", "compute", "message_s", "byte_s"):
        assert getattr(fit, name) == pytest.approx(getattr(STEP_TRUTH, name), rel=1e-6), name


def test_fit_steps_needs_op_counts_and_two_plans():
    with pytest.raises(ValueError, match="ops > 0"):
        fit_steps([StepSample(0, 0.1, 10, 1e6, 0.5), StepSample(0, 0.1, 20, 1e6, 0.6)])
    with pytest.raises(ValueError, match="at least two"):
        fit_steps(_step_samples(1))
    with pytest.raises(ValueError, match="measured_s"):
        StepSample(1, 0.1, 10, 1e6, 0.0)


def _linear_cost(spec: ClusterSpec, seq: str) -> NodeCost:
    part = OpPartition(linear_dims(8, 16, 32, 64), PartitionSeq.parse(seq), DeviceMesh((2, 2)))
    return node_cost(part, None, spec, {}, CostOptions())


def test_step_fitted_spec_prices_compute_ops_messages_and_bytes_as_the_fit_does():
    base = load_cluster("cpu-gloo")
    spec = step_fitted_spec(base, STEP_TRUTH, world_size=4, note="synthetic")
    assert spec.calibrated and spec.source.startswith("step-fitted") and "synthetic" in spec.source
    assert ClusterSpec.from_json(spec.to_json()) == spec
    # compute: c_compute x the base's compute plus c_op per priced sub-operator (one per phase here)
    ops = _linear_cost(op_counting_spec(base), "R,R").compute_s
    assert ops == 3  # forward, backward, gradient
    for seq in ("R,R", "B,B", "P2x2"):
        want = (
            STEP_TRUTH.compute * _linear_cost(base, seq).compute_s
            + STEP_TRUTH.op_s * _linear_cost(op_counting_spec(base), seq).compute_s
        )
        assert _linear_cost(spec, seq).compute_s == pytest.approx(want, rel=1e-12), seq
    # row parallel over 4 ranks: one all-reduce of the output, one message of its bus bytes
    row = _linear_cost(spec, "N,N")
    want = STEP_TRUTH.message_s + STEP_TRUTH.byte_s * row.comm_bytes["all-reduce"]
    assert row.collective_s == pytest.approx(want, rel=1e-12)
    # data parallel: the all-reduce of dW travels in a gradient bucket, whose message it shares: its bytes only
    dp = _linear_cost(spec, "B,B")
    assert dp.collective_s == pytest.approx(STEP_TRUTH.byte_s * dp.comm_bytes["all-reduce"], rel=1e-12)
    # a ring shift: one message of the block; a re-layout sending n bytes per rank to each of the 3 peers
    assert spec.shift_time(4096, [1, 0, 3, 2]) == pytest.approx(STEP_TRUTH.message_s + 4096 * STEP_TRUTH.byte_s)
    a2a = spec.levels[0].collective_time("all-to-all", 4, 3e6)
    assert a2a == pytest.approx(3 * STEP_TRUTH.message_s + 3e6 * STEP_TRUTH.byte_s, rel=1e-12)


def test_a_dearer_message_raises_the_communicating_plans_only():
    base = load_cluster("cpu-gloo")
    cheap = step_fitted_spec(base, STEP_TRUTH, world_size=4)
    dear = step_fitted_spec(base, dataclasses.replace(STEP_TRUTH, message_s=10 * STEP_TRUTH.message_s), world_size=4)
    assert _linear_cost(dear, "R,R").time_s == pytest.approx(_linear_cost(cheap, "R,R").time_s, rel=1e-12)
    assert _linear_cost(dear, "N,N").time_s - _linear_cost(cheap, "N,N").time_s == pytest.approx(
        9 * STEP_TRUTH.message_s, rel=1e-9
    )
    # a gradient bucket's message is not any one parameter's
    assert _linear_cost(dear, "B,B").time_s == pytest.approx(_linear_cost(cheap, "B,B").time_s, rel=1e-12)
    dearer_compute = step_fitted_spec(base, dataclasses.replace(STEP_TRUTH, compute=4.0), world_size=4)
    assert _linear_cost(dearer_compute, "R,R").compute_s > _linear_cost(cheap, "R,R").compute_s


# ---------------------------------------------------------------------------------------------------- real run
def test_quick_gloo_calibration_writes_a_loadable_calibrated_toml(tmp_path, capsys):
    out = tmp_path / "spec.toml"
    argv = ["calibrate", "--world-size", "2", "--backend", "gloo", "--quick", "--efficiency", "-o", str(out)]
    args = _parser().parse_args(argv)
    assert args.func is cal.cmd_calibrate
    t0 = time.monotonic()
    assert args.func(args) == 0
    assert time.monotonic() - t0 < 60
    spec = ClusterSpec.from_file(out)
    assert spec.calibrated and "gloo, world size 2" in spec.source
    assert spec.num_devices >= 2
    # Every kind gets a positive model. Either coefficient alone may be clamped to 0 by fit_collective: on a loaded
    # 2-core machine, waking a sleeping rank costs a scheduler slice (~4 ms), which can flatten a small-size median.
    for kind in COLLECTIVES:
        lat = spec.levels[0].collectives[kind]
        assert lat.bytes_coeff >= 0 and lat.fixed >= 0 and lat.bytes_coeff + lat.fixed > 0, (kind, lat)
        assert 0 < lat.collective(kind, 2, 4096) <= lat.collective(kind, 2, 4 << 20), (kind, lat)
    assert sum(spec.levels[0].collectives[k].bytes_coeff > 0 for k in COLLECTIVES) >= 3
    for family in ("matmul", "attention", "pointwise", "norm", "reduce", "loss", "embedding"):
        model = spec.device.compute[family]
        assert model.bytes_coeff > 0 or model.flops_coeff > 0, family
    assert spec.device.compute["matmul"].flops_coeff > 0
    table = spec.device.compute["matmul"].efficiency  # --efficiency: a factor per measured size, through TOML
    assert len(table) >= 2 and max(e for _, e in table) == 1.0 and spec.device.compute["attention"].efficiency
    assert not spec.device.compute["pointwise"].efficiency
    text = capsys.readouterr().out
    assert "R²" in text and "all-reduce" in text and f"wrote {out}" in text


# ---------------------------------------------------------------------------------------------------- hang
def _hanging_worker(rank, world, backend, port, sizes, reps, timeout, q):  # noqa: ARG001 - same signature as _worker
    q.put(("step", rank, "all-reduce 4096 B"))
    time.sleep(600)


def test_a_hung_collective_is_reported_not_waited_on(monkeypatch):
    monkeypatch.setattr(cal, "_worker", _hanging_worker)
    t0 = time.monotonic()
    with pytest.raises(cal.CalibrationError, match=r"hung: not done after 5 s \(rank 0: .*; rank 1: .*\)") as err:
        cal.measure_collectives(2, "gloo", quick=True, reps=1, timeout=5)
    assert time.monotonic() - t0 < 15
    # each rank's last step: the one it hung in, or start-up where a loaded machine has not imported torch yet
    assert "all-reduce 4096 B" in str(err.value) or "start-up" in str(err.value)


def _crashing_worker(rank, world, backend, port, sizes, reps, timeout, q):  # noqa: ARG001 - same signature as _worker
    q.put(("step", rank, "init_process_group"))
    raise SystemExit(3)


def test_a_crashed_rank_is_reported_with_its_exit_code_and_step(monkeypatch):
    monkeypatch.setattr(cal, "_worker", _crashing_worker)
    with pytest.raises(cal.CalibrationError, match=r"rank \d exited with code 3 during '(init_process_group|start-up)"):
        cal.measure_collectives(2, "gloo", quick=True, reps=1, timeout=60)


def test_an_efficiency_table_gives_every_measured_size_back_and_keeps_the_fastest_rate():
    from primepar_fx.calibrate.fitting import rounded, with_efficiency

    # 1 ns of overhead per call, 1e-12 s per FLOP at full speed, and a mid size at half speed (cache effects)
    samples = [(1e6, 0.0, 1e-9 + 1e-6), (1e8, 0.0, 1e-9 + 2e-4), (1e8, 0.0, 1e-9 + 4e-4), (1e10, 0.0, 1e-9 + 1e-2)]
    flat = rounded(fit_compute(samples))
    model = with_efficiency(flat, samples)
    assert model.flops_coeff == pytest.approx(min((t - flat.fixed) / f for f, _, t in samples), rel=1e-3)
    assert [f for f, _ in model.efficiency] == [1e6, 1e8, 1e10], "one point per size, sizes increasing"
    for f, n, t in samples[:2] + samples[3:]:  # the faster of the two shapes of 1e8 FLOPs is kept
        assert model(f, n) == pytest.approx(t, rel=2e-3)
    assert min(e for _, e in model.efficiency) < 0.7 < max(e for _, e in model.efficiency) == 1.0
    assert with_efficiency(flat, samples[:1]) == flat, "one size says nothing about sizes"
