"""Pipelined plans (issue 62) run on real gloo processes and train to the numbers of one device.

Each plan's stages are cut from the rank graph (:mod:`primepar_fx.passes.stages`) and driven by
``torch.distributed.pipelining`` (:mod:`primepar_fx.compiler.pipelined`): the loss and every gathered gradient of a
step equal one device's, so do the losses and parameters of three AdamW steps, and the bytes the ranks send equal
the plan's prediction: the pipeline's transfers, and the stages' own traffic (a tied embedding's gradient summed in
both stages that hold it and between them included).
"""

from __future__ import annotations

import pytest
from distributed_checks import ATOL, RTOL
from pipeline_checks import check_checkpoint_across_stages, check_pipelines

from primepar_fx.runtime.testing import spawn

TIMEOUT = 600


def _assert_trains_like_one_device(report: dict, specs: list[str]) -> None:
    for spec in specs:
        r = report[spec]
        assert r["loss"] == pytest.approx(report["reference_loss"], rel=RTOL, abs=ATOL), spec
        assert r["bad_grads"] == [], f"{spec}: gradients differ from one device: {r['bad_grads'][:5]}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), spec
        assert r["bad_params"] == [], f"{spec}: parameters after AdamW differ: {r['bad_params'][:5]}"


def _assert_sends_the_pipeline_predicted(report: dict, specs: list[str], *, stages_too: bool) -> None:
    for spec in specs:
        r = report[spec]
        assert r["pipeline_bytes"] == r["predicted_pipeline_bytes"] > 0, spec
        if stages_too:
            assert r["stage_bytes"] == pytest.approx(r["predicted_stage_bytes"] - r["predicted_pipeline_bytes"]), spec


def test_two_stages_of_two_ranks_train_like_one_device():
    """4 ranks as 2 stages x 2: our search asked for stages under 1F1B and GPipe (with ZeRO-1), P(S x S) in every
    stage with full recomputation, and data parallelism in every stage with ZeRO-1; gpt2-tiny ties its embedding
    and head, which the first and the last stage both hold."""
    searched = [
        "searched:stages=2,schedule=1F1B,mb=2,cluster=h100-dgx",
        "searched:stages=2,schedule=GPipe,mb=2,cluster=h100-dgx,zero=1",
    ]
    specs = [
        *searched,
        "prime:stages=2,schedule=1F1B,mb=2,recompute=full",
        "data_parallel:stages=2,schedule=1F1B,mb=4,zero=1",
    ]
    report = spawn(check_pipelines, 4, "gpt2-tiny", specs, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, specs)
    _assert_sends_the_pipeline_predicted(report, searched, stages_too=True)


def test_eight_ranks_interleaved_and_four_stages_train_like_one_device():
    """8 ranks as 2 stages x (2 x 2) under interleaved 1F1B (two stages a rank), and as 4 stages x 2 with ZeRO-1 and
    with Megatron's split recomputed; llama-tiny with 4 layers (rotary tables cross every stage) and untied
    embeddings."""
    searched = [
        "searched:stages=2,schedule=Interleaved1F1B,mb=2,virtual=2,cluster=h100-dgx",
        "searched:stages=4,schedule=1F1B,mb=4,cluster=h100-dgx,zero=1",
    ]
    specs = [*searched, "megatron:stages=4,schedule=1F1B,mb=4,recompute=full"]
    report = spawn(check_pipelines, 8, "llama-tiny@4", specs, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, specs)
    _assert_sends_the_pipeline_predicted(report, searched, stages_too=True)
    assert report[searched[0]]["stages_held"] == 2


@pytest.mark.parametrize(
    ("family", "specs"),
    [
        ("hf:gpt2", ["searched:stages=2,schedule=1F1B,mb=2,cluster=h100-dgx"]),
        ("hf:llama", ["searched:stages=2,schedule=1F1B,mb=2,cluster=h100-dgx,zero=1"]),
    ],
)
def test_hugging_face_families_train_like_one_device_as_two_stages(family, specs):
    report = spawn(check_pipelines, 4, family, specs, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, specs)
    _assert_sends_the_pipeline_predicted(report, specs, stages_too=True)


def test_a_pipelined_checkpoint_loads_into_a_plan_without_stages_and_back(tmp_path):
    """DCP across stage counts (bit-exact): 2 stages x 2 of gpt2-tiny (its tied embedding held by both stages) saved
    after a step, loaded into a P(S x S) plan on the same 4 ranks (its ring shifts point to point), stepped, saved,
    loaded into 2 stages again."""
    report = spawn(
        check_checkpoint_across_stages, 4, "gpt2-tiny", "data_parallel:stages=2,schedule=1F1B,mb=2", str(tmp_path),
        timeout=TIMEOUT,
    )  # fmt: skip
    assert report["into_flat"] == [] and report["back"] == [], report
    assert report["names"] and report["changed"], report
