"""The malloc tunable every skiff process restarts itself with (edge/memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edge.memory import TUNABLE

CODE = (
    "from edge.memory import reexec_with_tunables; "
    "reexec_with_tunables({'SKIFF_TEST_EXTRA': 'x'}); "
    "import os; print(os.environ.get('GLIBC_TUNABLES', ''), os.environ.get('SKIFF_TEST_EXTRA'))"
)


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables are Linux-only")
def test_process_restarts_once_with_the_tunable() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SKIFF_NO_REEXEC")}
    assert _run(env) == f"{TUNABLE} x"
    # an operator's own tunables and settings are kept
    assert _run({**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
        f"glibc.malloc.arena_max=2:{TUNABLE} x"
    )
    assert _run({**env, "SKIFF_TEST_EXTRA": "mine"}) == f"{TUNABLE} mine"
    # and the opt-out is honoured
    assert _run({**env, "SKIFF_NO_REEXEC": "1"}) == "None"  # (stdout is stripped)


TRIM_CODE = """
import ctypes, re
from edge.memory import trim_heap

def anon_kib():
    return sum(int(l.split()[1]) for l in open('/proc/self/smaps') if l.startswith('Anonymous:'))

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
blocks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB of heap chunks
for b in blocks:
    libc.memset(b, 1, 64 << 10)
keep = libc.malloc(64 << 10)  # the top of the heap stays in use: only a trim frees below it
for b in blocks:
    libc.free(b)
before = anon_kib()
released = trim_heap()
print(released, before - anon_kib())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_trim_heap_gives_freed_pages_back() -> None:
    """Freed heap chunks below a live one stay resident until trimmed."""
    out = subprocess.run(
        [sys.executable, "-c", TRIM_CODE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SKIFF_NO_REEXEC": "1"},
    ).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) > 32 << 10  # KiB: most of the 64 MiB went back
