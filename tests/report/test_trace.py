"""``TORCH_TRACE``: the plan, its cost breakdown and the rank's graph are structured trace artifacts (tlparse lists
them), for ``primepar_fx.compile`` and for the ``"primepar"`` backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from primepar_fx.record.plan import Plan

SCRIPT = textwrap.dedent(
    """
    import torch, primepar_fx
    from primepar_fx.models import build, example_inputs, get_config
    args, kwargs = example_inputs(get_config("gpt2-tiny"), 2, 16)
    primepar_fx.compile(build("gpt2-tiny"), args, world_size=1)
    torch.compile(build("gpt2-tiny"), backend="primepar")(*args)
    """
)


def artifacts(folder: str) -> list[tuple[dict, str]]:
    """``(metadata, payload)`` of every ``artifact`` record of the trace logs in ``folder``."""
    out = []
    for name in sorted(os.listdir(folder)):
        lines = open(os.path.join(folder, name), encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            head = line.partition("] ")[2]
            if not head.startswith('{"artifact"'):
                continue
            payload = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("\t"):
                    break
                payload.append(follow[1:])
            out.append((json.loads(head)["artifact"], "\n".join(payload)))
    return out


def test_compile_and_the_backend_write_the_plan_as_trace_artifacts(tmp_path):
    env = dict(os.environ, TORCH_TRACE=str(tmp_path), PRIMEPAR_CLUSTER="cpu-gloo", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = artifacts(str(tmp_path))
    names = [meta["name"] for meta, _ in found if meta["name"].startswith("primepar")]
    assert names == ["primepar_plan", "primepar_cost", "primepar_rank0_graph"] * 2, names
    plans = [Plan.from_json(payload) for meta, payload in found if meta["name"] == "primepar_plan"]
    assert plans[0].model == "gpt2-tiny" and plans[1].model == "dynamo graph"
    cost = next(payload for meta, payload in found if meta["name"] == "primepar_cost")
    assert cost.startswith("# Nodes of gpt2-tiny") and "| node " in cost
    code = next(payload for meta, payload in found if meta["name"] == "primepar_rank0_graph")
    assert "class PrimeParRank0" in code
