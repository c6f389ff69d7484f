"""compile() with no cluster prices on this machine: measured once on the live ranks, cached, reused; cluster= wins.

One spawn of 2 gloo ranks with an empty cache directory (``PRIMEPAR_CACHE_DIR``) and ``PRIMEPAR_CLUSTER`` unset:

1. the first ``compile`` measures and writes one spec file, and its plan is priced on it;
2. the second reads the file (not rewritten) and makes the same plan;
3. ``cluster="cpu-gloo"`` prices on the preset and leaves the cache alone;
4. a corrupt cache file is measured again and replaced;
5. rank 0 gives a plan and rank 1 ``plan=None`` (rank 0's is broadcast): no rank measures (the ranks used to
   disagree here and deadlock on mismatched broadcasts; found by the deep fuzz run, world 6, digits (2, 3)).
"""

from __future__ import annotations

import json
import os

import torch

import primepar_fx
from primepar_fx.calibrate.machine import cache_path, group_sizes
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.latency import COLLECTIVES
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.runtime.testing import spawn


def _compile(cluster=None, plan=None):
    torch.manual_seed(0)
    config = get_config("gpt2-tiny")
    args, kwargs = example_inputs(config, 4, 16)
    return primepar_fx.compile(build(config), args, kwargs, cluster=cluster, plan=plan)


def _without_search_time(plan) -> dict:
    data = json.loads(plan.to_json())
    data["search"] = {k: v for k, v in data["search"].items() if not k.endswith("_s")}  # how long it took
    return data


def _run(rank: int, world: int, cache: str) -> dict:
    os.environ.pop("PRIMEPAR_CLUSTER", None)
    os.environ["PRIMEPAR_CACHE_DIR"] = cache
    path = cache_path(world, "gloo")
    out: dict = {"path": str(path), "files_before": sorted(os.listdir(cache))}
    first = _compile()
    out["first_cluster"] = first.plan.cluster
    out["files"] = sorted(os.listdir(cache))
    stamp = os.stat(path).st_mtime_ns if rank == 0 else None
    spec = load_cluster(path) if rank == 0 else None
    second = _compile()
    out["second_cluster"] = second.plan.cluster
    out["same_plan"] = _without_search_time(second.plan) == _without_search_time(first.plan)
    out["rewritten"] = rank == 0 and os.stat(path).st_mtime_ns != stamp
    preset = _compile("cpu-gloo")
    out["preset_cluster"] = preset.plan.cluster
    out["rewritten_by_preset"] = rank == 0 and os.stat(path).st_mtime_ns != stamp
    if rank == 0:
        out["calibrated"] = spec.calibrated
        out["source"] = spec.source
        level0 = spec.levels[0].collectives
        out["kinds"] = sorted(level0)
        out["positive"] = all(level0[k].fixed + level0[k].call > 0 or level0[k].bytes_coeff > 0 for k in level0)
        out["matmul_overlap"] = spec.matmul_overlap
        path.write_text("{not json")
    torch.distributed.barrier()
    again = _compile()
    out["after_corruption"] = again.plan.cluster
    out["reloaded"] = load_cluster(path).name if rank == 0 else None
    # rank 0 gives its plan, the others None (it is broadcast): nothing to price, so no rank measures
    given = _compile(plan=again.plan if rank == 0 else None)
    out["given_cluster"] = given.plan.cluster
    return out


def test_the_machine_is_timed_at_every_group_size_a_mesh_makes():
    assert group_sizes(2) == [2] and group_sizes(4) == [2, 4] and group_sizes(6) == [2, 3, 6]
    assert group_sizes(8) == [2, 4, 8] and group_sizes(1) == []


def test_compile_without_a_cluster_measures_this_machine_once_and_reuses_it(tmp_path):
    r = spawn(_run, 2, str(tmp_path), timeout=400)
    name = os.path.basename(r["path"])
    assert r["files_before"] == [] and r["files"] == [name]
    assert r["first_cluster"] == r["second_cluster"] == "cpu-gloo-measured"
    assert r["same_plan"] and not r["rewritten"]
    assert r["preset_cluster"] == "cpu-gloo" and not r["rewritten_by_preset"]
    assert r["calibrated"] and "measured 2 gloo ranks" in r["source"]
    assert r["kinds"] == sorted(COLLECTIVES) and r["positive"]
    assert 0.0 <= r["matmul_overlap"] <= 1.0  # measured too (two ranks on two shared cores: near 0)
    assert r["after_corruption"] == "cpu-gloo-measured" and r["reloaded"] == "cpu-gloo-measured"
    assert r["given_cluster"] == "cpu-gloo-measured"  # rank 0's plan, run as given on both ranks
