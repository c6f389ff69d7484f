"""Worker processes leave through ``exit_worker`` (``runtime/process.py``): at once, and without leaving named
semaphores behind for the resource tracker to warn of when the parent exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from tqdm.auto import tqdm

    from primepar_fx.runtime.testing import spawn


    def job(rank, world):
        for _ in tqdm(range(3), disable=True):  # tqdm's first bar makes a multiprocessing lock (a named semaphore)
            pass
        return world


    if __name__ == "__main__":
        print("result", spawn(job, 2, timeout=120))
    """
)


def test_ranks_that_made_a_progress_bar_leave_no_semaphore_for_the_resource_tracker(tmp_path):
    """Fails without the finalizers ``exit_worker`` runs: "resource_tracker: There appear to be 2 leaked semaphore
    objects to clean up at shutdown" once the parent exits."""
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "result 2" in done.stdout
    assert "leaked semaphore" not in done.stderr, done.stderr
