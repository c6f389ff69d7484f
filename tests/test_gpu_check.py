"""bench/gpu_check.py, the prepared device check (issue 21), runs on CPU at tiny sizes so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from primepar_fx.cost.cluster import load_cluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, dict]:
    """One ``--device cpu --quick`` run of the script: its page and its figures."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu.md"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out, json.loads(out.with_suffix(".json").read_text())


def test_the_device_check_runs_on_cpu_and_writes_its_page_figures_and_spec(quick_run):
    out, result = quick_run
    assert [r["dtype"] for r in result["equivalence"]] == ["fp32"] and result["equivalence"][0]["equal"]
    rows = result["rank_compute"]
    assert [(r["world"], r["plan"]) for r in rows] == [
        (w, p) for w in (4, 8) for p in ("prime", "megatron", "searched")
    ]
    assert all(r["measured_s"] > 0 and r["predicted_compute_s"] > 0 for r in rows)
    for r in rows:  # every op kind the plan predicts a Forward for was timed, ring products included (prime)
        kinds = r["forward_by_kind"]
        predicted = {k for k, t in kinds.items() if t["predicted_s"] > 0}
        assert {"matmul", "attention", "pointwise"} <= predicted, r["plan"]
        assert all(kinds[k]["measured_s"] > 0 for k in predicted), (r["plan"], kinds)
    spec = load_cluster(str(out.with_name("h200-measured.json")))
    assert spec.name == "h200-measured" and spec.calibrated and "matmul" in spec.device.compute
    assert spec.device.compute["matmul"].efficiency, "matrix products carry an efficiency table by size"
    assert "Compiled (world_size=1) against eager" in out.read_text() and "Forward by op kind" in out.read_text()


def test_zero3_fsdp2_and_ddp_each_time_a_training_step_on_rank_0_of_a_fake_group(quick_run):
    out, result = quick_run
    part = result["zero3_fsdp2"]
    assert part["world"] == 4 and part["dtype"] == "fp32"
    rows = {r["system"]: r for r in part["rows"]}
    assert list(rows) == ["primepar ZeRO-3", "fsdp2", "ddp"]
    assert all(r["batch"] == 1 for r in rows.values()), "QUICK's batch of 4 over 4 ranks: rank 0 computes one row"
    assert all(0 < r["step_min_s"] <= r["step_s"] for r in rows.values())
    assert all(r["peak_bytes"] is None and r["resident_bytes"] is None for r in rows.values()), "CUDA only"
    assert part["ratios"]["primepar ZeRO-3 / fsdp2"] == pytest.approx(
        rows["primepar ZeRO-3"]["step_s"] / rows["fsdp2"]["step_s"]
    )
    assert set(part["ratios"]) == {"primepar ZeRO-3 / fsdp2", "primepar ZeRO-3 / ddp", "fsdp2 / ddp"}
    assert part["peak_ratios"] == {}
    page = out.read_text()
    assert "ZeRO-3 against FSDP2 on one device" in page and "needs a multi-GPU run" in page
