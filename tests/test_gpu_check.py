"""bench/gpu_check.py, the prepared device check (issue 21), runs on CPU at tiny sizes so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from primepar_fx.cost.cluster import load_cluster

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_cpu_and_writes_its_page_figures_and_spec(tmp_path):
    out = tmp_path / "gpu.md"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
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
    spec = load_cluster(str(tmp_path / "h200-measured.json"))
    assert spec.name == "h200-measured" and spec.calibrated and "matmul" in spec.device.compute
    assert spec.device.compute["matmul"].efficiency, "matrix products carry an efficiency table by size"
    assert "Compiled (world_size=1) against eager" in out.read_text() and "Forward by op kind" in out.read_text()
