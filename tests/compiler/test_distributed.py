"""Real multi-process training on gloo: every compiled plan trains to the numbers of one device.

One process group start per (world size, model family) group of checks, each with a deadline
(``primepar_fx.runtime.testing.spawn``), so a deadlock fails the test instead of hanging CI. The acceptance
points of the runtime: loss and every gathered gradient equal a single-device run, three AdamW steps later the
gathered parameters still do; a P(S x S) weight is held once across the ranks;
the bytes the ranks send equal the plan's prediction.
"""

from __future__ import annotations

import pytest
import torch
from distributed_checks import ATOL, RTOL, check_plans

from primepar_fx.runtime.testing import spawn

TIMEOUT = 600


def _assert_trains_like_one_device(report: dict, plans: list[str]) -> None:
    for plan in plans:
        r = report[plan]
        assert r["loss"] == pytest.approx(report["reference_loss"], rel=RTOL, abs=ATOL), plan
        assert r["bad_grads"] == [], f"{plan}: gradients differ from one device: {r['bad_grads'][:5]}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), plan
        assert r["bad_params"] == [], f"{plan}: parameters after AdamW differ: {r['bad_params'][:5]}"
        assert r["reloaded_loss"] == pytest.approx(report["reference_loss"], rel=RTOL, abs=ATOL), plan


def _assert_bytes_match(report: dict, plans: list[str]) -> None:
    for plan in plans:
        r = report[plan]
        assert r["sent_planned_total"] == pytest.approx(r["predicted_total"], rel=0.01), (plan, r["sent_rank0"])


def test_recomputation_trains_like_one_device():
    """Activation recomputation (issue 18): every layer recomputed in full, with the searched plan, a P(S x S)
    plan, Megatron's split and a random plan, trains to the numbers of one device on 4 ranks and sends the bytes
    predicted (the recomputed Forward's collectives, ring shifts and re-layouts included: shared ones once, fused
    reduce-scatters as reduce-scatters)."""
    # (Megatron with sequence parallelism: the fastest Megatron split of gpt2-tiny on 4 ranks is pure data parallelism)
    plans = ["searched+recompute=full", "prime+recompute=full", "megatron-sp+recompute=full", "random:5+recompute=full"]
    report = spawn(check_plans, 4, "gpt2-tiny", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)
    assert report["prime+recompute=full"]["sent_rank0"]["ring"] > 0
    for plan in plans[1:]:  # Forward runs twice: its collectives and ring shifts are sent again
        assert report[plan]["recomputed_bytes"] > 0, plan


def test_selective_recomputation_of_eager_attention_scores():
    """Selective recomputation re-runs a Hugging Face model's eager attention scores in Backward, on 4 ranks."""
    plans = ["data_parallel+recompute=selective", "prime+recompute=selective", "searched+recompute=full"]
    report = spawn(check_plans, 4, "hf:bloom", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)


def test_zero_trains_like_one_device():
    """ZeRO stages 1 and 2 (issue 18): with data parallelism, Megatron's split with recomputation and a random
    plan, ``module.optimizer(AdamW)`` keeps a share of the optimizer state on each rank, sends the bytes predicted
    in a whole step, and trains to one device's losses and parameters on 4 ranks."""
    from distributed_checks import check_levers

    plans = ["data_parallel+zero=1", "data_parallel+zero=2", "megatron-sp+recompute=full+zero=2", "random:5+zero=2"]
    report = spawn(check_levers, 4, "gpt2-tiny", plans, timeout=TIMEOUT)
    for plan in plans:
        r = report[plan]
        assert r["zero"] == int(plan[-1]), plan
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), plan
        assert r["bad_params"] == [], (plan, r["bad_params"][:3])
        assert r["sharded_buckets"] > 0, plan
        assert r["state_elems"] < r["unsharded_state_elems"], plan
        # every sharded bucket's all-gather left in flight by each step for the next Forward, none after Forward;
        # none after the last step, taken under torch's profiler
        assert r["in_flight_after_step"] == [r["sharded_buckets"]] * 2 + [0], plan
        assert r["in_flight_after_forward"] == [0] * 3, plan
    for plan in plans[:3]:
        r = report[plan]
        assert r["sent_planned_total"] == pytest.approx(r["predicted_total"], rel=0.01), plan
    dp1, dp2 = report["data_parallel+zero=1"], report["data_parallel+zero=2"]
    assert dp1["grad_elems"] == dp1["param_elems"]  # stage 1 sums gradients whole; stage 2 keeps only chunks
    assert dp2["grad_elems"] == dp2["unsharded_elems"] < dp2["param_elems"] / 10  # (one summed in the graph)
    # data parallelism replicates every parameter on 4 ranks: each keeps two moments of a quarter of the sharded
    sharded = dp2["param_elems"] - dp2["unsharded_elems"]
    assert dp2["state_elems"] == pytest.approx(2 * (sharded / 4 + dp2["unsharded_elems"]), rel=0.001)
    # stage 1 sends the all-reduce and an all-gather: 3/2 of stage 2's bytes (an all-reduce's)
    assert dp1["sent_planned_total"] == pytest.approx(1.5 * dp2["sent_planned_total"], rel=0.01)


def test_zero3_trains_like_one_device():
    """ZeRO stage 3 (issue 18): each replicated parameter block kept as chunks and gathered only around its uses,
    with data parallelism, Megatron's split with recomputation, a random plan and a P(S x S) plan with
    recomputation and micro-batches: one device's losses and parameters after three AdamW steps, the bytes the plan
    predicts (a gather before Forward, one before Backward where Backward reads the parameter or recomputes its
    layer, a reduce-scatter), and each rank stores a quarter of what it stored before, none of it whole between
    steps."""
    from distributed_checks import check_levers

    plans = [
        "data_parallel+zero=3",
        "megatron-sp+recompute=full+zero=3",
        "random:5+zero=3",
        "prime+recompute=full+zero=3+micro_batches=2",
    ]
    report = spawn(check_levers, 4, "gpt2-tiny", plans, timeout=TIMEOUT)
    for plan in plans:
        r = report[plan]
        assert r["zero"] == 3, plan
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), plan
        assert r["bad_params"] == [], (plan, r["bad_params"][:3])
        assert r["sent_planned_total"] == pytest.approx(r["predicted_total"], rel=1e-6), plan
        assert r["sharded_buckets"] > 0 and r["freed_between_steps"], plan
        assert r["stored_param_elems"] < r["param_elems"], plan
    dp = report["data_parallel+zero=3"]  # every parameter replicated on 4 ranks: a quarter of each (padding aside)
    # a unit a layer (its biases apart: Backward reads none) and the tied embedding and the final norm kept whole
    # from Forward (the position table's gradient is summed in the graph: kept whole, no unit); each gathered before
    # Forward, and again before Backward unless Backward reads none of it or it was kept whole from Forward
    assert sorted(map(tuple, dp["units"])) == [(False, False)] * 2 + [(True, False)] * 2 + [(True, True)] * 2
    assert dp["gathers"] == len(dp["units"]) + sum(read and not kept for read, kept in dp["units"])
    sharded = dp["param_elems"] - dp["unsharded_elems"]  # (but the one summed in the graph, kept whole)
    assert dp["stored_param_elems"] == pytest.approx(sharded / 4 + dp["unsharded_elems"], rel=0.001)


def test_micro_batches_train_like_one_device():
    """Micro-batches (issue 18): the compiled module cuts the batch of 4 into 2 and accumulates the gradients,
    summing them over replicas once, with data parallelism, Megatron's split with ZeRO-2, a P(S x S) plan with
    recomputation and the searched plan: one device's losses and parameters, the bytes the plan predicts."""
    from distributed_checks import check_levers

    plans = [
        "data_parallel+micro_batches=2",
        "megatron+zero=2+micro_batches=2",
        "prime+recompute=full+micro_batches=2",
        "searched+micro_batches=2",
    ]
    report = spawn(check_levers, 4, "gpt2-tiny", plans, timeout=TIMEOUT)
    for plan in plans:
        r = report[plan]
        assert r["micro_batches"] == 2, plan
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), plan
        assert r["bad_params"] == [], (plan, r["bad_params"][:3])
        assert r["sent_planned_total"] == pytest.approx(r["predicted_total"], rel=0.01), plan


def test_one_rank_without_a_process_group_when_asked_for():
    from distributed_checks import make

    import primepar_fx

    ref, args, kwargs = make("gpt2-tiny")
    model, _, _ = make("gpt2-tiny")
    module = primepar_fx.compile(model, args, kwargs, world_size=1)
    loss, ref_loss = module(*args, **kwargs), ref(*args, **kwargs)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    grads = primepar_fx.gather_grads(module)
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=RTOL, atol=ATOL), name
    assert module.comm_stats.total == 0


def test_two_ranks_reference_model():
    plans = ["searched", "searched:budget", "megatron", "data_parallel", "random:11"]
    report = spawn(check_plans, 2, "gpt2-tiny", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, ["searched", "searched:budget", "megatron", "data_parallel"])
    assert report["searched:budget"]["sharded_elems"] < 2 * report["searched:budget"]["full_elems"]


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_four_ranks_reference_models(model):
    plans = ["searched:budget", "megatron", "megatron-sp", "prime", "random:3"]
    report = spawn(check_plans, 4, model, plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, ["searched:budget", "megatron", "megatron-sp", "prime"])
    assert report["megatron-sp"]["reduce_scatters"] >= 4  # the SP all-reduces ran as reduce-scatters
    prime = report["prime"]
    linears = [p for n, p in prime["partitions"].items() if n.startswith("linear")]
    assert linears and all(p == "P2x2" for p in linears)
    assert prime["sent_rank0"]["ring"] > 0
    if model == "llama-tiny":  # untied: every P(2x2) weight is held exactly once across the 4 ranks
        assert prime["prime_weights"]
        for fqn, (held, full) in prime["prime_weights"].items():
            assert held == full, fqn


@pytest.mark.parametrize(
    ("family", "plans"),  # Megatron's layout on llama: 2 ranks in test_backend, 4 ranks of llama-tiny above
    [
        ("gpt2", ["searched:budget", "megatron", "prime"]),
        ("llama", ["searched:budget", "prime"]),
        ("opt", ["searched:budget", "megatron", "prime"]),
        ("bloom", ["searched:budget", "megatron", "prime"]),
    ],
)
def test_four_ranks_hugging_face(family, plans):
    report = spawn(check_plans, 4, f"hf:{family}", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)


@pytest.mark.parametrize("family", ["falcon", "gemma"])
def test_falcon_and_gemma_train_like_one_device_and_send_what_is_predicted(family):
    """Falcon adds the attention output into the MLP's in place (``mlp_output += attention_output``): captured
    out of place (frontend/inplace.py). Gemma's norms end in ``type_as(y, x)``, which reads only ``x``'s dtype:
    the runtime leaves ``x`` where it is, as the plan prices it (it used to gather all of it). Both train on 2
    ranks under random plans and Megatron's as one device, sending the bytes predicted."""
    plans = ["random:3", "random:11", "megatron"]
    report = spawn(check_plans, 2, f"hf:{family}", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)


def _seeds_with_tied_scatter(model_name: str, world: int, tries: int = 40) -> list[int]:
    """Seeds of random plans in which a tied parameter's later reader all-reduces its gradient and the re-layout back
    to the first reader's storage only slices it: the runtime runs a reduce-scatter there, and the plan prices one."""
    from distributed_checks import BATCH, SEQ, make

    from primepar_fx.frontend.capture import capture
    from primepar_fx.frontend.symbols import B, S
    from primepar_fx.graph import graph_of
    from primepar_fx.planning.forced import random_assignment
    from primepar_fx.planning.options import PlanOptions
    from primepar_fx.pricing.fixed import price_assignments
    from primepar_fx.pricing.price import shared_parameters

    model, args, kwargs = make(model_name)
    graph = graph_of(lambda static: capture(model, args, kwargs, static_seq=static))
    opts = PlanOptions.make(world_size=world, cluster="cpu-gloo", batch=BATCH, seq=SEQ, memory_budget=None)
    values, mesh, tied = {B: BATCH, S: SEQ}, opts.mesh(), shared_parameters(graph)
    assert tied, f"{model_name} ties no parameter"
    seeds = []
    for seed in range(tries):
        assignment = random_assignment(graph, mesh, values, seed)
        priced, (choice,) = price_assignments(graph, [assignment], mesh, opts.cluster, values, opts.cost_options())
        for u, _, v, _ in tied:
            saving = priced.scatter.get((u, v))
            if saving is not None and saving.backward_scattered[choice[u], choice[v]] > 0:
                seeds.append(seed)
    return seeds


def test_a_tied_parameter_gradient_reduce_scattered_to_its_storage_sends_what_is_predicted():
    """GPT-2's tied embedding is stored in the embedding's layout; where the LM head splits the rows (its weight
    gradient a partial sum) and the embedding splits the hidden dim, the head's all-reduce and the re-layout back to
    the storage are one reduce-scatter at run time, and the plan prices that (it priced the all-reduce)."""
    seeds = _seeds_with_tied_scatter("gpt2-tiny", 2)
    assert seeds, "no random plan of the first 40 fuses the tied gradient"
    plan = f"random:{seeds[0]}"
    report = spawn(check_plans, 2, "gpt2-tiny", [plan], timeout=TIMEOUT)
    _assert_trains_like_one_device(report, [plan])
    _assert_bytes_match(report, [plan])
    assert report[plan]["sent_rank0"]["redistribution"] > 0


def rotating_pair(families: tuple[str, ...], day: int) -> list[str]:
    """Two of ``families`` for the day ``day`` (an ordinal): every family comes round within len/2 days."""
    k = (2 * day) % len(families)
    return [families[k], families[(k + 1) % len(families)]]


def test_a_rotating_pair_of_covered_families_trains_like_one_device():
    """Two families of docs/coverage.md's matrix a day (``PRIMEPAR_COVERAGE_FAMILIES=a,b`` picks them), on 2 ranks
    under a random plan, as bench/coverage.py checks all of them."""
    import datetime
    import os

    from primepar_fx.models.hf import COVERED_FAMILIES

    assert {f for day in (7, 8) for f in rotating_pair(("a", "b", "c", "d"), day)} == {"a", "b", "c", "d"}
    chosen = os.environ.get("PRIMEPAR_COVERAGE_FAMILIES")
    families = chosen.split(",") if chosen else rotating_pair(COVERED_FAMILIES, datetime.date.today().toordinal())
    for family in families:
        report = spawn(check_plans, 2, f"hf:{family}", ["random:3"], timeout=TIMEOUT)
        _assert_trains_like_one_device(report, ["random:3"])
        _assert_bytes_match(report, ["random:3"])


def test_eight_ranks_prime_with_a_split():
    plans = ["prime", "megatron"]
    report = spawn(check_plans, 8, "llama-tiny", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)
    linears = [p for n, p in report["prime"]["partitions"].items() if n.startswith("linear")]
    assert any("P2x2" in p and "," in p for p in linears)


def test_mixture_of_experts_trains_like_one_device():
    """Mixtral (tiny: 4 experts, 2 a token) on 4 ranks under two random plans whose MoE layers split the experts
    over both digits (``E,E``: one expert a rank), each expert's intermediate over both (``I,I``), the experts with
    the intermediate (``I,E``) or with the tokens (``E,BS``): loss, gradients and 3 AdamW steps as on one device,
    bytes as predicted; then one of them with ZeRO-3, full recomputation and 2 micro-batches."""
    pytest.importorskip("transformers")
    plans = ["random:1", "random:2"]
    report = spawn(check_plans, 4, "hf:mixtral", plans, timeout=TIMEOUT)
    _assert_trains_like_one_device(report, plans)
    _assert_bytes_match(report, plans)
    experts = {p: {n: s for n, s in report[p]["partitions"].items() if n.startswith("moe_experts")} for p in plans}
    assert experts == {
        "random:1": {"moe_experts": "I,I", "moe_experts_1": "E,BS"},
        "random:2": {"moe_experts": "E,E", "moe_experts_1": "I,E"},
    }
    # and with every lever: ZeRO-3 (the experts' weights gathered around the op and again for its Backward, which
    # recomputes them), full recomputation of each layer and 2 micro-batches
    from distributed_checks import check_levers

    plan = "random:2+recompute=full+zero=3+micro_batches=2"
    r = spawn(check_levers, 4, "hf:mixtral", [plan], timeout=TIMEOUT)[plan]
    assert r["zero"] == 3 and r["freed_between_steps"]
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL)
    assert r["bad_params"] == [], r["bad_params"][:3]
    assert r["sent_planned_total"] == pytest.approx(r["predicted_total"], rel=1e-6)
