"""Start glibc's allocator where planning would take it anyway: its large-block thresholds at their steady state.

Pricing allocates and frees numpy arrays of up to tens of MB by the thousand. glibc serves a block above its mmap
threshold (128 KiB at start) with a fresh ``mmap`` and returns it to the kernel when freed, so every such array
costs its pages' faults again. The threshold is dynamic: freeing an mmapped block raises it to that block's size
(at most 32 MiB on 64-bit) and the heap's trim threshold to twice that, after which such arrays reuse freed heap
memory. A planning process gets there during its first pricing, so the first pricing of every process (the planner
and each worker it forks) runs slower than the ones after it, with more page faults (numbers in
``docs/benchmarks/measured_in_code.md``). :func:`steady_malloc` sets the two thresholds to where that dynamic rule
ends (32 MiB, 64 MiB) before the first pricing, so the first pricing runs as fast as the later ones; what a
process keeps of freed memory is what it would keep after its first pricing anyway.

Only with glibc (Linux), only once per process, and not where ``$MALLOC_MMAP_THRESHOLD_``, ``$MALLOC_TRIM_THRESHOLD_``
or ``$MALLOC_TOP_PAD_`` says the user has tuned the allocator; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: glibc's ``mallopt`` parameters (``malloc.h``)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: where glibc's dynamic mmap threshold stops rising on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``), and its trim
#: threshold then (twice the mmap threshold)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: the environment variables through which a user tunes glibc's allocator
USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_done: bool | None = None


def steady_malloc() -> bool:
    """Set glibc's mmap and trim thresholds to their steady state (module docstring), once; whether they are set."""
    global _done
    if _done is None:
        _done = _set_thresholds()
    return _done


def _set_thresholds() -> bool:
    if any(name in os.environ for name in USER_TUNING):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (AttributeError, ValueError, OSError):  # not glibc, or no confstr (not Unix)
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first: setting it fixes both thresholds where they are
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
