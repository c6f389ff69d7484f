"""When a rank dies or raises mid-step, the other ranks raise a clear error within the timeout instead of hanging.

``compile(..., timeout=T)`` bounds every wait of a compiled step on the other ranks. A killed rank closes its
sockets, so the others fail at their next transfer; a rank that raises and stays alive is only noticed when the
timeout runs out. Each check runs with ``primepar_fx.runtime.testing.spawn_each``, which lets a rank die without
stopping the others and returns every rank's report.
"""

from __future__ import annotations

import re

from reliability_checks import rank_fails_mid_step

from primepar_fx.runtime.testing import spawn_each

TIMEOUT = 10.0  # seconds a compiled step waits for the others (the acceptance asks for <= 60)


def test_a_rank_killed_before_its_forward_makes_the_others_raise_at_once():
    reports = spawn_each(rank_fails_mid_step, 3, "kill", "forward", TIMEOUT, "data_parallel", timeout=300)
    assert reports[1] is None  # killed: no report
    for r in (reports[0], reports[2]):
        kind, message = r["error"]
        assert kind == "RankFailureError", message
        assert f"rank {r['rank']}: a collective or transfer of the compiled step failed" in message
        assert "another rank has probably died" in message and f"timeout {TIMEOUT:g} s" in message
        assert r["seconds"] < TIMEOUT


def test_a_rank_killed_before_its_backward_makes_the_others_raise_at_once():
    reports = spawn_each(rank_fails_mid_step, 2, "kill", "backward", TIMEOUT, "megatron", timeout=300)
    assert reports[1] is None
    kind, message = reports[0]["error"]
    assert kind == "RuntimeError" and re.search("Connection (closed|reset) by peer", message), message
    assert reports[0]["seconds"] < TIMEOUT


def test_a_rank_that_raises_and_stays_silent_makes_the_others_time_out():
    reports = spawn_each(rank_fails_mid_step, 2, "raise", "backward", TIMEOUT, "megatron", timeout=300)
    assert reports[1]["injected"] == "injected failure on rank 1 before the backward"
    kind, message = reports[0]["error"]
    assert kind == "RuntimeError" and f"Timed out waiting {TIMEOUT * 1000:.0f}ms" in message, message
    assert TIMEOUT * 0.9 <= reports[0]["seconds"] < TIMEOUT + 10
