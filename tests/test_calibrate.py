"""Calibration: exact fits on synthetic samples, a real 2-rank gloo calibration, and a hang that is reported."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from primepar_fx.cost import calibrate as cal
from primepar_fx.cost.cluster import COLLECTIVES, ClusterSpec, LinearLatency, fit_collective, load_cluster


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
    model = cal.fit_compute(samples)
    assert model.flops_coeff == pytest.approx(flops_coeff, rel=1e-9)
    assert model.bytes_coeff == pytest.approx(bytes_coeff, rel=1e-9)
    assert model.fixed == pytest.approx(fixed, rel=1e-9)
    r2, max_rel = cal.fit_quality([model(f, n) for f, n, _ in samples], [t for *_, t in samples])
    assert r2 == pytest.approx(1.0) and max_rel < 1e-9


def test_fit_compute_without_flops_pins_flops_coeff_to_zero():
    samples = [(123.0, n, 4e-11 * n + 3e-6) for n in (1e5, 1e6, 1e7, 3e7)]
    model = cal.fit_compute(samples, use_flops=False)
    assert model.flops_coeff == 0.0
    assert model.bytes_coeff == pytest.approx(4e-11, rel=1e-9) and model.fixed == pytest.approx(3e-6, rel=1e-9)


def test_nnls_clips_a_negative_coefficient_and_satisfies_kkt():
    x = np.arange(1.0, 9.0)
    cols = [list(x), [1.0] * len(x)]
    y = list(2.0 * x - 5.0)  # unconstrained least squares wants a negative intercept
    coef = cal.nnls(cols, y)
    assert coef[1] == 0.0 and coef[0] > 0
    a = np.asarray(cols).T
    grad = a.T @ (a @ np.asarray(coef) - np.asarray(y))
    assert abs(grad[0]) < 1e-9 and grad[1] >= -1e-9  # active coefficient stationary, clipped one pushes down
    assert cal.nnls([[1.0, 2.0]], [3.0, 6.0]) == pytest.approx([3.0])


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("world", [2, 4])
def test_fit_collective_recovers_per_bus_byte_and_per_step_coefficients(kind, world):
    truth = LinearLatency(3e-10, 40e-6)
    samples = [(n, truth.collective(kind, world, n)) for n in cal.QUICK_COLLECTIVE_SIZES]
    fit = fit_collective(kind, world, samples)
    assert fit.bytes_coeff == pytest.approx(truth.bytes_coeff, rel=1e-9)
    assert fit.fixed == pytest.approx(truth.fixed, rel=1e-9)


def test_base_grows_to_the_calibrated_world_size():
    grown = cal._resize(load_cluster("cpu-gloo"), 16)
    assert grown.num_devices == grown.devices_per_node == 16
    assert cal._resize(load_cluster("cpu-gloo"), 2).num_devices == load_cluster("cpu-gloo").num_devices


def test_world_size_is_checked_before_anything_runs(tmp_path):
    args = _parser().parse_args(["calibrate", "--world-size", "1", "-o", str(tmp_path / "x.toml")])
    with pytest.raises(ValueError, match="--world-size"):
        args.func(args)


# ---------------------------------------------------------------------------------------------------- real run
def test_quick_gloo_calibration_writes_a_loadable_calibrated_toml(tmp_path, capsys):
    out = tmp_path / "spec.toml"
    args = _parser().parse_args(["calibrate", "--world-size", "2", "--backend", "gloo", "--quick", "-o", str(out)])
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
