"""scripts/cluster up|status|down, driven through the real command line.

Every test stops what it started (``down`` in a finalizer) so a failing
assertion never leaves workers running on the shared cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from conftest import ROOT, WAIT_S, wait_until
from protocol import Client

CLUSTER = ROOT / "scripts" / "cluster"
SMALL = ("--lanes", "2", "--ctx", "2048")
WAIT_MS = int(WAIT_S * 1000)
# ``down`` kills what has not stopped after --grace; the tests that expect a
# clean stop ("terminated") give a loaded machine all the time it needs.
GRACE = ("--grace", str(WAIT_S))


def _cluster(run_dir: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    """(exit code, the JSON it printed, its stderr)."""
    out = subprocess.run(
        [str(CLUSTER), "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    printed = json.loads(out.stdout) if out.stdout.strip() else {}
    return out.returncode, printed, out.stderr


def _status(run_dir: Path, healthy: bool = True) -> dict[str, Any]:
    """``status`` once it says what is asked (its pings wait 1 s each: a
    loaded machine may need another look, as an operator would take)."""

    def look() -> dict[str, Any] | None:
        code, status, _ = _cluster(run_dir, "status")
        return status if (code == 0) == healthy else None

    return wait_until(look, what=f"status {'healthy' if healthy else 'unhealthy'}")


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _module() -> ModuleType:
    """scripts/_cluster_procs.py as a module (launch and state, for the SIGKILL test)."""
    path = ROOT / "scripts" / "_cluster_procs.py"
    spec = importlib.util.spec_from_file_location("skiff_cluster_procs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def run_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "cluster"
    yield path
    _cluster(path, "down", "--grace", "5")


def test_two_workers_up_status_down(run_dir: Path) -> None:
    code, up, err = _cluster(run_dir, "up", "--no-gateway", "--no-speech", *SMALL)
    assert code == 0, err
    assert up["gateway"] is None and up["http"] is None and up["speech"] == []
    assert len(up["workers"]) == 2 and len(set(up["workers"])) == 2
    assert set(up["processes"]) == {"worker-1", "worker-2"}
    for endpoint in up["workers"]:
        assert endpoint.startswith("tcp://127.0.0.1:")
        with Client(endpoint, timeout_ms=WAIT_MS) as client:
            assert client.ping() is not None
            assert client.stats()["lanes"]["total"] == 2  # --lanes reached the worker
    pids = {name: p["pid"] for name, p in up["processes"].items()}

    status = _status(run_dir)
    assert status["running"] is True
    assert status["workers"] == up["workers"]
    for name, entry in status["processes"].items():
        assert entry["up"] and entry["answering"], name

    code, _, err = _cluster(run_dir, "up", "--no-gateway", "--no-speech", *SMALL)
    assert code == 1 and "already up" in err  # one cluster per run directory

    os.kill(pids["worker-2"], signal.SIGKILL)
    psutil.Process(pids["worker-1"])  # still there
    wait_until(lambda: _gone(pids["worker-2"]), what="worker-2 gone")

    def one_down() -> dict[str, Any] | None:
        status = _status(run_dir, healthy=False)  # not every process answers
        return status if status["processes"]["worker-1"]["answering"] else None

    status = wait_until(one_down, what="worker-1 answering beside a dead worker-2")
    assert status["processes"]["worker-2"]["up"] is False

    code, down, err = _cluster(run_dir, "down", *GRACE)
    assert code == 0, err
    # worker-1 left on SIGTERM alone: a clean stop, not a kill.
    assert down["stopped"] == {"worker-1": "terminated", "worker-2": "not running"}
    assert all(_gone(pid) for pid in pids.values())
    assert not (run_dir / "state.json").exists()
    assert (run_dir / "logs" / "worker-1.log").stat().st_size > 0  # kept for post-mortems

    code, status, _ = _cluster(run_dir, "status")
    assert code == 1 and status["running"] is False and status["processes"] == {}
    code, down, _ = _cluster(run_dir, "down")  # nothing to stop is not an error
    assert code == 0 and down["stopped"] == {}


def test_failed_up_stops_what_it_started(run_dir: Path) -> None:
    missing = run_dir.parent / "no-such-model.gguf"
    code, printed, err = _cluster(
        run_dir, "up", "--no-gateway", "--no-speech", "--transport", "ipc",
        "--model", str(missing), *SMALL,
    )  # fmt: skip
    assert code == 1 and printed == {}
    assert "exited" in err and "no-such-model.gguf" in err  # the worker's log tail
    assert not (run_dir / "state.json").exists()
    assert not list(run_dir.glob("*.sock"))
    # ipc endpoints live in the run directory, so its path is in every argv.
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if str(run_dir) in " ".join(p.info["cmdline"] or [])
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert leftovers == []


def _detached(cluster: ModuleType, run_dir: Path, name: str, code: str) -> Any:
    """``python -c code`` launched and recorded as the cluster's one process."""
    proc = cluster.Proc(
        name=name,
        role="worker",
        argv=[sys.executable, "-c", code],
        endpoint="tcp://127.0.0.1:9",
        metrics_port=0,
        log=str(run_dir / "logs" / f"{name}.log"),
    )
    cluster.launch(proc)
    cluster.save_state(run_dir, [proc])
    return proc


def test_down_kills_a_process_that_ignores_sigterm(run_dir: Path) -> None:
    cluster = _module()
    ready = run_dir / "ready"
    code = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"
    )
    proc = _detached(cluster, run_dir, "stubborn", code)

    def ready_or_dead() -> bool:  # SIGTERM is ignored once ready exists
        assert not _gone(proc.pid), (run_dir / "logs" / "stubborn.log").read_text()
        return ready.exists()

    wait_until(ready_or_dead, what="the stubborn process ready")

    code_, down, err = _cluster(run_dir, "down", "--grace", "0.5")
    assert code_ == 0, err
    assert down["stopped"] == {"stubborn": "killed"}
    assert _gone(proc.pid)


def test_down_dumps_the_stack_of_a_stuck_skiff_process(run_dir: Path) -> None:
    """A process with skiff's SIGUSR1 handler (edge/signals.py) that does not
    stop is asked for its stacks before the SIGKILL: the log says where it hung."""
    cluster = _module()
    ready = run_dir / "ready"
    code = (
        "import pathlib, signal, time, faulthandler\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def stuck_here():\n"
        f"    pathlib.Path({str(ready)!r}).touch(); time.sleep(600)\n"
        "stuck_here()"
    )
    proc = _detached(cluster, run_dir, "stuck", code)
    wait_until(ready.exists, what="the stuck process ready")
    code_, down, err = _cluster(run_dir, "down", "--grace", "0.5")
    assert code_ == 0, err
    assert down["stopped"] == {"stuck": "killed"}
    dump = Path(proc.log).read_text()
    assert "stuck_here" in dump, dump
    assert "stuck_here" in err  # the warning before the SIGKILL carries the log tail


def test_gateway_topology_up_status_down(run_dir: Path) -> None:
    """The full topology: gateway, two workers, speech (needs gateway/cli.py)."""
    code, up, err = _cluster(run_dir, "up", *SMALL)
    assert code == 0, err
    assert set(up["processes"]) == {"worker-1", "worker-2", "speech", "gateway"}
    assert up["gateway"].startswith("tcp://127.0.0.1:") and up["http"].startswith("http://")
    with Client(up["gateway"], timeout_ms=WAIT_MS) as client:
        client.ping()
        events = list(client.generate({"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}))
        assert events[-1].done and events[-1].header["ok"], events[-1].header
    with urllib.request.urlopen(f"{up['http']}/health", timeout=WAIT_S) as reply:
        assert reply.status == 200
    with Client(up["speech"][0], timeout_ms=WAIT_MS) as client:
        client.ping()

    status = _status(run_dir)
    assert status["processes"]["gateway"]["health"] == 200
    pids = [p["pid"] for p in up["processes"].values()]
    code, down, err = _cluster(run_dir, "down", *GRACE)
    assert code == 0, err
    # A process killed after the grace period logs its stack dump and log tail
    # in ``down``'s stderr (scripts/_cluster_procs.py stop): show them.
    assert set(down["stopped"].values()) == {"terminated"}, (down, err)
    assert all(_gone(pid) for pid in pids)


def test_a_chain_behind_the_gateway_is_routed_to_like_a_worker(run_dir: Path) -> None:
    """``up --chain 0:9,9:18``: the gateway lists the chain's stage 0 as a
    worker, places sessions on it, and what they generate equals one worker."""
    code, up, err = _cluster(
        run_dir, "up", "--workers", "1", "--no-speech", "--chain", "0:9,9:18", *SMALL
    )
    assert code == 0, err
    assert set(up["processes"]) == {"worker-1", "chain-s0", "chain-s1", "gateway"}
    roles = {name: p["role"] for name, p in up["processes"].items()}
    assert roles["chain-s0"] == "worker" and roles["chain-s1"] == "stage"
    head = up["processes"]["chain-s0"]["endpoint"]
    try:
        with Client(up["gateway"], timeout_ms=WAIT_MS) as gw:

            def both_up() -> bool:
                workers = gw.call("gateway_status").result["workers"]
                return sum(bool(w["up"]) for w in workers) == 2

            wait_until(both_up, what="the worker and the chain up behind the gateway")
            endpoints = {w["endpoint"] for w in gw.call("gateway_status").result["workers"]}
            assert endpoints == {up["processes"]["worker-1"]["endpoint"], head}
            args = {"prompt": "The harbour at dawn", "max_tokens": 6, "ignore_eos": True}
            sessions = [f"conv{i}" for i in range(4)]
            ids = [gw.send("generate", s, {**args, "stream": False}) for s in sessions]
            tokens = {
                s: gw.recv(i).raise_for_error().result["tokens"]
                for s, i in zip(sessions, ids, strict=True)
            }
            placed = {
                s: w["endpoint"]
                for w in gw.call("gateway_status").result["workers"]
                for s in w["sessions"]
            }
        on_chain = [s for s in sessions if placed.get(s) == head]
        assert on_chain, placed  # the least-loaded policy spread them over both
        with Client(up["processes"]["worker-1"]["endpoint"], timeout_ms=WAIT_MS) as one:
            want = one.call("generate", None, {**args, "stream": False}).result["tokens"]
        assert all(tokens[s] == want for s in sessions)
    finally:
        code, down, err = _cluster(run_dir, "down", *GRACE)
        assert code == 0, err
    assert set(down["stopped"].values()) == {"terminated"}, (down, err)
