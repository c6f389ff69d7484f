"""``primepar_fx.examples.train`` run for real: two gloo ranks under torchrun, and one process without it."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from primepar_fx.examples import train
from primepar_fx.record.plan import Plan

TIMEOUT = 300
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+(\S+)\s+time\s+\S+ ms\s+sent\s+[\d,]+ B$", re.M)
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done


def _losses(stdout: str, steps: int) -> list[float]:
    found = STEP_LINE.findall(stdout)
    assert [(int(s), int(n)) for s, n, _ in found] == [(s, steps) for s in range(1, steps + 1)], stdout
    losses = [float(v) for _, _, v in found]
    assert all(math.isfinite(v) for v in losses), losses
    return losses


def test_two_ranks_under_torchrun_train_and_report():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "primepar_fx.examples.train", "--model", "gpt2-tiny", "--steps", "3", "--lr", "1e-2"]
    out = _run(cmd).stdout
    losses = _losses(out, 3)
    assert losses[-1] < losses[0], losses
    assert "gpt2-tiny on 2 rank(s)" in out
    assert re.search(r"bytes per rank per step: predicted [\d,]+, measured [\d,]+", out), out


def test_one_process_without_torchrun_trains_and_saves_a_plan_that_loads(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "primepar_fx.examples.train", "--steps", "2", "--save-plan", str(path)]
    out = _run(cmd).stdout
    losses = _losses(out, 2)
    assert losses[1] < losses[0], losses
    assert "on 1 rank(s)" in out
    assert Plan.load(path).world_size == 1

    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert train.main(["--steps", "1", "--plan", str(path)]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt9"], "unknown model 'gpt9'"),
        (["--plan", "fastest"], "'fastest' is not one of"),
        (["--plan", "no-such-plan.json"], "no plan file"),
        (["--memory-budget", "lots"], "not a byte size"),
        (["--steps", "0"], "must be > 0"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
