"""The compose topology, run as local processes on loopback.

compose.yaml's ``model-init`` command runs first with the local cache
directory standing in for the ``models`` volume (it finds the model there and
returns: the idempotent path). Then two LLM workers and a speech worker start
with the environment compose.yaml gives each service; only the bind address
and the metrics port move to free loopback ports, and the volume's path maps
to the cache directory. Each service's own health-check command must pass
against it, and the load test drives both LLM workers round-robin.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, WAIT_S, stop_worker, wait_until
from loadtest import run_load
from protocol import Client, SkiffError
from worker.models import cache_dir

COMPOSE = Path(str(__import__("compose").__file__)).parent / "docker-compose"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _services() -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [str(COMPOSE), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    services: dict[str, dict[str, Any]] = json.loads(out.stdout)["services"]
    return services


def _volume(services: dict[str, dict[str, Any]]) -> str:
    """Run model-init's command as compose would; returns the volume's mount path."""
    init = services["model-init"]
    (mount,) = init["volumes"]
    env = {**os.environ, **init["environment"]}
    env["SKIFF_CACHE_DIR"] = str(cache_dir())  # the volume, here
    out = subprocess.run(
        [sys.executable, *[str(c) for c in init["command"][1:]]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()).is_file()
    return str(mount["target"])


def _start(
    service: dict[str, Any], bind_var: str, tmp: Path, name: str, moved: dict[str, str]
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """Start one service with compose's environment, every compose address in
    it moved to its local stand-in (``moved``: service names, container ports,
    the volume); adds this service's own address to ``moved`` for those after
    it. Returns the process and its endpoint, metrics URL and health-check code."""
    environment = {k: str(v) for k, v in service["environment"].items()}
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    container_port = environment[bind_var].rsplit(":", 1)[1]
    moved[f"tcp://{name}:{container_port}"] = endpoint  # how the gateway names it
    local = {**moved, f"tcp://127.0.0.1:{container_port}": endpoint}  # its health check
    if "SKIFF_GATEWAY_HTTP" in environment:
        http = f"127.0.0.1:{_free_port()}"
        http_port = environment["SKIFF_GATEWAY_HTTP"].rsplit(":", 1)[1]
        local[f"0.0.0.0:{http_port}"] = local[f"127.0.0.1:{http_port}"] = http

    def here(value: str) -> str:
        for old, new in local.items():
            value = value.replace(old, new)
        return value

    env = {**os.environ, **{k: here(v) for k, v in environment.items()}}
    env[bind_var] = endpoint
    metrics_port = _free_port()  # compose gives every process 9100, each its own host
    env["SKIFF_METRICS_PORT"] = str(metrics_port)
    env["SKIFF_METRICS_HOST"] = "127.0.0.1"
    env["SKIFF_LANES"] = "2"  # keep the test small on 2 cores
    env["SKIFF_CTX"] = "2048"
    info = {
        "endpoint": endpoint,
        "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
        "health": here(str(service["healthcheck"]["test"][-1])),
    }
    if "SKIFF_GATEWAY_HTTP" in environment:
        info["http"] = f"http://{env['SKIFF_GATEWAY_HTTP']}"
    command = [str(c) for c in service["command"]]
    module = {
        "skiff-worker": "worker.cli",
        "skiff-speech": "speech.cli",
        "skiff-gateway": "gateway.cli",
    }[command[0]]
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *command[1:]],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 2 * WAIT_S
    with Client(endpoint, timeout_ms=500) as client:
        while True:
            try:
                client.ping()
                return proc, info
            except SkiffError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError((tmp / f"{name}.log").read_text()) from None


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("topology")
    services = _services()
    moved = {_volume(services): str(cache_dir())}
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, str] = {}
    try:
        for name, var in (
            ("worker-1", "SKIFF_BIND"),
            ("worker-2", "SKIFF_BIND"),
            ("speech", "SKIFF_SPEECH_BIND"),
            ("gateway", "SKIFF_GATEWAY_BIND"),
        ):
            proc, info = _start(services[name], var, tmp, name, moved)
            procs.append(proc)
            endpoints.update({f"{name}/{k}": v for k, v in info.items()})
            endpoints[name] = info["endpoint"]
        yield endpoints
    finally:
        for proc in reversed(procs):
            stop_worker(proc)


def test_load_spreads_over_both_workers(topology: dict[str, str]) -> None:
    summary = run_load(
        endpoints=[topology["worker-1"], topology["worker-2"]],
        concurrency=2,
        requests=4,
        max_tokens=4,
        ignore_eos=True,
        timeout_ms=120_000,
    )
    assert summary["requests"]["ok"] == 4 and summary["requests"]["errors"] == 0
    for name in ("worker-1", "worker-2"):
        with Client(topology[name]) as c:
            stats = c.stats()
            assert stats["admitted"] >= 2, name  # round-robin reached it
            assert stats["lanes"]["total"] == 2  # settings came from the environment


def test_speech_beside_the_llm_workers(topology: dict[str, str]) -> None:
    with Client(topology["speech"], timeout_ms=60_000) as c:
        reply = c.call("synthesize", args={"text": "Hello.", "format": "wav", "stream": False})
        assert bytes(reply.buffers[0][:4]) == b"RIFF"
    with Client(topology["worker-1"]) as c:
        assert c.info()["speech"] is False


@pytest.mark.parametrize("name", ["worker-1", "worker-2", "speech", "gateway"])
def test_compose_health_check_and_metrics(topology: dict[str, str], name: str) -> None:
    if name == "gateway":  # /health is 503 until the gateway has seen a worker answer
        _wait_for_health(topology["gateway/http"])
    # The health-check command compose runs in the container, against this process.
    code = topology[f"{name}/health"]
    assert topology.get(f"{name}/http", topology[name]) in code

    # Its ping waits 2 s, and compose retries it: so does this test, on a
    # loaded machine, until it passes (the command, not the bound, is tested).
    def check() -> subprocess.CompletedProcess[str] | None:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S
        )
        return done if done.returncode == 0 else None

    wait_until(check, what=f"the {name} health check passing")
    # SKIFF_METRICS_PORT, set for every service, makes each process serve Prometheus text.
    with urllib.request.urlopen(topology[f"{name}/metrics"], timeout=WAIT_S) as reply:
        assert reply.status == 200
        assert b"# TYPE" in reply.read()


def test_gateway_finds_every_worker_compose_lists(topology: dict[str, str]) -> None:
    # SKIFF_GATEWAY_WORKERS / _SPEECH name the services; here they point at the
    # local stand-ins, and the gateway must mark every one up (it pings them).
    wanted = {topology["worker-1"], topology["worker-2"], topology["speech"]}

    def status() -> dict[str, Any]:
        with Client(topology["gateway"], timeout_ms=int(WAIT_S * 1000)) as c:
            result: dict[str, Any] = c.call("gateway_status").result
            return result

    def all_up() -> dict[str, Any] | None:
        now = status()
        return now if {w["endpoint"] for w in now["workers"] if w["up"]} == wanted else None

    found = wait_until(all_up, what="every worker up")
    up = {w["endpoint"]: w["kind"] for w in found["workers"] if w["up"]}
    assert up[topology["speech"]] != up[topology["worker-1"]]  # told apart
    assert found["policy"] == "cache_aware"


def _wait_for_health(url: str) -> None:
    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=WAIT_S):
                return True
        except OSError:  # HTTPError (503) included
            return False

    wait_until(healthy, what="gateway /health answering 200")
