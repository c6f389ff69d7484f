"""The ``primepar-fx`` command line: ``explain`` on zoo, Hugging Face and user models, and its errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from primepar_fx.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_prints_one_row_per_node_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "gpt2-tiny", "--world-size", "4", "--batch", "8", "--seq", "32")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("model gpt2-tiny:") and "world size 4" in lines[0] and "(2, 2)" in lines[0]
    assert "aten.linear.default" in out and "aten.scaled_dot_product_attention.default" in out
    total = next(line for line in lines if line.startswith("TOTAL"))
    assert "nodes" in total and "params" in total
    linear = next(line for line in lines if "aten.linear.default" in line)
    assert linear.split()[-1] == "26"  # {B, S, N, K, R} x {B, S, N, K, R} + P2x2


def test_explain_shows_symbolic_flops_without_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "gpt2-tiny", "--world-size", "2")
    assert rc == 0
    linear = next(line for line in out.splitlines() if "aten.linear.default" in line)
    assert "B*S" in linear


def test_explain_takes_mixed_radix_digits_and_hugging_face_models(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "hf:llama", "--world-size", "12", "--digits", "2,2,3")
    assert rc == 0 and "(2, 2, 3)" in out.splitlines()[0]


def test_explain_loads_a_user_callable(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            import torch
            class Tiny(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(8, 8)
                def forward(self, x):
                    return self.fc(x).relu().sum()
            def make():
                return Tiny(), (torch.randn(2, 4, 8),), {}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, _ = run(capsys, "explain", "mymodels:make", "--world-size", "2")
    sys.modules.pop("mymodels", None)
    assert rc == 0 and "aten.linear.default" in out and "aten.relu.default" in out


def test_explain_rejects_unknown_models_and_bad_digits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="unknown model 'nope'.*gpt2-tiny"):
        main(["explain", "nope"])
    with pytest.raises(SystemExit, match="multiply to 6, not --world-size 4"):
        main(["explain", "gpt2-tiny", "--world-size", "4", "--digits", "3,2"])
    with pytest.raises(SystemExit, match="both --batch and --seq"):
        main(["explain", "gpt2-tiny", "--batch", "4"])


def test_explain_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "--list")
    names = {line.split()[0] for line in out.splitlines()}
    assert {"gpt2", "gpt2-tiny", "llama2-7b", "llama2-70b", "opt-6.7b", "opt-175b", "bloom-7b1", "bloom-176b"} <= names


def test_plan_writes_a_valid_plan_json_with_baselines(capsys, tmp_path) -> None:
    from primepar_fx.plan import Plan

    out = tmp_path / "plan.json"
    rc, text, _ = run(capsys, "plan", "gpt2-tiny", "--world-size", "4", "--batch", "8", "--seq", "64", "-o", str(out))
    assert rc == 0 and "vs best Megatron" in text and f"wrote {out}" in text
    plan = Plan.load(out)
    assert plan.format == "primepar-plan/1" and plan.world_size == 4 and plan.digits == (2, 2)
    assert set(plan.baselines) == {"megatron", "data_parallel", "split_only"}
    # the search space contains the baselines, so the searched plan is never predicted slower than them
    assert all(plan.predicted.step_time_s <= b.predicted.step_time_s * (1 + 1e-9) for b in plan.baselines.values())
    assert plan.search["proven_optimal"] is True


def test_plan_rejects_an_unreadable_memory_budget(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "gpt2-tiny", "--world-size", "2", "--batch", "4", "--seq", "8", "--memory-budget", "lots"])
    assert "not a byte size" in capsys.readouterr().err


def test_plan_reports_an_infeasible_memory_budget(capsys) -> None:
    rc, _, err = run(
        capsys,
        "plan",
        "gpt2-tiny",
        "--world-size",
        "2",
        "--batch",
        "4",
        "--seq",
        "8",
        "--memory-budget",
        "1KiB",
        "--no-baselines",
    )
    assert rc == 2 and "infeasible" in err and "smallest achievable memory" in err
