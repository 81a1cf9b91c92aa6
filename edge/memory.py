"""Transparent huge pages for large message buffers (glibc malloc tunable).

ZeroMQ allocates every received message with ``malloc``; a large one (a
64 MiB tensor frame, a session's KV state) is a fresh ``mmap`` whose pages
the kernel faults in and zeroes one 4 KiB page at a time while the socket
copies into it. Measured here: a 64 MiB frame echoed between two processes
took ~150 ms, a third of it in page faults and page clearing; with glibc's
``glibc.malloc.hugetlb=1`` tunable (malloc advises transparent huge pages,
which this kernel grants on ``madvise``) it took ~60 ms (0.45 -> 1.1 GB/s).

The tunable is read only when a process starts, so ``reexec_with_tunables``
re-executes the process once with it set (and does nothing when it is set
already, on other platforms, or when ``SKIFF_NO_REEXEC`` is set).
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def reexec_with_tunables() -> None:
    """Restart this process with ``GLIBC_TUNABLES`` including ``TUNABLE``."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    if os.environ.get("SKIFF_NO_REEXEC"):
        return
    current = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    env["SKIFF_NO_REEXEC"] = "1"  # never loop, whatever glibc does with the value
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
