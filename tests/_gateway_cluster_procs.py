"""The cluster of test_gateway_cluster.py: ``skiff-gateway`` in front of two
workers (4 lanes of 512 cells, parking off), all as processes on loopback,
with what the tests ask of it (status, which worker holds a session, the
gateway's log) and restarts of a worker or of the gateway.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from conftest import WAIT_S, spawn, stop_all, wait_until
from protocol import Client

WAIT_MS = int(WAIT_S * 1000)
# A drain timeout no loaded machine reaches: a drain ends when its work does.
DRAIN = ("--drain-timeout-s", str(2 * WAIT_S))
# Parking off: these tests fill lanes on purpose to make work wait for one
# (parking is tested in test_park.py and, behind the gateway, test_rolling.py).
WORKER_ARGS = ("--lanes", "4", "--ctx", "2048", "--threads", "1", "--park-bytes", "0", *DRAIN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.endpoints = [f"ipc://{tmp}/w{i}.sock" for i in (1, 2)]
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        for ep in self.endpoints:
            self.start_worker(ep)
        self.gateway_ep = f"ipc://{tmp}/gw.sock"
        self.metrics_port = _free_port()
        for ep in self.endpoints:
            self.wait_worker(ep)
        self.start_gateway()

    def start_gateway(self) -> None:
        args = ["gateway.cli", "--bind", self.gateway_ep, "--metrics-port", str(self.metrics_port)]
        for ep in self.endpoints:
            args += ["--worker", ep]
        self.gateway = spawn([*args, *DRAIN], self.tmp / "gateway.log")
        self.wait_all_up()

    def wait_all_up(self) -> None:
        wait_until(lambda: all(w["up"] for w in self.status()["workers"]), what="workers up")

    def gateway_log(self) -> list[dict[str, Any]]:
        text = (self.tmp / "gateway.log").read_text(errors="replace")
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def start_worker(self, ep: str) -> None:
        name = ep.rsplit("/", 1)[-1]
        self.workers[ep] = spawn(
            ["worker.cli", "--bind", ep, *WORKER_ARGS], self.tmp / f"{name}.log"
        )

    def wait_worker(self, ep: str) -> None:
        proc = self.workers[ep]
        with Client(ep) as c:
            c.wait_ready(2 * WAIT_S, alive=lambda: proc.poll() is None)

    def client(self, timeout_ms: int = WAIT_MS) -> Client:
        return Client(self.gateway_ep, timeout_ms=timeout_ms)

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            result: dict[str, Any] = c.call("gateway_status").result
            return result

    def holders(self, session: str) -> list[str]:
        """The workers whose own ``stats`` list ``session`` (asked directly)."""
        out = []
        for ep in self.endpoints:
            if self.workers[ep].poll() is not None:
                continue
            with Client(ep, timeout_ms=WAIT_MS) as c:
                if any(s["session"] == session for s in c.stats()["sessions"]):
                    out.append(ep)
        return out

    def named_sessions(self, ep: str) -> list[str]:
        with Client(ep, timeout_ms=WAIT_MS) as c:
            return [s["session"] for s in c.stats()["sessions"] if not s.get("ephemeral")]

    def close(self) -> None:
        stop_all([self.gateway, *self.workers.values()])
