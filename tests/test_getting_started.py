"""The ``bash`` blocks of docs/getting_started.md run as written, in order, in one fresh folder, and exit with 0.

A block right under ``<!-- not run by the docs test -->`` is skipped (the page marks the set-up and the whole test
suite, which CI runs anyway). Later blocks may use files that earlier ones wrote (``plan.json``), so the blocks
share one folder and run in page order.

The page's sample output (the ``text`` block after a command) must also agree with what the command prints about
the *partitions* it chose: every row of a per-node plan table on the page (node and partition) and the training
summary's ``partitions:`` and ``most used:`` lines. Timings, which vary from machine to machine, are not compared.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "getting_started.md"
SKIP = "<!-- not run by the docs test -->"
FENCE = re.compile(r"^```bash\n(.*?)^```$", re.M | re.S)
SAMPLE = re.compile(r"\s*```text\n(.*?)^```$", re.M | re.S)  # a text block right after a bash block
#: a row of a per-node plan table: node, op, partition, then the forward ms (the explain table has a shape there)
PLAN_ROW = re.compile(r"^(\w+)\s+(?:aten\.\S+|getitem)\s+([A-Za-z0-9]+(?:,[A-Za-z0-9]+)*)\s+\d+\.\d+\s", re.M)
#: lines of the training summary that depend on the plan's partitions only
PARTITION_LINES = re.compile(r"^  (?:partitions|most used): .*$", re.M)
TIMEOUT = 300
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def bash_blocks(text: str) -> list[tuple[str, bool]]:
    """``(code, skipped)`` for every fenced ``bash`` block, skipped when the skip comment is right above it."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), before.strip() == SKIP))
    return out


def samples(text: str) -> list[str | None]:
    """For every fenced ``bash`` block (in the order of :func:`bash_blocks`), the ``text`` block that follows it
    (the page's sample output), or ``None``."""
    out = []
    for m in FENCE.finditer(text):
        after = SAMPLE.match(text, m.end())
        out.append(after.group(1) if after else None)
    return out


def partition_facts(sample: str) -> tuple[dict[str, str], list[str]]:
    """What a sample output states about partitions: ``{node: partition}`` of its plan-table rows and its
    ``partitions:``/``most used:`` summary lines."""
    rows = {m.group(1): m.group(2) for m in PLAN_ROW.finditer(sample)}
    return rows, PARTITION_LINES.findall(sample)


def check_partitions(sample: str | None, printed: str) -> int:
    """Assert that ``printed`` (a command's real output) chose the partitions ``sample`` shows; the number of
    facts checked."""
    if sample is None:
        return 0
    want_rows, want_lines = partition_facts(sample)
    got_rows, got_lines = partition_facts(printed)
    wrong = {n: (p, got_rows.get(n)) for n, p in want_rows.items() if got_rows.get(n) != p}
    assert not wrong, f"the page shows partitions that the command no longer chooses (page, printed): {wrong}"
    missing = [line for line in want_lines if line not in got_lines]
    assert not missing, f"the page shows summary lines that the command no longer prints: {missing} vs {got_lines}"
    return len(want_rows) + len(want_lines)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    bin_dir = os.path.dirname(sys.executable)  # primepar-fx and torchrun of the interpreter running the tests
    return {
        **env,
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PET_STANDALONE": "1",  # torchrun --standalone: a free rendezvous port, so parallel test runs don't collide
    }


def test_blocks_are_found_and_the_setup_and_suite_are_skipped():
    """Skipped: the set-up, the whole suite, and the plan of the repository's config file (a path from the
    repository root, which the fresh folder does not have; tests/test_cli.py runs it)."""
    blocks = bash_blocks(PAGE.read_text())
    skipped = [code for code, skip in blocks if skip]
    expected = [["pip", "install"], ["python", "-m"], ["primepar-fx", "plan", "tests/data/llama-2-7b-config.json"]]
    assert [c.split()[0 : len(e)] for c, e in zip(skipped, expected)] == expected, skipped
    assert len(skipped) == len(expected)
    assert sum(not skip for _, skip in blocks) >= 6


def test_the_sample_outputs_of_train_and_plan_state_partitions():
    """The partition check is not empty: it finds the train summary's lines and the plan table's rows."""
    text = PAGE.read_text()
    pairs = zip(bash_blocks(text), samples(text))
    facts = {code.split("\n")[0]: partition_facts(sample or "") for (code, _), sample in pairs}
    train = next(f for c, f in facts.items() if "primepar_fx.examples.train" in c)
    assert [line.split(":")[0].strip() for line in train[1]] == ["partitions", "most used"]
    plan = next(f for c, f in facts.items() if c.startswith("primepar-fx plan"))
    assert {"embedding", "linear", "linear_2", "linear_3"} <= set(plan[0]), plan
    explain = next(f for c, f in facts.items() if c.startswith("primepar-fx explain"))
    assert explain == ({}, []), "the explain table (shapes, no partitions) is not a plan table"


def test_bash_blocks_of_the_page_run(tmp_path):
    env = _env()
    text = PAGE.read_text()
    for i, ((code, skipped), sample) in enumerate(zip(bash_blocks(text), samples(text))):
        if skipped:
            continue
        t0 = time.perf_counter()
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        took = time.perf_counter() - t0
        assert done.returncode == 0, (
            f"block {i} exited {done.returncode} after {took:.0f} s:\n{code}\n{done.stdout}\n{done.stderr[-4000:]}"
        )
        checked = check_partitions(sample, done.stdout)
        print(f"block {i}: {took:.1f} s, {checked} partition fact(s) checked: {code.splitlines()[0]}")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("```bash\nls\n```\n", [("ls\n", False)]),
        (f"{SKIP}\n```bash\npip install x\n```\n\n```bash\nls\n```\n", [("pip install x\n", True), ("ls\n", False)]),
        (f"{SKIP}\n\n```bash\nA\n```\n```text\nout\n```\n", [("A\n", True)]),
    ],
)
def test_bash_blocks_parse_fences_and_skip_marks(text, want):
    assert bash_blocks(text) == want


ROW = "linear    aten.linear.default    {}    0.148    0.148\n"


@pytest.mark.parametrize(
    ("page", "printed", "ok"),
    [
        (ROW.format("B,K"), ROW.format("B,K") + ROW.format("R,R").replace("linear ", "other "), True),
        (ROW.format("B,R"), ROW.format("B,K"), False),  # the partition changed
        (ROW.format("B,K"), "", False),  # the row is gone
        ("  most used: R,R x47, K,R x2\n", "  most used: R,R x47, K,R x2\n  loss: 1 -> 0\n", True),
        ("  most used: R,R x47, K,R x2\n", "  most used: R,R x45, K,R x4\n", False),
        ("step 1/5 time 62.3 ms\n", "step 1/5 time 17.5 ms\n", True),  # timings are not compared
    ],
)
def test_check_partitions_catches_drift_of_the_chosen_partitions(page, printed, ok):
    if ok:
        check_partitions(page, printed)
    else:
        with pytest.raises(AssertionError, match="no longer"):
            check_partitions(page, printed)
