"""The ``process`` section every skiff process adds to its ``stats``.

Why: a soak (``scripts/soak.py``) has to tell a slow leak from allocator
settling. Resident memory alone cannot: glibc keeps freed arenas, llama.cpp
touches KV pages as positions first reach them, and both look like growth
that then stops. A growing count of Python objects is the other signal: if
RSS climbs while the object count stays flat, the memory is below Python
(allocator, C libraries); if both climb, something keeps Python objects.

- ``rss_bytes``: resident set size now, from ``/proc/self/statm`` (Linux;
  ``None`` elsewhere). Cheap: one small file read per ``stats``.
- ``rss_file_bytes``: the part of it backed by files (statm's ``shared``:
  file pages and shared memory) — for a worker mostly the mapped model,
  which llama.cpp reads through ``mmap``. Why: a pipeline stage should hold
  only its share of the model, and this shows it apart from allocations
  (KV cache, buffers, Python), which are the rest.
- ``objects``: objects tracked by the cyclic garbage collector,
  ``len(gc.get_objects())`` plus those frozen at start — containers and
  instances, not ints or strings, which is where a leak of requests,
  sessions or peers shows. ``frozen_objects``: those frozen at start
  (``memory.freeze_startup_objects``), never scanned again. Counting walks
  every tracked object (~3 ms for a worker's ~50k on this machine), and the
  gateway asks each worker for ``stats`` every 500 ms, so the count is
  recounted at most every ``OBJECTS_REFRESH_S`` seconds and reused between.
- ``SKIFF_DEBUG_OBJECT_TYPES=N`` (debugging only; a recount then costs tens
  of ms) adds ``object_types``: the ``N`` most common tracked types and their
  counts, to see *what* grows.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from typing import Any

OBJECTS_REFRESH_S = 2.0
DEBUG_TYPES_ENV = "SKIFF_DEBUG_OBJECT_TYPES"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident() -> tuple[int, int] | tuple[None, None]:
    """(resident bytes, of which file-backed) of this process, or Nones where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None, None


def rss_bytes() -> int | None:
    """This process's resident set size in bytes, or None where unknown."""
    return resident()[0]


class ProcessStats:
    """The ``process`` section of ``stats``, with the object count cached."""

    def __init__(self, refresh_s: float = OBJECTS_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._counted_at = -float("inf")
        self._objects = 0
        self._types: dict[str, int] | None = None

    def _recount(self, now: float) -> None:
        tracked = gc.get_objects()  # the frozen are not in it
        self._objects = len(tracked) + gc.get_freeze_count()
        top = _debug_types()
        if top > 0:
            counts = Counter(type(o).__qualname__ for o in tracked)
            self._types = dict(counts.most_common(top))
        else:
            self._types = None
        del tracked  # the list holds a reference to every object; let go at once
        self._counted_at = now

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._counted_at >= self.refresh_s:
            self._recount(now)
        rss, file_backed = resident()
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "rss_bytes": rss,
            "rss_file_bytes": file_backed,
            "objects": self._objects,
            "frozen_objects": gc.get_freeze_count(),
        }
        if self._types is not None:
            out["object_types"] = self._types
        return out


def _debug_types() -> int:
    try:
        return max(0, int(os.environ.get(DEBUG_TYPES_ENV, "0")))
    except ValueError:
        return 0


_THIS_PROCESS = ProcessStats()


def snapshot() -> dict[str, Any]:
    """This process's section (one cache per process: there is one process)."""
    return _THIS_PROCESS.snapshot()
