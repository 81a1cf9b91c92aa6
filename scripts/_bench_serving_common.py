"""What every system ``scripts/bench_serving.py`` measures shares.

Why a module of its own: the fixed configuration (threads, lanes, context,
prompt size), the ``Row`` a system's run at one concurrency gives, and the
subprocess plumbing (start, stop, wait until ready, a free port, how busy
the CPUs were before a run) are used by the raw baseline, the clients and
the report alike.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

THREADS = 2
LANES = 8
N_CTX = 8192  # the worker's default --ctx: 1024 cells per lane at 8 lanes
PROMPT_TOKENS = 128
N_PROMPTS = 16
PING_INTERVAL_S = 0.020
STAGGER_S = 0.5  # TTFT with users started this far apart


@dataclass
class Row:
    """One system at one concurrency."""

    tok_s: float
    tokens: int
    wall_s: float
    requests: int
    errors: int = 0
    ttft_p50_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Procs:
    """Every subprocess this run starts; all are ended on exit, even on error."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: Sequence[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, **kw)
        self._procs.append(proc)
        return proc

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self._procs):
            self.stop(proc)


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat), None if unknown."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return idle, sum(fields)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return None if total <= 0 else 1.0 - (idle1 - idle0) / total


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    log: Path,
    timeout_s: float = 180.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not become ready:\n{tail}")
        time.sleep(0.25)
