"""glibc's large-block thresholds set to their steady state: a multi-MB array then comes from the heap, not a fresh
mmap, from a process's first allocation on; a user's own tuning is left alone. Each case runs in a fresh process,
since the thresholds are process-wide and set once."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc only"
)

# bytes in mmapped blocks (glibc's mallinfo2().hblkhd) before and after a 4 MiB array, which is 32 times the mmap
# threshold a process starts with and 1/8 of the steady one
_PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util
    import numpy as np
    from primepar_fx.utils.malloc import steady_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    set_ = steady_malloc()
    before = libc.mallinfo2().hblkhd
    a = np.ones(1 << 19)  # 4 MiB
    print(set_, libc.mallinfo2().hblkhd - before >= a.nbytes)
    """
)


def _probe(env: dict[str, str]) -> str:
    if not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"):
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return env | extra


def test_a_large_array_comes_from_the_heap_once_the_thresholds_are_set():
    assert _probe(_env()) == "True False"  # set; the array was not mmapped


def test_a_users_own_allocator_tuning_is_kept():
    # the user's threshold (glibc's starting one, fixed): left as it is, and the array is mmapped as it says
    assert _probe(_env(MALLOC_MMAP_THRESHOLD_=str(128 << 10))) == "False True"
