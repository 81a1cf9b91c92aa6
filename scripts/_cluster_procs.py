"""The processes of ``scripts/cluster``: launched, watched, stopped, recorded.

Why a module of its own: what ``up``, ``status`` and ``down`` do to one
process is apart from which processes a topology has (``cluster.py``):
launching it detached in its own session, knowing it is still ours (the
start time in ``/proc/PID/stat``), waiting until it answers, stopping its
process group (a stack dump asked for before the SIGKILL), and the state
file that records them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from edge import logs
from protocol import Client, SkiffError
from protocol.sockets import Curve

ROOT = Path(__file__).resolve().parent.parent
STATE = "state.json"

log = logs.get_logger("skiff.cluster")


class ClusterError(Exception):
    """``up`` could not bring the topology to health, or the state is unusable."""


@dataclass
class Proc:
    """One process of the topology, as recorded in the state file."""

    name: str
    role: str  # "worker", "speech" or "gateway"
    argv: list[str]
    endpoint: str
    metrics_port: int
    log: str
    http: str | None = None  # the gateway's HTTP base URL
    pid: int = 0
    start_time: int = 0  # /proc/PID/stat field 22, in clock ticks since boot
    server_key: str = ""  # CURVE: the public certificate a client dials this process with


def client_curve(proc: Proc) -> Curve | None:
    """How a client dials ``proc``: as ``client`` when CURVE is on, else plain."""
    if not proc.server_key:
        return None
    return Curve.load(Path(proc.server_key).parent / "client.key_secret", proc.server_key)


def start_time(pid: int) -> int | None:
    """The process's start time, or None when it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(proc: Proc) -> bool:
    return proc.pid > 0 and start_time(proc.pid) == proc.start_time


def launch(proc: Proc) -> subprocess.Popen[bytes]:
    """Start ``proc`` in its own session (a Ctrl-C at the shell does not reach
    it; ``down`` signals its whole process group)."""
    Path(proc.log).parent.mkdir(parents=True, exist_ok=True)
    # Workers and the speech worker take the metrics port from the environment
    # (every skiff process reads SKIFF_METRICS_PORT; the gateway gets a flag),
    # served on loopback like everything else here.
    env = {
        **os.environ,
        "SKIFF_METRICS_PORT": str(proc.metrics_port),
        "SKIFF_METRICS_HOST": "127.0.0.1",
    }
    with open(proc.log, "wb") as out:
        popen = subprocess.Popen(
            proc.argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.pid = popen.pid
    proc.start_time = start_time(popen.pid) or 0
    return popen


def pings(proc: Proc, timeout_ms: int = 1000) -> bool:
    with Client(proc.endpoint, timeout_ms=timeout_ms, curve=client_curve(proc)) as client:
        try:
            client.ping()
            return True
        except SkiffError:
            return False


def http_health(base: str, timeout_s: float = 2.0) -> int | None:
    """The status of ``GET base/health`` (503 is an answer too), None if none."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout_s) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(proc: Proc, popen: subprocess.Popen[bytes], deadline: float) -> None:
    """Return once ``proc`` answers; raise with its log tail if it exits or
    the deadline passes first."""

    def running() -> bool:
        return popen.poll() is None

    with Client(proc.endpoint, curve=client_curve(proc)) as client:
        try:
            client.wait_ready(max(0.0, deadline - time.monotonic()), alive=running)
        except SkiffError:
            why = "exited" if not running() else "did not answer ping"
            raise ClusterError(f"{proc.name} {why}; {proc.log}:\n{tail(proc.log)}") from None
    while proc.http is not None and http_health(proc.http) != 200:
        if not running() or time.monotonic() > deadline:
            why = "exited" if not running() else "GET /health never answered 200"
            raise ClusterError(f"{proc.name} {why}; {proc.log}:\n{tail(proc.log)}")
        time.sleep(0.2)


def stop(procs: Sequence[Proc], grace: float) -> dict[str, str]:
    """SIGTERM each live process group, SIGKILL what is left after ``grace``."""
    outcome: dict[str, str] = {}
    live = [p for p in procs if alive(p)]
    for p in procs:
        if p not in live:
            outcome[p.name] = "not running"
    for p in live:
        _signal_group(p, signal.SIGTERM)
        outcome[p.name] = "terminated"
    deadline = time.monotonic() + grace
    while any(alive(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    stuck = [p for p in live if alive(p)]
    dumping = [p for p in stuck if catches(p.pid, signal.SIGUSR1)]
    for p in dumping:  # where is it? (faulthandler in every skiff process: edge/signals.py)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
    if dumping:
        time.sleep(1.0)  # the dump is written by a C handler: at once, unless it died
    for p in stuck:
        if alive(p):
            last = tail(p.log, 60)
            log.warning("grace period over; killing", process=p.name, pid=p.pid, log_tail=last)
            _signal_group(p, signal.SIGKILL)
            outcome[p.name] = "killed"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    still = [p.name for p in live if alive(p)]
    if still:
        raise ClusterError(f"still running after SIGKILL: {still}")
    return outcome


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (SigCgt in /proc): only then
    is SIGUSR1 a request for a stack dump rather than a kill."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid


def save_state(run_dir: Path, procs: Sequence[Proc]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps({"processes": [asdict(p) for p in procs]}, indent=2))
    tmp.replace(run_dir / STATE)  # a reader never sees half a file


def load_state(run_dir: Path) -> list[Proc]:
    """The recorded processes; empty when there is no state file."""
    try:
        data = json.loads((run_dir / STATE).read_text())
        return [Proc(**p) for p in data["processes"]]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"unreadable state {run_dir / STATE}: {exc}") from None


def clear_state(run_dir: Path, procs: Sequence[Proc]) -> None:
    (run_dir / STATE).unlink(missing_ok=True)
    for p in procs:
        if p.endpoint.startswith("ipc://"):
            Path(p.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
