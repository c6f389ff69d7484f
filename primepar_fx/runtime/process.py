"""Helpers for the worker processes that tests, benchmarks and ``calibrate`` start: a free port, a clean exit.

Why :func:`exit_worker` exists: a process that has used gloo can abort *after* its work is done, printing
``terminate called without an active exception`` (SIGABRT). Python objects that still hold a process group or a
finished gloo work (a compiled module, its groups, tensors a work kept) are freed during interpreter finalization;
a gloo thread that then needs the GIL finds the interpreter gone and the C++ runtime calls ``std::terminate``. It
happened about once in a full test suite (rank 0, after ``destroy_process_group``). :func:`exit_worker` frees
what it can while the interpreter is alive, flushes output and leaves with ``os._exit``, so the exit status says
how the work went and not how teardown raced.
"""

from __future__ import annotations

import gc
import os
import socket
import sys


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release() -> None:
    """Free unreachable objects now (module cycles that hold process groups), while the interpreter is alive."""
    gc.collect()


def exit_worker(code: int = 0) -> None:
    """Leave this worker process at once with ``code``: flush stdio and skip interpreter teardown (module doc).

    The finalizers a normal exit runs first are run: they unlink the named semaphores this process made (tqdm makes
    one with its first progress bar, shown or not), which would otherwise outlive it and make the resource tracker
    warn of "leaked semaphore objects" when the parent exits."""
    from multiprocessing import util

    util._run_finalizers(0)  # what multiprocessing's atexit hook runs first (no public API does this alone)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or redirected to something gone
            pass
    os._exit(code)
