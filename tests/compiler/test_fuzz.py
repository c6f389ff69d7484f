"""Differential fuzzing: random small decoders, world sizes and legal plans train one step like one device.

``tests/fuzz_checks.py`` explains the drawing (one generator, driven by a seeded ``random.Random`` for the bucketed
run and by hypothesis for the 2-rank examples) and how a failure is saved and rerun. CI runs a bounded, seeded
number of examples; ``PRIMEPAR_FUZZ_EXAMPLES=N`` runs N (``PRIMEPAR_FUZZ_SEED`` picks the seed).
"""

from __future__ import annotations

import json
import os
import tempfile

from fuzz_checks import (
    MICRO_BATCHES,
    SIM_WORLDS,
    WORLDS,
    Case,
    by_world,
    describe,
    draw_case,
    draw_cases,
    run_cases,
    save_failure,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CI_EXAMPLES = 8  # every world size once or twice (CI_WORLDS); deep runs set PRIMEPAR_FUZZ_EXAMPLES


@st.composite
def cases(draw, world: int | None = None) -> Case:
    return draw_case(lambda options: draw(st.sampled_from(list(options))), world=world)


def _assert_no_failures(failures: list[str], n: int) -> None:
    assert not failures, f"{len(failures)} of {n} fuzz cases differ from one device:\n\n" + "\n\n".join(failures)


def test_random_plans_train_like_one_device(tmp_path):
    n = int(os.environ.get("PRIMEPAR_FUZZ_EXAMPLES", CI_EXAMPLES))
    examples = draw_cases(n, seed=int(os.environ.get("PRIMEPAR_FUZZ_SEED", 0)))
    _assert_no_failures(run_cases(examples, str(tmp_path)), n)


def test_random_pipelines_train_like_one_device(tmp_path):
    """Issue 62: drawn models run as pipelines of drawn stage counts, schedules and micro-batches (the searched plan
    of each stage, ZeRO-1 and recomputation drawn too), on 2 and 4 ranks."""
    examples = draw_cases(3, seed=int(os.environ.get("PRIMEPAR_FUZZ_SEED", 0)), worlds=(2, 4, 4), pipelined=True)
    assert all(c.stages > 1 for c in examples)
    _assert_no_failures(run_cases(examples, str(tmp_path)), len(examples))


def test_a_random_case_on_thirty_two_simulated_ranks_trains_like_one_device(tmp_path):
    """One case of the simulated fuzz (``--simulated`` draws 16 to 64 ranks, issue 61), at 32 ranks: four nodes."""
    drawn = draw_cases(len(SIM_WORLDS), seed=int(os.environ.get("PRIMEPAR_FUZZ_SEED", 0)), simulated=True)
    (case,) = [c for c in drawn if c.world == 32]
    _assert_no_failures(run_cases([case], str(tmp_path)), 1)


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(world=2))
def test_hypothesis_cases_on_two_ranks_train_like_one_device(tmp_path, case):
    _assert_no_failures(run_cases([case], tempfile.mkdtemp(dir=tmp_path)), 1)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=cases())
def test_drawn_cases_are_valid_models_and_round_trip(case):
    from primepar_fx.models import DecoderConfig, example_inputs

    config = DecoderConfig(**case.config)
    assert config.hidden % 6 == 0 and config.vocab_size % 6 == 0 and config.ffn_hidden % 6 == 0
    assert case.batch != case.seq and case.seq <= config.max_seq
    example_inputs(config, case.batch, case.seq)
    assert case.world in WORLDS
    assert case.plan != "prime" or case.world in (4, 8)
    assert case.recompute in ("none", "selective", "full") and (case.recompute == "none" or config.layers >= 2)
    assert case.zero in (0, 1, 2, 3) and (case.zero == 0 or case.world > 1)
    assert case.micro_batches in MICRO_BATCHES and case.batch % case.micro_batches == 0
    assert Case.from_dict(case.to_dict()) == case
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case


def test_seeded_cases_cover_every_world_size_and_repeat():
    first, again = draw_cases(CI_EXAMPLES, seed=0), draw_cases(CI_EXAMPLES, seed=0)
    assert first == again
    assert {w for w, _ in by_world(first)} == set(WORLDS)
    assert [c.index for c in first] == list(range(CI_EXAMPLES))


def test_a_failure_names_its_config_plan_and_repro_command(tmp_path):
    case = draw_case(lambda options: options[-1], world=6, index=4)
    (tmp_path / "plan-4.json").write_text('{"compiled": "plan"}')
    (tmp_path / "error-4-rank2.txt").write_text("Traceback ...\nRuntimeError: boom")
    report = {"ok": False, "error_ranks": [2]}
    case_file = save_failure(case, report, str(tmp_path))
    text = describe(case, report, case_file)
    assert str(case.config) in text and "world 6" in text and "RuntimeError: boom" in text
    assert f"PYTHONPATH=. python tests/fuzz_checks.py {case_file}" in text
    saved = json.loads(case_file.read_text())
    assert saved.pop("report") == report
    pinned = Case.from_dict(saved)
    assert pinned.plan == str(case_file.parent / "plan.json") and pinned.note == {"drawn_plan": case.plan}
    assert (case_file.parent / "plan.json").read_text() == '{"compiled": "plan"}'


def test_three_micro_batches_sum_every_local_part_once(tmp_path):
    """A case the fuzz found: with three or more micro-batches the second one's start set the first one's local
    gradient aside as if it were from before the step, so it was added back after the sum over the replicas
    without being summed (the loss was right, the gradients were not)."""
    config = {"name": "fuzz", "vocab_size": 192, "hidden": 24, "layers": 3, "heads": 2, "kv_heads": 2}
    config |= {"ffn_hidden": 48, "norm": "rmsnorm", "mlp": "gelu", "position": "learned", "tied_embeddings": False}
    config |= {"max_seq": 24}
    case = Case(config=config, world=2, plan="data_parallel", batch=12, seq=24, seed=62, micro_batches=3)
    _assert_no_failures(run_cases([case], str(tmp_path)), 1)
