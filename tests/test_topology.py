"""The compose topology, run as local processes on loopback.

Two LLM workers and a speech worker start with the environment compose.yaml
gives each service (only the bind address is moved to a free loopback
port), and the load test drives both LLM workers round-robin.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, stop_worker
from loadtest import run_load
from protocol import Client, SkiffError

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


def _start(
    service: dict[str, Any], bind_var: str, tmp: Path, name: str
) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, **{k: str(v) for k, v in service["environment"].items()}}
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env[bind_var] = endpoint
    env["SKIFF_LANES"] = "2"  # keep the test small on 2 cores
    env["SKIFF_CTX"] = "2048"
    command = [str(c) for c in service["command"]]
    module = {"skiff-worker": "worker.cli", "skiff-speech": "worker.speech.cli"}[command[0]]
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *command[1:]],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 90
    with Client(endpoint, timeout_ms=500) as client:
        while True:
            try:
                client.ping()
                return proc, endpoint
            except SkiffError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError((tmp / f"{name}.log").read_text()) from None


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("topology")
    services = _services()
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, str] = {}
    try:
        for name, var in (
            ("worker-1", "SKIFF_BIND"),
            ("worker-2", "SKIFF_BIND"),
            ("speech", "SKIFF_SPEECH_BIND"),
        ):
            proc, endpoints[name] = _start(services[name], var, tmp, name)
            procs.append(proc)
        yield endpoints
    finally:
        for proc in procs:
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
