"""Transparent huge pages for large message buffers (glibc malloc tunable),
giving freed heap pages back to the kernel, and keeping the garbage
collector off the objects a process made to start.

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

import ctypes
import gc
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import cast

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


def _malloc_trim() -> Callable[[int], int] | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return cast("Callable[[int], int]", fn)


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim``).

    Why: a received frame (a stage's hidden rows, a session's KV state) is a
    ``malloc`` of megabytes; once freed, glibc keeps the pages for reuse, and
    a pipeline stage that prefilled 1,000 tokens held ~20 MiB of such free
    heap for good (measured: ``scripts/bench_memory.py``). Each stage of a
    chain pays it again, so it counted against a chain's memory. The edge
    calls this only when the process has been idle for a housekeeping tick
    after receiving messages: it takes well under a millisecond on a heap of
    tens of MiB, and never runs between the turns of busy work.
    Returns whether memory was released (False where glibc is absent)."""
    return bool(_TRIM(0)) if _TRIM is not None else False


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now into the collector's
    permanent generation, which no later collection scans; returns how many.

    Why: a loaded LLM worker holds ~48k gc-tracked objects (modules,
    llama-cpp-python's and the service's own), and Python's full collection,
    which comes every so often while requests make and drop objects, walked
    them all inside a turn: 25-27 ms on this machine, a stall of every
    stream at a random token. Objects made to start live as long as the
    process, so scanning them again finds nothing; after this a full
    collection walks only what requests made (measured with gc callbacks,
    an ad hoc probe, in 4 runs each of two c=4 cells of bench_vs_llama_server's
    workload, 2-core Xeon AVX-512: the worker's in-run full collection
    25.0-27.2 ms -> 0.19-0.58 ms; ``scripts/bench_gc.py``, the same start-up
    in one process, 2-core AMD EPYC AVX-512: 4.4-5.4 ms -> 0.05 ms a full
    collection). Each process main calls it once, after set-up and
    before its loop; a request's objects are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
