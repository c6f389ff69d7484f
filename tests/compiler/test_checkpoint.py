"""Checkpoints: sharded (DCP) and consolidated round trips are bit-exact, resumed training matches uninterrupted
training, and a checkpoint taken under one plan and world size loads under another and in one process."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from distributed_checks import ATOL, RTOL, make
from reliability_checks import adamw, checkpoint_load, checkpoint_save, step

import primepar_fx
from primepar_fx.compiler import checkpoint
from primepar_fx.compiler.checkpoint import held_blocks, owned_blocks
from primepar_fx.runtime.testing import spawn

MODEL = "llama-tiny"  # untied: every P(2 x 2) weight is held once across 4 ranks
BEFORE, AFTER = 2, 2


# ---------------------------------------------------------------------------------------------------- blocks
def _layout_cases():
    """``(layout, shape)``: replicated, split, split x replicated, strided (two intervals) and a P(2 x 2) skew."""
    full = ((0, 6),), ((0, 4),)
    yield (full, full), (6, 4)
    yield ((((0, 3),), ((0, 4),)), (((3, 6),), ((0, 4),))), (6, 4)
    halves = [(((0, 3),), ((0, 4),)), (((3, 6),), ((0, 4),))]
    yield tuple(h for h in halves for _ in range(2)), (6, 4)
    yield ((((0, 2), (4, 6)), ((0, 4),)), (((2, 4),), ((0, 4),)), (((0, 2), (4, 6)), ((0, 4),))), (6, 4)
    rows, cols = [((0, 3),), ((3, 6),)], [((0, 2),), ((2, 4),)]
    yield tuple((rows[r], cols[(r + c) % 2]) for r in range(2) for c in range(2)), (6, 4)


@pytest.mark.parametrize("case", list(_layout_cases()))
def test_owned_blocks_tile_the_tensor_once_and_held_blocks_fill_each_rank(case):
    layout, shape = case
    count = torch.zeros(shape, dtype=torch.int64)
    covered = torch.zeros(shape, dtype=torch.bool)
    for rank in range(len(layout)):
        for b in owned_blocks(layout, rank):
            count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] += 1
        local = tuple(sum(b - a for a, b in ivs) for ivs in layout[rank])
        filled = torch.zeros(local, dtype=torch.int64)
        for b in held_blocks(layout, rank):
            filled[b.local] += 1
            covered[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] = True
        assert bool((filled == 1).all()), rank
    assert bool((count == 1).all()) and bool(covered.all())


# ---------------------------------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-process module trained BEFORE steps, saved both ways, then trained AFTER more."""
    tmp = tmp_path_factory.mktemp("ckpt")
    model, args, kwargs = make(MODEL)
    module = primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1)
    opt = adamw(module.parameters())
    for _ in range(BEFORE):
        step(module, opt, args, kwargs)
    checkpoint.save(module, tmp / "dcp", opt)
    checkpoint.save_consolidated(module, tmp / "full.pt", opt)
    saved = {n: t.clone() for n, t in module.gather_state_dict().items()}
    uninterrupted = [step(module, opt, args, kwargs) for _ in range(AFTER)]
    return tmp, saved, uninterrupted, (args, kwargs)


@pytest.mark.parametrize("how", ["dcp", "consolidated"])
def test_one_process_round_trip_is_bit_exact_and_resumes_like_uninterrupted_training(trained, how):
    tmp, saved, uninterrupted, (args, kwargs) = trained
    model, _, _ = make(MODEL)
    module = primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1)
    opt = torch.optim.AdamW(module.parameters(), lr=1.0)  # the saved hyperparameters replace these
    if how == "dcp":
        checkpoint.load(module, tmp / "dcp", opt)
    else:
        checkpoint.load_consolidated(module, tmp / "full.pt", opt)
    assert all(torch.equal(module.gather_state_dict()[n], t) for n, t in saved.items())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert [step(module, opt, args, kwargs) for _ in range(AFTER)] == uninterrupted


def test_the_consolidated_file_loads_into_the_plain_model_with_weights_only(trained):
    tmp, saved, uninterrupted, (args, kwargs) = trained
    payload = torch.load(tmp / "full.pt", weights_only=True)
    model, _, _ = make(MODEL)
    model.load_state_dict(payload["model"])
    assert float(model(*args, **kwargs).detach()) == pytest.approx(uninterrupted[0], rel=RTOL, abs=ATOL)
    assert payload["optimizer"]["param_groups"][0]["lr"] == 1e-2


def test_bad_checkpoints_fail_before_anything_changes(trained, tmp_path):
    tmp, saved, _, (args, kwargs) = trained
    model, _, _ = make(MODEL)
    module = primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1)
    before = {n: t.clone() for n, t in module.gather_state_dict().items()}
    incomplete = shutil.copytree(tmp / "dcp", tmp_path / "incomplete")
    (incomplete / checkpoint.META_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="not a complete primepar checkpoint"):
        checkpoint.load(module, incomplete)
    other = shutil.copytree(tmp / "dcp", tmp_path / "other")
    meta = json.loads((other / checkpoint.META_FILE).read_text())
    meta["parameters"]["extra.weight"] = meta["parameters"].pop("lm_head.weight")
    (other / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(KeyError, match=r"missing \['lm_head.weight'\], unexpected \['extra.weight'\]"):
        checkpoint.load(module, other)
    gpt2, gpt2_args, gpt2_kwargs = make("gpt2-tiny")
    wrong = primepar_fx.compile(gpt2, gpt2_args, gpt2_kwargs, plan="megatron", world_size=1)
    with pytest.raises(KeyError, match="parameters differ from the model's"):
        checkpoint.load(wrong, tmp / "dcp")
    checkpoint.save(module, tmp_path / "no_optimizer")
    with pytest.raises(ValueError, match="holds no optimizer state"):
        checkpoint.load(module, tmp_path / "no_optimizer", torch.optim.AdamW(module.parameters()))
    assert all(torch.equal(module.gather_state_dict()[n], t) for n, t in before.items())


# ---------------------------------------------------------------------------------------------------- across plans
def test_saved_under_prime_on_4_ranks_loads_under_megatron_on_2_and_in_one_process(tmp_path):
    saved = spawn(checkpoint_save, 4, MODEL, "prime", str(tmp_path), BEFORE, AFTER, timeout=600)
    assert saved["file_differs"] == [] and "P2x2" in saved["partitions"]
    assert saved["other sizes"][0] == pytest.approx(saved["other sizes"][1], rel=RTOL, abs=ATOL)  # rebuilt P(2 x 2)
    for how in ("dcp", "consolidated"):  # the same plan and world size: bit-exact
        assert saved[f"{how} resumed"] == saved["uninterrupted"], how
        assert saved[f"{how} lr"] == 1e-2

    loaded = spawn(checkpoint_load, 2, MODEL, "megatron", str(tmp_path), AFTER, timeout=600)
    assert "P2x2" not in loaded["partitions"]
    for how in ("dcp", "consolidated"):  # another plan sums in another order: equal up to rounding
        assert loaded[f"{how} differs"] == [], how
        assert loaded[f"{how} resumed"] == pytest.approx(saved["uninterrupted"], rel=RTOL, abs=ATOL), how

    model, args, kwargs = make(MODEL)
    module = primepar_fx.compile(model, args, kwargs, plan="megatron", world_size=1)
    opt = torch.optim.AdamW(module.parameters(), lr=1.0)
    checkpoint.load(module, tmp_path / "dcp", opt)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(module.gather_state_dict()[n], t) for n, t in full["model"].items())
    params = module.local_parameters()
    for fqn, key in itertools.product(params, ("exp_avg", "exp_avg_sq")):
        assert torch.equal(opt.state[params[fqn]][key], full["optimizer"]["state"][fqn][key]), (fqn, key)
    resumed = [step(module, opt, args, kwargs) for _ in range(AFTER)]
    assert resumed == pytest.approx(saved["uninterrupted"], rel=RTOL, abs=ATOL)


def test_a_zero_optimizer_round_trips_and_moves_to_another_plan(tmp_path):
    """ZeRO-3's chunked parameters and optimizer state (data parallelism on 4 ranks) are checkpointed per
    parameter: the file has every parameter and its whole moments, resuming (into ZeRO-3 again) is bit-exact, and
    ZeRO-2 under Megatron on 2 ranks loads it."""
    saved = spawn(checkpoint_save, 4, MODEL, "data_parallel+zero=3", str(tmp_path), BEFORE, AFTER, timeout=600)
    assert saved["file_differs"] == []
    for how in ("dcp", "consolidated"):
        assert saved[f"{how} resumed"] == saved["uninterrupted"], how
        assert saved[f"{how} lr"] == 1e-2
    loaded = spawn(checkpoint_load, 2, MODEL, "megatron+zero=2", str(tmp_path), AFTER, timeout=600)
    for how in ("dcp", "consolidated"):
        assert loaded[f"{how} differs"] == [], how
        assert loaded[f"{how} resumed"] == pytest.approx(saved["uninterrupted"], rel=RTOL, abs=ATOL), how
