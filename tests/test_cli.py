"""The ``primepar-fx`` command line: ``explain`` on zoo, Hugging Face and user models, and its errors."""

from __future__ import annotations

import json
import logging
import re
import sys
import textwrap

import pytest

from primepar_fx.cli import main
from primepar_fx.frontend.specialize import StaticSeqWarning


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
    for argv, message in (
        (["explain", "nope"], "unknown model 'nope'.*gpt2-tiny"),
        (["explain", "hf:nope"], "unknown Hugging Face family 'nope'"),
        (
            ["explain", "gpt2-tiny", "--world-size", "4", "--digits", "3,2"],
            "--digits 3,2 multiply to 6, not --world-size 4",
        ),
        (["explain", "gpt2-tiny", "--batch", "4"], "both --batch and --seq"),
        (["explain", "gpt2-tiny", "--batch", "4", "--seq", "1000"], "--seq 1000 exceeds .* gpt2-tiny \\(128\\)"),
    ):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and re.fullmatch(f"error: .*{message}.*\n", err), (argv, err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "gpt2-tiny", "--batch", "0", "--seq", "8"], "argument --batch: must be >= 1, got 0"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "-n", "-4"], "argument --world-size/-n: must be >= 1"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--digits", "a,b"], "argument --digits: expected radices"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--alpha", "-1"], "argument --alpha: must be a finite"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--memory-budget", "1e400"], "not a byte size: '1e400'"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--memory-budget", "1.5.5MB"], "not a byte size"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--format", "nope"], "unknown table format 'nope'"),
        (["explain", "gpt2-tiny", "--devices-per-node", "0"], "argument --devices-per-node: must be >= 1"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "--workers", "0"], "argument --workers: must be >= 1"),
    ],
)
def test_bad_arguments_get_one_usage_error_naming_the_flag(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


def test_plan_checks_its_inputs_before_the_search(capsys, tmp_path, monkeypatch) -> None:
    """A folder as -o, --digits against --world-size, a too-long --seq and a bad PRIMEPAR_LOG stop before any capture
    or search with one line on stderr and exit status 2; so does dump's missing plan file."""
    import primepar_fx.api

    monkeypatch.setattr(primepar_fx.api, "analyze", lambda *a, **k: pytest.fail("captured before checking"))
    base = ["plan", "gpt2-tiny", "--batch", "4", "--seq", "8", "-n", "4"]
    for argv, message in (
        ([*base, "-o", str(tmp_path)], f"-o {tmp_path} is a folder"),
        ([*base, "--digits", "2,3"], "--digits 2,3 multiply to 6, not --world-size 4"),
        (["plan", "gpt2-tiny", "--batch", "4", "--seq", "4096", "-n", "4"], "--seq 4096 exceeds"),
        (["dump", "gpt2-tiny", "-n", "4", "--plan", "missing.json", "-o", str(tmp_path / "d")], "no plan file"),
    ):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    monkeypatch.setenv("PRIMEPAR_LOG", "LOUD")
    rc, _, err = run(capsys, "explain", "--list")
    assert rc == 2 and "PRIMEPAR_LOG=LOUD is not a log level" in err


def test_plan_warns_when_it_does_not_fit_or_splits_nothing(capsys, tmp_path) -> None:
    """A valid plan that needs more than a device's memory, or that leaves every node replicated, says so on stderr;
    the plan file is still written (into a folder that did not exist)."""
    out = tmp_path / "new" / "plan.json"
    argv = ["plan", "gpt2-tiny", "--batch", "8", "--seq", "64", "--cluster", "cpu-gloo"]
    rc, text, err = run(capsys, *argv, "-n", "5", "-o", str(out))  # no dim of gpt2-tiny divides by 5
    assert rc == 0 and out.is_file() and "warning: every node runs replicated: no dim divides" in err
    assert re.search(r"vs best Megatron \(megatron dp1 x mp5\).*\n  \(\d+ of 53 nodes could not take", text)
    assert not list(out.parent.glob(".*.tmp"))
    rc, _, err = run(capsys, *argv, "-n", "3", "--no-baselines")  # the fused qkv (192) divides by 3
    assert rc == 0 and "warning" not in err
    rc, _, err = run(
        capsys,
        "plan",
        "opt-6.7b",
        "--batch",
        "16",
        "--seq",
        "2048",
        "-n",
        "8",
        "--no-baselines",
        "--cluster",
        "v100-paper",
        "--memory-budget",
        "none",
    )
    assert rc == 0 and re.search(r"warning: the plan needs [0-9.]+ GiB per device, more than the 32.0 GiB", err)


def test_plan_searches_within_the_device_memory_by_default(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """No --memory-budget: 90% of the device's memory; a job no plan fits in says what it needs and what helps."""
    from primepar_fx.record.plan import Plan

    argv = ["plan", "gpt2-tiny", "--batch", "65536", "--seq", "128", "-n", "2", "--cluster", "cpu-gloo"]
    rc, _, err = run(capsys, *argv, "--no-baselines")
    assert rc == 2, err
    assert re.search(
        r"no plan fits the memory budget of 1\.8 GiB \(the default: 90% of the 2 GiB of a [^;]+; --memory-budget none "
        r"lifts it\): the smallest needs [0-9.]+ GiB per device \([0-9,]+ bytes\) with or without recomputation and "
        r"ZeRO-2 or 3, in up to 8 micro-batches\. "
        r"What would lower it: more devices",
        err,
    ), err
    out_file = tmp_path / "plan.json"
    rc, _, err = run(capsys, *argv[:3], "512", *argv[4:], "--no-baselines", "-o", str(out_file))
    assert rc == 0, err
    plan = Plan.load(out_file)
    assert plan.search.memory_budget == int(0.9 * 2**31) >= plan.predicted.peak_memory_bytes


def test_explain_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "--list")
    names = {line.split()[0] for line in out.splitlines()}
    assert {"gpt2", "gpt2-tiny", "llama2-7b", "llama2-70b", "opt-6.7b", "opt-175b", "bloom-7b1", "bloom-176b"} <= names


def test_plan_writes_a_valid_plan_json_with_baselines(capsys, tmp_path) -> None:
    from primepar_fx.record.plan import Plan

    out = tmp_path / "plan.json"
    rc, text, _ = run(capsys, "plan", "gpt2-tiny", "--world-size", "4", "--batch", "8", "--seq", "64", "-o", str(out))
    assert rc == 0 and "vs best Megatron" in text and f"wrote {out}" in text
    plan = Plan.load(out)
    assert plan.format == "primepar-plan/2" and plan.world_size == 4 and plan.digits == (2, 2)
    assert set(plan.baselines) == {
        "megatron",
        "data_parallel",
        "fsdp",
        "split_only",
        "megatron_pipelined",
        "fsdp_pipelined",
    }
    pipelined = plan.baselines["megatron_pipelined"].config
    assert f"vs best Megatron with pipelines ({pipelined['name']})" in text and pipelined["pp"] == 2
    # the search space contains the baselines (but those with pipeline stages, not searched yet: issue 62) but
    # for the gradient-free constants (shifted labels), which it runs replicated where a baseline may split them: no
    # baseline is predicted faster by more than their compute
    from primepar_fx import analyze
    from primepar_fx.models import build, example_inputs

    model = build("gpt2-tiny")
    graph = analyze(model, *example_inputs(model.config, 8, 64), name="gpt2-tiny")
    constants = [n for n in plan.nodes if not graph.nodes[n.name].requires_grad]
    assert constants and all(set(n.partition.split(",")) == {"R"} for n in constants)
    slack = sum(n.cost.compute_s for n in constants)
    assert all(
        plan.predicted.step_time_s <= (b.predicted.step_time_s + slack) * (1 + 1e-9)
        for k, b in plan.baselines.items()
        if not k.endswith("_pipelined")
    )
    assert plan.search.proven_optimal is True


def test_plan_searches_every_grouping_past_three_digits(capsys, tmp_path) -> None:
    from primepar_fx.record.plan import Plan

    base = [
        "plan",
        "gpt2-tiny",
        "-n",
        "16",
        "--batch",
        "16",
        "--seq",
        "16",
        "--no-baselines",
        "--cluster",
        "v100-paper",
    ]
    out = tmp_path / "all.json"
    rc, _, err = run(capsys, *base, "-o", str(out))
    assert rc == 0 and "3 groupings of the digits priced and searched" in err, err
    every = Plan.load(out)
    assert [g.digits for g in every.search.groupings] == [(4, 2, 2), (2, 2, 4), (2, 4, 2)]
    searched = [g for g in every.search.groupings if g.objective is not None]
    assert every.search.objective == min(g.objective for g in searched)
    # under the device's budget a grouping whose fastest plan is no faster than the best found is not searched
    assert all(g.bound >= every.search.objective for g in every.search.groupings if g.objective is None)
    with pytest.raises(SystemExit):
        main([*base, "--grouped", "all", "--no-grouped"])
    assert "not allowed with" in capsys.readouterr().err
    full = tmp_path / "full.json"  # the full mesh, then the groupings; never worse than the best of them
    rc, _, err = run(capsys, *base, "--no-grouped", "-o", str(full))
    assert rc == 0 and "the full mesh and 3 groupings of the digits priced and searched" in err, err
    listed = Plan.load(full).search.groupings
    assert [g.digits for g in listed] == [(2, 2, 2, 2), (4, 2, 2), (2, 2, 4), (2, 4, 2)]
    assert Plan.load(full).search.objective <= every.search.objective * (1 + 1e-12)
    # --group-digits 4 of four digits is the full mesh; it goes with the groupings of every digit only
    rc, _, err = run(capsys, *base, "--group-digits", "4", "-o", str(full))
    assert rc == 0 and "the full mesh and 3 groupings of the digits priced and searched" in err, err
    assert Plan.load(full).search.group_digits == 4
    rc, _, err = run(capsys, *base, "--group-digits", "4", "--grouped", "leading")
    assert rc == 2 and "group_digits=4 adds groupings to grouped='all', not to grouped='leading'" in err, err


def test_plan_rejects_an_unreadable_memory_budget(capsys) -> None:
    for budget in ("lots", "e", "."):
        with pytest.raises(SystemExit):
            main(["plan", "gpt2-tiny", "--world-size", "2", "--batch", "4", "--seq", "8", "--memory-budget", budget])
        assert f"not a byte size: {budget!r}" in capsys.readouterr().err


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
    # below the training state split over both devices: said at once, with the levers that shrink the state
    assert rc == 2 and "no plan fits the memory budget of 1 KiB: no plan can need less than" in err, err
    assert re.search(
        r"the training state alone, split evenly over all 2 devices \(16 B a parameter: [^)]+; [0-9,]+ parameters\)",
        err,
    ), err
    assert "What would lower it: more devices (-n), --state-dtype bf16" in err and "--recompute" not in err, err


def test_explain_and_plan_fold_identical_layers_unless_asked_for_every_node(capsys) -> None:
    """gpt2 (12 layers) prints its first layer and one marker row for the 11 copies; --all-nodes prints them all."""
    rc, folded, _ = run(capsys, "explain", "gpt2", "-n", "4")
    rc_all, whole, _ = run(capsys, "explain", "gpt2", "-n", "4", "--all-nodes")
    assert rc == rc_all == 0
    marker = re.search(r"^\.\.\. +x(\d+) the (\d+) rows above", folded, re.M)
    assert marker and "rows left out, the same but for the node names" in folded and "x11" not in whole
    copies, period = map(int, marker.groups())
    assert len(whole.splitlines()) - len(folded.splitlines()) == copies * period - 1 - 2  # less the note and gap
    rc, text, _ = run(capsys, "plan", "gpt2", "-n", "4", "--batch", "8", "--seq", "128", "--no-baselines")
    assert rc == 0 and re.search(r"^\.\.\. +x\d+ the \d+ rows above", text, re.M)


def test_plan_for_more_devices_than_a_preset_names_adds_its_nodes(capsys, tmp_path) -> None:
    """h100-dgx names 4 DGX nodes (32 GPUs); -n 64 plans for 8 of them, -n 36 is not a whole number of nodes."""
    from primepar_fx.record.plan import Plan

    base = ["plan", "gpt2-tiny", "--batch", "64", "--seq", "16", "--no-baselines", "--cluster", "h100-dgx"]
    out = tmp_path / "plan.json"
    rc, _, err = run(capsys, *base, "-n", "64", "--grouped", "-o", str(out))
    assert rc == 0, err
    plan = Plan.load(out)
    assert plan.world_size == 64 and plan.cluster == "h100-dgx"
    rc, _, err = run(capsys, *base, "-n", "36")
    assert rc == 2 and "not a whole number of its 8-device nodes" in err, err


CONFIG_7B = "tests/data/llama-2-7b-config.json"


def test_plan_takes_a_hugging_face_config_file_cut_to_its_first_layers(capsys, tmp_path) -> None:
    """A checkpoint's config.json, as a user has it: the model built offline on the meta device, ``--layers`` for
    a quick look; the plan names the file and has the real model's widths."""
    from primepar_fx.record.plan import Plan

    out = tmp_path / "plan.json"
    argv = ["plan", CONFIG_7B, "-n", "2", "--batch", "2", "--seq", "256", "--dtype", "bf16", "--layers", "1"]
    argv += ["--cluster", "h100-dgx"]
    rc, text, err = run(capsys, *argv, "-o", str(out))
    assert rc == 0 and "vs best Megatron" in text, err
    plan = Plan.load(out)
    assert plan.model == "llama-2-7b-config-1l" and plan.world_size == 2 and plan.seq == 256
    rc, text, _ = run(capsys, "explain", f"hf:{CONFIG_7B}", "--layers", "1", "--batch", "2", "--seq", "256")
    assert rc == 0 and "32000" in text and "11008" in text


def test_a_bad_config_file_or_layers_flag_gets_one_clear_error(capsys, tmp_path) -> None:
    broken, untyped = tmp_path / "broken.json", tmp_path / "untyped.json"
    broken.write_text("{not json")
    untyped.write_text('{"hidden_size": 64}')
    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 128}
    mistyped, unbuildable = tmp_path / "mistyped.json", tmp_path / "unbuildable.json"
    mistyped.write_text(json.dumps({"model_type": "llama", **tiny, "intermediate_size": "wide"}))
    # a field the config class lets be null and the model's constructor needs (transformers' default dots1 config)
    unbuildable.write_text(json.dumps({"model_type": "dots1", **tiny, "moe_intermediate_size": 32}))
    for argv, message in (
        (["explain", str(broken)], "broken.json is not JSON"),
        (["explain", str(untyped)], "untyped.json: a Hugging Face config needs a 'model_type'"),
        (["explain", str(mistyped)], "mistyped.json: transformers rejects it as a llama config .*intermediate_size"),
        (["explain", str(unbuildable)], "transformers could not build its dots1 model .* n_routed_experts.* unset"),
        (["explain", str(tmp_path / "missing.json")], "cannot read Hugging Face config .*missing.json"),
        (["explain", "gpt2-tiny", "--layers", "2"], "--layers applies to a Hugging Face config file"),
    ):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and re.fullmatch(f"error: .*{message}.*\n", err), (argv, err)


@pytest.mark.parametrize("seq", [32, 8])
def test_a_model_whose_seq_cannot_stay_symbolic_is_planned_at_the_seq_asked_for(capsys, caplog, tmp_path, seq) -> None:
    """GPT-Neo slices its causal-mask buffer by the sequence length, so it is captured at a fixed S: the plan is
    made at ``--seq``, and the one warning names that length and the model line. A ``--seq`` longer than the
    default example's is the examples' length, so the model is captured once; a shorter one is captured again."""
    from primepar_fx.record.plan import Plan

    out = tmp_path / "plan.json"
    with pytest.warns(StaticSeqWarning) as said, caplog.at_level(logging.INFO, logger="primepar_fx"):
        rc, _, err = run(capsys, "plan", "hf:gpt_neo", "-n", "2", "--batch", "4", "--seq", str(seq), "-o", str(out))
    assert rc == 0, err
    assert Plan.load(out).seq == seq
    messages = [str(w.message) for w in said if issubclass(w.category, StaticSeqWarning)]
    assert len(messages) == 1 and f"S={seq}" in messages[0] and "modeling_gpt_neo.py" in messages[0], messages
    assert ("captured again" in caplog.text) == (seq < 16), caplog.text


def test_the_console_entry_point_exits_with_mains_status_after_the_exit_handlers(tmp_path) -> None:
    """``run()`` skips the interpreter's teardown, not what a normal exit does: the status is main's (0, argparse's
    2, an error's 2), the streams reach their pipes and ``atexit`` handlers still run."""
    import subprocess

    script = textwrap.dedent(
        """
        import atexit, sys
        from primepar_fx.cli import run
        atexit.register(lambda: print("handler ran", flush=True))
        run(sys.argv[1:])
        """
    )
    path = tmp_path / "entry.py"
    path.write_text(script)
    cases = [
        (["explain", "--list"], 0, "gpt2-tiny"),
        (["plan"], 2, "required"),
        (["plan", "nosuch", "-n", "4", "--batch", "8", "--seq", "16"], 2, "error: "),
    ]
    for argv, status, text in cases:
        done = subprocess.run([sys.executable, str(path), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == status, (argv, done.stderr)
        assert done.stdout.rstrip().endswith("handler ran"), (argv, done.stdout[-200:])
        assert text in done.stdout + done.stderr
