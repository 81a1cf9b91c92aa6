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
already, on other platforms, or when ``SKIFF_NO_REEXEC`` is set). The same
restart carries other start-up-only settings a caller asks for: pipeline
stages ask for ``GOMP_SPINCOUNT=1000`` (llama.cpp's OpenMP threads otherwise
spin ~9 ms of CPU after each forward, taking the cores the next stage is
computing on: per-hop latency ~14 -> ~4 ms, measured by bench_stages.py).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"


def reexec_with_tunables(extra: Mapping[str, str] | None = None) -> None:
    """Restart this process with ``GLIBC_TUNABLES`` including ``TUNABLE`` and
    with the ``extra`` environment variables that are not set yet (settings
    a library reads only when it loads, such as ``GOMP_SPINCOUNT``)."""
    if sys.platform != "linux" or os.environ.get("SKIFF_NO_REEXEC"):
        return
    current = os.environ.get("GLIBC_TUNABLES", "")
    glibc = platform.libc_ver()[0] == "glibc"
    need_tunable = glibc and "glibc.malloc.hugetlb" not in current
    missing = {k: v for k, v in (extra or {}).items() if k not in os.environ}
    if not need_tunable and not missing:
        return
    env = {**os.environ, **missing}
    if need_tunable:
        env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    env["SKIFF_NO_REEXEC"] = "1"  # never loop, whatever glibc does with the value
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
