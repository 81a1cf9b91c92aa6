"""``edge/host.py``: the cores and memory a process may use, not the host's.

A worker in a container under a CPU limit sees every core of the host; one
llama.cpp thread per visible core is then throttled mid-forward. These tests
point ``SKIFF_CGROUP_ROOT`` at a stand-in cgroup tree (v2 and v1 layouts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge import host


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SKIFF_CGROUP_ROOT", str(tmp_path))
    return tmp_path


def cores_here() -> int:
    return len(os.sched_getaffinity(0))


def test_no_cgroup_files_means_no_quota(cgroup: Path) -> None:
    assert host.cpu_quota() is None
    assert host.usable_cpus() == cores_here()


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [("max 100000", None), ("100000 100000", 1.0), ("150000 100000", 1.5), ("junk", None)],
)
def test_cgroup_v2_quota(cgroup: Path, cpu_max: str, quota: float | None) -> None:
    (cgroup / "cpu.max").write_text(cpu_max + "\n")
    assert host.cpu_quota() == quota


def test_a_quota_caps_the_threads_rounding_down(cgroup: Path) -> None:
    """1.5 cores is one thread: a second would be throttled half of each period."""
    (cgroup / "cpu.max").write_text("150000 100000\n")
    assert host.usable_cpus() == 1
    (cgroup / "cpu.max").write_text("50000 100000\n")
    assert host.usable_cpus() == 1  # never zero
    (cgroup / "cpu.max").write_text(f"{100000 * (cores_here() + 8)} 100000\n")
    assert host.usable_cpus() == cores_here()  # a quota above the affinity changes nothing


def test_cgroup_v1_quota(cgroup: Path) -> None:
    (cgroup / "cpu").mkdir()
    (cgroup / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (cgroup / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert host.cpu_quota() is None  # v1 says -1 for no quota
    (cgroup / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert host.cpu_quota() == 2.0


def test_memory_limit(cgroup: Path) -> None:
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert host.memory_limit() == ram
    (cgroup / "memory.max").write_text("max\n")
    assert host.memory_limit() == ram
    (cgroup / "memory.max").write_text(f"{2 << 30}\n")
    assert host.memory_limit() == 2 << 30


def test_a_worker_takes_its_threads_from_the_quota_and_caps_the_spin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--threads 0`` under a one-core quota is one thread; the worker
    restarts itself with OpenMP's spin capped (info says both)."""
    from conftest import start_worker, stop_worker
    from protocol import Client

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    env = {"SKIFF_CGROUP_ROOT": str(root)}
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # the worker's own choice, not ours
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    proc, endpoint, _ = start_worker(
        tmp_path, "--lanes", "1", "--ctx", "256", "--threads", "0", env=env
    )
    try:
        with Client(endpoint) as c:
            info = c.info()
        assert info["threads"] == 1
        assert info["omp_spincount"] == "1000"
    finally:
        stop_worker(proc)
