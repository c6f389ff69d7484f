"""The ``bash`` blocks of docs/getting_started.md run as written, in order, in one fresh folder, and exit with 0.

A block right under ``<!-- not run by the docs test -->`` is skipped (the page marks the set-up and the whole test
suite, which CI runs anyway). Later blocks may use files that earlier ones wrote (``plan.json``), so the blocks
share one folder and run in page order.
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
TIMEOUT = 300
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def bash_blocks(text: str) -> list[tuple[str, bool]]:
    """``(code, skipped)`` for every fenced ``bash`` block, skipped when the skip comment is right above it."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), before.strip() == SKIP))
    return out


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
    blocks = bash_blocks(PAGE.read_text())
    skipped = [code for code, skip in blocks if skip]
    assert [c.split()[0:2] for c in skipped] == [["pip", "install"], ["python", "-m"]], skipped
    assert sum(not skip for _, skip in blocks) >= 6


def test_bash_blocks_of_the_page_run(tmp_path):
    env = _env()
    for i, (code, skipped) in enumerate(bash_blocks(PAGE.read_text())):
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
        print(f"block {i}: {took:.1f} s: {code.splitlines()[0]}")


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
