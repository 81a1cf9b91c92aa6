"""What this process may use of its host: cores and memory.

Why: ``os.cpu_count()`` and the machine's RAM are the host's, not the
process's. A container under a CPU limit (compose ``cpus:``, a Kubernetes
``resources.limits.cpu``) sees every core of the host but is throttled to
its quota by the kernel's CFS bandwidth control; a worker that starts one
llama.cpp thread per visible core then has threads descheduled mid-forward
while their siblings wait at ggml's barrier, and a forward takes many
times longer than with as many threads as the quota allows. The same
holds for a process pinned to a few cores (``taskset``, ``--cpus``).

- ``usable_cpus()``: the cores this process may run on
  (``os.sched_getaffinity``), capped by the cgroup's CPU quota rounded
  down (at least 1): quota 150000/100000 is 1 thread, not 2, because the
  second thread would be throttled half of each period.
- ``memory_limit()``: the cgroup's memory limit when one is set, else RAM.

Both read cgroup v2 (``/sys/fs/cgroup/cpu.max``, ``memory.max``) and v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, ``memory.limit_in_bytes``).
``SKIFF_CGROUP_ROOT`` moves the root (tests point it at a fake tree).
"""

from __future__ import annotations

import os
from pathlib import Path


def _root() -> Path:
    return Path(os.environ.get("SKIFF_CGROUP_ROOT", "/sys/fs/cgroup"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota() -> float | None:
    """The cgroup's CPU quota in cores (2.5 = 250 ms per 100 ms), or None
    when there is none ("max", no file, unreadable)."""
    root = _root()
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            return int(quota) / int(period)
        return None
    quota_v1 = _read(root / "cpu" / "cpu.cfs_quota_us")
    period_v1 = _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_v1 and period_v1 and quota_v1.isdigit() and period_v1.isdigit():
        return int(quota_v1) / int(period_v1) if int(period_v1) > 0 else None
    return None  # v1 writes -1 for no quota: not digits


def usable_cpus() -> int:
    """Cores this process may keep busy: affinity, capped by the CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    cores = cores or os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def memory_limit() -> int:
    """The cgroup v2 / v1 memory limit when one is set, else physical RAM."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    root = _root()
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        text = _read(path)
        if text is not None and text.isdigit() and 0 < int(text) < ram:
            return int(text)
    return ram
